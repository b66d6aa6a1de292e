"""The warm start: supervised fine-tuning (SFT) through the RL trainer's megatron-core model and checkpoint format.

Real post-training starts RL from a model that already knows the answer format. This module trains one on
(prompt, answer) pairs and leaves in the run folder exactly what RL starts from:

- ``warmstart/checkpoint``: a megatron dist-checkpoint (model and AdamW state), the trainer's format;
- ``warmstart/model``: an HF folder with the tokenizer, which engines serve and the trainer loads;
- ``metrics/warmstart.jsonl``: one line per ``log_every`` steps;
- ``warmstart/done.json``: the summary, written last by an atomic rename. A rerun of ``sluice run`` skips a warm
  start that has one; an unfinished one (no marker) starts over from the base model.

It runs in one process (world size 1), with TP = EP = 1 whatever the trainer's layout: the dist-checkpoint
reshards on load and the HF folder has no layout. The MoE router trains freely, since SFT has no rollout routing to
replay (no R3). Parameters and optimizer state are float32 whatever the checkpoint's dtype (AdamW steps on bf16
weights fall below bf16's resolution); the HF folder is written back in the model's own dtype.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.config.model import ModelSource
from pipeline.config.prompts import PromptConfig
from pipeline.config.run import RunConfig
from pipeline.config.warmstart import WarmStartConfig
from pipeline.consumers.rl.schedule import lr_at, set_lr
from pipeline.consumers.warmstart.config import format_summary
from pipeline.data.prompts import Prompt, PromptSource, load_jsonl, setup_heldout, setup_prompts
from pipeline.errors import ConfigError, SluiceError
from pipeline.rundir import (
    TMP_SUFFIX,
    WARMSTART_DONE_FILE,
    warmstart_dir,
    warmstart_metrics_path,
    warmstart_model_dir,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------------ data
@dataclass(frozen=True)
class SFTPair:
    """One tokenised training pair: the prompt (context only) and the answer with EOS appended (the targets)."""

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]


def _prompt_list(source: PromptSource) -> list[Prompt]:
    return [source[i] for i in range(len(source))]


def tokenize_pairs(prompts: Sequence[Prompt], tokenizer: Any, *, where: str) -> list[SFTPair]:
    """Tokenise prompts and answers apart (``add_special_tokens=False``) and append the tokenizer's EOS to answers.

    Apart, as in RL: the engine continues the prompt's own tokens, so a token merged across the prompt/answer
    boundary would teach a sequence the policy never generates. EOS is a target so that the policy learns to stop.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(f"the tokenizer has no EOS token; the warm start appends EOS to every answer of {where}")
    missing = [p.prompt_id for p in prompts if p.answer is None]
    if missing:
        raise ConfigError(f"{where}: {len(missing)} prompts have no answer (e.g. {missing[0]!r}); the warm start "
                          "trains on (prompt, answer) pairs, so every record needs an 'answer'")
    texts = [p.text for p in prompts if p.input_ids is None]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    answers = tokenizer([str(p.answer) for p in prompts], add_special_tokens=False)["input_ids"]
    pairs = []
    for p, answer in zip(prompts, answers):
        ids = tuple(p.input_ids) if p.input_ids is not None else tuple(next(encoded))
        if not ids:
            raise ConfigError(f"{where}: prompt {p.prompt_id!r} is empty; the first answer token needs a context")
        pairs.append(SFTPair(ids, (*answer, eos)))
    return pairs


