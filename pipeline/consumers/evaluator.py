"""The evaluator: a consumer group of its own that reports reward and pass rate per policy version.

It reads the run's ``samples`` stream through its own group (``eval`` by default), so the trainer's group never
waits for it: a slow or dead evaluator only holds back stream trimming, never the trainer's reads or acks.

What is measured, per policy version
------------------------------------
A sample's version is its ``version_max``: the newest weights that produced any of its tokens. A sample that spans
a weight push is thus credited to the policy that finished it, the one its reward mostly reflects, and such samples
are also counted as ``spanning``. (``version_min`` would credit a mostly-new response to the old policy.) A sample
with an empty response has no token version; it falls back to its entry's ``vmax``, and to -1 when that is unknown
too. Per version: samples, prompt groups (entries with at least one sample at that version), reward mean / std /
min / max, pass rate (``reward_info["pass"]`` when it is a bool or number, else ``reward > pass_threshold``),
response length mean / min / max, and counts per ``status``. The key ``"all"`` holds the totals over every version,
where each entry counts as one group. The arithmetic is pure (:class:`VersionStats`, :class:`EvalAggregate`) and
tested apart from the I/O loop.

Counting every entry exactly once
---------------------------------
The aggregates live in a Redis hash beside the stream (``sluice:{run}:eval`` for the default group,
``sluice:{run}:eval:<group>`` for others), as raw counters (``"<version>:<stat>"``). One Lua script commits a batch:
for each entry it runs XACK in the evaluator's group and adds that entry's contribution to the counters **only if
XACK removed it from the pending list** (returned 1). Redis runs a script atomically and logs its effects as one
transaction in the AOF, so the ack and the count can never be separated:

- killed before the script ran: nothing was counted and the entries are still pending; a restarted evaluator
  re-reads its own pending entries (same consumer name) or claims a dead peer's with XAUTOCLAIM, and counts them;
- killed after it: the entries are acked and counted, and are never delivered again;
- two evaluators holding the same entry (a slow one whose entries a peer claimed): the first XACK counts it, the
  second finds it no longer pending and adds nothing.

No set of counted ids is needed, so memory does not grow with the run, and several evaluator processes may share a
group. Entries that fail to decode are dead-lettered and acked by the queue, and never counted.

Headers only
------------
Everything counted is in an entry's header (docs/queue.md, "Entries"): reward, the ``pass`` verdict, status,
response length and versions. So the evaluator reads headers (``SampleQueue.read_headers``) and never fetches a
payload: its reads cost a few KB per group, whatever the routing weighs, and it loads no primary that holds only
payloads. A header whose payload was lost is still counted, since the group was generated and scored; the readers
that need the payload dead-letter it.

The metrics sink, ``<run_dir>/eval/metrics.jsonl``, is derived output: after each commit it gets one line per
version touched, holding that version's cumulative summary as Redis has it. The newest line per version is the
current figure; a crash can lose at most the lines of one commit, never a count. The in-memory summary
(:attr:`Evaluator.aggregate`) is refreshed from the hash the same way.

Evaluation by generation (held-out prompts sent through an engine every K policy versions) is
``pipeline.heldout.evaluate``; its lines share the metrics file, with ``"kind": "heldout"`` (these have
``"kind": "eval"``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import redis

from pipeline.config.eval import EvaluatorConfig
from pipeline.errors import ConfigError, QueueError
from pipeline.metrics import ScalarSink
from pipeline.queue.base import HeaderEntry, QueueEntry
from pipeline.queue.keys import RunKeys
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import SampleStatus
from pipeline.rundir import eval_metrics_path

log = logging.getLogger(__name__)

#: The key of the all-versions totals in an :class:`EvalAggregate`.
ALL: Literal["all"] = "all"
#: The version of a sample with no token versions in a group with none either.
UNKNOWN_VERSION = -1

StatKey = int | Literal["all"]


class Scored(Protocol):
    """What the aggregation reads of a sample; a ``Sample`` and a ``SampleHeader`` both have it."""

    @property
    def reward(self) -> float: ...

    @property
    def reward_info(self) -> Mapping[str, Any]: ...

    @property
    def status(self) -> SampleStatus: ...

    @property
    def num_response_tokens(self) -> int: ...

    @property
    def version_min(self) -> int | None: ...

    @property
    def version_max(self) -> int | None: ...


# --------------------------------------------------------------------------------------------- pure aggregation
def sample_version(sample: Scored, group_version_max: int = UNKNOWN_VERSION) -> int:
    """The policy version a sample is credited to: its newest token's version, else its group's (module docstring)."""
    v = sample.version_max
    if v is not None:
        return v
    return group_version_max if group_version_max >= 0 else UNKNOWN_VERSION


def group_version_max(samples: Sequence[Scored]) -> int:
    """The newest token version in a group (the queue entry's ``vmax``); -1 when no sample has a token."""
    versions = [s.version_max for s in samples if s.version_max is not None]
    return max(versions) if versions else UNKNOWN_VERSION


def sample_passed(sample: Scored, threshold: float) -> bool:
    """``reward_info["pass"]`` when it is a bool or a number; otherwise whether the reward is above ``threshold``."""
    return reward_passed(sample.reward, sample.reward_info, threshold)


def reward_passed(reward: float, info: Mapping[str, Any], threshold: float) -> bool:
    """The pass rule of :func:`sample_passed` on a bare reward and its info (the held-out evaluator's samples)."""
    verdict = info.get("pass")
    if isinstance(verdict, (bool, int, float)) and not (isinstance(verdict, float) and math.isnan(verdict)):
        return bool(verdict)
    return reward > threshold


@dataclass
class VersionStats:
    """Additive statistics of the samples credited to one policy version (or to all of them)."""

    samples: int = 0
    groups: int = 0
    passes: int = 0
    reward_count: int = 0  # finite rewards: an infinite one would poison every mean, so it is only counted apart
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    reward_min: float | None = None
    reward_max: float | None = None
    response_tokens: int = 0
    response_len_min: int | None = None
    response_len_max: int | None = None
    spanning: int = 0
    status: dict[str, int] = field(default_factory=dict)

    # -- building
    def add_sample(self, sample: Scored, passed: bool) -> None:
        self.samples += 1
        self.passes += int(passed)
        if math.isfinite(sample.reward):
            r = sample.reward
            self.reward_count += 1
            self.reward_sum += r
            self.reward_sq_sum += r * r
            self.reward_min = r if self.reward_min is None else min(self.reward_min, r)
            self.reward_max = r if self.reward_max is None else max(self.reward_max, r)
        n = sample.num_response_tokens
        self.response_tokens += n
        self.response_len_min = n if self.response_len_min is None else min(self.response_len_min, n)
        self.response_len_max = n if self.response_len_max is None else max(self.response_len_max, n)
        if sample.version_min is not None and sample.version_min != sample.version_max:
            self.spanning += 1
        key = sample.status.value
        self.status[key] = self.status.get(key, 0) + 1

    def merge(self, other: VersionStats) -> None:
        for name in ("samples", "groups", "passes", "reward_count", "response_tokens", "spanning"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reward_sum += other.reward_sum
        self.reward_sq_sum += other.reward_sq_sum
        self.reward_min = _opt(min, self.reward_min, other.reward_min)
        self.reward_max = _opt(max, self.reward_max, other.reward_max)
        self.response_len_min = _opt(min, self.response_len_min, other.response_len_min)
        self.response_len_max = _opt(max, self.response_len_max, other.response_len_max)
        for k, v in other.status.items():
            self.status[k] = self.status.get(k, 0) + v

    # -- derived figures
    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.reward_count if self.reward_count else None

    @property
    def reward_std(self) -> float | None:
        """Population standard deviation of the finite rewards."""
        if not self.reward_count:
            return None
        mean = self.reward_sum / self.reward_count
        return math.sqrt(max(self.reward_sq_sum / self.reward_count - mean * mean, 0.0))

    @property
    def pass_rate(self) -> float | None:
        return self.passes / self.samples if self.samples else None

    @property
    def response_len_mean(self) -> float | None:
        return self.response_tokens / self.samples if self.samples else None

    def summary(self) -> dict[str, Any]:
        """The figures a person reads (JSON-ready)."""
        return {
            "samples": self.samples,
            "groups": self.groups,
            "reward_mean": self.reward_mean,
            "reward_std": self.reward_std,
            "reward_min": self.reward_min,
            "reward_max": self.reward_max,
            "reward_nonfinite": self.samples - self.reward_count,
            "pass_rate": self.pass_rate,
            "response_len_mean": self.response_len_mean,
            "response_len_min": self.response_len_min,
            "response_len_max": self.response_len_max,
            "spanning": self.spanning,
            "status": dict(sorted(self.status.items())),
        }

    # -- the Redis counter encoding: (op, stat, value) with op i = add int, f = add float, < = min, > = max
    def to_ops(self) -> list[tuple[str, str, str]]:
        ops = [("i", name, str(getattr(self, name)))
               for name in ("samples", "groups", "passes", "reward_count", "response_tokens", "spanning")
               if getattr(self, name)]
        if self.reward_count:
            # repr round-trips a float exactly; the counters are only ever fed finite values (see reward_count).
            ops += [("f", "reward_sum", repr(self.reward_sum)), ("f", "reward_sq_sum", repr(self.reward_sq_sum)),
                    ("<", "reward_min", repr(self.reward_min)), (">", "reward_max", repr(self.reward_max))]
        if self.response_len_min is not None:
            ops += [("<", "response_len_min", str(self.response_len_min)),
                    (">", "response_len_max", str(self.response_len_max))]
        ops += [("i", f"status.{k}", str(v)) for k, v in sorted(self.status.items()) if v]
        return ops

    @classmethod
    def from_counters(cls, counters: Mapping[str, str]) -> VersionStats:
        """Rebuild from one version's counters (stat name -> stored value)."""
        st = cls()
        for name, raw in counters.items():
            if name.startswith("status."):
                st.status[name[len("status."):]] = int(raw)
            elif name in ("samples", "groups", "passes", "reward_count", "response_tokens", "spanning",
                          "response_len_min", "response_len_max"):
                setattr(st, name, int(raw))
            elif name in ("reward_sum", "reward_sq_sum", "reward_min", "reward_max"):
                setattr(st, name, float(raw))
            else:
                log.warning("ignoring unknown evaluator counter %r (written by a newer sluice?)", name)
        return st


def _opt(fn: Any, a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return fn(a, b)


@dataclass
class EvalAggregate:
    """Per-version statistics plus the all-versions totals (key ``"all"``)."""

    by_version: dict[int, VersionStats] = field(default_factory=dict)
    total: VersionStats = field(default_factory=VersionStats)

    def add_group(self, samples: Sequence[Scored], pass_threshold: float = 0.0) -> None:
        """Account one prompt group (one queue entry)."""
        fallback = group_version_max(samples)
        touched: set[int] = set()
        for s in samples:
            v = sample_version(s, fallback)
            passed = sample_passed(s, pass_threshold)
            self.by_version.setdefault(v, VersionStats()).add_sample(s, passed)
            self.total.add_sample(s, passed)
            touched.add(v)
        for v in touched:
            self.by_version[v].groups += 1
        self.total.groups += 1

    def merge(self, other: EvalAggregate) -> None:
        for v, st in other.by_version.items():
            self.by_version.setdefault(v, VersionStats()).merge(st)
        self.total.merge(other.total)

    def items(self) -> list[tuple[StatKey, VersionStats]]:
        """(version, stats) in version order, then ("all", totals)."""
        out: list[tuple[StatKey, VersionStats]] = [(v, self.by_version[v]) for v in sorted(self.by_version)]
        out.append((ALL, self.total))
        return out

    def summary(self) -> dict[str, dict[str, Any]]:
        return {str(k): st.summary() for k, st in self.items()}


def aggregate_groups(groups: Iterable[Sequence[Scored]], pass_threshold: float = 0.0) -> EvalAggregate:
    """The aggregate of some prompt groups, computed in memory (what the evaluator must arrive at)."""
    agg = EvalAggregate()
    for g in groups:
        agg.add_group(g, pass_threshold)
    return agg


def entry_ops(entry: QueueEntry | HeaderEntry, pass_threshold: float) -> list[tuple[str, str, str]]:
    """One entry's contribution as Redis counter ops on fields ``"<version>:<stat>"`` and ``"all:<stat>"``."""
    agg = EvalAggregate()
    agg.add_group(entry.headers if isinstance(entry, HeaderEntry) else entry.samples, pass_threshold)
    return [(op, f"{key}:{stat}", value) for key, st in agg.items() for op, stat, value in st.to_ops()]


def aggregate_from_hash(raw: Mapping[Any, Any]) -> EvalAggregate:
    """Rebuild an :class:`EvalAggregate` from the counters hash (``HGETALL``)."""
    per_key: dict[str, dict[str, str]] = {}
    for f, v in raw.items():
        name = f.decode() if isinstance(f, bytes) else str(f)
        key, sep, stat = name.partition(":")
        if not sep:
            continue
        per_key.setdefault(key, {})[stat] = v.decode() if isinstance(v, bytes) else str(v)
    agg = EvalAggregate()
    for key, counters in per_key.items():
        st = VersionStats.from_counters(counters)
        if key == ALL:
            agg.total = st
        else:
            try:
                agg.by_version[int(key)] = st
            except ValueError:
                log.warning("ignoring evaluator counters under %r: not a version", key)
    return agg


# ---------------------------------------------------------------------------------------------------- storage
# Add an entry's counters only when this call's XACK took it off the pending list, so an ack and its count are one
# atomic effect and a second holder of the entry counts nothing. ARGV: group, then per entry: id, op count, ops.
# Python sends only finite numbers and well-formed ops, since a Lua error part-way would not roll back.
_COMMIT = """
local counted = 0
local i = 2
while i <= #ARGV do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  if redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
    counted = counted + 1
    for j = i, i + 3 * (n - 1), 3 do
      local op, f, v = ARGV[j], ARGV[j + 1], ARGV[j + 2]
      if op == 'i' then
        redis.call('HINCRBY', KEYS[2], f, v)
      elseif op == 'f' then
        redis.call('HINCRBYFLOAT', KEYS[2], f, v)
      else
        local cur = redis.call('HGET', KEYS[2], f)
        if (not cur) or (op == '<' and tonumber(v) < tonumber(cur)) or (op == '>' and tonumber(v) > tonumber(cur)) then
          redis.call('HSET', KEYS[2], f, v)
        end
      end
    end
  end
  i = i + 3 * n
end
return counted
"""


def eval_key(run: str, group: str = "eval") -> str:
    """The hash holding a group's counters: ``sluice:{run}:eval``, or ``sluice:{run}:eval:<group>``."""
    keys = RunKeys(run)
    return keys.extra("eval") if group == "eval" else keys.extra(f"eval:{group}")


def read_eval_summary(queue: SampleQueue, group: str = "eval") -> EvalAggregate:
    """A group's aggregates as stored in Redis (for ``sluice queue stats`` and other readers)."""
    return aggregate_from_hash(queue.redis.hgetall(eval_key(queue.run, group)))


# ------------------------------------------------------------------------------------------------- the consumer
@dataclass
class EvalReport:
    """What one evaluator process did, and the group's aggregates when it stopped."""

    run: str
    group: str
    counted_entries: int
    skipped_entries: int  # acked by someone else first (a peer that also held them): not counted again here
    recovered_entries: int  # taken back at start: own pending ones, and dead peers'
    pending: int  # entries delivered to the group and not yet acked (held by other evaluators)
    lag: int | None  # entries not yet delivered to the group
    aggregate: EvalAggregate
    metrics_path: Path | None

    def format_table(self) -> str:
        """A plain-text table, one row per version, for the CLI."""
        head = f"{'version':>8} {'samples':>8} {'groups':>7} {'reward':>10} {'pass':>7} {'resp_len':>9}  status"
        title = (f"run {self.run} group {self.group}: counted {self.counted_entries} entries here "
                 f"({self.recovered_entries} recovered), {self.pending} pending, lag {self.lag}")
        rows = [title, head]
        for key, st in self.aggregate.items():
            rows.append(f"{key!s:>8} {st.samples:>8} {st.groups:>7} {_fmt(st.reward_mean):>10} "
                        f"{_fmt(st.pass_rate):>7} {_fmt(st.response_len_mean):>9}  "
                        + ",".join(f"{k}={v}" for k, v in sorted(st.status.items())))
        return "\n".join(rows)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


class Evaluator:
    """Reads a run's samples through its own consumer group and keeps per-version metrics (module docstring)."""

    def __init__(self, queue: SampleQueue, config: EvaluatorConfig | None = None, *,
                 metrics_path: str | Path | None = None, scalars: ScalarSink | None = None) -> None:
        self.queue = queue
        self.scalars = scalars  # TensorBoard (and W&B) beside the JSONL, keyed by policy version
        self.cfg = config or EvaluatorConfig()
        self.key = eval_key(queue.run, self.cfg.group)
        self.metrics_path = Path(metrics_path) if metrics_path is not None else None
        self._commit = queue.redis.register_script(_COMMIT)
        self.aggregate = EvalAggregate()
        self.counted_entries = 0
        self.skipped_entries = 0
        self.recovered_entries = 0
        self._last_claim = time.monotonic()

    # -- lifecycle steps
    def attach(self, reset: bool = False) -> bool:
        """Create the group at ``config.start`` (with ``reset``, drop it and its counters first).

        Returns False when the group already existed: it then resumes from its own position and ``start`` is not
        used.
        """
        if reset:
            self.queue.redis.delete(self.key)
            try:
                self.queue.redis.xgroup_destroy(self.queue.keys.samples, self.cfg.group)
            except redis.ResponseError:
                pass  # no stream yet: nothing to destroy
        created = self.queue.create_group(self.cfg.group, self.cfg.start)
        if not created:
            log.info("group %r already exists on run %r: resuming from its position (start=%r not used; pass "
                     "reset=True to evaluate from scratch)", self.cfg.group, self.queue.run, self.cfg.start)
        self.refresh()
        return created

    def recover(self) -> int:
        """Count the entries this consumer holds from before a crash, then those idle at dead peers."""
        mine = self.queue.read_pending_headers(self.cfg.group, self.cfg.consumer, count=self.cfg.batch_entries)
        self.commit(mine)
        n = len(mine) + self.claim()
        self.recovered_entries += n
        return n

    def claim(self) -> int:
        """Take over and count entries other consumers of the group have held for ``claim_idle_ms``."""
        self._last_claim = time.monotonic()
        claimed = self.queue.claim_stale_headers(self.cfg.group, self.cfg.consumer, self.cfg.claim_idle_ms,
                                                 count=self.cfg.batch_entries)
        self.commit(claimed)
        return len(claimed)

    def read(self, block_ms: int | None = None) -> list[HeaderEntry]:
        """Up to ``batch_entries`` new entries' headers (they stay pending until :meth:`commit`)."""
        wait = self.cfg.block_ms if block_ms is None else block_ms
        return self.queue.read_headers(self.cfg.group, self.cfg.consumer, count=self.cfg.batch_entries,
                               block_ms=wait or None)

    def step(self, block_ms: int | None = None) -> int:
        """Claim dead peers' entries when due, then read one batch and commit it; returns the entries read."""
        if time.monotonic() - self._last_claim >= self.cfg.claim_interval_s:
            self.claim()
        entries = self.read(block_ms)
        self.commit(entries)
        return len(entries)

    def commit(self, entries: Sequence[QueueEntry | HeaderEntry]) -> int:
        """Ack and count ``entries``, each atomically with its count; returns how many were counted here.

        Sent in chunks of ``batch_entries`` so a large recovery does not become one huge script call; atomicity is
        per entry, so chunking changes nothing about exactly-once (see the module docstring).
        """
        counted = 0
        touched: set[str] = {ALL}
        for i in range(0, len(entries), self.cfg.batch_entries):
            chunk = entries[i:i + self.cfg.batch_entries]
            args: list[str] = [self.cfg.group]
            for e in chunk:
                ops = entry_ops(e, self.cfg.pass_threshold)
                args += [e.id, str(len(ops))]
                for op, f, v in ops:
                    args += [op, f, v]
                    touched.add(f.partition(":")[0])
            counted += int(self._commit(keys=[self.queue.keys.samples, self.key], args=args))
        self.counted_entries += counted
        self.skipped_entries += len(entries) - counted
        if counted < len(entries):
            log.info("%d of %d entries were already acked in group %r by another evaluator; not counted again",
                     len(entries) - counted, len(entries), self.cfg.group)
        if counted:
            self.refresh(touched)
            self._write_metrics(touched)
        return counted

    def refresh(self, only: Iterable[str] | None = None) -> None:
        """Reload the in-memory aggregate from Redis, all of it or only some versions' counters."""
        if only is None:
            self.aggregate = read_eval_summary(self.queue, self.cfg.group)
            return
        keys = set(only)
        # The stat names are known, so one HMGET fetches exactly these versions' counters, where HSCAN MATCH would
        # walk the whole hash (one set of counters per version the run ever had).
        fields = [f"{k}:{stat}" for k in keys for stat in _STAT_FIELDS]
        fields += [f"{k}:status.{s}" for k in keys for s in _STATUSES]
        values = self.queue.redis.hmget(self.key, fields)
        fresh = aggregate_from_hash({f: v for f, v in zip(fields, values) if v is not None})
        for v, st in fresh.by_version.items():
            self.aggregate.by_version[v] = st
        if ALL in keys:
            self.aggregate.total = fresh.total

    def _write_metrics(self, keys: Iterable[str]) -> None:
        if self.metrics_path is None:
            return
        now = time.time()
        lines = []
        for k, st in self.aggregate.items():
            if str(k) in keys:
                lines.append(json.dumps({"kind": "eval", "time": now, "run": self.queue.run, "group": self.cfg.group,
                                         "version": k, **st.summary()}))
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write("\n".join(lines) + "\n")
        if self.scalars is not None:
            for k, st in self.aggregate.items():
                if str(k) in keys and isinstance(k, int):
                    self.scalars.add({"time": now, **st.summary()}, k, prefix="stream/")

    # -- the loop
    def run(self, stop: threading.Event | None = None, until_idle_s: float | None = None,
            reset: bool = False) -> EvalReport:
        """Evaluate until ``stop`` is set, or, with ``until_idle_s``, until no entry arrived for that long."""
        self.attach(reset=reset)
        self.recover()
        idle_since = time.monotonic()
        block_ms = self.cfg.block_ms
        if until_idle_s is not None:
            block_ms = min(block_ms, int(until_idle_s * 1000))
        while stop is None or not stop.is_set():
            if self.step(block_ms):
                idle_since = time.monotonic()
            elif until_idle_s is not None and time.monotonic() - idle_since >= until_idle_s:
                break
        return self.report()

    def report(self) -> EvalReport:
        self.refresh()  # peers may have counted versions this process never touched
        pending = 0
        try:
            pending = int(self.queue.redis.xpending(self.queue.keys.samples, self.cfg.group)["pending"])
        except redis.ResponseError:
            pass  # the group is gone (destroyed by a user): nothing is pending in it
        return EvalReport(run=self.queue.run, group=self.cfg.group, counted_entries=self.counted_entries,
                          skipped_entries=self.skipped_entries, recovered_entries=self.recovered_entries,
                          pending=pending, lag=self.queue.lag(self.cfg.group), aggregate=self.aggregate,
                          metrics_path=self.metrics_path)


_STAT_FIELDS = ("samples", "groups", "passes", "reward_count", "reward_sum", "reward_sq_sum", "reward_min",
                "reward_max", "response_tokens", "response_len_min", "response_len_max", "spanning")
_STATUSES = tuple(s.value for s in SampleStatus)


def run_eval(
    run_dir: str | Path | None = None,
    *,
    redis_url: str | None = None,
    run: str | None = None,
    group: str = "eval",
    consumer: str = "evaluator",
    start: str = "0",
    until_idle_s: float | None = None,
    pass_threshold: float = 0.0,
    metrics_path: str | Path | None = None,
    reset: bool = False,
    stop: threading.Event | None = None,
    config: EvaluatorConfig | None = None,
    scalars: ScalarSink | None = None,
    start_server: bool = True,
) -> EvalReport:
    """Attach an evaluator to a live or finished run (``sluice eval --run-dir DIR``) and return its report.

    The run is named by its folder, or by ``redis_url`` and ``run``. ``start="0"`` also covers the history still in
    the stream, ``"$"`` only entries added after the group is created. With ``until_idle_s`` it exits once nothing
    new arrived for that long (a finished run: it drains to the end, then exits); otherwise it runs until ``stop``.
    Metrics go to ``<run_dir>/eval/metrics.jsonl`` unless ``metrics_path`` says otherwise (no file without either).
    ``config``, when given, replaces the group/consumer/start/pass_threshold arguments. ``start_server=False``: a
    process of a live run, which never starts the run's embedded Redis (its launcher does).
    """
    # Deferred: it pulls in the embedded-server launcher, which a plain Evaluator does not need.
    from pipeline.queue.rundir import open_run

    if until_idle_s is not None and until_idle_s < 0:
        raise ConfigError(f"until_idle_s must be >= 0 seconds, got {until_idle_s}")
    cfg = config or EvaluatorConfig(group=group, consumer=consumer, start=start, pass_threshold=pass_threshold)
    handle = open_run(run_dir=run_dir, redis_url=redis_url, run=run, start_server=start_server)
    try:
        if metrics_path is None and handle.run_dir is not None:
            metrics_path = eval_metrics_path(handle.run_dir, cfg.group)
        evaluator = Evaluator(handle.queue, cfg, metrics_path=metrics_path, scalars=scalars)
        report = evaluator.run(stop=stop, until_idle_s=until_idle_s, reset=reset)
    except redis.ConnectionError as e:
        raise QueueError(f"lost the Redis server of run {handle.run!r} while evaluating: {e}; is it still running? "
                         "Restart `sluice eval`: nothing counted is lost and nothing is counted twice") from None
    finally:
        handle.close()
    return report
