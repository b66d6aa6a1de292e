"""Offline replay: train on stored rollouts, with no producers and no engines.

The records come from a Parquet archive (``run_dir/archive`` or an export) or from a run's stream, in stream order,
optionally limited to a stream-id range. They go through the same trainer loop, staleness policy and off-policy
corrections as a live run. Versions are taken from the records: the replay's clock starts at the oldest version in
the recording and advances by one per step, as a live trainer's does with each push (and never falls behind a version
the recording holds), so a recipe's
``staleness.max_lag`` replays the run as if it had been trained with that eta. For a given seed and range, two
replays produce the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.config.filters import FilterConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.trainer.drain import Batch, judge_group
from pipeline.consumers.trainer.filters import GroupFilters
from pipeline.consumers.trainer.ledger import Ledger
from pipeline.consumers.trainer.loop import LocalClock
from pipeline.errors import ConfigError, SampleDecodeError
from pipeline.queue.sample import Sample
from pipeline.rundir import run_file_path

Record = tuple[str, list[Sample]]  # (stream id, the group's samples)


@dataclass(frozen=True)
class ReplayRecovery:
    """Replay keeps no queue state: a restarted replay skips the groups its committed ledger already judged."""

    skipped_groups: int


class ReplaySource:
    """Batches from a recording, judged by the staleness policy against the replay clock and by the group filters.

    It judges groups with the live drain's :func:`~pipeline.consumers.trainer.drain.judge_group`, so a filter drops
    the same groups in a replay as in the run. A group the policy would requeue is recorded as stale: there are no
    producers.
    """

    def __init__(self, records: Iterator[Record], staleness: StalenessConfig, ledger: Ledger,
                 clock: LocalClock, filters: GroupFilters | FilterConfig | None = None) -> None:
        self._records = records
        self.staleness = staleness
        self.filters = GroupFilters(filters) if isinstance(filters, FilterConfig) else filters
        self.ledger = ledger
        self.clock = clock
        self.skipped = 0

    def recover(self) -> ReplayRecovery:
        return ReplayRecovery(skipped_groups=self.skipped)

    def ack(self, entry_ids: list[str]) -> None:
        """Nothing to acknowledge: the recording is read-only."""

    def next_batch(self, batch_groups: int, step: int, version: Callable[[], int],
                   should_stop: Callable[[], bool] = lambda: False) -> Batch:
        batch = Batch()
        while len(batch.groups) < batch_groups and not should_stop():
            if self.filters is not None and self.filters.drawn_enough(len(batch.groups), batch.filters.groups,
                                                                      batch_groups, 1):
                batch.filters.capped = 1
                break
            record = next(self._records, None)
            if record is None:
                break
            entry_id, samples = record
            if all(self.ledger.is_committed(s.sample_id) for s in samples):
                self.skipped += 1  # judged before the checkpoint this replay resumed from
                continue
            # A live trainer is never behind the engines; nor is the replay clock behind the recording.
            self.clock.observe(max((s.version_max for s in samples if s.version_max is not None), default=0))
            current = version()
            batch.add(entry_id, judge_group(samples, current, self.staleness, self.filters), step, current)
        return batch


def _group_rows(rows: Iterator[tuple[str, Sample]]) -> Iterator[Record]:
    """Consecutive rows of one stream entry form one prompt group."""
    current_id: str | None = None
    group: list[Sample] = []
    for entry_id, sample in rows:
        if entry_id != current_id and group:
            yield current_id or "", group
            group = []
        current_id = entry_id
        group.append(sample)
    if group:
        yield current_id or "", group


def archive_records(folder: Path, id_range: tuple[str | None, str | None] | None) -> Iterator[Record]:
    from pipeline.queue.archive import ArchiveReader

    return _group_rows(ArchiveReader(folder).entries(id_range=id_range))


def stream_records(run_dir: Path, id_range: tuple[str | None, str | None] | None) -> Iterator[Record]:
    from pipeline.queue.rundir import open_run

    handle = open_run(run_dir=run_dir)
    start, end = (id_range or (None, None))
    try:
        for entry_id, entry in handle.queue.scan(start or "-", end or "+"):
            if not isinstance(entry, SampleDecodeError):
                yield entry_id, entry.samples
    finally:
        handle.close(stop_server=True)


def open_records(source: Path, id_range: tuple[str | None, str | None] | None) -> Iterator[Record]:
    """A recording by path: an archive folder (Parquet segments) or a run folder (its stream)."""
    if any(source.glob("seg-*.parquet")):
        return archive_records(source, id_range)
    if run_file_path(source).exists():
        return stream_records(source, id_range)
    raise ConfigError(f"{source} is neither an archive (seg-*.parquet) nor a run folder (run.json); point --from at "
                      "run_dir/archive, a `sluice queue export` folder, or a run folder")


def first_version(source: Path, id_range: tuple[str | None, str | None] | None) -> int:
    """The oldest token version in the recording: where the replay clock starts."""
    versions = [s.version_min for _, g in open_records(source, id_range) for s in g if s.version_min is not None]
    return min(versions, default=0)


def parse_range(text: str | None) -> tuple[str | None, str | None] | None:
    if not text:
        return None
    start, sep, end = text.partition(":")
    if not sep:
        raise ConfigError(f"--range {text!r}: expected A:B with stream ids (either side may be empty)")
    return start or None, end or None
