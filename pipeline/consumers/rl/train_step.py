"""One RL training step on a stock megatron-core ``GPTModel``: proximal recompute, R3 replay, mini-batch PPO updates,
metrics.

``TrainStep.step(groups)`` runs, per call:

1. **proximal pass**: a no-grad forward of the current weights over the whole batch, in micro-batches (under
   REPLAY_FORWARD with the samples' routing when R3 is on). Its log-probs are the decoupled objective's proximal
   policy (``loss.py``), computed ONCE, before the first optimizer step. With ``measure_r3`` one more no-grad
   forward per micro-batch runs the other way (without replay when R3 is on, with it when off), so the
   train/rollout mismatch is known both with and without replay, and the router's own top-k choice is compared
   with the samples' routing. With a KL penalty the frozen reference model runs one more no-grad forward per
   micro-batch, replayed exactly when the proximal forward is.
2. **updates**: ``epochs`` passes, each a seeded shuffle of the batch's samples split into ``mini_batches``
   mini-batches; each mini-batch is one optimizer step (forward with replay, ``policy_loss`` at the sampling
   temperature, backward per micro-batch, then the updater's gradient sync, clipping and step at the scheduled
   learning rate). From the second mini-batch on the weights have moved, so the ratio current/proximal leaves 1 and
   the PPO clip acts; with one mini-batch and one epoch the ratio is exactly 1 and only the importance weight
   proximal/behaviour matters.
3. **metrics**, reduced over the data-parallel ranks (``train_metrics.py``).

Distributed contract (DP and EP over gloo or NCCL): every rank calls ``step`` (and ``compute_logprobs``) together,
each with ITS OWN share of whole prompt groups (never a group split across ranks: GRPO normalises within a group).
Ranks of one tensor-parallel group pass the same groups. :func:`shard_groups` gives the usual strided share. Each
optimizer step's loss terms are divided by counts over that mini-batch on ALL ranks (all-reduced before its
forwards), so the summed gradient is the gradient of the global mini-batch loss whatever the split into ranks and
micro-batches. Every rank makes the same number of optimizer steps (a rank whose share of a mini-batch is empty runs
a placeholder micro-batch with no loss), and under expert parallelism, where every forward is a collective, ranks
pad their micro-batch lists to the same length (and, for the ``allgather`` dispatcher, shapes).

R3 fallback: a micro-batch in which some sample has no routing cannot be replayed; it runs with the router's own
choice, and ``r3/unreplayed_samples`` / ``r3/unreplayed_micro_batches`` count it. The splitter puts samples without
routing together so the others keep replay. Each micro-batch runs forward then backward before the next one's
forward, and the replay indices stay set until its backward has finished, so a forward recomputed during backward
(activation recomputation) replays the same experts under REPLAY_FORWARD.

Routing agreement is measured with forward hooks on the routers (``megatron/scoring.py``), which see the routing
map each router actually dispatched with, in every mode, instead of megatron's RECORD action, which does not record
while replaying.

Reference model: the caller builds it like the policy (``build_gpt_model`` with the same layout and ``r3``) and
loads the starting weights into it; the step freezes it and never checkpoints it. megatron keeps one process-wide
list of router-replay hooks, which building a model resets, so the step pins that list to the policy's hooks and
swaps in the reference's only around the reference's forward.

Metrics: ``loss``, ``pg_loss``, ``entropy`` (``kl_ref`` too with a reference) as the mean per optimizer step; the
token means of ``policy_loss`` over every update (``mismatch_k3`` against the proximal pass, ``policy_kl_k3``,
``clip_fraction`` and its parts, ``is_weight_*``, ``masked_fraction``); the ``r3/*`` measurements; counts
(``num_tokens`` = loss tokens of the batch, ``num_samples``, ``num_trainable_samples``, ``num_groups``,
``padded_tokens``, ``micro_batches`` of the proximal pass, ``optimizer_steps``), ``reward_mean``,
``advantage_abs_mean``, ``grad_norm`` (mean over the updates, before clipping) and ``grad_norm_max``,
``grad_norm_router``, ``grad_clip_coef``, ``lr`` (of the last update), ``skipped_step`` (the fraction of updates
skipped) and ``time/*`` / ``tokens_per_s``. Loss plug-ins (``loss_plugins.py``) add ``loss/<name>/value`` and their
own ``loss/<name>/<key>``, each the mini-batch's value averaged over the optimizer steps; under ``loss.replace``
``pg_loss``, ``kl_ref`` and the clip / IS diagnostics are left out (the built-in loss did not run).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from pipeline.config.trainer import TrainStepConfig
from pipeline.consumers.megatron.config import ModelConfig
from pipeline.consumers.megatron.expert_bias import update_expert_bias
from pipeline.consumers.rl.batch import (
    RoutingShape,
    TrainBatch,
    collate,
    empty_like,
    split_micro_batches,
    split_rows,
)
from pipeline.consumers.rl.optim import Updater, build_updater
from pipeline.consumers.rl.passes import Norms, Passes
from pipeline.consumers.rl.schedule import lr_at
from pipeline.consumers.trainer.metrics import Accumulator, final_metrics
from pipeline.errors import ConfigError, SampleError
from pipeline.queue.sample import Sample

log = logging.getLogger(__name__)
Tensor = torch.Tensor
G = TypeVar("G")

# Base seed of the mini-batch shuffles (offset by the step counter).
_SHUFFLE_SEED = 0x51CE


def shard_groups(groups: Sequence[G], dp_rank: int, dp_size: int) -> list[G]:
    """This data-parallel rank's share of a global batch of prompt groups: every ``dp_size``-th group."""
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
    if len(groups) < dp_size:
        raise ConfigError(
            f"{len(groups)} prompt groups cannot feed {dp_size} data-parallel ranks; every rank needs at least one "
            "group per step. Raise the batch's group count or lower the number of trainer ranks"
        )
    return list(groups[dp_rank::dp_size])


