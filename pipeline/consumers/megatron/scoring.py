"""Scoring a megatron forward for RL: temperature-scaled token log-probs and entropy over a vocabulary that may be
split across tensor-parallel ranks, the routers' dispatched experts, and megatron's process-wide replay registry."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from pipeline.consumers.megatron.router_replay import from_megatron_layers

Tensor = torch.Tensor

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


class RouterProbe:
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


def replay_hooks(model: Any) -> list[Any]:
    """megatron's per-layer ``RouterReplay`` objects of ``model``, in layer order (empty without replay)."""
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    return [r.router_replay for r in routers if getattr(r, "router_replay", None) is not None]


def install_replay_hooks(hooks: list[Any]) -> list[Any]:
    """Make ``hooks`` megatron's process-wide replay list; returns the list it held before."""
    from megatron.core.transformer.moe.router_replay import RouterReplay as MegatronReplay

    registry = MegatronReplay.global_router_replay_instances
    saved = list(registry)
    registry[:] = hooks
    return saved


@contextmanager
def replay_registry(hooks: list[Any]) -> Iterator[None]:
    """Point megatron's process-wide replay list at ``hooks`` for the duration, then restore it.

    megatron's static ``set_replay_data``/``set_global_router_replay_action`` act on that one list, so with two
    models in the process the list decides which model a replay reaches.
    """
    saved = install_replay_hooks(hooks)
    try:
        yield
    finally:
        install_replay_hooks(saved)


