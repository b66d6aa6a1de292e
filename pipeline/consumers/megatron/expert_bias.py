"""Aux-loss-free load balancing (DeepSeek-V3): the routers' expert bias, updated once per optimizer step.

megatron-core keeps the bias as a router buffer and counts, in every forward with gradients, the tokens each expert
received (padding excluded); its ``finalize_model_grads`` then sums the counts over the tensor- and data-parallel
ranks and moves each expert's bias by ``rate`` toward balance (up for an under-loaded expert, down for an over-loaded
one), and zeroes the counts. sluice's updaters do not call ``finalize_model_grads`` (its CPU path replaces megatron's
DDP), so the train step calls :func:`update_expert_bias` after each optimizer step, with megatron's own update
function. Under R3 the counts are those of the replayed routing, i.e. the engines' load.

The bias steers only which experts are chosen, never their weights, and it is an HF weight
(``e_score_correction_bias``): checkpoints keep it (a persistent buffer) and every weight push carries it.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def bias_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of ``model`` that have an expert bias, in layer order (empty for other models)."""
    return [m for m in model.modules() if getattr(m, "expert_bias", None) is not None
            and getattr(m, "local_tokens_per_expert", None) is not None]


@torch.no_grad()
def update_expert_bias(model: torch.nn.Module, rate: float) -> dict[str, float]:
    """Move every router's expert bias by ``rate`` toward balance from the tokens counted since the last call, then
    zero the counts; returns ``expert_bias_abs_max`` and ``expert_load_max_ratio`` (most-loaded expert over the mean,
    averaged over layers, before the update). Collective over all trainer ranks; {} for a model without a bias."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    routers = bias_routers(model)
    if not routers:
        return {}
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    biases = torch.stack([r.expert_bias for r in routers])
    # All-reduces ``counts`` in place over the tensor- and data-parallel ranks (all of them, without pipeline
    # stages), so every rank applies the same update and the bias stays replicated.
    updated = get_updated_expert_bias(counts, biases, rate)
    for router, bias in zip(routers, updated, strict=True):
        router.expert_bias.copy_(bias)
        router.local_tokens_per_expert.zero_()
    mean = counts.mean(dim=-1).clamp(min=1e-9)
    return {
        "expert_bias_abs_max": float(updated.abs().max()),
        "expert_load_max_ratio": float((counts.max(dim=-1).values / mean).mean()),
    }
