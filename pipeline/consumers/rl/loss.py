"""The RL loss: GRPO advantages, the decoupled PPO objective with off-policy corrections, KL, entropy and metrics.

Plain PyTorch on right-padded ``[B, T]`` tensors of per-token log-probs with a ``loss_mask`` (1 = a response token
that is trained on). The trainer gathers the log-probs from its model's logits (:func:`gather_logprobs`) and calls
:func:`policy_loss`.

Three policies meet in the decoupled objective (Hilton et al., "Batch size-invariance for policy optimization"; the
form AReaL uses for asynchronous RL):

- **behaviour** (mu): the rollout engine's log-probs, stored in the sample. Possibly several versions old, and
  computed by a different kernel stack (bf16, other attention kernels, other MoE routing), so it differs from the
  trainer even at the same version.
- **proximal** (pi_prox): the same tokens scored by the trainer's weights *before* this update. Recomputed by the
  trainer; it is a constant for the loss.
- **current** (pi_theta): the training forward, the only term with gradients.

Per token, with advantage ``A``, ``r = pi_theta / pi_prox`` and ``w = pi_prox / mu``::

    loss_t = w_c * max(-r * A, -clip(r, 1 - clip_low, 1 + clip_high) * A)

The clip keeps the update in a trust region around the proximal policy, not around the stale behaviour policy;
``w_c`` (the importance weight after the configured correction, never differentiated) accounts for the tokens having
been sampled from mu. With ``proximal = behaviour`` the weight is 1 and this is plain PPO/GRPO.

Corrections of w (``CorrectionConfig.type``):

- ``none``: ``w_c = 1`` (ignore the mismatch; behaviour log-probs are then used only for metrics).
- ``is``: ``w_c = w``, untruncated.
- ``tis``: truncated IS, ``w_c = min(w, cap)``.
- ``mis``: masked IS, ``w_c = w`` when ``low <= w <= high`` and 0 otherwise, per token or per sequence.
- ``icepop``: a two-sided per-token mask, as MIS at token level with the bounds of the IcePop paper
  (``[0.5, 5.0]`` unless given): tokens whose train/rollout ratio is far off either way carry no gradient.

At sequence level (``tis``, ``mis``) one weight serves every token of a sequence: ``product`` is
``exp(sum_t log w_t)`` (the exact sequence likelihood ratio, which explodes or vanishes on long responses) and
``geometric_mean`` is ``exp(mean_t log w_t)`` (length-normalised, so one bound means the same for any length). Sums
and means run over the sequence's ``loss_mask`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pipeline.config.trainer import AdvantageConfig, CorrectionConfig, LossConfig
from pipeline.errors import ConfigError, SampleError, SluiceError

Tensor = torch.Tensor

# exp() of a log-ratio beyond this overflows float32 products downstream; such tokens are far outside any clip range
# or correction bound, so clamping changes no decision, only keeps inf/nan out of the loss.
_MAX_LOG_RATIO = 20.0
# The KL penalty's per-token value is bounded to this (verl bounds its own the same way): k3 = exp(-x) - 1 + x grows
# exponentially in the log-ratio, so one token far below the reference (x = -15) would put about 3e6 * kl_coef into
# the loss and dominate the step. A token beyond the bound contributes a constant, and no gradient.
_MAX_KL = 10.0

# ---------------------------------------------------------------------------------------------------------- advantages


def grpo_advantages(rewards: Tensor, group_index: Tensor, cfg: AdvantageConfig) -> Tensor:
    """Per-sample advantages ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g``) within each prompt group.

    ``group_index`` holds any integer id per sample; groups may differ in size (filtered samples). A group whose
    rewards are all equal (including a group of one) gets exactly 0: it carries no signal about which response was
    better, and floating-point noise in its mean must not turn into a spurious direction.
    """
    _check_same_shape(rewards=rewards, group_index=group_index)
    if rewards.dim() != 1:
        raise SluiceError(f"rewards must be 1-D [num_samples], got shape {tuple(rewards.shape)}")
    # float64: sums of float32 rewards are exact there, and tiny groups' std is not lost to rounding.
    r = rewards.detach().to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise SampleError(f"rewards at positions {bad[:10]} are NaN or inf; fix the reward function or drop them")
    inverse, num_groups = _group_inverse(group_index)
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count
    centred = r - mean[inverse]
    adv = centred
    if cfg.normalize_std:
        dof = count - 1.0 if cfg.std_unbiased else count
        sq = torch.zeros_like(count).index_add_(0, inverse, centred * centred)
        std = torch.sqrt(sq / dof.clamp(min=1.0))
        adv = centred / (std[inverse] + cfg.eps)
    adv = torch.where(zero_variance_mask(rewards, group_index), torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def zero_variance_mask(rewards: Tensor, group_index: Tensor) -> Tensor:
    """True for every sample whose group's rewards are all equal (a batch filter in the style of DAPO)."""
    _check_same_shape(rewards=rewards, group_index=group_index)
    r = rewards.detach().to(torch.float64)
    inverse, num_groups = _group_inverse(group_index)
    hi = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=r.device)
    lo = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=r.device)
    hi = hi.scatter_reduce(0, inverse, r, reduce="amax")
    lo = lo.scatter_reduce(0, inverse, r, reduce="amin")
    return (hi == lo)[inverse]


