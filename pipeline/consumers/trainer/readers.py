"""Data-parallel readers: each replica fetches the payloads of its own share of a step, and rank 0 sends only keys.

Rank 0 decides a step from the stream's headers (``drain.Drainer``). It then splits the trained groups over the
data-parallel replicas, balanced by tokens (``balance``), and broadcasts the plan: per group a payload key, its size
and a checksum of its header, about 40 bytes where the batch itself is megabytes. The first rank of each replica
(its tensor-parallel rank 0) fetches its keys from Redis in one pipelined round trip per shard, hands the bytes to
its tensor-parallel peers, and every rank decodes only the groups it trains.

A payload that is missing, of the wrong size, or whose samples do not match the header rank 0 judged, is reported
back to rank 0 (a small all-gather of group indices and reasons). Rank 0 dead-letters those entries, hands their
prompts back, draws replacements and sends a plan for them alone; the step trains once every reader holds its share.

Groups that reach rank 0 whole (an offline replay, an entry of schema 1 or 2 that carries its payload inline) travel
inside the plan, as does every group under ``trainer.fetch = "rank0"``: rank 0 fetches each payload itself and
broadcasts the batch, the path before readers, kept for comparison.
"""

from __future__ import annotations

import heapq
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import torch
import torch.distributed as dist

from pipeline.consumers.trainer.drain import Batch
from pipeline.errors import SampleDecodeError
from pipeline.queue.codec import decode_samples, encode_header, encode_samples
from pipeline.queue.redis_streams import MISSING_PAYLOAD, SampleQueue
from pipeline.queue.sample import Sample

log = logging.getLogger(__name__)

FetchMode = Literal["readers", "rank0"]


def header_check(head: bytes) -> int:
    """The checksum a reader compares its payload's header against: CRC-32 of the header as the stream holds it."""
    return zlib.crc32(head)


@dataclass(frozen=True)
class GroupRef:
    """How a reader gets one trained group: by payload key (with its size and header checksum), or inline bytes."""

    index: int
    """The group's place in rank 0's batch: how a reader names it when reporting it lost."""
    key: str | None = None
    size: int = 0
    check: int = 0
    data: bytes | None = None
    weight: float = 1.0

    def pack(self) -> list[Any]:
        tail: list[Any] = [] if self.weight == 1.0 else [self.weight]
        if self.key is None:
            return [self.index, self.data, *tail]
        return [self.index, self.key, self.size, self.check, *tail]

    @staticmethod
    def unpack(row: Sequence[Any]) -> GroupRef:
        if isinstance(row[1], bytes):
            return GroupRef(int(row[0]), data=row[1], weight=float(row[2]) if len(row) > 2 else 1.0)
        weight = float(row[4]) if len(row) > 4 else 1.0
        return GroupRef(int(row[0]), key=str(row[1]), size=int(row[2]), check=int(row[3]), weight=weight)


def balance(tokens: Sequence[int], readers: int, loads: Sequence[int] | None = None) -> list[list[int]]:
    """Group indices per reader, so that the readers' tokens (``loads`` plus their groups') are as even as a greedy
    pass makes them.

    Largest group first to the reader with the fewest tokens, then, while it narrows the gap between the fullest and
    the emptiest reader, a group moved or two swapped between them. Counts are not kept equal: a step's cost is its
    tokens, and a batch with a few long responses cannot be split evenly by both (3 long and 5 short groups over two
    readers: 1.21 x the mean at four groups each, 1.04 when counts may differ). Under expert parallelism the ranks
    pad their micro-batch lists to the longest, which tokens, not groups, decide. A reader keeps at least one group
    when there are enough to go round.
    """
    if readers < 1:
        raise ValueError(f"readers must be >= 1, got {readers}")
    load = list(loads) if loads is not None else [0] * readers
    shares: list[list[int]] = [[] for _ in range(readers)]
    heap = [(load[r], r) for r in range(readers)]
    heapq.heapify(heap)
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        have, r = heapq.heappop(heap)
        shares[r].append(i)
        load[r] = have + tokens[i]
        heapq.heappush(heap, (load[r], r))
    keep_one = len(tokens) >= readers
    for _ in range(4 * len(tokens) + 4):
        hi = max(range(readers), key=lambda r: load[r])
        lo = min(range(readers), key=lambda r: load[r])
        gap = load[hi] - load[lo]
        # (new gap between the two, group leaving hi, group leaving lo or None for a move)
        best: tuple[int, int, int | None] | None = None
        if len(shares[hi]) > 1 or not keep_one:
            for a in shares[hi]:
                if 0 < tokens[a] < gap and (best is None or abs(gap - 2 * tokens[a]) < best[0]):
                    best = (abs(gap - 2 * tokens[a]), a, None)
        for a in shares[hi]:
            for b in shares[lo]:
                d = tokens[a] - tokens[b]
                if 0 < d < gap and (best is None or abs(gap - 2 * d) < best[0]):
                    best = (abs(gap - 2 * d), a, b)
        if best is None:
            break
        _, a, b = best
        d = tokens[a] - (tokens[b] if b is not None else 0)
        shares[hi].remove(a)
        shares[lo].append(a)
        if b is not None:
            shares[lo].remove(b)
            shares[hi].append(b)
        load[hi] -= d
        load[lo] += d
    return shares


