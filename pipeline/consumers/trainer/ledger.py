"""The ledger: each sample's fate in the trainer (trained, stale, invalid or filtered), with the step and policy
version.

It is the trainer's half of the exactly-once protocol (docs/architecture.md, "Exactly-once effect"). Lines accumulate in
memory during steps; at a checkpoint commit they are written as one Parquet segment ``ledger/seg-<step>.parquet``
(temporary file, fsync, rename) BEFORE the checkpoint itself is renamed into place. A segment whose step is newer
than the last committed checkpoint belongs to a commit that never finished; loading discards it. So the committed
ledger is exactly the segments up to the loaded checkpoint's step, and its sample ids are what a restarted trainer
acks without training again.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

# filtered: the staleness policy accepted the group but a group filter (pipeline.consumers.trainer.filters) dropped it.
Fate = Literal["trained", "stale", "invalid", "filtered"]
FATES: tuple[Fate, ...] = ("trained", "stale", "invalid", "filtered")

LEDGER_SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("entry_id", pa.string(), nullable=False),
    pa.field("fate", pa.string(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),
    pa.field("policy_version", pa.int64(), nullable=False),
])


@dataclass(frozen=True)
class LedgerLine:
    """One sample's fate."""

    sample_id: str
    entry_id: str
    fate: Fate
    step: int
    policy_version: int


class Ledger:
    """Committed lines on disk plus the lines of the steps since the last commit."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._pending: list[LedgerLine] = []
        self._committed_ids: set[str] = set()
        self.committed_step = -1

    # ---------------------------------------------------------------------------------------------------- write
    def record(self, lines: Iterable[LedgerLine]) -> None:
        self._pending.extend(lines)

    @property
    def pending(self) -> list[LedgerLine]:
        return list(self._pending)

    def write_segment(self, step: int) -> Path | None:
        """Durably write the pending lines as the segment of ``step``; call before the checkpoint is renamed."""
        if not self._pending:
            return None
        table = pa.Table.from_pylist([vars(line) for line in self._pending], schema=LEDGER_SCHEMA)
        final = self.folder / f"seg-{step:09d}.parquet"
        tmp = self.folder / f".seg-{step:09d}.parquet.tmp"
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return final

    def mark_committed(self, step: int) -> None:
        """The checkpoint of ``step`` is in place: the pending lines are now part of the committed ledger."""
        self._committed_ids.update(line.sample_id for line in self._pending)
        self._pending = []
        self.committed_step = step

    # ----------------------------------------------------------------------------------------------------- read
    def load(self, committed_step: int) -> int:
        """Load the ledger as of the checkpoint of ``committed_step`` (-1: none), discarding newer segments."""
        self._pending = []
        self._committed_ids = set()
        for path in self.folder.glob(".seg-*.tmp"):
            path.unlink()
        for path, step in _segments(self.folder):
            if step > committed_step:
                path.unlink()  # written by a commit whose checkpoint never landed
                continue
            self._committed_ids.update(pq.read_table(path, columns=["sample_id"])["sample_id"].to_pylist())
        self.committed_step = committed_step
        return len(self._committed_ids)

    def is_committed(self, sample_id: str) -> bool:
        return sample_id in self._committed_ids

    def __len__(self) -> int:
        return len(self._committed_ids)


def _segments(folder: Path) -> list[tuple[Path, int]]:
    out = []
    for path in folder.glob("seg-*.parquet"):
        try:
            out.append((path, int(path.stem.split("-")[1])))
        except (IndexError, ValueError):
            continue
    return sorted(out, key=lambda x: x[1])


def read_ledger(folder: str | Path, upto_step: int | None = None) -> Iterator[LedgerLine]:
    """Committed lines in step order (segments newer than ``upto_step`` are skipped)."""
    for path, step in _segments(Path(folder)):
        if upto_step is not None and step > upto_step:
            continue
        for row in pq.read_table(path).to_pylist():
            yield LedgerLine(**row)
