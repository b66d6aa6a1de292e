"""R3 (rollout routing replay): make the trainer's MoE layers use the experts the rollout engine chose.

A thin typed layer over megatron-core's built-in ``RouterReplay`` (on with ``moe_enable_routing_replay``). It owns
the one awkward conversion: the engine reports routing per sample as ``[tokens, layers, topk]``, while megatron wants
one ``[seq * batch, topk]`` int64 tensor per MoE layer with tokens flattened sequence-major (index = s * B + b).

In REPLAY_FORWARD megatron gathers the router's probabilities at the replayed indices, so the router still receives
gradients; only the choice of experts is pinned.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.errors import ConfigError, SampleError

RoutingArray = np.ndarray | torch.Tensor


def _as_tensor(routing: RoutingArray) -> torch.Tensor:
    """The ids as a tensor, without a copy where torch has the dtype; ``pad_routing`` widens them to int64 as it
    writes them into the batch, in one pass."""
    if not isinstance(routing, np.ndarray):
        return routing
    if routing.dtype == np.uint8:
        with warnings.catch_warnings():
            # Decoded arrays are read-only views of the queue payload; this tensor is only ever read.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(routing)
    # torch's uint16 lacks min/max/sort on CPU; int32 holds every id.
    return torch.from_numpy(routing.astype(np.int32))


def _check_sample(index: int, routing: torch.Tensor, seq_len: int, num_layers: int, topk: int, experts: int) -> None:
    if routing.dim() != 3 or routing.shape[1:] != (num_layers, topk):
        raise SampleError(
            f"routed_experts of sample {index} has shape {tuple(routing.shape)}, expected [tokens, {num_layers}, "
            f"{topk}] (MoE layers x top-k of the trained model)"
        )
    if routing.shape[0] > seq_len:
        raise SampleError(f"routed_experts of sample {index} covers {routing.shape[0]} tokens, more than seq {seq_len}")
    if routing.numel() and (int(routing.min()) < 0 or int(routing.max()) >= experts):
        raise SampleError(f"routed_experts of sample {index} has expert ids outside [0, {experts})")
    if _repeats_an_expert(routing):
        raise SampleError(f"routed_experts of sample {index} repeats an expert within one token's top-k")


def _repeats_an_expert(routing: torch.Tensor) -> bool:
    """Whether any row names an expert twice. Pairwise over contiguous columns: a sort along a top-k of 8 took
    4-6x as long, and it ran for every sample of every batch."""
    topk = routing.shape[-1]
    if topk < 2 or routing.numel() == 0:
        return False
    columns = routing.reshape(-1, topk).t().contiguous()
    repeated = torch.zeros(columns.shape[1], dtype=torch.bool)
    equal = torch.empty_like(repeated)
    for i in range(topk):
        for j in range(i + 1, topk):
            torch.eq(columns[i], columns[j], out=equal)
            repeated.logical_or_(equal)
    return bool(repeated.any())


def pad_routing(
    samples: Sequence[RoutingArray], seq_len: int, *, num_layers: int, topk: int, num_experts: int
) -> torch.Tensor:
    """Stack per-sample ``[tokens, layers, topk]`` routing into ``[batch, seq_len, layers, topk]`` int64.

    Samples are right-padded. Padded positions get experts 0..topk-1: they must be valid, distinct ids because
    megatron dispatches pad tokens like any other (their outputs are masked out of the loss).
    """
    if topk > num_experts:
        raise ConfigError(f"topk={topk} exceeds num_experts={num_experts}")
    filler = torch.arange(topk, dtype=torch.int64)
    out = filler.expand(len(samples), seq_len, num_layers, topk).clone()
    for b, sample in enumerate(samples):
        routing = _as_tensor(sample)
        _check_sample(b, routing, seq_len, num_layers, topk, num_experts)
        out[b, : routing.shape[0]] = routing
    return out


def to_megatron_layers(routing: torch.Tensor, *, sp_rank: int = 0, sp_size: int = 1) -> list[torch.Tensor]:
    """``[batch, seq, layers, topk]`` into megatron's per-layer ``[seq * batch, topk]`` (sequence-major) tensors.

    Under sequence parallelism each TP rank routes only its slice of the sequence; pass its rank and size.
    """
    if routing.dim() != 4:
        raise ConfigError(f"routing must be [batch, seq, layers, topk], got shape {tuple(routing.shape)}")
    batch, seq, layers, topk = routing.shape
    if seq % sp_size:
        raise ConfigError(f"sequence length {seq} is not divisible by the sequence-parallel size {sp_size}")
    chunk = seq // sp_size
    local = routing[:, sp_rank * chunk : (sp_rank + 1) * chunk]
    seq_major = local.transpose(0, 1)  # [seq, batch, layers, topk]
    return [seq_major[:, :, layer].reshape(-1, topk).contiguous() for layer in range(layers)]


def from_megatron_layers(layers: Sequence[torch.Tensor], batch: int) -> torch.Tensor:
    """Inverse of ``to_megatron_layers`` (no sequence parallelism): per-layer ``[seq * batch, topk]`` to
    ``[batch, seq, layers, topk]``."""
    if not layers:
        raise ConfigError("no routing recorded: was the model built with r3=True and run under record()?")
    stacked = torch.stack([t.detach().cpu().to(torch.int64) for t in layers], dim=1)  # [s*b, layers, topk]
    tokens = stacked.shape[0]
    if tokens % batch:
        raise ConfigError(f"recorded routing has {tokens} tokens, not a multiple of batch {batch}")
    return stacked.reshape(tokens // batch, batch, *stacked.shape[1:]).transpose(0, 1).contiguous()


def topk_agreement(recorded: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Fraction of (token, layer) pairs whose top-k expert SETS are equal (order ignored), over ``mask``.

    ``recorded`` and ``reference`` are ``[..., layers, topk]`` with the same leading token shape; ``mask`` has that
    leading shape (1 = count the token).
    """
    per_pair = topk_match(recorded, reference)  # [..., layers]
    if mask is None:
        return float(per_pair.float().mean())
    weights = mask.to(torch.float32).unsqueeze(-1).expand_as(per_pair)
    total = float(weights.sum())
    if total == 0:
        raise ConfigError("topk_agreement got an all-zero mask: there are no tokens to compare")
    return float((per_pair.float() * weights).sum() / total)