@dataclass(frozen=True)
class SFTBatch:
    """A right-padded batch; ``loss_mask[b, t]`` is True where token t+1 is a target (an answer token or EOS)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor

    @property
    def num_targets(self) -> int:
        """Tokens scored by the loss."""
        return int(self.loss_mask.sum())

    def split(self, rows: int | None) -> list[SFTBatch]:
        """Micro-batches of at most ``rows`` rows (the whole batch for None)."""
        total = self.input_ids.shape[0]
        if rows is None or rows >= total:
            return [self]
        return [SFTBatch(self.input_ids[i:i + rows], self.attention_mask[i:i + rows], self.loss_mask[i:i + rows])
                for i in range(0, total, rows)]

    def to(self, device: torch.device) -> SFTBatch:
        return SFTBatch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device))


class SFTData:
    """Pairs stored ragged (one flat token array and offsets), so memory follows the tokens, not rows x longest row;
    a batch is padded only to its own longest row."""

    def __init__(self, pairs: Sequence[SFTPair], pad_id: int) -> None:
        if not pairs:
            raise ConfigError("the warm start has no training pairs; check [prompts] or warmstart.path")
        self.pad_id = pad_id
        self.prompt_lengths = np.array([len(p.prompt_ids) for p in pairs], dtype=np.int64)
        self.lengths = self.prompt_lengths + np.array([len(p.answer_ids) for p in pairs], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.flat = np.fromiter((t for p in pairs for t in (*p.prompt_ids, *p.answer_ids)), dtype=np.int64,
                                count=int(self.offsets[-1]))

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def max_length(self) -> int:
        """The longest pair, in tokens."""
        return int(self.lengths.max())

    def batch(self, indices: np.ndarray) -> SFTBatch:
        """The pairs at ``indices`` as one right-padded batch."""
        lengths, prompts = self.lengths[indices], self.prompt_lengths[indices]
        width = int(lengths.max())
        tokens = np.full((len(indices), width), self.pad_id, dtype=np.int64)
        for row, i in enumerate(indices):
            tokens[row, :lengths[row]] = self.flat[self.offsets[i]:self.offsets[i + 1]]
        positions = np.arange(width)[None, :]
        # logits at position t predict token t+1: the targets are the answer's positions, shifted back by one.
        targets = (positions[:, :-1] >= prompts[:, None] - 1) & (positions[:, :-1] < lengths[:, None] - 1)
        return SFTBatch(
            input_ids=torch.from_numpy(tokens),
            attention_mask=torch.from_numpy((positions < lengths[:, None]).astype(np.int64)),
            loss_mask=torch.from_numpy(targets),
        )


class BatchOrder:
    """Batch indices from a seeded permutation per epoch: every pair is seen once per epoch, in a fresh order."""

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        self.size, self.batch_size = size, batch_size
        self._rng = np.random.default_rng(seed)
        self._pending = np.empty(0, dtype=np.int64)

    def next(self) -> np.ndarray:
        """The indices of the next batch."""
        while len(self._pending) < self.batch_size:
            self._pending = np.concatenate([self._pending, self._rng.permutation(self.size)])
        out, self._pending = self._pending[:self.batch_size], self._pending[self.batch_size:]
        return out


def sft_loss(
    logits: torch.Tensor, batch: SFTBatch, num_targets: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross-entropy summed over the batch's target tokens / ``num_targets``, count of targets the argmax gets right,
    count of rows whose every target the argmax gets right).

    Only answer and EOS positions are scored; the prompt is context, since training on it would teach the policy to
    write prompts and weight each pair by its prompt's length. Dividing by the whole step's target count rather than
    this micro-batch's makes the micro-batch losses add up to the step's token mean, however the step is split. A row
    with every target right is one greedy decoding answers exactly (teacher forcing and greedy agree until the first
    wrong token).
    """
    mask = batch.loss_mask
    hits = (logits[:, :-1].argmax(-1) == batch.input_ids[:, 1:]) & mask
    picked = logits[:, :-1][mask].float()
    targets = batch.input_ids[:, 1:][mask]
    nll = F.cross_entropy(picked, targets, reduction="sum")
    rows_right = (hits.sum(-1) == mask.sum(-1)) & mask.any(-1)
    return nll / max(num_targets, 1), hits.sum(), rows_right.sum()


# --------------------------------------------------------------------------------------------------------- trainer
def sft_adamw(params: list[torch.nn.Parameter], cfg: WarmStartConfig) -> torch.optim.Optimizer:
    # The fused kernel is one call for all parameters: on the tiny CPU model it cuts the step from ~5 ms to ~1 ms.
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, foreach=True, **kwargs)