def check_payload(ref: GroupRef, data: bytes | None) -> list[Sample]:
    """The samples of ``ref``'s payload, checked against what rank 0 judged; SampleDecodeError says what is wrong."""
    if ref.data is not None:
        return decode_samples(ref.data)
    if data is None:
        raise SampleDecodeError(MISSING_PAYLOAD.format(key=ref.key) + " when a reader fetched it")
    if len(data) != ref.size:
        raise SampleDecodeError(f"payload {ref.key} holds {len(data)} bytes but its header says {ref.size}")
    samples = decode_samples(data)
    if header_check(encode_header(samples)) != ref.check:
        raise SampleDecodeError(f"payload {ref.key} disagrees with its header (a payload of another entry?)")
    return samples


def broadcast_msgpack_from(obj: Any, src: int, group: Any) -> Any:
    """``obj`` (given on global rank ``src``, None elsewhere) on every rank of ``group``, as msgpack bytes."""
    return broadcast_msgpack_sized(obj, src, group)[0]


def broadcast_msgpack_sized(obj: Any, src: int, group: Any) -> tuple[Any, int]:
    """``broadcast_msgpack_from``, and how many bytes went over the wire (packed once, on ``src``)."""
    mine = dist.get_rank() == src
    data = msgpack.packb(obj, use_bin_type=True) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine and data else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    # Unpacked from the buffer itself: a bytes copy of it would be one more share's worth of memory on every peer.
    return (obj if mine else msgpack.unpackb(memoryview(buf.numpy()), raw=False)), int(size.item())


