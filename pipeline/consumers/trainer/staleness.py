"""The staleness policy: what the trainer does with a prompt group whose tokens came from an older policy.

Everything here is a pure function of (sample versions, current policy version, config): no Redis, no clock, no
model. The trainer calls :func:`apply_policy` on each drained batch of groups; producers call :func:`may_admit` (or
:func:`admission_budget`) before starting a new group.

Definitions (see docs/architecture.md, "Versions and staleness"):

- A sample's lag is ``current_version - version_min``: the number of weight pushes since its OLDEST token was
  generated. (``lag_from="version_max"`` measures from the newest token instead, for setups that continue partial
  rollouts across a push and only care about the policy that finished them.)
- A group's lag is the MAX lag over its samples. GRPO normalises rewards within a group, so the group is trained or
  discarded as a unit, and the oldest sample decides.
- A group is *fresh* when ``lag <= max_lag``: ``lag == max_lag`` still trains, ``max_lag + 1`` does not.
- After a trainer rolled back to a checkpoint, versions form a tree (:class:`Lineage`, docs/versions.md): a sample's
  lag is then its distance from the current weights along that tree, in optimizer steps, not the difference of the
  counters.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal, Protocol

from pipeline.config.staleness import Action, StalenessConfig
from pipeline.errors import ConfigError, SampleError, SluiceError


class HasVersions(Protocol):
    """What the policy reads from a sample; ``pipeline.queue.Sample`` satisfies it."""

    @property
    def group_id(self) -> str: ...

    @property
    def version_min(self) -> int | None: ...

    @property
    def version_max(self) -> int | None: ...


@dataclass(frozen=True)
class GroupVersions:
    """The versions of one prompt group's samples (None for a sample with no response tokens)."""

    group_id: str
    version_min: tuple[int | None, ...]
    version_max: tuple[int | None, ...]
    requeues: int = 0
    """How many times this prompt was already requeued (tracked by whoever requeues it)."""

    def __post_init__(self) -> None:
        if not self.version_min:
            raise SampleError(f"group {self.group_id!r} has no samples; a prompt group needs at least one")
        if len(self.version_min) != len(self.version_max):
            raise SampleError(
                f"group {self.group_id!r}: {len(self.version_min)} version_min values but "
                f"{len(self.version_max)} version_max values; give one of each per sample"
            )
        for lo, hi in zip(self.version_min, self.version_max):
            if (lo is None) != (hi is None):
                raise SampleError(f"group {self.group_id!r}: version_min={lo} but version_max={hi}; both or neither")
            if lo is not None and hi is not None and (lo < 0 or lo > hi):
                raise SampleError(
                    f"group {self.group_id!r}: version_min={lo}, version_max={hi}; versions must satisfy "
                    "0 <= version_min <= version_max"
                )
        if self.requeues < 0:
            raise SampleError(f"group {self.group_id!r}: requeues={self.requeues} is negative")

    @property
    def num_samples(self) -> int:
        """Samples in the group."""
        return len(self.version_min)

    @classmethod
    def from_samples(cls, samples: Sequence[HasVersions], requeues: int = 0) -> GroupVersions:
        """Collect the versions of samples that all belong to one prompt group."""
        if not samples:
            raise SampleError("from_samples got no samples; a prompt group needs at least one")
        group_ids = {s.group_id for s in samples}
        if len(group_ids) != 1:
            raise SampleError(f"from_samples got samples of several groups {sorted(group_ids)}; pass one group")
        return cls(
            group_id=samples[0].group_id,
            version_min=tuple(s.version_min for s in samples),
            version_max=tuple(s.version_max for s in samples),
            requeues=requeues,
        )


