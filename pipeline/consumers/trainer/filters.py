"""Group filters: which drained prompt groups the trainer keeps (an extension point; docs/architecture.md, "Edges").

A filter sees one prompt group, the samples of it the trainer could train on (with their rewards), after the
staleness policy has accepted it. A dropped group is recorded in the ledger as ``filtered``, acked at the next commit
like a stale one, gives its pacing slot back, and does not count towards the batch: the drainer keeps reading until
``batch_groups`` groups passed every filter (DAPO's dynamic sampling when the filter is ``zero_variance``).

- ``zero_variance`` (built in): every reward of the group is the same. GRPO's advantage ``r - mean(r)`` is then 0 for
  every sample, so the group adds no gradient, only noise to the loss normaliser and time to the step.
- ``user``: functions named ``package.module:function``, each called with the group (``list[Sample]``). They return
  True (or 1.0) to keep it, False (or 0.0) to drop it, or another finite weight >= 0 to keep it with its part of the
  loss scaled by that weight (several filters' weights multiply). They are imported and their signatures checked when
  the recipe loads; an answer that is none of these (a negative or NaN weight, a string) stops the drain with an error
  naming the filter.

A weight travels with its group to the trainer (``Batch.group_weights``, then ``TrainBatch.sample_weights``) and
multiplies the token losses of the group's samples; the loss normaliser keeps counting their tokens unweighted, so a
weight of 2 doubles that group's gradient and leaves every other group's as it was (docs/plugins.md).

The ``[filters]`` section and the filters' signature are ``pipeline.config.filters``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from pipeline.config.filters import FILTER_SIGNATURE, FilterConfig
from pipeline.errors import SluiceError
from pipeline.plugins import resolve
from pipeline.queue.sample import Sample

GroupFilterFn = Callable[[list[Sample]], Any]
ZERO_VARIANCE = "zero_variance"


def resolve_filter(spec: str, field: str = "filters.user") -> GroupFilterFn:
    """The function an import path ``package.module:function`` names; ConfigError says what is wrong with it."""
    return resolve(spec, field=field, signature=FILTER_SIGNATURE)


def zero_variance(group: Sequence[Sample]) -> bool:
    """Whether every sample of the group has the same reward (so its GRPO advantages are all exactly 0)."""
    rewards = [float(s.reward) for s in group]
    return max(rewards) == min(rewards)


@dataclass(frozen=True)
class FilterVerdict:
    """What the filters made of one group: dropped (by which filter), or kept with a loss weight."""

    dropped_by: str | None
    """``"zero_variance"`` or the dropping filter's import path; None when kept."""
    weight: float = 1.0
    """The product of the user filters' weights (1 = as is)."""


def as_weight(answer: Any, spec: str) -> float:
    """A filter's answer as a weight: True/False are 1/0, a number must be finite and >= 0; anything else raises."""
    if isinstance(answer, bool | np.bool_):
        return 1.0 if answer else 0.0
    if isinstance(answer, numbers.Real):
        weight = float(answer)
        if math.isfinite(weight) and weight >= 0:
            return weight
        raise SluiceError(f"group filter {spec!r} returned the weight {answer!r}; a weight must be finite and >= 0 "
                          "(0 drops the group, 1 keeps it, another value scales its loss)")
    raise SluiceError(f"group filter {spec!r} returned {type(answer).__name__} {answer!r}; it must return True (keep "
                      "the group), False (drop it) or a weight >= 0 (scale its loss)")


@dataclass
class FilterCounts:
    """Groups and samples a batch's filters removed or reweighted (on ``Batch.filters``); add them up across steps
    with ``+=``."""

    groups_zero_variance: int = 0
    groups_user: int = 0
    samples: int = 0
    capped: int = 0
    """Steps whose draw stopped at filters.max_draw_factor with a partial batch."""
    groups_reweighted: int = 0
    """Kept groups whose weight is not 1."""
    groups_kept: int = 0
    weight_sum: float = 0.0
    """Sum of the kept groups' weights (for the mean weight)."""

    def record_kept(self, weight: float) -> None:
        """Count one group that passed the filters with ``weight``."""
        self.groups_kept += 1
        self.weight_sum += weight
        self.groups_reweighted += int(weight != 1.0)

    def forget_kept(self, weight: float) -> None:
        """Undo ``record_kept`` for a group that never reached the step (its payload was lost)."""
        self.groups_kept -= 1
        self.weight_sum -= weight
        self.groups_reweighted -= int(weight != 1.0)

    def record(self, reason: str, num_samples: int) -> None:
        """Count one removed group; ``reason`` is what :meth:`GroupFilters.check` returned."""
        if reason == ZERO_VARIANCE:
            self.groups_zero_variance += 1
        else:
            self.groups_user += 1
        self.samples += num_samples

    @property
    def groups(self) -> int:
        """Groups removed by any filter."""
        return self.groups_zero_variance + self.groups_user

    def __iadd__(self, other: FilterCounts) -> FilterCounts:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_metrics(self, prefix: str = "filter/") -> dict[str, float]:
        """``filter/groups_zero_variance``, ``groups_user``, ``samples`` (removed), ``capped``,
        ``groups_reweighted`` and ``weight_mean`` (over the kept groups; 1 when none was kept)."""
        removed = ("groups_zero_variance", "groups_user", "samples", "capped", "groups_reweighted")
        out = {f"{prefix}{name}": float(getattr(self, name)) for name in removed}
        out[f"{prefix}weight_mean"] = self.weight_sum / self.groups_kept if self.groups_kept else 1.0
        return out


class GroupFilters:
    """The filters a config names, resolved once; :meth:`check` runs them in order (built-in first)."""

    def __init__(self, cfg: FilterConfig | None = None) -> None:
        cfg = cfg or FilterConfig()
        self.zero_variance = cfg.zero_variance
        self.max_draw_factor = cfg.max_draw_factor
        self.user: list[tuple[str, GroupFilterFn]] = [(spec, resolve_filter(spec, f"filters.user[{i}]"))
                                                       for i, spec in enumerate(cfg.user)]

    @property
    def active(self) -> bool:
        """Whether any filter is on."""
        return self.zero_variance or bool(self.user)

    def drawn_enough(self, kept: int, removed: int, batch_groups: int, min_groups: int) -> bool:
        """Whether a step may stop drawing with ``kept`` groups after filters ``removed`` others (the draw cap)."""
        if self.max_draw_factor is None or kept < min_groups:
            return False
        return removed >= self.max_draw_factor * batch_groups

    def check(self, group: list[Sample]) -> str | None:
        """Why the group is dropped (``"zero_variance"`` or the user filter's import path), or None to keep it."""
        return self.weigh(group).dropped_by

    def weigh(self, group: list[Sample]) -> FilterVerdict:
        """Run the filters in order: the first that drops the group decides; kept groups get the product of the
        weights."""
        if self.zero_variance and zero_variance(group):
            return FilterVerdict(ZERO_VARIANCE, 0.0)
        weight = 1.0
        for spec, fn in self.user:
            try:
                answer = fn(list(group))  # a copy: a filter that edits its list must not change what is trained
            except Exception as e:  # re-raised naming the filter: a bare traceback from user code names no field
                raise SluiceError(f"group filter {spec!r} raised {type(e).__name__}: {e}") from e
            w = as_weight(answer, spec)
            if w == 0.0:
                return FilterVerdict(spec, 0.0)
            weight *= w
        return FilterVerdict(None, weight)
