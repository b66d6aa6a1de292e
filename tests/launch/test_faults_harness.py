"""The fault-injection harness (``sluice bench faults``, docs/faults.md): its checker reports a lost sample, a
duplicate, a version that goes back and an archive that disagrees with the stream when fed such data (a checker that
never reports anything would pass every trial), and a fast trial of a few kinds ends with nothing lost or trained
twice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from pipeline.benchmarks.fault_check import (
    TAP_GROUP,
    RunRecord,
    StreamTap,
    archive_owner,
    archive_problems,
    check,
    collect,
    raw_client,
)
from pipeline.benchmarks.faults import FaultsBenchParams, run_faults_bench, table_lines
from pipeline.consumers.trainer.ledger import Ledger, LedgerLine
from pipeline.queue.archive import ArchiveWriter
from pipeline.queue.archive_parts import owner_of
from pipeline.queue.connection import connect
from pipeline.queue.keys import payload_prefix
from pipeline.queue.redis_streams import GONE_REASON, SampleQueue
from tests.helpers import redis_cluster as bed
from tests.helpers.redis_cluster import LocalCluster
from tests.helpers.samples import make_group

redis_cluster = bed.redis_cluster


def _checkpoint(run_dir: Path, step: int, version: int) -> None:
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "sluice_meta.json").write_text(json.dumps({"step": step, "policy_version": version}))


def test_the_checker_reports_loss_duplicates_versions_and_archive_holes(
        queue: SampleQueue, redis_url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    client = redis.Redis.from_url(redis_url, protocol=2)
    prefix = queue.keys.prefix
    tap = StreamTap(lambda: redis_url, queue.keys.samples)
    tap.attach(client)
    assert tap.attached_empty
    groups = [make_group(rng, 2, version=0) for _ in range(5)]
    ids = queue.put_many(groups)
    queue.create_group("archive")
    queue.create_group("trainer")
    archived = queue.read("archive", "archiver", count=5)
    run_dir = tmp_path / "run"
    ArchiveWriter(run_dir / "archive").write_segment(archived)
    queue.ack("archive", [e.id for e in archived])
    # The trainer read four entries: trained two (step 1 and 2), judged one stale, holds the fourth uncommitted;
    # the fifth is not delivered yet.
    read = queue.read("trainer", "trainer-0", count=4)
    ledger = Ledger(run_dir / "ledger")
    fates = [("trained", 1, 1), ("trained", 2, 2), ("stale", 2, 2)]
    for entry, (fate, step, version) in zip(read, fates):
        ledger.record(LedgerLine(s.sample_id, entry.id, fate, step, version) for s in entry.samples)
    ledger.write_segment(2)
    queue.ack("trainer", [e.id for e in read[:3]])
    for v in (1, 2):
        queue.log_event("weight_push", version=v, step=v)
    queue.log_event("checkpoint", step=2, version=2)
    client.set(queue.keys.policy_version, 2)
    _checkpoint(run_dir, 2, 2)
    tap.drain(client)
    queue.create_group("eval")
    queue.read("eval", "e", count=5)
    queue.ack("eval", ids)
    assert queue.trim() == 3  # what every group (the tap's too) acked leaves the stream; the tap recorded it

    clean = check(collect(client, prefix, run_dir, tap, archive_on=True))
    assert clean.samples == 10 and clean.trained == 4 and clean.stale == 2, clean
    assert clean.lost == 0 and clean.duplicated == 0 and clean.committed_step == 2
    assert not (clean.version_problems or clean.archive_problems or clean.phantom), clean
    # Mid-run, the trainer holds its uncommitted entry: a finished run must not, so the check names it.
    assert clean.leftover_problems == ["entries delivered and never acked: {'trainer': 1}"] and not clean.ok

    # A trainer that acks its uncommitted entry: its two samples are in no fate and no longer pending.
    queue.ack("trainer", [read[3].id])
    lost = check(collect(client, prefix, run_dir, tap, archive_on=True))
    assert lost.lost == 2 and set(lost.lost_ids) == {s.sample_id for s in read[3].samples} and not lost.ok
    # Dead-lettered because it was gone from the stream, it is still lost: that is how a loss looks to the reader
    # that meets it. Dead-lettered by the trainer for what it held, it is answered (and only the trainer's group's
    # dead-letters answer for the trainer, only the archiver's for the archive, below).
    queue._dead_letter("trainer", "trainer-0", [(read[3].id, GONE_REASON, None)])
    assert check(collect(client, prefix, run_dir, tap, archive_on=True)).lost == 2
    queue._dead_letter("eval", "e", [(read[3].id, "routing of the wrong shape", None)])
    assert check(collect(client, prefix, run_dir, tap, archive_on=True)).lost == 2
    queue._dead_letter("trainer", "trainer-0", [(read[3].id, "routing of the wrong shape", None)])
    assert check(collect(client, prefix, run_dir, tap, archive_on=True)).lost == 0

    # A sample trained twice: a second committed segment holds a line for a sample of step 1.
    again = read[0].samples[0].sample_id
    row = {"sample_id": again, "entry_id": read[0].id, "fate": "trained", "step": 1, "policy_version": 1}
    pq.write_table(pa.Table.from_pylist([row]), run_dir / "ledger" / "seg-000000001.parquet")
    dup = check(collect(client, prefix, run_dir, tap, archive_on=True))
    assert dup.duplicated == 1 and dup.duplicated_ids == [again]

    # A push version that repeats, and Redis's counter behind the newest checkpoint.
    queue.log_event("weight_push", version=2, step=3)
    client.set(queue.keys.policy_version, 1)
    versions = check(collect(client, prefix, run_dir, tap, archive_on=True)).version_problems
    assert any("not strictly increasing" in p for p in versions)
    assert any("newest checkpoint (step 2) holds version 2 > Redis's 1" in p for p in versions)

    # An archive that lost a segment: every entry the archiver acked is missing from it.
    for path in (run_dir / "archive").glob("seg-*.parquet"):
        path.unlink()
    holes = check(collect(client, prefix, run_dir, tap, archive_on=True)).archive_problems
    assert holes == ["5 stream entries missing from the archive, e.g. " + str(sorted(ids)[:3])]
    client.close()


def test_on_a_cluster_the_checker_finds_what_a_run_left_on_every_primary(
        redis_cluster: LocalCluster, tmp_path: Path) -> None:
    """After a run, every payload key must belong to an entry still in the stream, the trash must be empty and no
    group may hold an entry unacked. On a cluster the payloads are spread over every primary, so a check that looked
    at one node would miss two thirds of them: a stray key planted on each primary is found on each."""
    rng = np.random.default_rng(5)
    run = "faults-check"
    queue = SampleQueue(connect(redis_cluster.url), run, capacity=1000)
    client = raw_client(redis_cluster.url)
    prefix = queue.keys.prefix
    tap = StreamTap(lambda: redis_cluster.url, queue.keys.samples)
    tap.attach(client)
    queue.put_many([make_group(rng, 2, version=0) for _ in range(12)])
    queue.create_group("trainer")
    tap.drain(client)
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def leftovers() -> list[str]:
        return check(collect(client, prefix, run_dir, tap, archive_on=False)).leftover_problems

    record = collect(client, prefix, run_dir, tap, archive_on=False)
    assert len(record.payload_keys) == 3 and all(record.payload_keys.values()), record.payload_keys
    assert leftovers() == []  # every payload belongs to an entry still in the stream (not yet trained)

    # A stray payload key under a shard tag of each primary: three keys nothing names, one on each primary.
    tags = queue.shard_tags()
    by_primary = {redis_cluster.primary_for("{" + tag + "}").name: tag for tag in tags}
    assert len(by_primary) == 3
    for tag in by_primary.values():
        client.set(payload_prefix(tag) + "999999", b"stray")
    v = check(collect(client, prefix, run_dir, tap, archive_on=False))
    assert v.payload_keys_left == 3 and not v.ok, v
    assert all(node in v.leftover_problems[0] for node in by_primary), v.leftover_problems
    for tag in by_primary.values():
        client.delete(payload_prefix(tag) + "999999")

    # An entry read and never acked, a key left in the trash, and an entry whose payload is gone.
    read = queue.read_headers("trainer", "trainer-0", count=1)
    client.sadd(queue.keys.payload_trash, "sluice:{faults-check/0}:payload:1")
    client.delete(read[0].payload_key)
    assert leftovers() == ["1 payload keys left in the trash set", "entries delivered and never acked: {'trainer': 1}",
                           f"1 stream entries whose payload is gone, e.g. {[read[0].id]}"]
    for key in client.scan_iter(match=f"sluice:{{{run}*"):  # every key of this run, on every primary
        client.delete(key)
    client.close()
    queue.redis.close()


def test_with_several_archivers_an_entry_waits_only_for_the_archiver_that_owns_it() -> None:
    """With queue.archive.processes = M the archive's groups are archive-i-of-M, and archiver i archives the prompt
    groups whose crc32 mod M is i. An entry missing from the archive is still to come only while its owner has not
    acked it: the other archivers ack it at once, without archiving it."""
    gids = [f"g{i}" for i in range(8)]
    owner = {g: f"archive-{owner_of(g, 2)}-of-2" for g in gids}
    assert {archive_owner(g, ["archive-0-of-2", "archive-1-of-2"]) for g in gids} == set(owner.values())
    assert all(archive_owner(g, ["archive-0-of-2", "archive-1-of-2"]) == owner[g] for g in gids)
    assert archive_owner("g0", ["archive"]) == "archive"
    ids = [f"{i + 1}-0" for i in range(len(gids))]

    def record(pending: dict[str, set[str]]) -> RunRecord:
        return RunRecord(
            tapped={e: [f"s{e}"] for e in ids}, stream_ids=set(ids), trainer_pending=set(), trainer_last=ids[-1],
            deadletter_ids=set(), ledger=[], counter=0, pushes=[], event_checkpoints=[], newest_checkpoint=None,
            archive_rows=[(e, f"s{e}") for e in ids[1:]],  # the first entry is not archived
            archive_pending=pending, archive_last={"archive-0-of-2": ids[-1], "archive-1-of-2": ids[-1]},
            group_ids=dict(zip(ids, gids)))

    mine, other = owner[gids[0]], next(g for g in ("archive-0-of-2", "archive-1-of-2") if g != owner[gids[0]])
    assert archive_problems(record({mine: {ids[0]}, other: set()})) == []  # pending for its owner: still to come
    assert archive_problems(record({mine: set(), other: {ids[0]}})) == [
        f"1 stream entries missing from the archive, e.g. {[ids[0]]}"]  # its owner acked it: lost to the archive


def test_the_tap_records_a_delivery_whose_answer_was_lost(queue: SampleQueue, redis_url: str) -> None:
    """An XREADGROUP that Redis applied but whose answer never arrived leaves the entries pending for the tap; its
    next pass reads its own pending entries first, so it records them all the same."""
    rng = np.random.default_rng(3)
    client = redis.Redis.from_url(redis_url, protocol=2)
    tap = StreamTap(lambda: redis_url, queue.keys.samples)
    tap.attach(client)
    ids = queue.put_many([make_group(rng, 2) for _ in range(3)])
    client.xreadgroup(TAP_GROUP, "harness", {queue.keys.samples: ">"}, count=2)  # the answer "lost"
    assert tap.drain(client) == 3
    assert sorted(tap.entries) == sorted(ids) and all(len(v or []) == 2 for v in tap.entries.values())
    assert queue.pending_ids(TAP_GROUP) == []
    client.close()


@pytest.mark.slow
def test_a_fast_trial_of_three_kinds_loses_nothing(tmp_path: Path) -> None:
    params = FaultsBenchParams(kinds="producer,trainer-checkpoint,redis", trials=1, seed=5, steps=8,
                               checkpoint_every=2, baseline=False, out=str(tmp_path), timeout_s=300)
    res = run_faults_bench(params)
    print("\n".join(table_lines(res)))
    for kind, trials in res["trials"].items():
        t = trials[0]
        assert t["injection"]["at"] is not None, (kind, t["injection"])
        assert t["finished"] and t["lost"] == 0 and t["duplicated"] == 0, (kind, t)
        assert t["version_problems"] == [] and t["archive_problems"] == [] and t["tap_attached_empty"], (kind, t)
        assert t["samples"] > t["trained"] // 2 > 0, (kind, t)


@pytest.mark.slow
def test_a_reader_killed_mid_fetch_on_a_cluster_loses_nothing(tmp_path: Path) -> None:
    """One trial of the reader kind: two data-parallel replicas on a three-primary Redis Cluster, rank 1 killed while
    its fetch waits on a held primary. The kill must land, the launcher restart both ranks, and the checks pass:
    nothing lost or trained twice, versions never back, the archive exact, no payload key or unacked entry left."""
    params = FaultsBenchParams(kinds="reader", trials=1, seed=2, steps=8, checkpoint_every=2, baseline=False,
                               out=str(tmp_path), timeout_s=300, redis="cluster")
    res = run_faults_bench(params)
    print("\n".join(table_lines(res)))
    t = res["trials"]["reader"][0]
    assert t["injection"]["landed"], t["injection"]
    assert t["finished"] and t["recovered"] and t["lost"] == 0 and t["duplicated"] == 0, t
    assert t["version_problems"] == [] and t["archive_problems"] == [] and t["leftover_problems"] == [], t
    assert t["payload_keys_left"] == 0 and t["unacked_left"] == 0 and t["audit"]["duplicates"] == 0, t
    assert t["restart_s"] is not None and t["recover_s"] is not None, t  # both ranks came back and trained again
    assert t["samples"] > t["trained"] // 2 > 0, t


def test_a_restore_spends_the_pacing_slots_its_pushes_added_once(queue: SampleQueue, tmp_path: Path) -> None:
    """What the harness found: a trainer that rolls back from version 5 to its checkpoint's 1 and resyncs as 6
    raised the counter by 5 with no trained batch to pay for it. The budget ``(version + max_lag + 1) * batch_groups``
    then let producers run 5 batches further ahead for the rest of the run, and the surplus was dropped as stale at
    step after step (32-848 stale samples per rolled-back trial, 0 without a fault). The drain spends those slots,
    once per restore, however often a trainer restarts."""
    from pipeline.config.staleness import StalenessConfig
    from pipeline.consumers.trainer.drain import Drainer, record_restore

    rng = np.random.default_rng(4)
    queue.put_many([make_group(rng, 2, version=6) for _ in range(2)])
    queue.redis.set(queue.keys.groups_started, 10)
    record_restore(queue, 6, 1)

    def drain(ledger: str) -> int:
        drainer = Drainer(queue, Ledger(tmp_path / ledger), StalenessConfig(max_lag=2), block_ms=20)
        drainer.recover()
        return drainer.next_batch(1, step=2, version=lambda: 6).slots.burned

    assert drain("a") == 5 * 1 and int(queue.redis.get(queue.keys.groups_started)) == 10 + 5
    assert drain("b") == 0 and int(queue.redis.get(queue.keys.groups_started)) == 15  # a restarted trainer
    record_restore(queue, 9, 6)  # a second rollback: its own surplus, once
    assert drain("c") == 3 and int(queue.redis.get(queue.keys.groups_started)) == 18


def _victim(run_dir: Path, role: str) -> subprocess.Popen[bytes]:
    """A process that looks like the run's ``role`` to the injector: its environment and command line."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "pipeline.launch.processes", role],
                            env={**os.environ, "SLUICE_RUN_DIR": str(run_dir.resolve())})


