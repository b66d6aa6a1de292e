"""Draining the ``trainer`` group: recovery against the ledger, then batches of prompt groups under the staleness
policy. Only the trainer's rank 0 talks to the queue; the other ranks get their share from it.

Nothing is acked here. Every entry a batch consumed (trained, stale or invalid) stays pending until the checkpoint
that holds its effect is committed; the trainer acks it then (ARCHITECTURE.md, "Exactly-once effect").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.consumers.ledger import Ledger, LedgerLine
from pipeline.consumers.staleness import (
    GroupVersions,
    StalenessConfig,
    StalenessCounts,
    decide_group,
)
from pipeline.queue.base import QueueEntry
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample, SampleStatus

log = logging.getLogger(__name__)

#: Outcomes a sample can carry and still be trained on.
TRAINABLE = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


@dataclass
class Batch:
    """One step's worth of prompt groups, and everything the drain decided on the way."""

    groups: list[list[Sample]] = field(default_factory=list)
    group_entries: list[str] = field(default_factory=list)
    lines: list[LedgerLine] = field(default_factory=list)  # stale and invalid fates, decided at drain time
    consumed: list[str] = field(default_factory=list)  # every entry id taken this step, to ack at the commit
    counts: StalenessCounts = field(default_factory=StalenessCounts)
    lags: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Recovery:
    """What a restarted trainer found pending."""

    already_committed: int  # entries whose every sample is in the committed ledger: acked, not trained again
    to_redo: int  # entries re-read or claimed, to be trained (again)


class Drainer:
    """Reads the trainer group for one trainer process (one consumer name, stable across restarts)."""

    def __init__(
        self,
        queue: SampleQueue,
        ledger: Ledger,
        staleness: StalenessConfig,
        *,
        group: str = "trainer",
        consumer: str = "trainer-0",
        block_ms: int = 1000,
        claim_idle_ms: int = 60_000,
    ) -> None:
        self.queue, self.ledger, self.staleness = queue, ledger, staleness
        self.group, self.consumer = group, consumer
        self.block_ms, self.claim_idle_ms = block_ms, claim_idle_ms
        self._backlog: list[QueueEntry] = []

    def recover(self) -> Recovery:
        """Re-read this consumer's pending entries and claim dead trainers', acking those already committed."""
        self.queue.create_group(self.group, "0")
        pending = self.queue.read_pending(self.group, self.consumer)
        pending += self.queue.claim_stale(self.group, self.consumer, self.claim_idle_ms)
        done = [e.id for e in pending if all(self.ledger.is_committed(s.sample_id) for s in e.samples)]
        self.queue.ack(self.group, done)
        done_set = set(done)
        self._backlog = [e for e in pending if e.id not in done_set]
        if pending:
            log.info("trainer recovery: %d pending entries already committed (acked), %d to train again",
                     len(done), len(self._backlog))
        return Recovery(already_committed=len(done), to_redo=len(self._backlog))

    def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge entries whose effect a commit now holds."""
        self.queue.ack(self.group, entry_ids)

    def next_batch(self, batch_groups: int, step: int, version: Callable[[], int],
                   should_stop: Callable[[], bool] = lambda: False) -> Batch:
        """Read until ``batch_groups`` trainable groups are collected (or ``should_stop``)."""
        batch = Batch()
        while len(batch.groups) < batch_groups and not should_stop():
            want = batch_groups - len(batch.groups)
            if self._backlog:
                entries, self._backlog = self._backlog[:want], self._backlog[want:]
            else:
                entries = self.queue.read(self.group, self.consumer, count=want, block_ms=self.block_ms)
            current = version()
            for entry in entries:
                self._decide(entry, batch, step, current)
        return batch

    def _decide(self, entry: QueueEntry, batch: Batch, step: int, current: int) -> None:
        batch.consumed.append(entry.id)
        valid: list[Sample] = []
        invalid: list[Sample] = []
        for s in entry.samples:
            (valid if s.status in TRAINABLE and s.num_response_tokens > 0 else invalid).append(s)
        batch.lines += [LedgerLine(s.sample_id, entry.id, "invalid", step, current) for s in invalid]
        if not valid:
            return
        decision = decide_group(GroupVersions.from_samples(valid), current, self.staleness)
        batch.counts.record(decision)
        batch.lags.append(decision.lag)
        if decision.action == "train":
            batch.groups.append(valid)
            batch.group_entries.append(entry.id)
            return
        batch.lines += [LedgerLine(s.sample_id, entry.id, "stale", step, current) for s in valid]
        if decision.action == "requeue":
            # Producers take requeued prompts before new ones (PromptCursor); the prompt id names it.
            self.queue.redis.rpush(self.queue.keys.extra("prompt_requeue"), valid[0].prompt_id)