class SFTTrainer:
    """The model, its AdamW and the data; ``step()`` is one optimizer step on one batch."""

    def __init__(self, model: torch.nn.Module, data: SFTData, cfg: WarmStartConfig) -> None:
        self.model, self.data, self.cfg = model, data, cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = sft_adamw(self.params, cfg)
        self.order = BatchOrder(len(data), cfg.batch_size, cfg.seed)
        self.device = self.params[0].device
        self.steps_done = 0

    def step(self) -> dict[str, float]:
        """Train on the next batch; returns its loss, token accuracy, lr and gradient norm."""
        from pipeline.consumers.megatron.expert_bias import update_expert_bias
        from pipeline.consumers.megatron.model import forward_logits

        lr = lr_at(self.steps_done, self.cfg.lr, self.cfg.schedule, total_steps=self.cfg.steps)
        set_lr(self.optimizer, lr)
        batch = self.data.batch(self.order.next()).to(self.device)
        targets = batch.num_targets
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, right, rows_right = 0.0, 0, 0
        for micro in batch.split(self.cfg.micro_batch_size):
            logits = forward_logits(self.model, micro.input_ids, micro.attention_mask)
            loss, correct, exact = sft_loss(logits, micro, targets)
            loss.backward()
            loss_sum += float(loss.detach())
            right += int(correct)
            rows_right += int(exact)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip or math.inf)
        if not (math.isfinite(loss_sum) and math.isfinite(float(norm))):
            raise SluiceError(f"the warm start diverged at step {self.steps_done} (loss {loss_sum}, gradient norm "
                              f"{float(norm)}); lower warmstart.lr or set warmstart.grad_clip")
        self.optimizer.step()
        balance = update_expert_bias(self.model, self.cfg.expert_bias_update_rate)
        self.steps_done += 1
        return balance | {"loss": loss_sum, "token_accuracy": right / max(targets, 1),
                "exact_match": rows_right / batch.input_ids.shape[0], "lr": lr, "grad_norm": float(norm),
                "targets": float(targets)}


class _Window:
    """Means of step metrics since the last metrics line."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1

    def take(self) -> dict[str, float]:
        out = {k: v / self.count for k, v in self.sums.items()}
        self.sums, self.count = {}, 0
        return out


def train_steps(trainer: SFTTrainer, metrics_path: Path) -> dict[str, float]:
    """Run the configured steps (until ``until_loss`` or ``until_exact_match``, if set), writing one metrics line per
    ``log_every`` steps; returns the last line."""
    cfg = trainer.cfg
    window, last = _Window(), {}
    start = time.perf_counter()
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    with metrics_path.open("w") as out:
        for step in range(1, cfg.steps + 1):
            window.add(trainer.step())
            if step % cfg.log_every and step != cfg.steps:
                continue
            means = window.take()
            last = {"step": step, "loss": means["loss"], "token_accuracy": means["token_accuracy"],
                    "exact_match": means["exact_match"], "lr": trainer.optimizer.param_groups[0]["lr"],
                    "grad_norm": means["grad_norm"], "seconds": time.perf_counter() - start}
            out.write(json.dumps(last) + "\n")
            out.flush()
            log.info("warm start step %d: loss %.4f, token accuracy %.3f, exact match %.3f, lr %.2e", step,
                     last["loss"], last["token_accuracy"], last["exact_match"], last["lr"])
            if cfg.until_loss is not None and last["loss"] <= cfg.until_loss:
                log.info("warm start: mean loss %.4f <= until_loss %.4f at step %d; stopping", last["loss"],
                         cfg.until_loss, step)
                break
            if cfg.until_exact_match is not None and last["exact_match"] >= cfg.until_exact_match:
                log.info("warm start: exact match %.3f >= until_exact_match %.3f at step %d; stopping",
                         last["exact_match"], cfg.until_exact_match, step)
                break
    return last


# ------------------------------------------------------------------------------------------------------ prompts
def sft_prompts(warmstart: WarmStartConfig, prompts: PromptConfig) -> list[Prompt]:
    """The warm start's pairs: warmstart.path, else the training split of [prompts]; never the held-out split."""
    path = warmstart.path
    if path is None:
        return _prompt_list(setup_prompts(prompts))
    pairs = _prompt_list(load_jsonl(path))
    if prompts.has_heldout:
        held = {(p.text, p.input_ids) for p in _prompt_list(setup_heldout(prompts))}
        leaked = [p.prompt_id for p in pairs if (p.text, p.input_ids) in held]
        if leaked:
            raise ConfigError(f"warmstart.path {path} holds {len(leaked)} prompts of the held-out split (e.g. "
                              f"{leaked[0]!r}); remove them, since held-out prompts are never trained on")
    return pairs


def measure_prompts(warmstart: WarmStartConfig, prompts: PromptConfig,
                    train: Sequence[Prompt]) -> tuple[list[Prompt], str]:
    """(the first warmstart.eval_prompts prompts of the held-out split, else of the training pairs; the split)."""
    if prompts.has_heldout:
        held = setup_heldout(prompts)
        return [held[i] for i in range(min(warmstart.eval_prompts, len(held)))], "heldout"
    return list(train[:warmstart.eval_prompts]), "train"