@pytest.mark.parametrize(("steps", "landed"), [(10, True), (6, False)])  # the step drawn is at most 6 either way
def test_a_kill_after_the_runs_last_step_does_not_count_as_landed(tmp_path: Path, steps: int, landed: bool) -> None:
    """A kill is drawn after some step; if the trainer has already written its last row, the run had nothing left to
    recover and the kill must not be counted as one that landed (it would make a recovery out of nothing)."""
    from pipeline.benchmarks.fault_kinds import INJECTORS, Target

    run_dir = tmp_path / "run"
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "metrics" / "trainer.jsonl").write_text("".join(json.dumps({"step": i + 1}) + "\n" for i in range(6)))
    victim, launcher = _victim(run_dir, "producer"), _victim(tmp_path / "elsewhere", "launcher")
    try:
        target = Target(run_dir=run_dir, steps=steps, checkpoint_every=4, rng=random.Random(0), launcher=launcher,
                        redis_url=lambda: None, prefix="sluice:{t}")
        inj = INJECTORS["producer"](target)
        assert victim.wait(10) == -signal.SIGKILL  # the kill itself happened either way
        assert inj.at is not None and inj.step == 6 and inj.landed is landed, inj
        assert ("after the last step" in inj.note) is not landed
    finally:
        for p in (victim, launcher):
            p.kill()
            p.wait()