def topk_match(recorded: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Boolean ``[..., layers]``: whether each token's top-k expert set matches, ignoring order."""
    if recorded.shape != reference.shape:
        raise ConfigError(f"routing shapes differ: {tuple(recorded.shape)} vs {tuple(reference.shape)}")
    a = recorded.to(torch.int64).sort(dim=-1).values
    b = reference.to(torch.int64).sort(dim=-1).values
    return (a == b).all(dim=-1)


class RouterReplay:
    """Record or replay the MoE routing of one megatron ``GPTModel`` built with ``r3=True``.

    Typical trainer step: ``replay_forward(routing)`` before the forward pass, then ``clear()`` after the optimizer
    step. ``record()`` captures the model's own choices (for measuring agreement).
    """

    def __init__(self, *, num_layers: int, topk: int, num_experts: int) -> None:
        from megatron.core.transformer.moe import router_replay as mrr

        self._mrr = mrr
        self.topk = topk
        self.num_experts = num_experts
        found = len(mrr.RouterReplay.global_router_replay_instances)
        if found != num_layers:
            raise ConfigError(
                f"megatron has {found} router-replay instances but the model has {num_layers} MoE layers; build the "
                "model with build_gpt_model(..., r3=True) right before creating RouterReplay"
            )
        self.num_layers = num_layers

    @classmethod
    def for_model(cls, model_cfg: Any) -> RouterReplay:
        """A replayer sized for a sluice ``ModelConfig`` (its MoE layers; dense layers have no router)."""
        return cls(num_layers=model_cfg.num_moe_layers, topk=model_cfg.moe_topk, num_experts=model_cfg.num_experts)

    def _set(self, action: Any) -> None:
        self._mrr.RouterReplay.set_global_router_replay_action(action)

    def record(self) -> None:
        """Subsequent forwards compute routing normally and record it."""
        self.clear()
        self._set(self._mrr.RouterReplayAction.RECORD)

    def recorded(self, batch: int) -> torch.Tensor:
        """The routing recorded by the last forward, as ``[batch, seq, layers, topk]``."""
        data = self._mrr.RouterReplay.get_recorded_data()
        if any(t is None for t in data):
            raise ConfigError("nothing recorded: call record() and run a forward pass first")
        return from_megatron_layers(data, batch)

    def replay_forward(
        self,
        routing: torch.Tensor | Sequence[RoutingArray],
        *,
        seq_len: int | None = None,
        sp_rank: int = 0,
        sp_size: int = 1,
    ) -> None:
        """Pin the next forward's experts to ``routing``.

        ``routing`` is either a ``[batch, seq, layers, topk]`` tensor or a list of per-sample ``[tokens, layers,
        topk]`` arrays (the engine's order), which are right-padded to ``seq_len``. An engine reports routing for
        prompt + response - 1 tokens (the last sampled token is never fed back), so each row's final position and its
        padding get the filler experts; their outputs do not reach any scored log-prob.
        """
        if not isinstance(routing, torch.Tensor):
            if seq_len is None:
                raise ConfigError("replay_forward with per-sample routing arrays needs seq_len (the padded length)")
            routing = pad_routing(
                routing, seq_len, num_layers=self.num_layers, topk=self.topk, num_experts=self.num_experts
            )
        self.clear()
        self._mrr.RouterReplay.set_replay_data(to_megatron_layers(routing, sp_rank=sp_rank, sp_size=sp_size))
        self._set(self._mrr.RouterReplayAction.REPLAY_FORWARD)

    def replay_backward(self) -> None:
        """Switch to replaying the same routing for activation recomputation during backward."""
        self._set(self._mrr.RouterReplayAction.REPLAY_BACKWARD)

    def off(self) -> None:
        """Route normally (no recording, no replay); keeps nothing."""
        self.clear()
        self._mrr.RouterReplay.clear_global_router_replay_action()

    def clear(self) -> None:
        """Drop recorded and replayed indices; call once per step so tensors of old batches are freed."""
        self._mrr.RouterReplay.clear_global_indices()
