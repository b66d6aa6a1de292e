"""``sluice bench lora``: what LoRA saves, against full fine-tuning of the same model, in one run.

Both trainers are built from one recipe (by default ``recipes/cpu-moe-lora.toml``: its model, its train step and
its ``[trainer.lora]``), the full one with ``[trainer.lora]`` removed and the full recipe's rate. Each round trains
both on the same batch (the recipe's shape: ``batch_groups`` groups of ``group_size``, routing recorded from the model
itself for R3), alternating which goes first, so that the machine's noise falls on both. Reported:

- **step time**, LoRA over full, the median of the rounds' ratios;
- **optimizer state bytes** (Adam's moments, and fp32 masters where the model is low precision) and **trainable
  parameters**, LoRA over full;
- **push bytes**: one push of the adapters (``lora_export.iter_hf_adapters``) over one push of every weight.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class LoRABenchParams:
    """What one ``sluice bench lora`` measures."""

    recipe: str = "recipes/cpu-moe-lora.toml"
    """A recipe with [trainer.lora] on a tiny model (model.init_tiny)."""
    rank: int = 0
    """Override the recipe's LoRA rank (0: keep it)."""
    full_lr: float = 8e-4
    """The full fine-tuning rate (the full recipe's)."""
    rounds: int = 7
    """Timed rounds (each trains both once), after one untimed."""
    groups: int = 0
    """Groups per batch (0: the recipe's trainer.batch_groups)."""
    out: str = ""
    """Also write the JSON result to this file."""


def _optimizer_bytes(optimizer: Any) -> int:
    state = getattr(optimizer, "state", {})
    total = sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if hasattr(t, "numel"))
    masters = getattr(optimizer, "master_params", [])
    return total + sum(p.numel() * p.element_size() for p in masters)


def run_lora_bench(params: LoRABenchParams) -> dict[str, Any]:
    import torch

    from pipeline.benchmarks.gpu_check import Sizes, record_own_routing, synthetic_groups
    from pipeline.config import load_config
    from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig
    from pipeline.consumers.megatron.convert import iter_hf_weights, load_hf_into_megatron
    from pipeline.consumers.megatron.lora import LoRASpec, apply_lora
    from pipeline.consumers.megatron.lora_export import iter_hf_adapters
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel
    from pipeline.consumers.rl.train_step import TrainStep
    from pipeline.errors import ConfigError
    from pipeline.models.tiny import init_tiny_model

    cfg = load_config(params.recipe)
    lora = cfg.trainer.lora
    if lora is None or cfg.model.init_tiny is None:
        raise ConfigError(f"{params.recipe}: sluice bench lora needs a recipe with [trainer.lora] on a tiny model "
                          "(model.init_tiny)")
    if params.rank:
        lora = lora.model_copy(update={"rank": params.rank})
    torch.manual_seed(cfg.run.seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = init_tiny_model(cfg.model.init_tiny, Path(tmp) / "model", seed=cfg.run.seed)
        model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
        parallel = ParallelConfig(device="cpu")
        init_parallel(parallel, seed=cfg.run.seed)
        steps = {}
        for kind in ("full", "lora"):
            model = build_gpt_model(model_cfg, parallel, r3=cfg.trainer.r3)
            load_hf_into_megatron(model, folder, model_cfg)
            step_cfg = cfg.trainer.model_copy(update={"lora": None, "lr": params.full_lr})
            if kind == "lora":
                apply_lora(model, LoRASpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                           targets=lora.targets), seed=cfg.run.seed)
                step_cfg = cfg.trainer
            steps[kind] = TrainStep(model, model_cfg, step_cfg)
        sizes = Sizes(moe={}, dense={}, dtype="float32", groups=params.groups or cfg.trainer.batch_groups,
                      group_size=cfg.producer.group_size, prompt_len=6, response_len=(2, 4),
                      micro_batch_samples=cfg.trainer.micro_batch_samples, micro_batch_tokens=None, lr=0.0, steps=0,
                      r3_rows=0, r3_len=0, engine_groups=0, engine_prompt_len=0, engine_new_tokens=0,
                      temperature=cfg.producer.sampling.temperature)
        groups = synthetic_groups(model_cfg, sizes, cfg.run.seed)
        if cfg.trainer.r3:
            # The recorder follows the model built last; with a fresh adapter (B = 0) it routes as the base does.
            record_own_routing(steps["lora"].model, model_cfg, [s for g in groups for s in g], rows=64)
        seconds: dict[str, list[float]] = {"full": [], "lora": []}
        for round_ in range(params.rounds + 1):
            order = ("full", "lora") if round_ % 2 == 0 else ("lora", "full")
            for kind in order:
                start = time.perf_counter()
                steps[kind].step(groups)
                if round_:
                    seconds[kind].append(time.perf_counter() - start)
        res: dict[str, Any] = {"params": asdict(params), "rank": lora.rank, "alpha": lora.alpha,
                               "targets": list(lora.targets), "groups": sizes.groups, "group_size": sizes.group_size}
        for kind, step in steps.items():
            model = step.model
            res[kind] = {
                "step_seconds": seconds[kind],
                "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "optimizer_bytes": _optimizer_bytes(step.optimizer),
                "push_bytes": sum(t.numel() * t.element_size() for _, t in (
                    iter_hf_adapters(model, model_cfg) if kind == "lora" else iter_hf_weights(model, model_cfg))),
            }
        full, low = res["full"], res["lora"]
        res["step_time_ratio"] = statistics.median(a / b for a, b in zip(low["step_seconds"], full["step_seconds"],
                                                                           strict=True))
        for key in ("optimizer_bytes", "trainable_params", "push_bytes"):
            res[f"{key}_ratio"] = low[key] / full[key]
        for step in steps.values():
            step.close()
    if params.out:
        Path(params.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


def summary_lines(res: dict[str, Any]) -> list[str]:
    full, low = res["full"], res["lora"]
    return [
        f"LoRA rank {res['rank']}, alpha {res['alpha']:g} on {', '.join(res['targets'])}; batches of "
        f"{res['groups']} x {res['group_size']} samples",
        f"  step time      LoRA / full = {res['step_time_ratio']:.3f} (median of {len(low['step_seconds'])} rounds; "
        f"full {statistics.median(full['step_seconds']):.3f} s)",
        f"  optimizer state LoRA / full = {res['optimizer_bytes_ratio']:.4f} ({low['optimizer_bytes']:,} of "
        f"{full['optimizer_bytes']:,} B)",
        f"  trainable      LoRA / full = {res['trainable_params_ratio']:.4f} ({low['trainable_params']:,} of "
        f"{full['trainable_params']:,} parameters)",
        f"  push bytes     LoRA / full = {res['push_bytes_ratio']:.4f} ({low['push_bytes']:,} of "
        f"{full['push_bytes']:,} B)",
    ]