# ---------------------------------------------------------------------------------------------------------- the step


class TrainStep:
    """Holds the megatron ``GPTModel``, its optimizer and the loss; ``step(groups)`` trains on one batch.

    ``model`` must be built with ``build_gpt_model(..., r3=True)`` for R3 on a MoE model (megatron only creates its
    replay hooks then); the updater is ``build_updater``'s: megatron's DDP and distributed optimizer on CUDA, AdamW
    with an explicit gradient all-reduce elsewhere or when an ``optimizer`` is passed in. ``reference`` is the
    frozen KL anchor that ``loss.kl_coef > 0`` needs: a second model built like ``model`` (same layout, same ``r3``)
    holding the starting weights; the step turns off its gradients and never saves it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_cfg: ModelConfig,
        cfg: TrainStepConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        reference: torch.nn.Module | None = None,
        total_steps: int | None = None,
    ) -> None:
        if cfg.loss.aggregation == "constant_norm" and cfg.loss.norm_length is None:
            raise ConfigError("trainer.loss.aggregation = 'constant_norm' needs trainer.loss.norm_length, the fixed "
                              "generation budget it divides by (a recipe fills in producer.sampling.max_new_tokens)")
        self.model = model
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.updater: Updater = build_updater(model, cfg, optimizer)
        self.total_optimizer_steps = None if total_steps is None else total_steps * cfg.epochs * cfg.mini_batches
        self.passes = Passes(model, model_cfg, cfg, reference)
        self.reference = self.passes.reference
        self._routing_shape = (
            RoutingShape(model_cfg.num_moe_layers, model_cfg.moe_topk, model_cfg.num_experts)
            if model_cfg.is_moe else None
        )
        self.steps = 0
        self.optimizer_steps = 0
        self.samples_trained = 0
        self.tokens_trained = 0
        self.unreplayed_samples = 0

    # ------------------------------------------------------------------------------------------------- public surface

    @property
    def policy_version(self) -> int | None:
        """The version of the weights about to be trained (set by the trainer before each step), which singles out
        the lag-0 tokens for ``mismatch_k3_lag0``; None: not measured."""
        return self.passes.policy_version

    @policy_version.setter
    def policy_version(self, version: int | None) -> None:
        self.passes.policy_version = version

    @property
    def optimizer(self) -> Any:
        """What a checkpoint saves beside the model: the torch, master-weight or megatron optimizer."""
        return self.updater.optimizer

    def step(self, groups: Sequence[Sequence[Sample]], weights: Sequence[float] | None = None) -> dict[str, float]:
        """Train on this rank's share of the global batch: one proximal pass, then ``epochs x mini_batches``
        optimizer steps; returns metrics reduced over all data-parallel ranks.

        ``weights`` (one per group, default 1) are the group filters' weights: each scales its group's part of the
        loss (``policy_loss``'s ``sample_weights``)."""
        start = time.perf_counter()
        acc = Accumulator()
        batch = self._collate(groups, weights)
        acc.add(num_samples=batch.num_rows, num_trainable_samples=int(batch.trainable.sum()),
                num_groups=len(groups), num_tokens=batch.num_loss_tokens, reward_sum=float(batch.rewards.sum()),
                advantage_abs_sum=float(batch.advantages.abs().sum()))
        # Samples that carry no loss (failed, aborted, empty) have done their part in their groups' advantages;
        # their rows would only cost forward passes.
        keep = [b for b in range(batch.num_rows) if bool(batch.trainable[b]) and int(batch.response_lens[b]) > 0]
        if keep and len(keep) < batch.num_rows:
            batch = batch.select(keep, pad_multiple=self.passes.sp()[1])
        plan = self._mini_batch_rows(batch)
        proximal, reference = self._proximal(batch, plan[: self.cfg.mini_batches], acc)
        t_train = time.perf_counter()
        updates = [self._update(batch, rows, proximal, reference, acc) for rows in plan]
        end = time.perf_counter()
        acc.maxes["time/step_s"] = end - start
        sums, maxes = acc.reduce(self._dp_group())
        metrics = final_metrics(sums, maxes, kl_ref=self.reference is not None, updates=len(updates))
        metrics.update(_update_metrics(updates))
        metrics.update({
            "time/step_s": maxes["time/step_s"],
            "time/proximal_s": t_train - start,
            "time/train_s": end - t_train,
            "tokens_per_s": sums["num_tokens"] / max(maxes["time/step_s"], 1e-9),
        })  # fmt: skip
        self._count_step(metrics)
        return metrics

    def compute_logprobs(self, groups: Sequence[Sequence[Sample]], *, replay: bool) -> list[np.ndarray]:
        """Response log-probs ``[R]`` of every sample (groups flattened in order) under the current weights.

        ``replay`` pins the MoE routing to the samples' own; every sample must then carry routing. Collective under
        expert parallelism: all ranks call it together (each with its own groups).
        """
        if replay and not self.passes.replay_capable:
            raise ConfigError(
                "compute_logprobs(replay=True) needs a MoE model built with build_gpt_model(..., r3=True); "
                "use replay=False for this model"
            )
        batch = self._collate(groups)
        if replay and not batch.all_routed:
            routed = batch.has_routing.tolist()
            missing = [sid for sid, ok in zip(batch.sample_ids, routed, strict=True) if not ok]
            raise SampleError(
                f"compute_logprobs(replay=True): samples {missing[:5]} carry no routed_experts, so their routing "
                "cannot be replayed; score them with replay=False, or have the engine return routing "
                "(SGLang --enable-return-routed-experts)"
            )
        micro = self._equalize(self._split(batch))
        out: list[np.ndarray] = []
        with torch.no_grad():
            for mb in micro:
                logprobs, _, _ = self.passes.forward(mb, replay=replay and mb.all_routed)
                out.extend(mb.response_values(logprobs))
        return out

    def state_dict(self) -> dict[str, int]:
        """Counters that live outside the model and optimizer (the checkpoint stores them beside those)."""
        return {
            "steps": self.steps,
            "optimizer_steps": self.optimizer_steps,
            "samples_trained": self.samples_trained,
            "tokens_trained": self.tokens_trained,
            "unreplayed_samples": self.unreplayed_samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the counters of :meth:`state_dict`."""
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ConfigError(f"TrainStep state has unknown keys {sorted(unknown)}; was it written by another version?")
        self.steps = int(state.get("steps", 0))
        # Checkpoints from before mini-batching made one optimizer step per step.
        self.optimizer_steps = int(state.get("optimizer_steps", self.steps))
        self.samples_trained = int(state.get("samples_trained", 0))
        self.tokens_trained = int(state.get("tokens_trained", 0))
        self.unreplayed_samples = int(state.get("unreplayed_samples", 0))

    def close(self) -> None:
        """Remove the router hooks and leave megatron's router replay switched off."""
        self.passes.close()

    # -------------------------------------------------------------------------------------------------- batching

    def _collate(self, groups: Sequence[Sequence[Sample]], weights: Sequence[float] | None = None) -> TrainBatch:
        return collate(
            groups,
            group_weights=weights,
            advantage=self.cfg.loss.advantage,
            routing_shape=self._routing_shape,
            temperature=self.cfg.temperature,
            pad_token_id=self.cfg.pad_token_id,
            pad_multiple=self.passes.sp()[1],
            failed_in_group_stats=self.cfg.failed_in_group_stats,
        )

    def _split(self, batch: TrainBatch) -> list[TrainBatch]:
        return split_micro_batches(
            batch,
            max_samples=self.cfg.micro_batch_samples,
            max_tokens=self.cfg.micro_batch_tokens,
            pad_multiple=self.passes.sp()[1],
        )

    def _proximal(self, batch: TrainBatch, parts: list[list[int]],
                  acc: Accumulator) -> tuple[Tensor, Tensor | None]:
        """Row-indexed ``[B, T-1]`` proximal (and reference) log-probs of the whole batch, computed once before the
        first optimizer step: every mini-batch's ratio current/proximal is then measured from the same weights.

        ``parts`` are the first epoch's mini-batches (together, every row once). Each is cut into micro-batches exactly
        as its optimizer step cuts it, so that kernels that are not batch-invariant (bf16 on GPU) see the same shapes
        and neighbours in both passes, and the ratio is 1 before the first update."""
        proximal = torch.zeros(batch.num_rows, batch.seq_len - 1)
        reference = None if self.reference is None else torch.zeros_like(proximal)
        for part in parts:
            micro_rows, micro = self._micro_batches(batch, part)
            acc.add(micro_batches=len(micro), padded_tokens=sum(mb.num_rows * mb.seq_len for mb in micro))
            for i, mb in enumerate(micro):
                prox, ref = self.passes.proximal_pass(mb, acc)
                if i >= len(micro_rows):
                    continue  # a placeholder: an EP rank's, or an empty mini-batch's
                rows, cols = micro_rows[i], min(prox.shape[1], batch.seq_len - 1)
                proximal[rows, :cols] = prox[: len(rows), :cols].float().cpu()
                if reference is not None and ref is not None:
                    reference[rows, :cols] = ref[: len(rows), :cols].float().cpu()
        return proximal, reference

    def _micro_batches(self, batch: TrainBatch, rows: list[int]) -> tuple[list[list[int]], list[TrainBatch]]:
        """The micro-batches of one mini-batch (``rows`` of the batch): the rows of each, and each as the forward
        takes it, with placeholders where this rank has none or expert parallelism needs more."""
        pad = self.passes.sp()[1]
        micro_rows = split_rows(batch, max_samples=self.cfg.micro_batch_samples,
                                max_tokens=self.cfg.micro_batch_tokens, pad_multiple=pad, rows=rows) if rows else []
        micro = [batch.select(r, pad_multiple=pad) for r in micro_rows]
        if not micro:
            micro = [empty_like(batch, pad_token_id=self.cfg.pad_token_id)]
        return micro_rows, self._equalize(micro)

    def _mini_batch_rows(self, batch: TrainBatch) -> list[list[int]]:
        """The rows of each optimizer step: per epoch a fresh seeded shuffle split into ``mini_batches`` parts.

        Seeded by the step counter, which the checkpoint restores, so a resumed run repeats the same split. A part
        may be empty on a rank with few rows; it still takes part in the step's collectives.
        """
        count, epochs = self.cfg.mini_batches, self.cfg.epochs
        if count == 1 and epochs == 1:
            return [list(range(batch.num_rows))]
        generator = torch.Generator().manual_seed(_SHUFFLE_SEED + self.steps)
        plan = []
        for _ in range(epochs):
            order = torch.randperm(batch.num_rows, generator=generator)
            plan += [sorted(part.tolist()) for part in torch.tensor_split(order, count)]
        return plan

    def _update(self, batch: TrainBatch, rows: list[int], proximal: Tensor, reference: Tensor | None,
                acc: Accumulator) -> dict[str, float]:
        """One optimizer step on ``rows`` of the batch."""
        micro_rows, micro = self._micro_batches(batch, rows)
        norms = self._global_norms(micro)
        self.updater.zero_grad()
        for i, mb in enumerate(micro):
            real = micro_rows[i] if i < len(micro_rows) else []
            prox = _rows_of(proximal, real, mb)
            ref = None if reference is None else _rows_of(reference, real, mb)
            with self.updater.backward_of(last=i == len(micro) - 1):
                self.passes.train_micro_batch(mb, prox, ref, norms, acc)
        lr = lr_at(self.optimizer_steps, self.cfg.lr, self.cfg.lr_schedule, self.total_optimizer_steps,
                   samples=self.samples_trained)
        update = self.updater.step(lr, skip=norms.tokens == 0)
        update.update(update_expert_bias(self.model, self.cfg.expert_bias_update_rate))
        self.optimizer_steps += 1
        return update

    def _equalize(self, micro: list[TrainBatch]) -> list[TrainBatch]:
        """Under EP every forward is a collective: give all ranks as many micro-batches (and, for the allgather
        dispatcher, the same shapes), padding with micro-batches that carry no loss."""
        from megatron.core import parallel_state as ps

        if ps.get_expert_model_parallel_world_size() == 1:
            return micro
        count = torch.tensor([len(micro)], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        micro = micro + [empty_like(micro[0], pad_token_id=self.cfg.pad_token_id)] * (int(count) - len(micro))
        if getattr(self.model.config, "moe_token_dispatcher_type", "alltoall") != "allgather":
            return micro
        # allgather gathers equal-sized token blocks from every EP rank.
        shapes = torch.tensor([[mb.num_rows, mb.seq_len] for mb in micro], dtype=torch.int64)
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX)
        return [
            mb.padded_to(int(rows), int(seq), pad_token_id=self.cfg.pad_token_id)
            for mb, (rows, seq) in zip(micro, shapes.tolist(), strict=True)
        ]

    def _global_norms(self, micro: list[TrainBatch]) -> Norms:
        """The loss denominators over the whole global batch (all micro-batches of all data-parallel ranks)."""
        real = [mb for mb in micro if any(mb.sample_ids)]
        counts = torch.tensor(
            [
                sum(mb.num_loss_tokens for mb in real),
                sum(int((mb.loss_mask.sum(-1) > 0).sum()) for mb in real),
                sum(sum(1 for s in mb.sample_ids if s) for mb in real),
            ],
            dtype=torch.float64,
        )
        group = self._dp_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        tokens, sequences, rows = counts.tolist()
        loss_cfg = self.cfg.loss
        normalizer = {"token_mean": tokens, "sequence_mean": sequences, "constant_norm": rows}[loss_cfg.aggregation]
        return Norms(tokens=tokens, normalizer=max(normalizer, 1.0), loss_cfg=loss_cfg)

    def _dp_group(self) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def _count_step(self, metrics: dict[str, float]) -> None:
        self.steps += 1
        if metrics["skipped_step"] < 1.0:
            self.samples_trained += int(metrics["num_trainable_samples"])
            self.tokens_trained += int(metrics["num_tokens"])
        self.unreplayed_samples += int(metrics["r3/unreplayed_samples"])


def _rows_of(full: Tensor, rows: list[int], mb: TrainBatch) -> Tensor:
    """``full``'s values for the real rows of micro-batch ``mb``, shaped like its per-column tensors (zeros for
    padding rows and columns)."""
    out = torch.zeros(mb.num_rows, mb.seq_len - 1)
    cols = min(mb.seq_len, full.shape[1] + 1) - 1
    if rows:
        out[: len(rows), :cols] = full[rows, :cols]
    return out


def _update_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """The optimizer steps of one drained batch: means, the largest gradient norm, the last learning rate."""
    n = len(updates)
    # Models with an expert bias (DeepSeek-V3) report its balancing: the last update's bias, the mean load ratio.
    balance = {}
    if "expert_bias_abs_max" in updates[-1]:
        balance = {"expert_bias_abs_max": updates[-1]["expert_bias_abs_max"],
                   "expert_load_max_ratio": sum(u["expert_load_max_ratio"] for u in updates) / n}
    return balance | {
        "grad_norm": sum(u["grad_norm"] for u in updates) / n,
        "grad_norm_max": max(u["grad_norm"] for u in updates),
        "grad_norm_router": sum(u["grad_norm_router"] for u in updates) / n,
        "grad_clip_coef": sum(u["grad_clip_coef"] for u in updates) / n,
        "lr": updates[-1]["lr"],
        "skipped_step": sum(u["skipped_step"] for u in updates) / n,
    }
