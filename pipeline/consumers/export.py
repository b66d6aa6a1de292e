"""``sluice export``: a run's Megatron checkpoint as an HF folder that ``from_pretrained`` loads as it is.

The conversion is the one held-out evaluation uses (``CheckpointExporter``): the trainer's architecture is built
once in this process at world size 1, the dist-checkpoint is loaded into it (megatron's dist-checkpointing reshards
whatever TP/EP layout the trainer saved under), and ``megatron_to_hf_state_dict`` writes HF names. The config and
tokenizer come from the folder the run's trainer started from (the warm-started model when the recipe has a warm
start), so the export serves exactly as the run's engines did.

The folder is assembled in ``OUT.tmp`` and renamed into place, so a crash never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config.model import ModelSource
from pipeline.config.run import RunConfig
from pipeline.config.trainer import TrainStepConfig
from pipeline.errors import ConfigError
from pipeline.rundir import (
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    config_path,
    load_run_config,
    model_folder,
    run_checkpoints,
)

EXPORT_META = "sluice_export.json"


class CheckpointExporter:
    """Turns a run's Megatron checkpoints into HF folders, in this process (world size 1, any saved layout).

    The model is built once, with the trainer's architecture and router-replay setting, and each checkpoint's
    weights are loaded into it (resharded from the trainer's TP/EP layout by megatron's dist-checkpointing).
    """

    def __init__(self, model_dir: Path, *, run: RunConfig, model: ModelSource, trainer: TrainStepConfig) -> None:
        self.model_dir = model_dir
        self.seed, self.r3, self.spec = run.seed, trainer.r3, model.spec
        self.lora = getattr(trainer, "lora", None)
        self._model: Any = None
        self._model_cfg: Any = None

    def export(self, checkpoint: Path, out: Path, adapter: bool = False) -> None:
        """The checkpoint as an HF folder in ``out`` (with LoRA: base and adapters merged), or with ``adapter`` the
        LoRA adapters alone as a PEFT folder."""
        from pipeline.consumers.megatron.checkpoint import check_base, load_checkpoint
        from pipeline.consumers.trainer.main import export_hf_model

        if adapter and self.lora is None:
            raise ConfigError("--adapter exports LoRA adapters, and this run trained every weight (no [trainer.lora])")
        if self._model is None:
            self._build()
        if self.lora is not None:
            from pipeline.consumers.megatron.lora_export import base_identity

            check_base(checkpoint, base_identity(self.model_dir))
        load_checkpoint(checkpoint, self._model, None)
        if adapter:
            from pipeline.consumers.megatron.lora_export import write_peft_adapter

            write_peft_adapter(self._model, self._model_cfg, rank=self.lora.rank, alpha=self.lora.alpha,
                               targets=self.lora.targets, base_dir=self.model_dir, out=out)
            return
        export_hf_model(self._model, self._model_cfg, self.model_dir, out)

    def _build(self) -> None:
        import torch

        from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig
        from pipeline.consumers.megatron.model import build_gpt_model, init_parallel

        torch.set_num_threads(1)
        hf_config = json.loads((self.model_dir / "config.json").read_text())
        self._model_cfg = ModelConfig.from_hf(hf_config)
        init_parallel(ParallelConfig(), seed=self.seed)
        # The trainer's model.spec too: its checkpoints hold the user modules' weights, and the export must carry them.
        self._model = build_gpt_model(self._model_cfg, ParallelConfig(), r3=self.r3, spec=self.spec,
                                      hf_config=hf_config)
        if self.lora is not None:
            # LoRA checkpoints hold the adapters alone: the frozen base comes from the folder the run started from.
            from pipeline.consumers.megatron.convert import load_hf_into_megatron
            from pipeline.consumers.megatron.lora import LoRASpec, apply_lora

            load_hf_into_megatron(self._model, self.model_dir, self._model_cfg)
            apply_lora(self._model, LoRASpec(rank=self.lora.rank, alpha=self.lora.alpha, targets=self.lora.targets),
                       seed=self.seed)

    def close(self) -> None:
        if self._model is not None:
            from pipeline.consumers.megatron.model import shutdown_parallel

            shutdown_parallel()
            self._model = None


@dataclass(frozen=True)
class ExportResult:
    """Where the export went and what it holds."""

    folder: Path
    checkpoint: Path
    step: int
    policy_version: int


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The run's checkpoint of ``step``, or its newest complete one; an error lists what there is."""
    found = run_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"{run_dir} has no complete checkpoint under {CHECKPOINTS_DIR}/ ({CHECKPOINT_PREFIX}N "
                          "folders): the trainer writes one every trainer.checkpoint_every steps and at its end")
    if step is None:
        return max(found, key=_step_of)
    for ckpt in found:
        if _step_of(ckpt) == step:
            return ckpt
    have = ", ".join(str(_step_of(c)) for c in sorted(found, key=_step_of))
    raise ConfigError(f"{run_dir} has no checkpoint of step {step}; steps with one: {have} (omit --step for the "
                      "newest)")


def _step_of(ckpt: Path) -> int:
    return int(ckpt.name.removeprefix(CHECKPOINT_PREFIX))


def export_run(run_dir: Path, out: Path, step: int | None = None, adapter: bool = False) -> ExportResult:
    """Write the checkpoint of ``step`` (default: the newest) of the run in ``run_dir`` as an HF folder ``out`` (a
    LoRA run's: base and adapters merged), or with ``adapter`` a LoRA run's adapters as a PEFT folder."""
    from pipeline.consumers.megatron.checkpoint import read_checkpoint_meta

    run_dir = Path(run_dir)
    if not config_path(run_dir).is_file():
        raise ConfigError(f"{run_dir} has no {CONFIG_FILE}: not the folder of a `sluice run` (give --run-dir the "
                          "run folder)")
    if out.exists():
        raise ConfigError(f"{out} already exists; export into a new folder (or remove it first)")
    ckpt = find_checkpoint(run_dir, step)
    meta = read_checkpoint_meta(ckpt)
    cfg = load_run_config(run_dir)  # the Redis URL stays redacted: the export never connects to the queue
    # The saved config names the run folder as the launcher saw it (often relative to another working directory).
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_dir": run_dir})})
    like = model_folder(cfg)
    if not (like / "config.json").is_file():
        raise ConfigError(f"the run's starting model {like} has no config.json; the export takes its config and "
                          "tokenizer from there (restore that folder, or the run's model.path)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    exporter = CheckpointExporter(like, run=cfg.run, model=cfg.model, trainer=cfg.trainer)
    try:
        exporter.export(ckpt, tmp, adapter=adapter)
    finally:
        exporter.close()
    result = ExportResult(out, ckpt, int(meta.get("step", _step_of(ckpt))), int(meta.get("policy_version", -1)))
    (tmp / EXPORT_META).write_text(json.dumps({"run_dir": str(run_dir), "checkpoint": ckpt.name, "step": result.step,
                                               "policy_version": result.policy_version}))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return result