@dataclass(frozen=True)
class GroupDecision:
    """The policy's verdict on one group."""

    group_id: str
    action: Action
    lag: int
    """The group's lag (max over samples); negative when every sample is newer than the trainer."""
    stale: bool
    """True when the lag is over ``max_lag``, whatever the action (a "train" group with stale=True is off-policy)."""
    reason: str
    num_samples: int
    requeues_exhausted: bool = False
    """A "drop" because the prompt was already requeued ``max_requeues`` times."""


@dataclass
class StalenessCounts:
    """Counters for metrics; add them up across steps with ``+=``."""

    groups_train: int = 0
    groups_train_stale: int = 0
    groups_drop: int = 0
    groups_requeue: int = 0
    groups_drop_max_requeues: int = 0  # among groups_drop: their prompt had been requeued max_requeues times
    samples_train: int = 0
    samples_drop: int = 0
    samples_requeue: int = 0

    def record(self, decision: GroupDecision) -> None:
        """Count one decision."""
        n = decision.num_samples
        if decision.action == "train":
            self.groups_train += 1
            self.groups_train_stale += int(decision.stale)
            self.samples_train += n
        elif decision.action == "drop":
            self.groups_drop += 1
            self.groups_drop_max_requeues += int(decision.requeues_exhausted)
            self.samples_drop += n
        else:
            self.groups_requeue += 1
            self.samples_requeue += n

    def forget(self, decision: GroupDecision) -> None:
        """Undo ``record`` of a decision whose group never reached the step (its payload was lost)."""
        undo = StalenessCounts()
        undo.record(decision)
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) - getattr(undo, f.name))

    def __iadd__(self, other: StalenessCounts) -> StalenessCounts:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_metrics(self, prefix: str = "staleness/") -> dict[str, float]:
        """The counters as a flat metrics dict."""
        return {f"{prefix}{f.name}": float(getattr(self, f.name)) for f in fields(self)}

    def state_dict(self) -> dict[str, int]:
        """Counters for a checkpoint."""
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore counters from :meth:`state_dict`; unknown keys are an error, missing keys stay 0."""
        known = {f.name for f in fields(self)}
        unknown = set(state) - known
        if unknown:
            raise SluiceError(
                f"staleness counters: unknown keys {sorted(unknown)} in checkpoint; known: {sorted(known)}"
            )
        for name, value in state.items():
            setattr(self, name, int(value))


@dataclass(frozen=True)
class StalenessResult:
    """Decisions for a batch of groups (in input order) and their counters."""

    decisions: tuple[GroupDecision, ...]
    counts: StalenessCounts

    def by_action(self, action: Action) -> tuple[GroupDecision, ...]:
        """Decisions with the given action, in input order."""
        return tuple(d for d in self.decisions if d.action == action)

    @property
    def lags(self) -> tuple[int, ...]:
        """The lag of every group, in input order."""
        return tuple(d.lag for d in self.decisions)


@dataclass(frozen=True)
class Lineage:
    """Which weights each policy version holds (docs/versions.md).

    Version ``v`` holds the weights one optimizer step after those of ``v - 1``, except the first version a trainer
    pushed after resuming from a checkpoint (a *restore*): that one holds exactly the weights of an older version,
    the checkpoint's, its *base*. The versions thus form a tree rooted at 0, and the distance between two versions
    is the number of optimizer steps on the path between them (a restore's edge to its base costs none). Without
    restores it is the difference of the counters.
    """

    restores: Mapping[int, int] = field(default_factory=dict)
    """First version of a restored branch -> the version whose weights it holds (always an older one)."""

    def __post_init__(self) -> None:
        for start, base in self.restores.items():
            if not 0 <= base < start:
                raise SluiceError(f"lineage: restore {start} -> {base}; a restore holds an older version's weights")

    def _chain(self, version: int) -> list[tuple[int, int, int]]:
        """``version``'s ancestry as (low, high, steps from ``version`` to high), newest segment first; each segment
        is a run of consecutive versions, and a segment's low is a restore start whose base is the next's high."""
        starts = sorted(self.restores)
        chain, steps, high = [], 0, version
        while True:
            i = bisect.bisect_right(starts, high) - 1
            low = starts[i] if i >= 0 else 0
            chain.append((low, high, steps))
            if i < 0:
                return chain
            steps += high - low
            high = self.restores[low]

    def distance(self, version: int, current: int) -> int:
        """Optimizer steps between the weights of ``version`` and those of ``current`` along the tree (through
        their newest common ancestor); ``current - version`` (negative) for a version newer than ``current``."""
        if version >= current or not self.restores:
            return current - version
        ours = self._chain(current)
        for low, high, steps in self._chain(version):
            # The newest version of this segment of the sample's ancestry that is also the trainer's ancestor.
            common = max((min(high, h) for lo, h, _ in ours if max(low, lo) <= min(high, h)), default=None)
            if common is not None:
                to_current = next(s + h - common for lo, h, s in ours if lo <= common <= h)
                return steps + (high - common) + to_current
        raise AssertionError("every version descends from version 0")  # the last segment of a chain starts at 0

    def worst(self, low: int, high: int, current: int) -> int:
        """The largest distance to ``current`` of any version in [low, high] (a sample's tokens): at the ends, or
        just below a restore start inside the range (the deepest version of an abandoned branch)."""
        candidates = {low, high, *(s - 1 for s in self.restores if low < s <= high)}
        return max(self.distance(v, current) for v in candidates)


LINEAR = Lineage()


def group_lag(group: GroupVersions, current_version: int, lag_from: Literal["version_min", "version_max"],
              lineage: Lineage = LINEAR) -> int:
    """The group's lag: ``current_version`` minus the oldest counted version (along ``lineage`` when the trainer
    ever restored a checkpoint); 0 if no sample has tokens."""
    _check_version(current_version)
    pairs = [(lo, hi) for lo, hi in zip(group.version_min, group.version_max) if lo is not None and hi is not None]
    # A group made only of empty responses carries no tokens from any policy, so it cannot be stale.
    if not pairs:
        return 0
    if not lineage.restores:
        versions = [lo for lo, _ in pairs] if lag_from == "version_min" else [hi for _, hi in pairs]
        return current_version - min(versions)
    if lag_from == "version_max":
        return max(lineage.distance(hi, current_version) for _, hi in pairs)
    return max(lineage.worst(lo, hi, current_version) for lo, hi in pairs)


def decide_group(group: GroupVersions, current_version: int, cfg: StalenessConfig,
                 lineage: Lineage = LINEAR) -> GroupDecision:
    """Decide what to do with one group (its lag measured along ``lineage``)."""
    lag = group_lag(group, current_version, cfg.lag_from, lineage)
    newest = max((v for v in group.version_max if v is not None), default=current_version)
    exhausted = False
    if newest > current_version:
        action, reason = _future_action(group, current_version, newest, cfg)
    elif lag <= cfg.max_lag:
        action, reason = "train", f"fresh: lag {lag} <= max_lag {cfg.max_lag}"
    else:
        action, reason = _stale_action(group, lag, cfg)
        exhausted = cfg.action == "requeue" and action == "drop"  # requeue drops only at the cap
    return GroupDecision(group.group_id, action, lag, lag > cfg.max_lag, reason, group.num_samples, exhausted)


def _stale_action(group: GroupVersions, lag: int, cfg: StalenessConfig) -> tuple[Action, str]:
    over = f"stale: lag {lag} > max_lag {cfg.max_lag}"
    if cfg.action == "drop":
        return "drop", over
    if cfg.action == "requeue":
        # Without a cap, a prompt whose generation always takes longer than max_lag pushes would loop forever.
        if cfg.max_requeues is not None and group.requeues >= cfg.max_requeues:
            return "drop", f"{over}, already requeued {group.requeues} times (max_requeues {cfg.max_requeues})"
        return "requeue", f"{over}, requeued"
    if cfg.train_max_lag is not None and lag > cfg.train_max_lag:
        return "drop", f"{over} and > train_max_lag {cfg.train_max_lag}"
    return "train", f"{over}, trained with importance correction"


def _future_action(
    group: GroupVersions, current_version: int, newest: int, cfg: StalenessConfig
) -> tuple[Action, str]:
    # A token newer than the trainer means an engine holds weights the trainer never pushed, or the trainer resumed
    # from a checkpoint older than its last push; either way the version bookkeeping is off.
    what = f"a token has version {newest} > current version {current_version}"
    if cfg.on_future_version == "error":
        raise SampleError(
            f"group {group.group_id!r}: {what}. The trainer's policy version is behind the engines' (was it resumed "
            "from a checkpoint older than its last weight push?). Set staleness.on_future_version to 'drop' or "
            "'train' to accept such groups."
        )
    if cfg.on_future_version == "drop":
        return "drop", f"future: {what}; dropped"
    return "train", f"future: {what}; trained"


def apply_policy(groups: Iterable[GroupVersions], current_version: int, cfg: StalenessConfig,
                 lineage: Lineage = LINEAR) -> StalenessResult:
    """Decide every group of a drained batch; decisions keep the input order."""
    counts = StalenessCounts()
    decisions = []
    for group in groups:
        decision = decide_group(group, current_version, cfg, lineage)
        counts.record(decision)
        decisions.append(decision)
    return StalenessResult(tuple(decisions), counts)


def lag_histogram(lags: Iterable[int], num_buckets: int, prefix: str = "staleness/lag_") -> dict[str, float]:
    """Counts of lags 0 .. num_buckets-2 and one overflow bucket ``{num_buckets-1}+``, keyed for a metrics logger.

    Negative lags (future versions) go to a separate ``neg`` bucket so they are visible rather than folded into 0.
    """
    if num_buckets < 2:
        raise ConfigError(
            f"lag_histogram needs num_buckets >= 2 (one exact bucket and one overflow), got {num_buckets}"
        )
    last = num_buckets - 1
    hist = {f"{prefix}{i}": 0.0 for i in range(last)}
    hist[f"{prefix}{last}+"] = 0.0
    hist[f"{prefix}neg"] = 0.0
    for lag in lags:
        if lag < 0:
            key = f"{prefix}neg"
        elif lag >= last:
            key = f"{prefix}{last}+"
        else:
            key = f"{prefix}{lag}"
        hist[key] += 1.0
    return hist


def admission_budget(groups_produced: int, current_version: int, max_lag: int, batch_groups: int) -> int:
    """How many more groups producers may start now under AReaL-style pacing (0 = wait for a weight push).

    A group started now is trained at the earliest ``max_lag + 1`` versions from now if every group before it fills a
    batch of ``batch_groups``; capping total production at ``(current_version + max_lag + 1) * batch_groups`` keeps
    producers from generating output that would arrive over the lag limit and be dropped.
    """
    _check_version(current_version)
    if groups_produced < 0:
        raise SluiceError(f"groups_produced={groups_produced} is negative; it counts groups started so far")
    if max_lag < 0:
        raise ConfigError(f"max_lag={max_lag} is negative; use 0 for on-policy training")
    if batch_groups < 1:
        raise ConfigError(f"batch_groups={batch_groups}; a training batch needs at least one group")
    return max(0, (current_version + max_lag + 1) * batch_groups - groups_produced)


def may_admit(groups_produced: int, current_version: int, max_lag: int, batch_groups: int) -> bool:
    """Whether a new group may start: ``(current_version + max_lag + 1) * batch_groups > groups_produced``."""
    return admission_budget(groups_produced, current_version, max_lag, batch_groups) > 0


def _check_version(current_version: int) -> None:
    if current_version < 0:
        raise SluiceError(f"current_version={current_version} is negative; policy versions start at 0")
