"""The loss's configuration, apart from ``loss.py`` so that loading a recipe does not import torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import ConfigError

_ICEPOP_BOUNDS = (0.5, 5.0)
_MIS_BOUNDS = (0.0, 2.0)


class AdvantageConfig(BaseModel):
    """GRPO group-normalised advantages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    normalize_std: bool = True
    """Divide by the group's reward std (GRPO); False only subtracts the group mean (Dr. GRPO)."""

    eps: float = Field(default=1e-6, gt=0.0, le=1.0)
    """Added to the std before dividing, so near-constant groups do not blow up."""

    std_unbiased: bool = True
    """Use the unbiased (n-1) std over a group, as torch.std does; False uses the population (n) std."""


class CorrectionConfig(BaseModel):
    """How the importance weight proximal/behaviour is corrected (see the module docstring for the formulas)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["none", "is", "tis", "mis", "icepop"] = "tis"
    """The correction: none, raw IS, truncated IS, masked IS, or IcePop's two-sided token mask."""

    level: Literal["token", "sequence"] = "token"
    """For tis and mis: one weight per token, or one per sequence shared by its tokens (icepop is token-only)."""

    sequence_weight: Literal["product", "geometric_mean"] = "geometric_mean"
    """At sequence level: exp(sum of log w) (exact, explodes on long sequences) or exp(mean of log w)."""

    cap: float = Field(default=2.0, gt=0.0, le=1e6)
    """TIS truncation C: the weight is min(w, C)."""

    low: float | None = Field(default=None, ge=0.0, le=1e6)
    """MIS/IcePop lower bound on w (tokens below are masked); None = 0.0 for mis, 0.5 for icepop."""

    high: float | None = Field(default=None, gt=0.0, le=1e6)
    """MIS/IcePop upper bound on w (tokens above are masked); None = 2.0 for mis, 5.0 for icepop."""

    @model_validator(mode="after")
    def _check(self) -> CorrectionConfig:
        if self.type == "icepop" and self.level == "sequence":
            raise ConfigError(
                "correction.type='icepop' masks single tokens; level='sequence' does not apply. Use type='mis' with "
                "level='sequence' for a sequence-level mask, or set level='token'."
            )
        low, high = self.bounds()
        if low >= high:
            raise ConfigError(f"correction bounds low={low} >= high={high}; the kept interval [low, high] is empty")
        return self

    def bounds(self) -> tuple[float, float]:
        """The [low, high] interval of kept weights for mis/icepop, with the type's defaults filled in."""
        default = _ICEPOP_BOUNDS if self.type == "icepop" else _MIS_BOUNDS
        return (
            default[0] if self.low is None else self.low,
            default[1] if self.high is None else self.high,
        )


class LossConfig(BaseModel):
    """The policy-gradient loss."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """PPO clip below: the ratio current/proximal is clipped at 1 - clip_low."""

    clip_high: float = Field(default=0.2, ge=0.0, le=100.0)
    """PPO clip above: the ratio is clipped at 1 + clip_high (DAPO raises it, e.g. 0.28, to keep exploring)."""

    dual_clip: float | None = Field(default=None, gt=1.0, le=100.0)
    """For negative advantages, cap the token loss at dual_clip * |A| (dual-clip PPO); None = off."""

    kl_coef: float = Field(default=0.0, ge=0.0, le=100.0)
    """Weight of the KL penalty to the reference policy, added to the loss; 0 = no reference model needed."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL(current || ref) estimator per token: k1, k2 or k3 (see :func:`kl_penalty`); k3 is GRPO's."""

    entropy_coef: float = Field(default=0.0, ge=0.0, le=100.0)
    """Weight of an entropy bonus subtracted from the loss; needs logits or entropy; 0 = metric only."""

    aggregation: Literal["token_mean", "sequence_mean", "constant_norm"] = "token_mean"
    """How token losses become one number: mean over all batch tokens, mean of per-sequence means, or Dr. GRPO's
    sum over (sequences * norm_length)."""

    norm_length: int | None = Field(default=None, ge=1, le=10_000_000)
    """The constant length for aggregation='constant_norm'; None = the padded length T of the batch."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """GRPO advantage settings."""

    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    """The off-policy correction of the importance weight proximal/behaviour."""
