"""What ``sluice queue stats|tail|export|audit`` do: looking into a run's queue without consuming from it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import SampleDecodeError
from pipeline.queue.archive import ArchiveWriter, SegmentInfo, parse_id
from pipeline.queue.base import QueueEntry
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample


def stats(queue: SampleQueue) -> dict[str, Any]:
    return asdict(queue.stats())


def sample_to_json(sample: Sample, stream_id: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"stream_id": stream_id} if stream_id else {}
    d.update(
        sample_id=sample.sample_id, group_id=sample.group_id, prompt_id=sample.prompt_id, index=sample.index,
        status=sample.status.value, finish_reason=sample.finish_reason, reward=sample.reward,
        reward_info=sample.reward_info, version_min=sample.version_min, version_max=sample.version_max,
        prompt_ids=sample.prompt_ids.tolist(), response_ids=sample.response_ids.tolist(),
        rollout_logprobs=sample.rollout_logprobs.tolist(), token_versions=sample.token_versions.tolist(),
        loss_mask=sample.loss_mask.tolist() if sample.loss_mask is not None else None,
        routed_experts_shape=list(sample.routed_experts.shape) if sample.routed_experts is not None else None,
        producer=sample.producer, engine=sample.engine, created_at=sample.created_at,
        sampling=sample.sampling.to_dict(),
    )
    return d


def tail(queue: SampleQueue, count: int = 10, follow: bool = False, block_ms: int = 1000) -> Iterator[dict[str, Any]]:
    """The last ``count`` samples' JSON records; with ``follow``, then every new one as it arrives (XREAD, no group)."""
    rows = queue.redis.xrevrange(queue.keys.samples, count=max(count, 1))
    start = rows[-1][0].decode() if rows else "0"
    last = "0-0"
    for entry_id, item in queue.scan(start=start) if rows else iter(()):
        last = entry_id
        yield from _entry_json(entry_id, item)
    while follow:
        reply = queue.redis.xread({queue.keys.samples: last}, block=block_ms, count=64)
        for _, entries in reply or []:
            for raw_id, _flat in entries:
                last = raw_id.decode()
                for eid, item in queue.scan(start=last, end=last):
                    yield from _entry_json(eid, item)


def _entry_json(entry_id: str, item: QueueEntry | SampleDecodeError) -> Iterator[dict[str, Any]]:
    if isinstance(item, SampleDecodeError):
        yield {"stream_id": entry_id, "error": str(item)}
        return
    for s in item.samples:
        yield sample_to_json(s, entry_id)


def export(queue: SampleQueue, folder: str | Path, start: str = "-", end: str = "+",
           segment_samples: int = 4096) -> list[SegmentInfo]:
    """Write the stream's entries in [start, end] as Parquet segments (the archive format); skips undecodable ones."""
    writer = ArchiveWriter(folder)
    out: list[SegmentInfo] = []
    buf: list[QueueEntry] = []
    n = 0
    for _, item in queue.scan(start, end):
        if isinstance(item, SampleDecodeError):
            continue
        buf.append(item)
        n += len(item.samples)
        if n >= segment_samples:
            out.append(writer.write_segment(buf))
            buf, n = [], 0
    if buf:
        out.append(writer.write_segment(buf))
    return out


@dataclass
class AuditReport:
    """Every sample's fate as the queue sees it, summed up. Later stages add the trainer's ledger."""

    run: str
    entries_produced: int
    entries_in_stream: int
    entries_trimmed: int
    samples_in_stream: int
    undecodable_in_stream: int
    deadlettered: int
    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    duplicate_sample_ids: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)


def audit(queue: SampleQueue, with_samples: bool = False) -> AuditReport:
    """Per group: how many entries/samples are acked, pending or not yet delivered; plus dead letters."""
    st = queue.stats()
    groups = {g.name: g for g in st.groups}
    pending = {name: set(queue.pending_ids(name)) for name in groups}
    last = {name: parse_id(g.last_delivered_id) for name, g in groups.items()}
    counts: dict[str, Counter[str]] = {name: Counter() for name in groups}
    seen: Counter[str] = Counter()
    rows: list[dict[str, Any]] = []
    entries = samples = undecodable = 0
    for entry_id, item in queue.scan_headers():  # sample ids are in the headers: no payload is fetched
        entries += 1
        if isinstance(item, SampleDecodeError):
            undecodable += 1
            continue
        eid = parse_id(entry_id)
        fates = {}
        for name in groups:
            fate = "pending" if entry_id in pending[name] else ("acked" if eid <= last[name] else "undelivered")
            fates[name] = fate
            counts[name][f"{fate}_entries"] += 1
            counts[name][f"{fate}_samples"] += len(item.headers)
        for s in item.headers:
            samples += 1
            seen[s.sample_id] += 1
            if with_samples:
                rows.append({"sample_id": s.sample_id, "stream_id": entry_id, **fates})
    return AuditReport(
        run=queue.run,
        entries_produced=st.produced,
        entries_in_stream=entries,
        entries_trimmed=max(st.produced - entries, 0),
        samples_in_stream=samples,
        undecodable_in_stream=undecodable,
        deadlettered=st.deadletter,
        groups={name: dict(c) for name, c in counts.items()},
        duplicate_sample_ids=sum(1 for c in seen.values() if c > 1),
        samples=rows,
    )
