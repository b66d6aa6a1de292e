"""The queue boundary: what producers and consumers may rely on, whatever stores the entries."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.queue.sample import Sample, SampleStatus


@dataclass(frozen=True)
class QueueEntry:
    """One queue entry (one prompt group) as a consumer receives it."""

    id: str
    samples: list[Sample]
    version_min: int
    version_max: int
    delivery: str = ">"  # ">" fresh, "pending" re-read after a restart, "claimed" taken from a dead consumer


@dataclass(frozen=True)
class SampleHeader:
    """What a stream entry's header says of one sample: every scalar a decision reads (the drain's staleness policy,
    validity check, dedupe and pacing, the built-in filter, the stream evaluator), without its arrays.

    Attribute names match :class:`Sample`'s, so code that reads only these works on either.
    """

    sample_id: str
    group_id: str
    prompt_id: str
    index: int
    reward: float
    status: SampleStatus
    finish_reason: str
    producer: str
    engine: str
    created_at: float
    prompt_len: int
    response_len: int
    version_min: int | None
    version_max: int | None
    reward_info: Mapping[str, Any] = field(default_factory=dict)
    """Only the reward's ``pass`` verdict, when it has one (a bool or a number): the rest rides in the payload."""

    @property
    def num_response_tokens(self) -> int:
        return self.response_len

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_len


@dataclass(frozen=True)
class HeaderEntry:
    """One queue entry as its header gives it: the samples' scalars and where the payload lies, not the payload.

    ``payload_key`` is None for an entry of schema 1 or 2, which carries its payload inline; ``samples`` then holds
    it already decoded, and fetching it costs nothing.
    """

    id: str
    headers: list[SampleHeader]
    version_min: int
    version_max: int
    payload_key: str | None
    payload_size: int
    delivery: str = ">"
    fields: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    """The entry's raw stream fields, for a dead-letter record."""
    samples: list[Sample] | None = field(default=None, repr=False)

    @property
    def group_id(self) -> str:
        return self.headers[0].group_id

    @property
    def producer(self) -> str:
        return self.headers[0].producer


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

    def read_headers(self, group: str, consumer: str, count: int = 1,
                     block_ms: int | None = None) -> list[HeaderEntry]: ...

    def fetch_payloads(self, keys: Sequence[str]) -> dict[str, bytes | None]: ...

    def materialize(self, group: str, consumer: str, entries: Sequence[HeaderEntry]) -> list[QueueEntry]: ...

    def read_pending(self, group: str, consumer: str, count: int = 64) -> list[QueueEntry]: ...

    def claim_stale(self, group: str, consumer: str, min_idle_ms: int, count: int = 64) -> list[QueueEntry]: ...

    def ack(self, group: str, ids: Sequence[str]) -> int: ...

    def trim(self) -> int: ...

    def stats(self) -> QueueStats: ...
