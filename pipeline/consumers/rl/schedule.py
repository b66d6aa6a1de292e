"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay to a floor.

Pure arithmetic on the optimizer step count (no torch import; the section is ``pipeline.config.trainer``). The
schedule is a function of the step alone (and, with ``decay_unit = "samples"``, of the samples trained), so a resumed
trainer, whose counters come back from the checkpoint, continues on the same curve without saving any scheduler
state.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.config.trainer import LRScheduleConfig


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
