"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay to a floor.

Pure arithmetic on the optimizer step count (no torch import, so recipes load fast). The schedule is a function of
the step alone (and, with ``decay_unit = "samples"``, of the samples trained), so a resumed trainer, whose counters
come back from the checkpoint, continues on the same curve without saving any scheduler state.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import ConfigError


class LRScheduleConfig(BaseModel):
    """Warm-up, then a decay shape, over optimizer steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    warmup_steps: int = Field(default=0, ge=0, le=100_000_000)
    """Optimizer steps over which the rate rises linearly from lr / (warmup_steps + 1) to lr; 0 = no warm-up."""
    decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: keep lr, or decay it linearly or along a half cosine down to min_lr_ratio * lr."""
    decay_steps: int | None = Field(default=None, ge=1, le=100_000_000)
    """Optimizer steps from the end of warm-up to the floor; None = the rest of the run."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """The floor of the decay, as a fraction of lr."""
    decay_unit: Literal["steps", "samples"] = "steps"
    """What the decay counts: optimizer steps, or samples trained. Runs whose steps train different numbers of
    samples (sync and async, or batches that dynamic sampling left partial) then have the same rate at the same
    number of samples, which is what a comparison at equal samples needs. The warm-up stays in optimizer steps."""
    decay_samples: int | None = Field(default=None, ge=1, le=10**12)
    """With decay_unit = "samples": samples trained from the start of the run to the floor (required). The decay's
    clock starts at sample 0, so right after a warm-up of w samples the rate is already the decay's value at w."""

    @model_validator(mode="after")
    def _check_unit(self) -> LRScheduleConfig:
        if self.decay_unit == "samples" and self.decay == "constant":
            raise ConfigError('lr_schedule.decay_unit = "samples" needs decay = "linear" or "cosine"; a constant rate '
                              "has no decay to count")
        if self.decay_unit == "samples" and self.decay_samples is None:
            raise ConfigError('lr_schedule.decay_unit = "samples" needs decay_samples (the samples trained from the '
                              "start of the run to the floor), e.g. the samples the run trains")
        if self.decay_unit == "steps" and self.decay_samples is not None:
            raise ConfigError('lr_schedule.decay_samples is set but decay_unit = "steps" ignores it; set '
                              'decay_unit = "samples", or drop decay_samples')
        return self


def lr_at(step: int, base_lr: float, cfg: LRScheduleConfig, total_steps: int | None = None, *,
          samples: int = 0) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total_steps``.

    Warm-up starts above zero (step 0 gets ``lr / (warmup + 1)``): a step at lr 0 would cost a whole batch and move
    nothing. With ``decay_unit = "samples"`` the decay's progress is ``samples / decay_samples``, ``samples`` being
    those trained before this step.
    """
    if step < 0:
        raise ValueError(f"step={step} is negative; optimizer steps count from 0")
    if step < cfg.warmup_steps:
        return base_lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.decay == "constant":
        return base_lr
    if cfg.decay_unit == "samples":
        assert cfg.decay_samples is not None  # the config's validator requires it
        progress = min(samples / cfg.decay_samples, 1.0)
    else:
        span = cfg.decay_steps
        if span is None:
            span = max((total_steps or 0) - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.min_lr_ratio * base_lr
    if cfg.decay == "linear":
        return floor + (base_lr - floor) * (1.0 - progress)
    return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: Any, lr: float) -> None:
    """Write ``lr`` into every parameter group of a torch (or megatron) optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr
