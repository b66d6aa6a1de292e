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
skipped) and ``time/*`` / ``tokens_per_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from pipeline.consumers.batch import (
    RoutingShape,
    TrainBatch,
    collate,
    empty_like,
    split_micro_batches,
    split_rows,
)
from pipeline.consumers.loss import LossConfig, kl_penalty, policy_loss
from pipeline.consumers.megatron.config import ModelConfig
from pipeline.consumers.megatron.model import forward_logits, model_device
from pipeline.consumers.megatron.router_replay import RouterReplay, topk_match
from pipeline.consumers.megatron.scoring import (
    RouterProbe,
    install_replay_hooks,
    replay_hooks,
    replay_registry,
    score_tokens,
)
from pipeline.consumers.optim import Updater, build_updater
from pipeline.consumers.schedule import lr_at
from pipeline.consumers.train_config import TrainStepConfig
from pipeline.consumers.train_metrics import Accumulator, final_metrics
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


def _check_reference(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    if reference is model:
        raise ConfigError(
            "the reference model is the policy model itself; build a second model (build_gpt_model with the same "
            "layout) and load the starting weights into it"
        )
    policy = {name: tuple(p.shape) for name, p in model.named_parameters()}
    ref = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    if policy != ref:
        diff = sorted(set(policy.items()) ^ set(ref.items()))[:4]
        raise ConfigError(
            f"the reference model's parameters differ from the policy's (first differences: {diff}); build it with "
            "the same ModelConfig and ParallelConfig as the policy"
        )


@dataclass(frozen=True)
class _Norms:
    """Global-batch counts that make micro-batch and per-rank losses add up to the global-batch loss."""

    tokens: float
    normalizer: float
    loss_cfg: LossConfig


# ---------------------------------------------------------------------------------------------------------- the step


class TrainStep:
    """Holds the megatron ``GPTModel``, its optimizer and the loss; ``step(groups)`` trains on one batch.

    ``model`` must be built with ``build_gpt_model(..., r3=True)`` for R3 on a MoE model (megatron only creates its
    replay hooks then); ``optimizer`` defaults to AdamW over the model's parameters (megatron's distributed
    optimizer is wrong on CPU, and the gradient all-reduce here replaces its DDP wrapper). ``reference`` is the
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
        self.model = model
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.updater: Updater = build_updater(model, cfg, optimizer)
        self.total_optimizer_steps = None if total_steps is None else total_steps * cfg.epochs * cfg.mini_batches
        replay_capable = model_cfg.is_moe and bool(getattr(model.config, "moe_enable_routing_replay", False))
        if cfg.r3 and model_cfg.is_moe and not replay_capable:
            raise ConfigError(
                "r3=True needs a model built with build_gpt_model(..., r3=True) (megatron's "
                "moe_enable_routing_replay); rebuild the model or set r3=false"
            )
        if cfg.r3 and not model_cfg.is_moe:
            log.warning("r3=True is ignored: the model is dense, there is no routing to replay")
        if replay_capable:
            # Building another model (the reference, say) resets megatron's replay list; the policy's hooks go back.
            install_replay_hooks(replay_hooks(model))
        self._replay = RouterReplay.for_model(model_cfg) if replay_capable else None
        self.reference, self._reference_hooks = self._adopt_reference(reference)
        self._probe = RouterProbe(model, model_cfg.moe_topk) if model_cfg.is_moe else None
        self._routing_shape = (
            RoutingShape(model_cfg.num_layers, model_cfg.moe_topk, model_cfg.num_experts) if model_cfg.is_moe else None
        )
        self.steps = 0
        self.optimizer_steps = 0
        self.samples_trained = 0
        self.tokens_trained = 0
        self.unreplayed_samples = 0

    def _adopt_reference(self, reference: torch.nn.Module | None) -> tuple[torch.nn.Module | None, list[Any]]:
        """(the frozen reference or None, its replay hooks): checks it fits the config and the policy."""
        kl_coef = self.cfg.loss.kl_coef
        if reference is None:
            if kl_coef > 0:
                raise ConfigError(
                    f"loss.kl_coef={kl_coef} needs a reference model to take the KL against: pass reference= (a "
                    "second build_gpt_model like the policy, loaded with the starting weights), or set loss.kl_coef=0"
                )
            return None, []
        if kl_coef == 0:
            # Keeping it would cost a forward per micro-batch for a term that is multiplied by 0.
            log.warning("a reference model was passed but loss.kl_coef=0: it is ignored and not run")
            return None, []
        _check_reference(self.model, reference)
        hooks = replay_hooks(reference)
        if self._replay is not None and self.cfg.r3 and len(hooks) != self.model_cfg.num_layers:
            raise ConfigError(
                "r3=True with a KL penalty needs the reference built with build_gpt_model(..., r3=True) too, so it "
                "scores under the same replayed routing as the policy; rebuild the reference or set r3=false"
            )
        reference.requires_grad_(False)
        return reference, hooks

    # ------------------------------------------------------------------------------------------------- public surface

    @property
    def optimizer(self) -> Any:
        """What a checkpoint saves beside the model: the torch, master-weight or megatron optimizer."""
        return self.updater.optimizer

    def step(self, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
        """Train on this rank's share of the global batch: one proximal pass, then ``epochs x mini_batches``
        optimizer steps; returns metrics reduced over all data-parallel ranks."""
        start = time.perf_counter()
        acc = Accumulator()
        batch = self._collate(groups)
        acc.add(num_samples=batch.num_rows, num_trainable_samples=int(batch.trainable.sum()),
                num_groups=len(groups), num_tokens=batch.num_loss_tokens, reward_sum=float(batch.rewards.sum()),
                advantage_abs_sum=float(batch.advantages.abs().sum()))
        proximal, reference = self._proximal(batch, acc)
        t_train = time.perf_counter()
        updates = [self._update(batch, rows, proximal, reference, acc) for rows in self._mini_batch_rows(batch)]
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
        if replay and self._replay is None:
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
                logprobs, _, _ = self._forward(mb, replay=replay and mb.all_routed)
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
        if self._probe is not None:
            self._probe.close()
        if self._replay is not None:
            self._replay.off()

    # -------------------------------------------------------------------------------------------------- batching

    def _collate(self, groups: Sequence[Sequence[Sample]]) -> TrainBatch:
        return collate(
            groups,
            advantage=self.cfg.loss.advantage,
            routing_shape=self._routing_shape,
            temperature=self.cfg.temperature,
            pad_token_id=self.cfg.pad_token_id,
            pad_multiple=self._sp()[1],
            failed_in_group_stats=self.cfg.failed_in_group_stats,
        )

    def _split(self, batch: TrainBatch) -> list[TrainBatch]:
        return split_micro_batches(
            batch,
            max_samples=self.cfg.micro_batch_samples,
            max_tokens=self.cfg.micro_batch_tokens,
            pad_multiple=self._sp()[1],
        )

    def _proximal(self, batch: TrainBatch, acc: Accumulator) -> tuple[Tensor, Tensor | None]:
        """Row-indexed ``[B, T-1]`` proximal (and reference) log-probs of the whole batch, computed once before the
        first optimizer step: every mini-batch's ratio current/proximal is then measured from the same weights."""
        micro_rows = split_rows(batch, max_samples=self.cfg.micro_batch_samples, max_tokens=self.cfg.micro_batch_tokens,
                                pad_multiple=self._sp()[1])
        micro = self._equalize([batch.select(rows, pad_multiple=self._sp()[1]) for rows in micro_rows])
        acc.add(micro_batches=len(micro), padded_tokens=sum(mb.num_rows * mb.seq_len for mb in micro))
        proximal = torch.zeros(batch.num_rows, batch.seq_len - 1)
        reference = None if self.reference is None else torch.zeros_like(proximal)
        for i, mb in enumerate(micro):
            prox, ref = self._proximal_pass(mb, acc)
            if i >= len(micro_rows):
                continue  # an EP placeholder
            rows, cols = micro_rows[i], min(prox.shape[1], batch.seq_len - 1)
            proximal[rows, :cols] = prox[: len(rows), :cols].float().cpu()
            if reference is not None and ref is not None:
                reference[rows, :cols] = ref[: len(rows), :cols].float().cpu()
        return proximal, reference

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
        pad = self._sp()[1]
        micro_rows = split_rows(batch, max_samples=self.cfg.micro_batch_samples,
                                max_tokens=self.cfg.micro_batch_tokens, pad_multiple=pad, rows=rows) if rows else []
        micro = [batch.select(r, pad_multiple=pad) for r in micro_rows]
        if not micro:
            micro = [empty_like(batch, pad_token_id=self.cfg.pad_token_id)]
        micro = self._equalize(micro)
        norms = self._global_norms(micro)
        self.updater.zero_grad()
        for i, mb in enumerate(micro):
            real = micro_rows[i] if i < len(micro_rows) else []
            prox = _rows_of(proximal, real, mb)
            ref = None if reference is None else _rows_of(reference, real, mb)
            self._train_micro_batch(mb, prox, ref, norms, acc)
        lr = lr_at(self.optimizer_steps, self.cfg.lr, self.cfg.lr_schedule, self.total_optimizer_steps)
        update = self.updater.step(lr, skip=norms.tokens == 0)
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

    def _global_norms(self, micro: list[TrainBatch]) -> _Norms:
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
        longest = torch.tensor([max((mb.seq_len - 1 for mb in real), default=1)], dtype=torch.int64)
        group = self._dp_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        tokens, sequences, rows = counts.tolist()
        loss_cfg = self.cfg.loss
        normalizer = {"token_mean": tokens, "sequence_mean": sequences, "constant_norm": rows}[loss_cfg.aggregation]
        if loss_cfg.aggregation == "constant_norm" and loss_cfg.norm_length is None:
            # Dr. GRPO's constant must not depend on how this rank's micro-batches happened to be padded.
            loss_cfg = loss_cfg.model_copy(update={"norm_length": int(longest)})
        return _Norms(tokens=tokens, normalizer=max(normalizer, 1.0), loss_cfg=loss_cfg)

    # ---------------------------------------------------------------------------------------------------- forwards

    def _sp(self) -> tuple[int, int]:
        """(rank, size) of the sequence-parallel split of the tokens the routers see."""
        if not getattr(self.model.config, "sequence_parallel", False):
            return 0, 1
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()

    def _replays(self, mb: TrainBatch) -> bool:
        return self.cfg.r3 and self._replay is not None and mb.all_routed

    def _forward(
        self,
        mb: TrainBatch,
        *,
        replay: bool,
        grad: bool = False,
        entropy: bool = False,
        probe: bool = False,
        model: torch.nn.Module | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(log-probs [B, T-1], entropy or None, dispatched routing [B, T, layers, topk] or None) of ``model``
        (default: the policy); the probe watches the policy's routers only."""
        model = self.model if model is None else model
        device = model_device(model)
        if self._replay is not None:
            if replay:
                assert mb.routing is not None  # replay is only requested for all-routed micro-batches
                sp_rank, sp_size = self._sp()
                self._replay.replay_forward(mb.routing, sp_rank=sp_rank, sp_size=sp_size)
            else:
                self._replay.off()
        probing = probe and self._probe is not None
        if probing:
            self._probe.start()  # type: ignore[union-attr]
        try:
            with torch.set_grad_enabled(grad):
                logits = forward_logits(model, mb.input_ids.to(device), mb.attention_mask.to(device))
                logprobs, ent = score_tokens(
                    logits,
                    mb.targets,
                    mb.temperatures,
                    entropy=entropy,
                    entropy_grad=self.cfg.loss.entropy_coef > 0,
                )
        finally:
            if not grad and self._replay is not None:
                self._replay.off()
        used = self._probe.take(mb.num_rows) if probing else None  # type: ignore[union-attr]
        return logprobs, ent, used

    def _agreement(self, used: Tensor, mb: TrainBatch) -> tuple[float, float]:
        """(matching (token, layer) top-k sets, pairs compared) of dispatched vs sample routing."""
        assert mb.routing is not None
        sp_rank, sp_size = self._sp()
        chunk = mb.seq_len // sp_size
        cols = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
        mask = mb.routing_mask[:, cols]
        match = topk_match(used, mb.routing[:, cols])  # [B, T/sp, layers]
        hits = (match & mask.unsqueeze(-1)).sum()
        return float(hits), float(mask.sum()) * match.shape[-1]

    def _mismatch(self, logprobs: Tensor, mb: TrainBatch) -> tuple[float, float]:
        """(sum over loss tokens of k3 KL(behaviour || trainer), loss tokens)."""
        k3 = kl_penalty(mb.behaviour_logprobs, logprobs.detach().float().cpu(), "k3")
        return float(torch.where(mb.loss_mask, k3, 0.0).sum()), float(mb.loss_mask.sum())

    def _proximal_pass(self, mb: TrainBatch, acc: Accumulator) -> tuple[Tensor, Tensor | None]:
        """(proximal, reference or None) log-probs of ``mb`` (both replayed when R3 applies), plus the
        with/without-replay measurements."""
        replayed = self._replays(mb)
        with torch.no_grad():
            proximal, _, used = self._forward(mb, replay=replayed, probe=not replayed)
            self._record_pass(mb, proximal, used, replayed=replayed, acc=acc)
            reference = self._reference_pass(mb, replay=replayed)
            if self.cfg.measure_r3 and self._replay is not None:
                # Unconditional, so that every EP rank runs the same number of (collective) forwards.
                other = not replayed and mb.all_routed
                logprobs, _, used = self._forward(mb, replay=other, probe=not other)
                if other or replayed:
                    self._record_pass(mb, logprobs, used, replayed=other, acc=acc)
        if any(mb.sample_ids):
            real = sum(1 for s in mb.sample_ids if s)
            key = "r3_replayed_samples" if replayed else "r3_unreplayed_samples"
            if self.cfg.r3 and self._replay is not None:
                acc.add(**{key: real})
                if not replayed:
                    acc.add(r3_unreplayed_micro_batches=1)
        return proximal.detach(), reference

    def _reference_pass(self, mb: TrainBatch, *, replay: bool) -> Tensor | None:
        """The frozen reference's log-probs of ``mb`` under the same routing as the proximal pass (None without a
        reference). Every rank runs it for every micro-batch, padding included, as EP's collectives require."""
        if self.reference is None:
            return None
        with replay_registry(self._reference_hooks), torch.no_grad():
            logprobs, _, _ = self._forward(mb, replay=replay and bool(self._reference_hooks), model=self.reference)
        return logprobs.detach()

    def _record_pass(
        self, mb: TrainBatch, logprobs: Tensor, used: Tensor | None, *, replayed: bool, acc: Accumulator
    ) -> None:
        total, tokens = self._mismatch(logprobs, mb)
        if replayed:
            acc.add(mismatch_replay_sum=total, mismatch_replay_tokens=tokens)
            return
        acc.add(mismatch_free_sum=total, mismatch_free_tokens=tokens)
        if used is not None:
            hits, pairs = self._agreement(used, mb)
            acc.add(agree_free_hits=hits, agree_free_total=pairs)

    def _train_micro_batch(
        self, mb: TrainBatch, proximal: Tensor, reference: Tensor | None, norms: _Norms, acc: Accumulator
    ) -> None:
        device = model_device(self.model)
        try:
            logprobs, ent, used = self._forward(
                mb, replay=self._replays(mb), grad=True, entropy=True, probe=mb.routing is not None
            )
            out = policy_loss(
                logprobs,
                mb.behaviour_logprobs.to(device),
                mb.advantages.to(device),
                mb.loss_mask.to(device),
                norms.loss_cfg,
                proximal=proximal.to(device),
                ref=None if reference is None else reference.to(device),
                entropy=ent,
                normalizer=norms.normalizer,
            )
            out.loss.backward()
        finally:
            # megatron keeps the replay indices (and a backward-replay list) until cleared.
            if self._replay is not None:
                self._replay.off()
        acc.add_loss_metrics(out.metrics)
        if used is not None:
            hits, pairs = self._agreement(used, mb)
            acc.add(agree_train_hits=hits, agree_train_total=pairs)

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
    return {
        "grad_norm": sum(u["grad_norm"] for u in updates) / n,
        "grad_norm_max": max(u["grad_norm"] for u in updates),
        "grad_norm_router": sum(u["grad_norm_router"] for u in updates) / n,
        "grad_clip_coef": sum(u["grad_clip_coef"] for u in updates) / n,
        "lr": updates[-1]["lr"],
        "skipped_step": sum(u["skipped_step"] for u in updates) / n,
    }
