"""The archive: Parquet segments of the queue, written by a consumer group and read back for offline replay.

A segment is the commit point. It is written to a temporary file, fsynced, renamed into place and the folder
fsynced; only then are its entries acked in the ``archive`` group. Each segment carries its stream-id and
policy-version range in its Parquet metadata, so ``index.json`` is only a cache that can always be rebuilt from the
segments. A crash between rename and ack re-delivers entries that are already archived; the archiver recognises them
by id (every id up to the newest segment's last id is archived) and acks them without writing them twice.

With ``queue.archive.processes`` = M > 1, archiver i of M reads group ``archive-i-of-M``, archives the entries it owns
(``archive_parts``) and acks the others unfetched; its segments' names and its restart rule are its own, and readers
merge every archiver's segments back into stream order.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import QueueError
from pipeline.queue.archive_parts import ALONE, ArchivePart, archive_parts, check_archive_layout
from pipeline.queue.arrow import SAMPLE_SCHEMA, parquet_write_options, samples_to_table, table_to_samples
from pipeline.queue.base import HeaderEntry, QueueEntry
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample

log = logging.getLogger(__name__)

INDEX_FILE = "index.json"
StreamId = tuple[int, int]


def parse_id(entry_id: str) -> StreamId:
    """A stream id "ms-seq" as a tuple that orders like Redis orders ids."""
    try:
        ms, _, seq = entry_id.partition("-")
        return int(ms), int(seq or 0)
    except ValueError:
        raise QueueError(f"{entry_id!r} is not a stream id (expected 'milliseconds-sequence')") from None


@dataclass(frozen=True)
class SegmentInfo:
    """One Parquet segment and the ranges it covers."""

    name: str
    first_id: str
    last_id: str
    entries: int
    samples: int
    version_min: int
    version_max: int
    part: int = 0
    """Which archiver wrote it (its index of ``parts``)."""
    parts: int = 1
    """``queue.archive.processes`` when it was written."""

    @property
    def writer(self) -> ArchivePart:
        return ArchivePart(self.part, self.parts)

    def as_dict(self) -> dict[str, Any]:
        """Its fields; a lone archiver's segment leaves out the split, so that it reads as before the split."""
        d = asdict(self)
        if self.parts == 1:
            del d["part"], d["parts"]
        return d

    def to_metadata(self) -> dict[bytes, bytes]:
        return {b"sluice.segment": json.dumps(self.as_dict()).encode()}

    @classmethod
    def from_parquet(cls, path: Path) -> SegmentInfo:
        meta = pq.read_schema(path).metadata or {}
        raw = meta.get(b"sluice.segment")
        if raw is None:
            raise QueueError(f"{path.name} has no sluice segment metadata; not written by sluice's archiver?")
        return cls(**json.loads(raw))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ArchiveWriter:
    """Writes queue entries as durable Parquet segments in one folder and keeps its index; ``part`` is the archiver
    of a split archive it writes for (its segments' names carry it)."""

    def __init__(self, folder: str | Path, compression: str = "zstd", part: ArchivePart = ALONE) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.compression = compression
        self.part = part

    def write_segment(self, entries: Sequence[QueueEntry]) -> SegmentInfo:
        if not entries:
            raise QueueError("a segment needs at least one entry")
        samples = [s for e in entries for s in e.samples]
        stream_ids = [e.id for e in entries for _ in e.samples]
        versions = [v for s in samples for v in (s.version_min, s.version_max) if v is not None]
        info = SegmentInfo(
            name=f"seg-{parse_id(entries[0].id)[0]:015d}-{parse_id(entries[0].id)[1]:06d}{self.part.suffix}.parquet",
            first_id=entries[0].id,
            last_id=entries[-1].id,
            entries=len(entries),
            samples=len(samples),
            version_min=min(versions) if versions else -1,
            version_max=max(versions) if versions else -1,
            part=self.part.index,
            parts=self.part.processes,
        )
        table = samples_to_table(samples, stream_ids)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **info.to_metadata()})
        final = self.folder / info.name
        tmp = self.folder / f".{info.name}.tmp"
        try:
            with open(tmp, "wb") as f:
                pq.write_table(table, f, **parquet_write_options(table, self.compression))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            # A full disk (ENOSPC) or a file-size limit (EFBIG): pyarrow's own message names no file. Nothing was
            # acked, so the entries stay pending in the archive group and a restarted archiver writes them.
            tmp.unlink(missing_ok=True)
            raise QueueError(f"could not write archive segment {final} ({e.strerror or e}); free space under "
                             f"{self.folder}: nothing is lost, its {len(entries)} entries stay pending in the "
                             "archive group and the restarted archiver writes them") from e
        os.replace(tmp, final)
        _fsync_dir(self.folder)
        self._update_index(info)
        return info

    def _update_index(self, info: SegmentInfo) -> None:
        # The archivers of a split archive share the folder's index: each read-modify-write holds an flock, so that
        # none drops another's segment (the index would still be rebuilt, but from every segment's footer).
        fd = os.open(self.folder / ".index.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            segments = [s for s in load_index(self.folder) if s.name != info.name] + [info]
            segments.sort(key=lambda s: parse_id(s.first_id))
            tmp = self.folder / f".{INDEX_FILE}.tmp"
            tmp.write_text(json.dumps([s.as_dict() for s in segments], indent=1))
            os.replace(tmp, self.folder / INDEX_FILE)
        finally:
            os.close(fd)


def load_index(folder: str | Path) -> list[SegmentInfo]:
    """The segments of an archive (of every archiver) by first id; the index is only a cache: a segment it lacks is
    read from its own footer, one it names that is gone is dropped."""
    folder = Path(folder)
    files = {p.name for p in folder.glob("seg-*.parquet")}
    index_path = folder / INDEX_FILE
    cached: dict[str, SegmentInfo] = {}
    if index_path.exists():
        try:
            cached = {s.name: s for s in (SegmentInfo(**d) for d in json.loads(index_path.read_text()))}
        except (ValueError, TypeError):
            cached = {}
    segments = [cached[name] if name in cached else SegmentInfo.from_parquet(folder / name) for name in files]
    return sorted(segments, key=lambda s: parse_id(s.first_id))


def _id_key(stream_id: str | None) -> StreamId:
    """A row's place in stream order (a row without an id, from a hand-written table, sorts first)."""
    return parse_id(stream_id) if stream_id else (-1, -1)


class ArchiveReader:
    """Reads an archive folder back as Samples, in stream order, with optional id and version filters.

    A split archive (``queue.archive.processes`` > 1) holds each archiver's segments side by side; each archiver's
    are in stream order and disjoint, so a k-way merge by stream id gives the sequence one archiver would have
    written, holding one segment per archiver in memory.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise QueueError(f"archive folder {self.folder} does not exist")
        self.segments = load_index(self.folder)

    def writers(self) -> list[list[SegmentInfo]]:
        """The segments of each archiver that wrote into the folder, each list in stream order."""
        out: dict[ArchivePart, list[SegmentInfo]] = {}
        for seg in self.segments:
            out.setdefault(seg.writer, []).append(seg)
        return [out[k] for k in sorted(out, key=lambda p: (p.processes, p.index))]

    def table(self) -> pa.Table:
        """All segments as one Arrow table in stream order (SAMPLE_SCHEMA; uint16 routing ids if any segment has them).

        Segments of schema 1 and 2 in one folder (an archiver that was upgraded mid-run) concatenate with the other
        schema's routing columns null; read such an archive with ``entries`` instead.
        """
        tables = [pq.read_table(self.folder / s.name) for s in self.segments]
        if not tables:
            return SAMPLE_SCHEMA.empty_table()
        table = pa.concat_tables(tables, promote_options="permissive")
        if len(self.writers()) > 1:
            # Segments are in first-id order, but two archivers' ranges interleave: sort the rows (stably, so a
            # group's samples keep their order).
            ids = table.column("stream_id").to_pylist()
            table = table.take(pa.array(sorted(range(len(ids)), key=lambda i: _id_key(ids[i]))))
        return table

    def entries(
        self,
        id_range: tuple[str | None, str | None] | None = None,
        version_range: tuple[int | None, int | None] | None = None,
    ) -> Iterator[tuple[str, Sample]]:
        """(stream id, sample) pairs, in stream order, merged across the archivers that wrote the folder.

        ``id_range`` is inclusive on both ends. ``version_range`` keeps samples whose every token was produced by a
        policy version inside it (version_min >= lo and version_max <= hi).
        """
        streams = [self._writer_entries(segs, id_range, version_range) for segs in self.writers()]
        if len(streams) == 1:
            yield from streams[0]
        else:
            yield from heapq.merge(*streams, key=lambda row: _id_key(row[0]))

    def _writer_entries(
        self,
        segments: list[SegmentInfo],
        id_range: tuple[str | None, str | None] | None,
        version_range: tuple[int | None, int | None] | None,
    ) -> Iterator[tuple[str, Sample]]:
        lo_id = parse_id(id_range[0]) if id_range and id_range[0] else None
        hi_id = parse_id(id_range[1]) if id_range and id_range[1] else None
        lo_v = version_range[0] if version_range else None
        hi_v = version_range[1] if version_range else None
        for seg in segments:
            if (lo_id and parse_id(seg.last_id) < lo_id) or (hi_id and parse_id(seg.first_id) > hi_id):
                continue
            if (lo_v is not None and seg.version_max < lo_v) or (hi_v is not None and seg.version_min > hi_v):
                continue
            for stream_id, sample in table_to_samples(pq.read_table(self.folder / seg.name)):
                sid = parse_id(stream_id) if stream_id else None
                if sid is not None and ((lo_id and sid < lo_id) or (hi_id and sid > hi_id)):
                    continue
                vmin, vmax = sample.version_min, sample.version_max
                if lo_v is not None and (vmin is None or vmin < lo_v):
                    continue
                if hi_v is not None and (vmax is None or vmax > hi_v):
                    continue
                yield stream_id or "", sample

    def samples(self, **filters: Any) -> Iterator[Sample]:
        for _, sample in self.entries(**filters):
            yield sample


class Archiver:
    """One archiver's worker: reads its group's headers, fetches and archives the entries it owns, writes segments,
    and acks after each durable rename; entries another archiver owns it acks at once, their payloads unfetched.

    One archiver per folder and part (an flock on ``part.lock_name`` enforces it), since recognising already-archived
    entries after a crash relies on one writer seeing its entries in stream order.
    """

    def __init__(
        self,
        queue: SampleQueue,
        folder: str | Path,
        *,
        part: ArchivePart = ALONE,
        consumer: str = "archiver",
        segment_samples: int = 4096,
        flush_interval_s: float = 30.0,
        block_ms: int = 1000,
    ) -> None:
        self.queue = queue
        self.part = part
        self.writer = ArchiveWriter(folder, part=part)
        self.folder = self.writer.folder
        self.group, self.consumer = part.group, consumer
        self.segment_samples = segment_samples
        self.flush_interval_s = flush_interval_s
        self.block_ms = block_ms
        self._buffer: list[QueueEntry] = []
        self._buffer_since = time.monotonic()
        self._lock_fd: int | None = None
        self.segments_written = 0

    def _acquire_lock(self) -> None:
        fd = os.open(self.folder / self.part.lock_name, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            who = "" if self.part.alone else f" as archiver {self.part.index} of {self.part.processes}"
            raise QueueError(f"another archiver holds {self.folder}{who}; run one archiver per archive folder and "
                             "part") from None
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def archived_upto(self) -> StreamId:
        """The last id of this archiver's newest segment: every entry it owns up to there is archived. Only its own
        segments count: another archiver's newer segment says nothing of this one's entries."""
        own = [s for s in load_index(self.folder) if s.writer == self.part]
        return parse_id(own[-1].last_id) if own else (-1, -1)

    def recover(self) -> int:
        """Take back this consumer's pending entries (and dead archivers'), acking those already archived and those
        another archiver owns; returns how many were acked."""
        check_archive_layout(self.part.processes, self.queue.group_names(), self.folder)
        # Every archiver's group, not only its own: a trim between two archivers' starts must not drop entries that
        # the later one would have owned.
        for part in archive_parts(self.part.processes):
            self.queue.create_group(part.group, "0")
        upto = self.archived_upto()
        pending = self.queue.read_pending_headers(self.group, self.consumer)
        pending += self.queue.claim_stale_headers(self.group, self.consumer, min_idle_ms=60_000)
        todo = sorted((h for h in pending if self.part.owns(h.group_id) and parse_id(h.id) > upto),
                      key=lambda h: parse_id(h.id))
        todo_ids = {h.id for h in todo}
        done = [h.id for h in pending if h.id not in todo_ids]
        self.queue.ack(self.group, done)
        self._buffer.extend(self.queue.materialize(self.group, self.consumer, todo))
        return len(done)

    def _owned(self, headers: list[HeaderEntry]) -> list[HeaderEntry]:
        """The entries this archiver archives; the others it acks here, without fetching their payloads."""
        if self.part.alone:
            return headers
        owned = [self.part.owns(h.group_id) for h in headers]
        self.queue.ack(self.group, [h.id for h, mine in zip(headers, owned) if not mine])
        return [h for h, mine in zip(headers, owned) if mine]

    def step(self) -> int:
        """Read once (blocking up to block_ms), write every full segment, and a partial one if it is old; returns
        how many headers were read (its own entries and others')."""
        headers = self.queue.read_headers(self.group, self.consumer, count=256, block_ms=self.block_ms)
        entries = self.queue.materialize(self.group, self.consumer, self._owned(headers))
        if entries and not self._buffer:
            self._buffer_since = time.monotonic()
        self._buffer.extend(entries)
        while self._take_full_segment():
            pass
        if self._buffer and time.monotonic() - self._buffer_since >= self.flush_interval_s:
            self.flush()
        return len(headers)

    def _take_full_segment(self) -> bool:
        n = 0
        for i, entry in enumerate(self._buffer):
            n += len(entry.samples)
            if n >= self.segment_samples:
                self._write(self._buffer[: i + 1])
                self._buffer = self._buffer[i + 1 :]
                self._buffer_since = time.monotonic()
                return True
        return False

    def flush(self) -> SegmentInfo | None:
        """Write whatever is buffered as one segment."""
        if not self._buffer:
            return None
        info = self._write(self._buffer)
        self._buffer = []
        return info

    def _write(self, entries: list[QueueEntry]) -> SegmentInfo:
        info = self.writer.write_segment(entries)
        # Ack strictly after the rename and directory fsync: an acked entry is always on disk.
        self.queue.ack(self.group, [e.id for e in entries])
        self.segments_written += 1
        log.info("archived %d samples (%s..%s) to %s", info.samples, info.first_id, info.last_id, info.name)
        return info

    def run(self, stop: threading.Event | None = None, idle_exit_s: float | None = None) -> None:
        """Archive until ``stop`` is set (or, with ``idle_exit_s``, until nothing arrives for that long)."""
        self._acquire_lock()
        try:
            self.recover()
            idle_since = time.monotonic()
            while stop is None or not stop.is_set():
                if self.step():
                    idle_since = time.monotonic()
                elif idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                    break
            self.flush()
        finally:
            self.close()
