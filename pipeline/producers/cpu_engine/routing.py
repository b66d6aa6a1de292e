"""Capture of the experts the router picked for every token, during generation (for R3 router replay).

A forward hook on each MoE block's router (Qwen3-MoE ``mlp.gate``, which returns ``(logits, scores, indices)``)
keeps the ``[tokens, topk]`` expert ids of the forward that just ran. The generator turns them into per-sequence
rows, dropping the rows of padding tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router module of every MoE layer, in layer order (empty for a dense model)."""
    layers = getattr(getattr(model, "model", model), "layers", [])
    routers = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "gate") and hasattr(mlp, "experts"):
            routers.append(mlp.gate)
    return routers


class RoutingRecorder:
    """Records the top-k expert ids of every MoE layer for the most recent forward pass."""

    def __init__(self, model: nn.Module) -> None:
        self._routers = moe_routers(model)
        self._captured: list[torch.Tensor | None] = [None] * len(self._routers)
        self._handles = [router.register_forward_hook(self._make_hook(i)) for i, router in enumerate(self._routers)]

    @property
    def num_layers(self) -> int:
        """Number of MoE layers."""
        return len(self._routers)

    def _make_hook(self, index: int) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            # Qwen3-MoE routers return (router_logits, routing_weights, selected_experts); older ones return the
            # logits only, from which the engine cannot know the tie-breaking the block used, so they are refused.
            if not isinstance(output, tuple) or len(output) < 3:
                raise TypeError(f"router {type(module).__name__} does not return expert indices; cannot record routing")
            self._captured[index] = output[2].detach()

        return hook

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """Expert ids of the last forward as ``[batch, seq, layers, topk]`` int32, and forget them."""
        if any(t is None for t in self._captured):
            raise RuntimeError("no routing was captured; was the forward pass run with this recorder attached?")
        stacked = torch.stack([t.reshape(batch, seq, -1) for t in self._captured if t is not None], dim=2)
        self._captured = [None] * len(self._routers)
        return stacked.to(torch.int32)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