def _group_inverse(group_index: Tensor) -> tuple[Tensor, int]:
    if group_index.dtype.is_floating_point:
        raise SluiceError(f"group_index must hold integer group ids, got dtype {group_index.dtype}")
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    return inverse, num_groups


# ------------------------------------------------------------------------------------------------ log-probs, entropy


def gather_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probs ``[B, T]`` of ``token_ids`` under ``logits`` ``[B, T, V]`` divided by the sampling temperature.

    The engine reports log-probs of the temperature-scaled distribution it sampled from, so the trainer must score
    with the same temperature or every token looks off-policy. Computed in float32.
    """
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise SluiceError(
            f"gather_logprobs needs logits [B, T, V] and token_ids [B, T]; got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}"
        )
    if temperature <= 0:
        raise ConfigError(f"temperature={temperature}; it must be > 0 (greedy decoding has no log-probs to match)")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy ``[B, T]`` of the (temperature-scaled) next-token distribution."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: Literal["k1", "k2", "k3"]) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    k1 = log(pi/ref) is unbiased but can be negative; k2 = log(pi/ref)^2 / 2 is biased, low variance; k3 =
    ref/pi - 1 - log(ref/pi) is unbiased, never negative and low variance (GRPO's choice).
    """
    log_ratio = (logprobs - ref_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    return torch.exp(-log_ratio) - 1.0 + log_ratio


# -------------------------------------------------------------------------------------------------- importance weights


@dataclass(frozen=True)
class ImportanceWeights:
    """The importance weight proximal/behaviour per token, before and after the correction (both without grad)."""

    raw: Tensor
    """w per token (the sequence weight broadcast at sequence level), before truncation or masking."""
    applied: Tensor
    """The weight that multiplies each token's surrogate; 0 where the correction masked the token."""
    kept: Tensor
    """Bool: the correction did not mask the token."""


def importance_weights(
    proximal: Tensor, behaviour: Tensor, loss_mask: Tensor, cfg: CorrectionConfig
) -> ImportanceWeights:
    """Apply ``cfg`` to ``w = exp(proximal - behaviour)`` over the ``loss_mask`` tokens of ``[B, T]`` tensors."""
    mask = loss_mask.bool()
    log_w = torch.where(mask, (proximal.detach().float() - behaviour.detach().float()), 0.0)
    if cfg.level == "sequence" and cfg.type in ("tis", "mis"):
        log_w = _sequence_log_weight(log_w, mask, cfg.sequence_weight).unsqueeze(-1).expand_as(log_w)
    raw = torch.exp(log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    kept = mask.clone()
    if cfg.type == "none":
        applied = torch.ones_like(raw)
    elif cfg.type == "is":
        applied = raw
    elif cfg.type == "tis":
        applied = raw.clamp(max=cfg.cap)
    else:
        low, high = cfg.bounds()
        kept = mask & (raw >= low) & (raw <= high)
        applied = torch.where(kept, raw, 0.0)
    return ImportanceWeights(raw=raw, applied=torch.where(mask, applied, 0.0), kept=kept)


def _sequence_log_weight(log_w: Tensor, mask: Tensor, how: Literal["product", "geometric_mean"]) -> Tensor:
    total = log_w.sum(-1)
    if how == "product":
        return total
    return total / mask.sum(-1).clamp(min=1)


# --------------------------------------------------------------------------------------------------------- aggregation


def aggregate(
    values: Tensor,
    loss_mask: Tensor,
    how: Literal["token_mean", "sequence_mean", "constant_norm"],
    *,
    norm_length: int | None = None,
    normalizer: float | None = None,
) -> Tensor:
    """Reduce per-token values ``[B, T]`` to a scalar over the ``loss_mask`` tokens.

    - ``token_mean``: ``sum_bt m*v / N`` with N the number of mask tokens in the batch. Every token weighs the same,
      so long responses count more (DAPO).
    - ``sequence_mean``: ``(1/S) * sum_b (sum_t m*v / n_b)`` with n_b the mask tokens of sequence b and S the number
      of sequences with n_b > 0. Every sequence weighs the same (the original GRPO).
    - ``constant_norm``: ``sum_bt m*v / (S * L)`` with S = B and L = ``norm_length`` (default T). A constant
      denominator, so no length bias (Dr. GRPO).

    ``normalizer`` replaces N (token_mean) or S (the other two). With gradient accumulation or data parallelism, pass
    the count over the whole global batch so that micro-batch losses add up to the global-batch loss.
    """
    mask = loss_mask.to(values.dtype)
    # where, not multiply: a NaN or inf at a pad position times 0 is still NaN.
    masked = torch.where(loss_mask.bool(), values, 0.0)
    if how == "token_mean":
        denom = mask.sum() if normalizer is None else torch.tensor(float(normalizer), dtype=values.dtype)
        return masked.sum() / denom.clamp(min=1.0)
    if how == "sequence_mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        count = (mask.sum(-1) > 0).sum().to(values.dtype) if normalizer is None else torch.tensor(float(normalizer))
        return per_seq.sum() / count.clamp(min=1.0)
    length = values.shape[-1] if norm_length is None else norm_length
    seqs = values.shape[0] if normalizer is None else normalizer
    return masked.sum() / max(float(seqs) * length, 1.0)


# -------------------------------------------------------------------------------------------------------------- loss


@dataclass(frozen=True)
class LossOutput:
    """The scalar loss (with grad), float metrics, and the importance weights used.

    ``metrics["pg_loss"]``, ``["kl_ref"]`` and ``["entropy"]`` are aggregated like the loss, so ``loss = pg_loss +
    kl_coef * kl_ref - entropy_coef * entropy``. The other metrics are plain means over the ``loss_mask`` tokens:
    ``mismatch_k3``/``mismatch_k1`` (KL(behaviour || trainer), the train/rollout gap), ``policy_kl_k3`` (how far
    current moved from proximal), ``clip_fraction`` (tokens where the clip zeroes the gradient) with its
    ``_high``/``_low`` parts, ``is_weight_mean``/``_min``/``_max`` (the raw weight proximal/behaviour),
    ``is_weight_applied_mean``, ``masked_fraction`` (tokens a correction zeroed) and ``num_tokens``.
    """

    loss: Tensor
    metrics: dict[str, float]
    weights: ImportanceWeights


def policy_loss(
    current: Tensor,
    behaviour: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: LossConfig,
    *,
    proximal: Tensor | None = None,
    ref: Tensor | None = None,
    logits: Tensor | None = None,
    entropy: Tensor | None = None,
    normalizer: float | None = None,
    sample_weights: Tensor | None = None,
) -> LossOutput:
    """The decoupled PPO loss over ``[B, T]`` per-token log-probs (see the module docstring).

    ``current`` carries the gradient. ``proximal`` defaults to ``behaviour`` (plain PPO: the weight is 1 and the clip
    ratio is current/behaviour). ``advantages`` is per sequence ``[B]`` or per token ``[B, T]``. ``ref`` is needed
    when ``kl_coef > 0``; ``logits`` (``[B, T, V]``, already temperature-scaled) or ``entropy`` (``[B, T]``) when
    ``entropy_coef > 0``, otherwise they only feed the entropy metric. Pad positions must be 0 in ``loss_mask``;
    the log-prob and advantage values there are ignored, even NaN or inf. ``sample_weights`` ``[B]`` (a group
    filter's weights) multiply each sample's token losses, pg, KL and entropy alike; the normaliser still counts
    tokens (or sequences) unweighted, so a weight scales that sample's share of the gradient and nothing else.
    """
    _check_same_shape(current=current, behaviour=behaviour, loss_mask=loss_mask)
    if current.dim() != 2:
        raise SluiceError(f"policy_loss needs [B, T] log-probs, got shape {tuple(current.shape)}")
    prox = behaviour if proximal is None else proximal
    _check_same_shape(current=current, proximal=prox)
    mask = loss_mask.bool()
    adv = torch.where(mask, _token_advantages(advantages, current), 0.0)
    cur = torch.where(mask, current.float(), 0.0)
    prox = torch.where(mask, prox.detach().float(), 0.0)

    weights = importance_weights(prox, behaviour, mask, cfg.correction)
    ratio = torch.exp((cur - prox).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    pg = weights.applied * _clipped_surrogate(ratio, adv, cfg)
    token_loss = pg
    parts: dict[str, Tensor] = {"pg_loss": pg}
    if cfg.kl_coef > 0 or ref is not None:
        kl = _reference_kl(cur, ref, mask, cfg)
        parts["kl_ref"] = kl
        token_loss = token_loss + cfg.kl_coef * kl
    ent = _entropy(logits, entropy, mask, cfg)
    if ent is not None:
        parts["entropy"] = ent
        token_loss = token_loss - cfg.entropy_coef * ent

    if sample_weights is not None:
        if sample_weights.shape != current.shape[:1]:
            raise SluiceError(f"sample_weights of shape {tuple(sample_weights.shape)} must be [B] = "
                              f"({current.shape[0]},)")
        rows = sample_weights.detach().float().unsqueeze(-1)
        token_loss = token_loss * rows
        parts = {name: v * rows for name, v in parts.items()}

    def agg(v: Tensor) -> Tensor:
        return aggregate(v, mask, cfg.aggregation, norm_length=cfg.norm_length, normalizer=normalizer)

    loss = agg(token_loss)
    with torch.no_grad():
        metrics = {"loss": float(loss.item())}
        metrics.update({name: float(agg(v).item()) for name, v in parts.items()})
        diag = _diagnostics(cur, prox, behaviour, adv, ratio, weights, mask, cfg, has_proximal=proximal is not None)
        metrics.update(diag)
    return LossOutput(loss=loss, metrics=metrics, weights=weights)


def _token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.shape == like.shape:
        return advantages.detach().float()
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.detach().float().unsqueeze(-1).expand_as(like)
    raise SluiceError(
        f"advantages of shape {tuple(advantages.shape)} fit neither [B] nor [B, T] = {tuple(like.shape)}"
    )


def _clipped_surrogate(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    # -min(r*A, clip(r)*A): the pessimistic bound, so moving the ratio out of the trust region never lowers the loss.
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(-ratio * adv, -clipped * adv)
    if cfg.dual_clip is not None:
        # For A < 0 the unclipped side grows with r without bound; a far-off-policy token could dominate the batch.
        loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip * adv), loss)
    return loss


def _reference_kl(cur: Tensor, ref: Tensor | None, mask: Tensor, cfg: LossConfig) -> Tensor:
    if ref is None:
        raise ConfigError(
            f"loss.kl_coef={cfg.kl_coef} needs reference log-probs (ref=...); pass them, or set loss.kl_coef=0"
        )
    _check_same_shape(current=cur, ref=ref)
    kl = kl_penalty(cur, torch.where(mask, ref.detach().float(), 0.0), cfg.kl_estimator)
    return kl.clamp(-_MAX_KL, _MAX_KL)


def _entropy(logits: Tensor | None, entropy: Tensor | None, mask: Tensor, cfg: LossConfig) -> Tensor | None:
    if entropy is None and logits is not None:
        # Only the bonus needs the [B, T, V] graph; for the metric alone, do not keep it alive.
        with torch.set_grad_enabled(cfg.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    if entropy is None:
        if cfg.entropy_coef > 0:
            raise ConfigError(
                f"loss.entropy_coef={cfg.entropy_coef} needs logits or entropy; pass one, or set loss.entropy_coef=0"
            )
        return None
    _check_same_shape(loss_mask=mask, entropy=entropy)
    ent = torch.where(mask, entropy.float(), 0.0)
    return ent if cfg.entropy_coef > 0 else ent.detach()


def _diagnostics(
    cur: Tensor,
    prox: Tensor,
    behaviour: Tensor,
    adv: Tensor,
    ratio: Tensor,
    weights: ImportanceWeights,
    mask: Tensor,
    cfg: LossConfig,
    *,
    has_proximal: bool,
) -> dict[str, float]:
    """Token means over the mask; they describe the batch, whatever the loss aggregation."""
    n = mask.sum()
    if int(n.item()) == 0:
        return {"num_tokens": 0.0}

    def mean(v: Tensor) -> float:
        return float((torch.where(mask, v, 0.0).sum() / n).item())

    beh = torch.where(mask, behaviour.detach().float(), 0.0)
    # Train-vs-rollout mismatch, KL(mu || pi_prox) by k3 on tokens sampled from mu: the kernel/precision gap plus
    # staleness. Without a proximal pass, the current forward (before any step on this batch) stands in.
    train = prox if has_proximal else cur.detach()
    log_r = (train - beh).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    high_clipped = (adv > 0) & (ratio > 1.0 + cfg.clip_high)
    low_clipped = (adv < 0) & (ratio < 1.0 - cfg.clip_low)
    raw_valid = weights.raw[mask]
    return {
        "num_tokens": float(n.item()),
        "mismatch_k3": mean(torch.exp(log_r) - 1.0 - log_r),
        "mismatch_k1": mean(-log_r),
        "policy_kl_k3": mean(kl_penalty(prox, cur.detach(), "k3")),
        "clip_fraction": mean((high_clipped | low_clipped).float()),
        "clip_high_fraction": mean(high_clipped.float()),
        "clip_low_fraction": mean(low_clipped.float()),
        "is_weight_mean": float(raw_valid.mean().item()),
        "is_weight_min": float(raw_valid.min().item()),
        "is_weight_max": float(raw_valid.max().item()),
        "is_weight_applied_mean": mean(weights.applied),
        "masked_fraction": mean((~weights.kept).float()),
        # The share of tokens whose TIS weight the cap cut: what the correction did (0 for the other types).
        "is_capped_fraction": mean((weights.raw > cfg.correction.cap).float()) if cfg.correction.type == "tis"
        else 0.0,
    }


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise SluiceError(f"shape mismatch: {shapes}; these tensors must all have the same shape")
