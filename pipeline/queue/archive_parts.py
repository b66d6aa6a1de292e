"""How the archive splits over ``queue.archive.processes`` archivers: each one's consumer group, the entries it owns,
its segments' names, and the check that a run's archive keeps one split for its whole life.

Kept apart from ``archive.py`` (pyarrow) so that the launcher can name the groups and check the layout without
loading Arrow.

Ownership is ``crc32(group id) mod M``, read from the header, the same hash ``SampleQueue.payload_key`` picks a
payload's shard tag with (``crc32 mod N``). So it splits evenly in every layout (a single server has one shard tag,
so a split by tag would leave M - 1 archivers idle there), and whenever M divides the number of shard tags, archiver
i fetches from exactly the tags whose index is i mod M: its own shards, on its own primaries.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError

ARCHIVE_GROUP = "archive"
"""The consumer group of the archive when one archiver runs (``queue.archive.processes = 1``)."""

_GROUP = re.compile(r"^archive-(\d+)-of-(\d+)$")
# seg-<ms>-<seq>.parquet (one archiver) or seg-<ms>-<seq>-<i>-of-<M>.parquet (archiver i of M).
_SEGMENT = re.compile(r"^seg-\d+-\d+(?:-(\d+)-of-(\d+))?\.parquet$")


def owner_of(group_id: str, processes: int) -> int:
    """The index of the archiver that archives the entries of prompt group ``group_id``."""
    return zlib.crc32(group_id.encode()) % processes


@dataclass(frozen=True)
class ArchivePart:
    """Archiver ``index`` of ``processes``: its consumer group, the entries it owns, and its segments' names."""

    index: int = 0
    processes: int = 1

    def __post_init__(self) -> None:
        if self.processes < 1 or not 0 <= self.index < self.processes:
            raise ConfigError(f"archiver {self.index} of {self.processes} does not exist; queue.archive.processes "
                              "must be >= 1 and an archiver's index in [0, processes)")

    @property
    def alone(self) -> bool:
        return self.processes == 1

    @property
    def group(self) -> str:
        """Its consumer group: ``archive`` alone (the name runs before the split used), else ``archive-i-of-M``.
        Every group sees every header (a few KB each); only the owner fetches an entry's payload."""
        return ARCHIVE_GROUP if self.alone else f"{ARCHIVE_GROUP}-{self.index}-of-{self.processes}"

    @property
    def process_name(self) -> str:
        """Its process's name under the launcher (and its log file's)."""
        return "archiver" if self.alone else f"archiver-{self.index}"

    @property
    def suffix(self) -> str:
        """What its segment names carry after the first id, so that no two archivers' segments share a name."""
        return "" if self.alone else f"-{self.index}-of-{self.processes}"

    @property
    def lock_name(self) -> str:
        return ".lock" if self.alone else f".lock{self.suffix}"

    def owns(self, group_id: str) -> bool:
        return self.alone or owner_of(group_id, self.processes) == self.index


ALONE = ArchivePart()
"""The one archiver of an archive that is not split."""


def archive_parts(processes: int) -> list[ArchivePart]:
    return [ArchivePart(i, processes) for i in range(processes)]


def group_part(name: str) -> ArchivePart | None:
    """The archiver a consumer group belongs to (``archive``, ``archive-i-of-M``); None for any other group."""
    if name == ARCHIVE_GROUP:
        return ALONE
    m = _GROUP.match(name)
    if m is None or not 0 <= int(m[1]) < int(m[2]):
        return None
    return ArchivePart(int(m[1]), int(m[2]))


def segment_part(name: str) -> ArchivePart | None:
    """The archiver that wrote segment file ``name``, from its name alone; None if it is no segment's name."""
    m = _SEGMENT.match(name)
    if m is None:
        return None
    return ALONE if m[1] is None else ArchivePart(int(m[1]), int(m[2]))


def check_archive_layout(processes: int, group_names: Iterable[str], folder: Path | None) -> None:
    """Refuse to continue an archive with another number of archivers than it was begun with.

    Each archiver's restart rule ("every id it owns up to its newest segment's last id is archived") holds only for
    one split, and the groups of another split would hold the stream's trim back forever; so a change of
    ``queue.archive.processes`` mid-run is refused rather than re-split.
    """
    seen = {p.processes for p in map(group_part, group_names) if p is not None}
    source = "its consumer groups"
    if folder is not None and folder.is_dir():
        written = {p.processes for p in map(segment_part, (f.name for f in folder.glob("seg-*.parquet")))
                   if p is not None}
        if written - {processes}:
            seen, source = written, f"the segments in {folder}"
    other = sorted(seen - {processes})
    if other:
        raise ConfigError(
            f"queue.archive.processes = {processes}, but this run's archive was written by {other[0]} archiver(s) "
            f"({source} say so). An archive keeps one split for its whole run: set queue.archive.processes = "
            f"{other[0]} again, or start a new run folder")
