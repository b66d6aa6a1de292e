"""Group filters: which drained prompt groups the trainer keeps (an extension point; ARCHITECTURE.md, "Edges").

A filter sees one prompt group, the samples of it the trainer could train on (with their rewards), after the
staleness policy has accepted it. A dropped group is recorded in the ledger as ``filtered``, acked at the next commit
like a stale one, gives its pacing slot back, and does not count towards the batch: the drainer keeps reading until
``batch_groups`` groups passed every filter (DAPO's dynamic sampling when the filter is ``zero_variance``).

- ``zero_variance`` (built in): every reward of the group is the same. GRPO's advantage ``r - mean(r)`` is then 0 for
  every sample, so the group adds no gradient, only noise to the loss normaliser and time to the step.
- ``user``: functions named ``package.module:function``, each called with the group (``list[Sample]``) and returning
  True to keep it. They are imported and their signatures checked when the recipe loads.

Light on purpose (no torch): the config imports it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.errors import ConfigError, SluiceError
from pipeline.queue.sample import Sample

GroupFilterFn = Callable[[list[Sample]], Any]
ZERO_VARIANCE = "zero_variance"


class FilterConfig(BaseModel):
    """The ``[filters]`` section: group filters applied to every drained group the staleness policy accepts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    zero_variance: bool = False
    """Drop groups whose rewards are all equal (zero GRPO advantage) and keep drawing until the batch is full."""
    user: list[str] = []
    """Filters 'package.module:function', each called with one group (list[Sample]) and returning True to keep it."""
    max_draw_factor: float | None = Field(default=None, ge=1.0, le=1000.0)
    """Stop drawing for a step once filters removed this many times trainer.batch_groups groups, and train on the
    groups kept so far (a smaller batch); None = draw until the batch is full. Near convergence most groups are all
    right, and filling the batch would cost many times its generation (DAPO caps it with max_num_gen_batches)."""

    @field_validator("user")
    @classmethod
    def _importable(cls, specs: list[str]) -> list[str]:
        for i, spec in enumerate(specs):
            try:
                resolve_filter(spec)
            except ConfigError as e:
                raise ValueError(f"filters.user[{i}]: {e}") from None
        return specs


def resolve_filter(spec: str) -> GroupFilterFn:
    """The function an import path ``package.module:function`` names; ConfigError says what is wrong with it."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"group filter {spec!r} is not an import path 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"group filter {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"group filter {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"group filter {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn):
        raise ConfigError(f"group filter {spec!r}: it is async; the trainer calls filters synchronously, so make it a "
                          "plain function")
    try:
        inspect.signature(fn).bind([])
    except TypeError:
        raise ConfigError(f"group filter {spec!r}: must take one argument, the group (list[Sample]); its signature "
                          f"is {inspect.signature(fn)}") from None
    except ValueError:
        pass  # a builtin without a signature: trust it
    return fn  # type: ignore[no-any-return]


def zero_variance(group: Sequence[Sample]) -> bool:
    """Whether every sample of the group has the same reward (so its GRPO advantages are all exactly 0)."""
    rewards = [float(s.reward) for s in group]
    return max(rewards) == min(rewards)


@dataclass
class FilterCounts:
    """Groups and samples a batch's filters removed (on ``Batch.filters``); add them up across steps with ``+=``."""

    groups_zero_variance: int = 0
    groups_user: int = 0
    samples: int = 0
    capped: int = 0
    """Steps whose draw stopped at filters.max_draw_factor with a partial batch."""

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
        """``filter/groups_zero_variance``, ``filter/groups_user`` and ``filter/samples``."""
        return {f"{prefix}{f.name}": float(getattr(self, f.name)) for f in fields(self)}


class GroupFilters:
    """The filters a config names, resolved once; :meth:`check` runs them in order (built-in first)."""

    def __init__(self, cfg: FilterConfig | None = None) -> None:
        cfg = cfg or FilterConfig()
        self.zero_variance = cfg.zero_variance
        self.max_draw_factor = cfg.max_draw_factor
        self.user: list[tuple[str, GroupFilterFn]] = [(spec, resolve_filter(spec)) for spec in cfg.user]

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
        if self.zero_variance and zero_variance(group):
            return ZERO_VARIANCE
        for spec, fn in self.user:
            keep = fn(list(group))  # a copy: a filter that edits its list must not change what is trained
            if not isinstance(keep, bool | np.bool_):
                raise SluiceError(f"group filter {spec!r} returned {type(keep).__name__}; it must return True (keep "
                                  "the group) or False (drop it)")
            if not keep:
                return spec
        return None
