"""One RL training step on a stock megatron-core ``GPTModel``: proximal recompute, R3 replay, loss, update, metrics.

``TrainStep.step(groups)`` runs, per call:

1. **proximal pass**: a no-grad forward of the current weights over every micro-batch (under REPLAY_FORWARD with the
   samples' routing when R3 is on). Its log-probs are the decoupled objective's proximal policy (``loss.py``).
   With ``measure_r3`` one more no-grad forward per micro-batch runs the other way (without replay when R3 is on,
   with it when off), so the train/rollout mismatch is known both with and without replay, and the router's own
   top-k choice (without replay) is compared with the samples' routing. With a KL penalty (``loss.kl_coef > 0``)
   the frozen reference model (the starting weights) runs one more no-grad forward per micro-batch, replayed exactly
   when the proximal forward is, so both score under the same routing.
2. **training pass**: forward (replay again when on), ``policy_loss`` at the sampling temperature, backward; the
   replay indices are cleared after each micro-batch, as megatron requires. Then the gradient all-reduce
   (``allreduce_gradients``), global grad-norm clipping and the optimizer step.
3. **metrics**, reduced over the data-parallel ranks.

Distributed contract (DP and EP over gloo or NCCL): every rank calls ``step`` (and ``compute_logprobs``) together,
each with ITS OWN share of whole prompt groups (never a group split across ranks: GRPO normalises within a group).
Ranks of one tensor-parallel group pass the same groups. :func:`shard_groups` gives the usual strided share. Loss
terms are divided by counts over the GLOBAL batch (all-reduced before the training pass), so the summed gradient is
the gradient of the global-batch loss whatever the split into ranks and micro-batches. Under expert parallelism
every forward is a collective (token dispatch), so ranks pad their list of micro-batches with empty ones to the same
length (and, for the ``allgather`` dispatcher, to the same shapes).

R3 fallback: a micro-batch in which some sample has no routing cannot be replayed; it runs with the router's own
choice, and ``r3/unreplayed_samples`` / ``r3/unreplayed_micro_batches`` count it. The batch splitter puts samples
without routing together so the others keep replay. Each micro-batch runs forward then backward before the next
one's forward, and the replay indices stay set until its backward has finished, so a forward recomputed during
backward (activation recomputation) replays the same experts under REPLAY_FORWARD; REPLAY_BACKWARD, megatron's queue
for pipeline schedules that run several forwards before their backwards, is not needed.

Routing agreement is measured with forward hooks on the routers, which see the routing map each router actually
dispatched with, in every mode (free, replayed), instead of megatron's RECORD action, which does not record while
replaying.

Reference model: the caller builds it like the policy (``build_gpt_model`` with the same layout and ``r3``) and
loads the starting weights into it; the step freezes it and never checkpoints it (a resume rebuilds it from the model
folder). megatron keeps one process-wide list of router-replay hooks, which building a model resets, so the step
pins that list to the policy's hooks and swaps in the reference's only around the reference's forward.

Metrics (all reduced over the data-parallel ranks): ``loss``, ``pg_loss``, ``entropy`` (aggregated as the loss;
``kl_ref`` too, only when a reference is kept);
the token means of ``policy_loss`` (``mismatch_k3`` against the proximal pass, ``policy_kl_k3``, ``clip_fraction``
and its parts, ``is_weight_*``, ``masked_fraction``); ``r3/agreement_no_replay`` (the router's own top-k vs the
samples'), ``r3/agreement_train`` (the routing the training forward used vs the samples': 1.0 under R3),
``r3/mismatch_k3_replay`` / ``r3/mismatch_k3_no_replay`` (k3 KL(rollout || trainer) over loss tokens),
``r3/replayed_samples``, ``r3/unreplayed_samples``, ``r3/unreplayed_micro_batches``; counts (``num_tokens`` = loss
tokens, ``num_samples``, ``num_trainable_samples``, ``num_groups``, ``padded_tokens``, ``micro_batches``),
``reward_mean``, ``advantage_abs_mean``, ``grad_norm`` (before clipping), ``grad_norm_router``, ``grad_clip_coef``,
``lr``, ``skipped_step`` and ``time/*`` / ``tokens_per_s``. A quantity that could not be measured (no routing, a
dense model) is left out rather than reported as 0.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
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
)
from pipeline.consumers.loss import LossConfig, kl_penalty, policy_loss
from pipeline.consumers.megatron.config import ModelConfig
from pipeline.consumers.megatron.model import (
    allreduce_gradients,
    forward_logits,
    model_device,
)
from pipeline.consumers.megatron.router_replay import (
    RouterReplay,
    from_megatron_layers,
    topk_match,
)
from pipeline.consumers.train_config import TrainStepConfig
from pipeline.errors import ConfigError, SampleError
from pipeline.queue.sample import Sample

log = logging.getLogger(__name__)
Tensor = torch.Tensor
G = TypeVar("G")


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


# --------------------------------------------------------------------------------------------------- metric reduction

# Means over loss tokens that policy_loss reports per micro-batch; combined weighted by each micro-batch's tokens.
_TOKEN_MEANS = (
    "mismatch_k3",
    "mismatch_k1",
    "policy_kl_k3",
    "clip_fraction",
    "clip_high_fraction",
    "clip_low_fraction",
    "is_weight_mean",
    "is_weight_applied_mean",
    "masked_fraction",
)
# Loss terms already divided by the global count: they add up over micro-batches and ranks.
_ADDITIVE = ("loss", "pg_loss", "entropy", "kl_ref")
_COUNTS = (
    "num_tokens",
    "num_samples",
    "num_trainable_samples",
    "num_groups",
    "padded_tokens",
    "micro_batches",
    "reward_sum",
    "advantage_abs_sum",
    "r3_replayed_samples",
    "r3_unreplayed_samples",
    "r3_unreplayed_micro_batches",
    "agree_free_hits",
    "agree_free_total",
    "agree_train_hits",
    "agree_train_total",
    "mismatch_replay_sum",
    "mismatch_replay_tokens",
    "mismatch_free_sum",
    "mismatch_free_tokens",
)
_SUMS = _ADDITIVE + tuple(f"w.{k}" for k in _TOKEN_MEANS) + _COUNTS
_MAXES = ("is_weight_max", "neg.is_weight_min", "time/step_s")


@dataclass
class _Accumulator:
    """Per-rank partial sums, maxima and minima; ``reduce`` combines them over the data-parallel ranks."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_SUMS, 0.0))
    maxes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_MAXES, -math.inf))

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self.sums[key] += float(value)

    def add_loss_metrics(self, metrics: dict[str, float]) -> None:
        tokens = metrics.get("num_tokens", 0.0)
        for key in _ADDITIVE:
            self.sums[key] += metrics.get(key, 0.0)
        if tokens > 0:
            for key in _TOKEN_MEANS:
                self.sums[f"w.{key}"] += metrics[key] * tokens
            self.maxes["is_weight_max"] = max(self.maxes["is_weight_max"], metrics["is_weight_max"])
            self.maxes["neg.is_weight_min"] = max(self.maxes["neg.is_weight_min"], -metrics["is_weight_min"])
        self.sums["num_tokens"] += tokens

    def reduce(self, group: Any) -> tuple[dict[str, float], dict[str, float]]:
        sums = torch.tensor([self.sums[k] for k in _SUMS], dtype=torch.float64)
        maxes = torch.tensor([self.maxes[k] for k in _MAXES], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        return dict(zip(_SUMS, sums.tolist(), strict=True)), dict(zip(_MAXES, maxes.tolist(), strict=True))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _final_metrics(sums: dict[str, float], maxes: dict[str, float], *, kl_ref: bool) -> dict[str, float]:
    tokens = sums["num_tokens"]
    out: dict[str, float] = {k: sums[k] for k in _ADDITIVE if kl_ref or k != "kl_ref"}
    if tokens > 0:
        out.update({k: sums[f"w.{k}"] / tokens for k in _TOKEN_MEANS})
        out["is_weight_max"] = maxes["is_weight_max"]
        out["is_weight_min"] = -maxes["neg.is_weight_min"]
    for key in ("num_tokens", "num_samples", "num_trainable_samples", "num_groups", "padded_tokens", "micro_batches"):
        out[key] = sums[key]
    samples = sums["num_samples"]
    if samples > 0:
        out["reward_mean"] = sums["reward_sum"] / samples
        out["advantage_abs_mean"] = sums["advantage_abs_sum"] / samples
    out["r3/replayed_samples"] = sums["r3_replayed_samples"]
    out["r3/unreplayed_samples"] = sums["r3_unreplayed_samples"]
    out["r3/unreplayed_micro_batches"] = sums["r3_unreplayed_micro_batches"]
    # Only what was measured: a dense model, or samples without routing, leave these out rather than invent zeros.
    derived = {
        "r3/agreement_no_replay": _ratio(sums["agree_free_hits"], sums["agree_free_total"]),
        "r3/agreement_train": _ratio(sums["agree_train_hits"], sums["agree_train_total"]),
        "r3/mismatch_k3_replay": _ratio(sums["mismatch_replay_sum"], sums["mismatch_replay_tokens"]),
        "r3/mismatch_k3_no_replay": _ratio(sums["mismatch_free_sum"], sums["mismatch_free_tokens"]),
    }
    out.update({k: v for k, v in derived.items() if v is not None})
    return out


# ----------------------------------------------------------------------------------------------------------- scoring


def _vocab_parallel_entropy(scaled: Tensor) -> Tensor:
    """Entropy ``[B, T]`` of softmax(scaled) where the vocabulary may be split over the TP ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
    )

    split = ps.get_tensor_model_parallel_world_size() > 1
    peak = scaled.detach().amax(-1, keepdim=True)
    if split:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = scaled - peak
    weights = shifted.exp()
    total, weighted = weights.sum(-1), (weights * shifted).sum(-1)
    if split:
        total = reduce_from_tensor_model_parallel_region(total)
        weighted = reduce_from_tensor_model_parallel_region(weighted)
    # H = -sum p log p with log p = shifted - log(total).
    return total.log() - weighted / total


def score_tokens(
    logits: Tensor, targets: Tensor, temperatures: Tensor, *, entropy: bool = False, entropy_grad: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[B, T-1]`` of ``targets`` (and optionally entropy) from rank-local logits ``[B, T, V/tp]``.

    Each row is scaled by its own sampling temperature: the engine reports log-probs of the distribution it sampled
    from, so scoring at any other temperature would make every token look off-policy.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits[:, :-1].float() / temperatures.to(logits.device, torch.float32)[:, None, None]
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = _vocab_parallel_entropy(scaled)
    # vocab_parallel_cross_entropy writes into its input, so it gets a private [seq, batch, vocab] copy.
    private = scaled.transpose(0, 1).clone(memory_format=torch.contiguous_format)
    nll = vocab_parallel_cross_entropy(private, targets.to(logits.device).transpose(0, 1).contiguous())
    return -nll.transpose(0, 1), ent


class _RouterProbe:
    """Forward hooks on every MoE router that keep the experts it actually dispatched to (its routing map)."""

    def __init__(self, model: Any, topk: int) -> None:
        self.topk = topk
        self.active = False
        self._maps: list[Tensor] = []
        routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
        self._handles = [router.register_forward_hook(self._hook) for router in routers]

    def _hook(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if self.active:
            self._maps.append(output[1].detach())

    def start(self) -> None:
        self._maps = []
        self.active = True

    def take(self, batch: int) -> Tensor:
        """The dispatched experts of the forward since ``start``, ``[batch, seq, layers, topk]``."""
        self.active = False
        layers = [m.float().topk(self.topk, dim=-1).indices.cpu() for m in self._maps]
        self._maps = []
        return from_megatron_layers(layers, batch)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _replay_hooks(model: Any) -> list[Any]:
    """megatron's per-layer ``RouterReplay`` objects of ``model``, in layer order (empty without replay)."""
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    return [r.router_replay for r in routers if getattr(r, "router_replay", None) is not None]


def _install_replay_hooks(hooks: list[Any]) -> list[Any]:
    """Make ``hooks`` megatron's process-wide replay list; returns the list it held before."""
    from megatron.core.transformer.moe.router_replay import RouterReplay as MegatronReplay

    registry = MegatronReplay.global_router_replay_instances
    saved = list(registry)
    registry[:] = hooks
    return saved


@contextmanager
def _replay_registry(hooks: list[Any]) -> Iterator[None]:
    """Point megatron's process-wide replay list at ``hooks`` for the duration, then restore it.

    megatron's static ``set_replay_data``/``set_global_router_replay_action`` act on that one list, so with two
    models in the process the list decides which model a replay reaches.
    """
    saved = _install_replay_hooks(hooks)
    try:
        yield
    finally:
        _install_replay_hooks(saved)


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
    ) -> None:
        self.model = model
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.optimizer = optimizer or torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
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
            _install_replay_hooks(_replay_hooks(model))
        self._replay = RouterReplay.for_model(model_cfg) if replay_capable else None
        self.reference, self._reference_hooks = self._adopt_reference(reference)
        self._probe = _RouterProbe(model, model_cfg.moe_topk) if model_cfg.is_moe else None
        self._routing_shape = (
            RoutingShape(model_cfg.num_layers, model_cfg.moe_topk, model_cfg.num_experts) if model_cfg.is_moe else None
        )
        self.steps = 0
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
        hooks = _replay_hooks(reference)
        if self._replay is not None and self.cfg.r3 and len(hooks) != self.model_cfg.num_layers:
            raise ConfigError(
                "r3=True with a KL penalty needs the reference built with build_gpt_model(..., r3=True) too, so it "
                "scores under the same replayed routing as the policy; rebuild the reference or set r3=false"
            )
        reference.requires_grad_(False)
        return reference, hooks

    # ------------------------------------------------------------------------------------------------- public surface

    def step(self, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
        """Train on this rank's share of the global batch; returns metrics reduced over all data-parallel ranks."""
        start = time.perf_counter()
        acc = _Accumulator()
        micro = self._micro_batches(groups, acc)
        norms = self._global_norms(micro)
        t_prox = time.perf_counter()
        proximal = [self._proximal_pass(mb, acc) for mb in micro]
        t_train = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        for mb, (prox, ref) in zip(micro, proximal, strict=True):
            self._train_micro_batch(mb, prox, ref, norms, acc)
        t_opt = time.perf_counter()
        update = self._optimizer_step(skip=norms.tokens == 0)
        end = time.perf_counter()
        acc.maxes["time/step_s"] = end - start
        sums, maxes = acc.reduce(self._dp_group())
        metrics = _final_metrics(sums, maxes, kl_ref=self.reference is not None)
        metrics.update(update)
        metrics.update(
            {
                "time/step_s": maxes["time/step_s"],
                "time/proximal_s": t_train - t_prox,
                "time/train_s": t_opt - t_train,
                "time/optimizer_s": end - t_opt,
                "tokens_per_s": sums["num_tokens"] / max(maxes["time/step_s"], 1e-9),
            }
        )
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

    def _micro_batches(self, groups: Sequence[Sequence[Sample]], acc: _Accumulator) -> list[TrainBatch]:
        batch = self._collate(groups)
        micro = self._split(batch)
        acc.add(
            num_samples=batch.num_rows,
            num_trainable_samples=int(batch.trainable.sum()),
            num_groups=len(groups),
            reward_sum=float(batch.rewards.sum()),
            advantage_abs_sum=float(batch.advantages.abs().sum()),
            micro_batches=len(micro),
            padded_tokens=sum(mb.num_rows * mb.seq_len for mb in micro),
        )
        return self._equalize(micro)

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
        longest = torch.tensor([max(mb.seq_len - 1 for mb in real)], dtype=torch.int64)
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

    def _proximal_pass(self, mb: TrainBatch, acc: _Accumulator) -> tuple[Tensor, Tensor | None]:
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
        with _replay_registry(self._reference_hooks), torch.no_grad():
            logprobs, _, _ = self._forward(mb, replay=replay and bool(self._reference_hooks), model=self.reference)
        return logprobs.detach()

    def _record_pass(
        self, mb: TrainBatch, logprobs: Tensor, used: Tensor | None, *, replayed: bool, acc: _Accumulator
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
        self, mb: TrainBatch, proximal: Tensor, reference: Tensor | None, norms: _Norms, acc: _Accumulator
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

    # ------------------------------------------------------------------------------------------------- the update

    def _optimizer_step(self, *, skip: bool) -> dict[str, float]:
        allreduce_gradients(self.model, scale=1.0)  # losses are already divided by global counts
        norm = self._grad_norm()
        router = self._router_grad_norm()
        coef = 1.0
        finite = math.isfinite(norm)
        if not finite:
            log.warning("gradient norm is %s; skipping this optimizer step (the batch's metrics still report)", norm)
        if self.cfg.grad_clip is not None and finite and norm > self.cfg.grad_clip:
            coef = self.cfg.grad_clip / (norm + 1e-6)
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, coef)
        skipped = skip or not finite
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "grad_norm": norm,
            "grad_norm_router": router,
            "grad_clip_coef": coef,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "skipped_step": float(skipped),
        }

    def _grad_norm(self) -> float:
        """L2 norm of the whole model's gradient: each distinct shard counted once, experts of every EP rank."""
        from megatron.core import parallel_state as ps

        dense = torch.zeros((), dtype=torch.float64)
        expert = torch.zeros((), dtype=torch.float64)
        tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
        for param in self.model.parameters():
            if param.grad is None:
                continue
            is_expert = not getattr(param, "allreduce", True)
            # Replicated (non-TP) weights are identical on every TP rank after the all-reduce; count them once.
            if not getattr(param, "tensor_model_parallel", False) and (etp_rank if is_expert else tp_rank) != 0:
                continue
            square = param.grad.detach().double().pow(2).sum().cpu()
            if is_expert:
                expert += square
            else:
                dense += square
        for value, group in (
            (dense, ps.get_tensor_model_parallel_group()),
            (expert, ps.get_expert_tensor_and_model_parallel_group()),
        ):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(value, group=group)
        return float((dense + expert).sqrt())

    def _router_grad_norm(self) -> float:
        total = 0.0
        for name, param in self.model.named_parameters():
            if ".router." in name and param.grad is not None:
                total += float(param.grad.detach().double().pow(2).sum())
        return math.sqrt(total)

    def _dp_group(self) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def _count_step(self, metrics: dict[str, float]) -> None:
        self.steps += 1
        if not metrics["skipped_step"]:
            self.samples_trained += int(metrics["num_trainable_samples"])
            self.tokens_trained += int(metrics["num_tokens"])
        self.unreplayed_samples += int(metrics["r3/unreplayed_samples"])
