"""Example loss plug-ins (docs/plugins.md, "Loss plug-ins"). Recipe lines:

    [plugins]
    paths = ["examples"]

    [[trainer.loss.terms]]          # an auxiliary term, added to the policy loss
    fn = "losses:length_penalty"
    coef = 0.05

    [trainer.loss]
    replace = "losses:reinforce"    # or: the whole policy loss replaced

Each function gets one ``LossInputs`` per micro-batch (pipeline/consumers/rl/loss_plugins.py) and returns its mean over
that micro-batch, a 0-dim tensor, plus a dict of float metrics; ``inputs.mean`` averages per-token values the way the
built-in loss does, so sluice can scale each micro-batch by its share of the optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch


def length_penalty(inputs: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Push down the likelihood of long responses, in proportion to their length (a positive coef shortens them).

    Per sample: (its loss tokens / the longest in the micro-batch) x its log-probs. Minimising it lowers the
    log-prob of every token of a response, the more so the longer the response: a REINFORCE-style length cost.
    """
    mask = inputs.loss_mask
    lengths = mask.sum(-1).float()
    relative = lengths / lengths.max().clamp(min=1.0)
    value = inputs.mean(relative.unsqueeze(-1) * inputs.logprobs)
    real = lengths[lengths > 0]
    return value, {"mean_length": float(real.mean().item()) if real.numel() else 0.0}


def entropy_bonus(inputs: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Minus the mean entropy: a positive coef raises entropy. Needs ``trainer.loss.entropy_grad = true`` (otherwise
    the entropy carries no gradient and the term only changes the reported loss; sluice logs a warning)."""
    if inputs.entropy is None:
        raise ValueError("entropy_bonus needs the entropy; it is computed in every training forward")
    value = -inputs.mean(inputs.entropy)
    return value, {"entropy": float(-value.item())}


def reinforce(inputs: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain REINFORCE with the group baseline, as a replacement for the PPO loss: -mean(A * log pi), no ratio, no
    clip, no importance weight (so it is exact only on-policy: mode = "sync", or max_lag = 0). Group-filter weights
    apply through ``inputs.mean``."""
    value = -inputs.mean(inputs.advantages.unsqueeze(-1) * inputs.logprobs)
    return value, {"advantage_abs": float(inputs.mean(inputs.advantages.abs(), weighted=False).item())}
