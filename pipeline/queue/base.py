"""The queue boundary: what producers and consumers may rely on, whatever stores the entries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.queue.sample import Sample


@dataclass(frozen=True)
class QueueEntry:
    """One queue entry (one prompt group) as a consumer receives it."""

    id: str
    samples: list[Sample]
    version_min: int
    version_max: int
    delivery: str = ">"  # ">" fresh, "pending" re-read after a restart, "claimed" taken from a dead consumer


@dataclass(frozen=True)
class GroupStats:
    """State of one consumer group."""

    name: str
    consumers: int
    pending: int
    last_delivered_id: str
    lag: int | None  # entries not yet delivered to the group; None if it cannot be known


@dataclass(frozen=True)
class QueueStats:
    """A snapshot of a run's queue."""

    run: str
    length: int
    produced: int
    first_id: str | None
    last_id: str | None
    deadletter: int
    policy_version: int
    groups: list[GroupStats] = field(default_factory=list)


class SampleQueueBase(Protocol):
    """A durable log of sample groups read through consumer groups with explicit acknowledgement."""

    def put(self, group: Sequence[Sample], timeout_s: float | None = None,
            abort: Callable[[], bool] | None = None) -> str: ...

    def put_many(self, groups: Sequence[Sequence[Sample]], timeout_s: float | None = None,
                 abort: Callable[[], bool] | None = None) -> list[str]: ...

    def create_group(self, name: str, start: str = "0") -> bool: ...

    def read(self, group: str, consumer: str, count: int = 1, block_ms: int | None = None) -> list[QueueEntry]: ...

    def read_pending(self, group: str, consumer: str, count: int = 64) -> list[QueueEntry]: ...

    def claim_stale(self, group: str, consumer: str, min_idle_ms: int, count: int = 64) -> list[QueueEntry]: ...

    def ack(self, group: str, ids: Sequence[str]) -> int: ...

    def trim(self) -> int: ...

    def stats(self) -> QueueStats: ...