# ---------------------------------------------------------------------------------------------------- measurement
def greedy_exact_match(model_dir: Path, prompts: Sequence[Prompt], *, batch_size: int = 256) -> dict[str, float]:
    """Greedy generation with the HF model in ``model_dir``: the fraction answered exactly (the answer then EOS).

    ``max_new_tokens`` is the longest answer plus one, so a model that does not stop scores 0; ``stop_rate`` is the
    fraction that emitted EOS at all (the format, right or wrong).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).to(device).eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    pairs = tokenize_pairs(prompts, tokenizer, where="the exact-match prompts")
    max_new = max(len(p.answer_ids) for p in pairs)
    right = stopped = 0
    for lo in range(0, len(pairs), batch_size):
        chunk = pairs[lo:lo + batch_size]
        width = max(len(p.prompt_ids) for p in chunk)
        # Left padding: generation appends at the right end of every row at once.
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p.prompt_ids):] = torch.tensor(p.prompt_ids)
            mask[i, width - len(p.prompt_ids):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=max_new, eos_token_id=eos, pad_token_id=pad)
        for p, row in zip(chunk, out[:, width:].tolist()):
            if eos in row:
                stopped += 1
                right += tuple(row[:row.index(eos) + 1]) == p.answer_ids
    return {"exact_match": right / len(pairs), "stop_rate": stopped / len(pairs), "prompts": len(pairs)}


# ---------------------------------------------------------------------------------------------------------- driver
def build_sft_model(model_dir: Path, seed: int, spec: str | None = None) -> tuple[Any, Any, torch.dtype]:
    """(megatron model in float32, its ModelConfig, the checkpoint's own dtype) on a world of one process; ``spec``
    is the run's ``model.spec``."""
    import torch.distributed as dist

    from pipeline.consumers.megatron.adapter import torch_dtype
    from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig, check_layout
    from pipeline.consumers.megatron.convert import load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel

    hf_config = json.loads((model_dir / "config.json").read_text())
    own_dtype = torch_dtype(ModelConfig.from_hf(hf_config))
    model_cfg = ModelConfig.from_hf(hf_config, dtype="float32")
    parallel = ParallelConfig(tp=1, ep=1)
    check_layout(model_cfg, parallel, 1)
    init_parallel(parallel, seed=seed)
    if dist.get_world_size() != 1:
        raise ConfigError(f"the warm start runs in one process, but this one joined a world of "
                          f"{dist.get_world_size()} (RANK/WORLD_SIZE are set); run it without a launcher")
    model = build_gpt_model(model_cfg, parallel, r3=False, spec=spec, hf_config=hf_config)
    load_hf_into_megatron(model, model_dir, model_cfg)
    if spec is not None:
        from pipeline.consumers.megatron.convert import check_exportable

        check_exportable(model, model_cfg)  # the warm-started model is exported as HF: refuse now, not after training
    return model, model_cfg, own_dtype


class _WriterWarmUp(threading.Thread):
    """Warms megatron's checkpoint writer up beside training, so that the save after training does not wait for it.

    megatron's first save starts a results-queue Manager in a spawned process, and that process imports torch when
    it unpickles the first write results: about 4 s on a small CPU. A probe of the same type, put and taken back
    here, pays that while the training steps run.
    """

    def __init__(self, get_queue: Any, probe: Any) -> None:
        super().__init__(name="checkpoint-writer-warm-up", daemon=True)
        self._get_queue, self._probe = get_queue, probe
        self._queue: Any = None
        self._taken_back = False

    def run(self) -> None:
        self._queue = self._get_queue()
        self._queue.put(self._probe)
        self._queue.get(timeout=300)
        self._taken_back = True

    def finish(self) -> None:
        """Wait for the warm-up; a probe left in the queue would be read as the real save's results, so drain it."""
        self.join()
        if self._queue is not None and not self._taken_back:
            while not self._queue.empty():
                self._queue.get_nowait()


def _start_writer_warm_up() -> _WriterWarmUp | None:
    """The warm-up thread, on the megatron-core versions that have the private queue it warms; else None."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.storage import WriteResult
    except ImportError:
        return None
    get_queue = getattr(filesystem_async, "_get_write_results_queue", None)
    if get_queue is None:
        return None
    probe = {0: [WriteResult(index=MetadataIndex("warm-up"), size_in_bytes=0, storage_data=_StorageInfo("-", 0, 0))]}
    thread = _WriterWarmUp(get_queue, probe)
    thread.start()
    return thread


def _clear_outputs(run_dir: Path) -> Path:
    out = warmstart_dir(run_dir)
    # Whatever a previous, unfinished attempt left is discarded: it starts over from the base model.
    shutil.rmtree(out, ignore_errors=True)
    warmstart_metrics_path(run_dir).unlink(missing_ok=True)
    out.mkdir(parents=True)
    return out


def _write_done(out: Path, summary: dict[str, Any]) -> None:
    tmp = out / (WARMSTART_DONE_FILE + TMP_SUFFIX)
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out / WARMSTART_DONE_FILE)


def run_warmstart(run_dir: Path, base_model: Path, *, warmstart: WarmStartConfig, prompts: PromptConfig,
                  run: RunConfig, model: ModelSource) -> dict[str, Any]:
    """Supervised training of ``base_model`` into ``run_dir``: checkpoint, HF model, metrics, then the done marker.

    Uses ``warmstart`` whether or not it is enabled (``enabled`` only tells ``sluice run`` to call this).
    Initialises and tears down a one-process torch.distributed world. Returns the summary written to ``done.json``:
    steps, pairs, final_loss, final_token_accuracy and final_exact_match (means over the last metrics window),
    steps_per_s, phase_seconds (setup, train, save, eval), seconds (the whole call), eval (exact_match, stop_rate,
    prompts, split; None when eval_prompts = 0) and the [warmstart] config it ran with.
    """
    from transformers import AutoTokenizer

    from pipeline.consumers.megatron.checkpoint import save_checkpoint
    from pipeline.consumers.megatron.model import shutdown_parallel
    from pipeline.consumers.trainer.main import export_hf_model

    ws = warmstart
    start = time.perf_counter()
    run_dir = Path(run_dir)
    out = _clear_outputs(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(base_model))
    train = sft_prompts(warmstart, prompts)
    where = str(ws.path) if ws.path is not None else "the training split of [prompts]"
    pairs = tokenize_pairs(train, tokenizer, where=where)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = SFTData(pairs, pad)
    try:
        megatron_model, model_cfg, own_dtype = build_sft_model(base_model, run.seed, model.spec)
        if data.max_length > model_cfg.max_position_embeddings:
            raise ConfigError(f"{where} has pairs of {data.max_length} tokens, longer than the model's "
                              f"max_position_embeddings={model_cfg.max_position_embeddings}; shorten them")
        writer = _start_writer_warm_up()
        trainer = SFTTrainer(megatron_model, data, ws)
        clock = time.perf_counter()
        seconds = {"setup": clock - start}
        last = train_steps(trainer, warmstart_metrics_path(run_dir))
        seconds["train"] = time.perf_counter() - clock
        clock = time.perf_counter()
        if writer is not None:
            writer.finish()
        save_checkpoint(out / "checkpoint", megatron_model, trainer.optimizer,
                        meta={"kind": "warmstart", "step": trainer.steps_done, "policy_version": 0})
        if own_dtype != torch.float32:
            megatron_model.to(own_dtype)
        export_hf_model(megatron_model, model_cfg, base_model, warmstart_model_dir(run_dir))
        seconds["save"] = time.perf_counter() - clock
    finally:
        shutdown_parallel()
    summary: dict[str, Any] = {
        "steps": trainer.steps_done, "pairs": len(data), "source": where,
        "final_loss": last["loss"], "final_token_accuracy": last["token_accuracy"],
        "final_exact_match": last["exact_match"],
        "steps_per_s": trainer.steps_done / seconds["train"], "phase_seconds": seconds,
        "checkpoint": "checkpoint", "model": "model", "config": ws.model_dump(mode="json"), "eval": None,
    }
    if ws.eval_prompts:
        clock = time.perf_counter()
        held, split = measure_prompts(warmstart, prompts, train)
        summary["eval"] = {**greedy_exact_match(warmstart_model_dir(run_dir), held), "split": split}
        seconds["eval"] = time.perf_counter() - clock
    summary["seconds"] = time.perf_counter() - start
    _write_done(out, summary)
    log.info("%s", format_summary(summary))
    return summary