def all_gather_msgpack(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` of ``group``, in rank order, as msgpack bytes (the lost-payload reports are small)."""
    data = msgpack.packb(obj, use_bin_type=True)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    most = max(int(s.item()) for s in sizes)
    padded = torch.zeros(most, dtype=torch.uint8)
    padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(most, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    return [msgpack.unpackb(b[:int(n.item())].numpy().tobytes(), raw=False) for b, n in zip(bufs, sizes)]


@dataclass
class ReaderStats:
    """What this rank's reading cost in one step (``time/`` and ``drain/`` metrics)."""

    fetched_bytes: int = 0
    fetched_groups: int = 0
    decoded_groups: int = 0
    rounds: int = 0
    """Plans this step took: 1, plus one per round of replacements for lost payloads."""


class ShareReader:
    """One rank's side of the plan: fetch (the replica's reader), pass on to tensor-parallel peers, decode.

    ``queue`` is set on readers only (the rank that talks to Redis); ``peers`` is the gloo group of this rank's
    tensor-parallel replica and ``reader`` that replica's reading rank (global), both None when tensor parallelism
    is 1 and every rank reads for itself.
    """

    def __init__(self, queue: SampleQueue | None, *, peers: Any = None, reader: int | None = None) -> None:
        self.queue = queue
        self.peers, self.reader = peers, reader
        self.stats = ReaderStats()
        self.totals = ReaderStats()
        """Since the start, never reset."""

    @property
    def is_reader(self) -> bool:
        return self.reader is None or dist.get_rank() == self.reader

    def read(self, refs: Sequence[GroupRef]) -> tuple[list[tuple[GroupRef, list[Sample]]], list[tuple[int, str]]]:
        """This rank's groups of ``refs`` (its share of one plan), and those it could not have: (index, reason)."""
        fetched: dict[str, bytes | None] = {}
        keys = [r.key for r in refs if r.key is not None]
        if self.is_reader and keys:
            if self.queue is None:
                raise RuntimeError("this rank reads payloads for its replica but has no queue connection")
            fetched = self.queue.fetch_payloads(keys)
            self.stats.fetched_groups += len(keys)
            self.stats.fetched_bytes += sum(len(v) for v in fetched.values() if v is not None)
        if self.peers is not None and keys:
            fetched = broadcast_msgpack_from(fetched if self.is_reader else None, self.reader, self.peers)
        got: list[tuple[GroupRef, list[Sample]]] = []
        lost: list[tuple[int, str]] = []
        for ref in refs:
            try:
                # Popped: each payload's bytes go as soon as its samples exist, so that a rank never holds the
                # whole share twice.
                samples = check_payload(ref, fetched.pop(ref.key, None) if ref.key is not None else None)
                # The whole group, failed samples too: the train step trains none of them but counts their
                # rewards in the group's statistics (trainer.failed_in_group_stats).
                got.append((ref, samples))
            except SampleDecodeError as e:
                lost.append((ref.index, str(e)))
        self.stats.decoded_groups += len(got)
        self.stats.rounds += 1
        return got, lost

    def take_stats(self) -> ReaderStats:
        """The counts since the last call."""
        stats, self.stats = self.stats, ReaderStats()
        for f in ("fetched_bytes", "fetched_groups", "decoded_groups", "rounds"):
            setattr(self.totals, f, getattr(self.totals, f) + getattr(stats, f))
        return stats


class SharePlanner:
    """Rank 0's side: which reader gets which trained groups of a batch, and how (by key, or inline)."""

    def __init__(self, dp_size: int, mode: FetchMode = "readers", queue: SampleQueue | None = None) -> None:
        if mode == "rank0" and queue is None:
            raise ValueError("trainer.fetch = 'rank0' needs rank 0's queue connection to fetch every payload")
        self.dp_size, self.mode, self.queue = dp_size, mode, queue

    def plan(self, batch: Batch, indices: Sequence[int], loads: list[int]
             ) -> tuple[list[list[GroupRef]], list[tuple[int, str]]]:
        """Shares of ``batch``'s groups ``indices`` for each data-parallel rank, balanced by tokens on top of
        ``loads`` (updated in place), and the groups rank 0 already found lost (``fetch = "rank0"`` only)."""
        refs, lost = self._refs(batch, indices)
        tokens = [batch.tokens(r.index) for r in refs]
        shares = balance(tokens, self.dp_size, loads)
        for rank, share in enumerate(shares):
            loads[rank] += sum(tokens[i] for i in share)
        return [[refs[i] for i in share] for share in shares], lost

    def _refs(self, batch: Batch, indices: Sequence[int]) -> tuple[list[GroupRef], list[tuple[int, str]]]:
        weights = batch.group_weights + [1.0] * (len(batch.groups) - len(batch.group_weights))
        refs: list[GroupRef] = []
        lost: list[tuple[int, str]] = []
        fetched: dict[str, bytes | None] = {}
        if self.mode == "rank0":
            assert self.queue is not None
            keys = [e.payload_key for i in indices if (e := batch.source(i)) is not None and e.payload_key]
            fetched = self.queue.fetch_payloads(keys) if keys else {}
        for i in indices:
            entry = batch.source(i)
            if entry is not None and entry.payload_key is not None:
                ref = GroupRef(i, key=entry.payload_key, size=entry.payload_size,
                               check=header_check(entry.fields["head"]), weight=weights[i])
                if self.mode == "readers":
                    refs.append(ref)
                    continue
                try:
                    samples = check_payload(ref, fetched.get(ref.key))
                except SampleDecodeError as e:
                    lost.append((i, str(e)))
                    continue
            elif entry is not None and entry.samples is not None:
                samples = list(entry.samples)  # an entry of schema 1 or 2: inline
            else:
                # Whole already (a replay), with the group's untrained samples back in their places.
                samples = sorted([*batch.groups[i], *batch.untrained(i)], key=lambda s: s.index)
            # Plain routing: inline bytes are decoded once, on the rank that trains them; compressing costs time.
            refs.append(GroupRef(i, data=encode_samples(samples, routing="plain"), weight=weights[i]))
        return refs, lost
