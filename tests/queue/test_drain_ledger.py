"""The trainer's queue side without a model: drain under the staleness policy, the ledger, and recovery."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.trainer.drain import Drainer
from pipeline.consumers.trainer.ledger import Ledger, LedgerLine, read_ledger
from pipeline.producers.cursor import PromptCursor
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import SampleStatus
from tests.helpers import one_slot, redis_cluster
from tests.helpers.samples import make_group

# Every test here runs on a single server and on a 3-primary Redis Cluster, under the one-slot check
# (tests/helpers/one_slot.py): the drainer's release and requeue scripts and its ack's MULTI.
pytestmark = one_slot.ON_BOTH
redis_kind, redis_url, redis_client = one_slot.redis_kind, one_slot.redis_url, one_slot.redis_client
redis_cluster = redis_cluster.redis_cluster


def test_drain_applies_staleness_and_marks_invalid_samples(queue: SampleQueue, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    fresh = make_group(rng, 3, version=5)
    old = make_group(rng, 3, version=1)
    mixed = make_group(rng, 3, version=4)
    mixed[1].status = SampleStatus.FAILED
    ids = queue.put_many([fresh, old, mixed])
    ledger = Ledger(tmp_path / "ledger")
    d = Drainer(queue, ledger, StalenessConfig(max_lag=1, action="drop"), block_ms=10)
    d.recover()
    batch = d.next_batch(2, step=0, version=lambda: 5)
    assert batch.group_entries == [ids[0], ids[2]] and batch.consumed == ids
    assert [len(g) for g in batch.groups] == [3, 2]  # the failed sample left its group
    fates = {(line.sample_id, line.fate) for line in batch.lines}
    assert fates == {(s.sample_id, "stale") for s in old} | {(mixed[1].sample_id, "invalid")}
    assert batch.lags == [0, 4, 1]
    assert queue.pending_ids("trainer") == ids  # nothing acked by draining


def test_requeue_hands_the_prompt_back_with_its_count_and_releases_the_slot(queue: SampleQueue,
                                                                            tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    group = make_group(rng, 2, version=0)
    # What a producer leaves for a queued group: its slot counted, and a record of its prompt index (requeued once).
    queue.redis.set(queue.keys.groups_started, 1)
    queue.redis.hset(queue.keys.group_slots, group[0].group_id, "7:1")
    queue.put(group)
    d = Drainer(queue, Ledger(tmp_path / "l"), StalenessConfig(max_lag=0, action="requeue", max_requeues=3),
                block_ms=10)
    d.recover()
    batch = d.next_batch(1, step=0, version=lambda: 3, should_stop=lambda: bool(queue.redis.llen(
        queue.keys.prompt_retry)))
    assert batch.groups == [] and all(line.fate == "stale" for line in batch.lines)
    assert PromptCursor(queue.redis, queue.run).retries() == [(7, 2)]
    assert int(queue.redis.get(queue.keys.groups_started)) == 0 and not queue.redis.hlen(queue.keys.group_slots)
    assert (batch.counts.groups_requeue, batch.slots.released, batch.slots.requeued) == (1, 1, 1)


def test_ledger_commit_and_recovery_ack_only_committed_entries(queue: SampleQueue, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    groups = [make_group(rng, 2, version=0) for _ in range(6)]
    ids = queue.put_many(groups)
    ledger = Ledger(tmp_path / "ledger")
    d = Drainer(queue, ledger, StalenessConfig(max_lag=2), block_ms=10)
    d.recover()
    # Step 1 trains groups 0-1 and commits; step 2 trains 2-3, writes its segment, and dies before its checkpoint.
    b1 = d.next_batch(2, step=1, version=lambda: 0)
    ledger.record(LedgerLine(s.sample_id, e, "trained", 1, 0) for e, g in zip(b1.group_entries, b1.groups) for s in g)
    ledger.write_segment(1)
    ledger.mark_committed(1)
    queue.ack("trainer", b1.consumed)
    b2 = d.next_batch(2, step=2, version=lambda: 1)
    ledger.record(LedgerLine(s.sample_id, e, "trained", 2, 1) for e, g in zip(b2.group_entries, b2.groups) for s in g)
    ledger.write_segment(2)  # the checkpoint of step 2 never landed

    restarted = Ledger(tmp_path / "ledger")
    assert restarted.load(committed_step=1) == 4
    assert not (tmp_path / "ledger" / "seg-000000002.parquet").exists()
    d2 = Drainer(queue, restarted, StalenessConfig(max_lag=2), block_ms=10)
    rec = d2.recover()
    assert (rec.already_committed, rec.to_redo) == (0, 2)  # groups 2-3 come back to be trained again
    again = d2.next_batch(4, step=2, version=lambda: 1)
    assert again.group_entries == ids[2:6]
    assert [line.sample_id for line in read_ledger(tmp_path / "ledger")] == [s.sample_id for g in groups[:2] for s in g]


def test_recovery_acks_entries_committed_but_not_acked(queue: SampleQueue, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    ids = queue.put_many([make_group(rng, 2) for _ in range(3)])
    ledger = Ledger(tmp_path / "ledger")
    d = Drainer(queue, ledger, StalenessConfig(max_lag=2), block_ms=10)
    d.recover()
    b = d.next_batch(3, step=1, version=lambda: 0)
    ledger.record(LedgerLine(s.sample_id, e, "trained", 1, 0) for e, g in zip(b.group_entries, b.groups) for s in g)
    ledger.write_segment(1)
    ledger.mark_committed(1)  # the checkpoint landed; the process died before XACK
    fresh = Ledger(tmp_path / "ledger")
    fresh.load(1)
    rec = Drainer(queue, fresh, StalenessConfig(max_lag=2), consumer="trainer-0").recover()
    assert (rec.already_committed, rec.to_redo) == (3, 0)
    assert queue.pending_ids("trainer") == [] and ids


def test_a_dead_trainers_entries_are_claimed(queue: SampleQueue, tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    ids = queue.put_many([make_group(rng, 1) for _ in range(2)])
    queue.create_group("trainer", "0")
    queue.read("trainer", "old-trainer", count=2)
    d = Drainer(queue, Ledger(tmp_path / "l"), StalenessConfig(max_lag=2), consumer="trainer-0", claim_idle_ms=0)
    assert d.recover().to_redo == 2
    assert d.next_batch(2, step=0, version=lambda: 0).group_entries == ids
