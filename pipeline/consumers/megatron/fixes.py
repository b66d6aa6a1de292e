"""Work-arounds for megatron-core bugs that sluice hits on every device (the CPU-only patches are in cpu_shim.py).

Each fix is applied only on the versions it was checked against, at most once per process; other versions are
left as they are (a newer release may have fixed the bug, and the DeepSeek-V3 tests would show if not).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.version import Version

from pipeline.consumers.megatron.cpu_shim import megatron_core_version

_BUGGY = (Version("0.16.0"), Version("0.17.0"))
_fixed = False


def fix_expert_bias_padding_mask() -> bool:
    """Make the expert-bias token count honour the padding mask; returns whether the fix is in place.

    0.16.1's ``TopKRouter._apply_expert_bias`` computes ``routing_map & ~padding_mask`` with a ``[tokens, experts]``
    map and a ``[tokens]`` mask, which raises whenever a padding mask is passed to a router with an expert bias (every
    sluice training forward of a DeepSeek-V3 model). The fix masks per token, as intended.
    """
    global _fixed
    if _fixed:
        return True
    if not (_BUGGY[0] <= megatron_core_version() < _BUGGY[1]):
        return False
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter._apply_expert_bias = _count_routed_tokens  # type: ignore[method-assign]
    _fixed = True
    return True


def _count_routed_tokens(self: Any, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
    # Counted only in forwards with gradients, as megatron does: a no-grad scoring pass or an activation
    # recomputation must not count its tokens twice.
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.unsqueeze(-1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)
