"""The embedded Redis under ``sluice run``: SIGKILLed mid-run it is restarted on its AOF at its port, every process's
client rides through the gap, and the run finishes with nothing lost or trained twice; the run's processes never
start a server of their own; a trainer that Redis delivers an entry to again does not train it twice; the 'safe'
durability profile (docs/faults.md, "Durability")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from pipeline.config import load_config
from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.trainer.audit import audit_trainer
from pipeline.consumers.trainer.drain import Batch, Drainer
from pipeline.consumers.trainer.ledger import Ledger, LedgerLine
from pipeline.errors import ConfigError, QueueError
from pipeline.queue.connection import check_fsync_always, connect
from pipeline.queue.redis_server import EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.rundir import open_run
from tests.helpers.runprocs import alive, run_processes
from tests.helpers.samples import make_group

ROOT = Path(__file__).parents[2]


def _redis_pids(folder: Path) -> list[int]:
    """redis-server processes serving ``folder`` (their --dir)."""
    want = str(folder.resolve())
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if "redis" in (p.info["name"] or "") and want in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


def test_a_killed_embedded_redis_comes_back_on_its_aof_and_clients_ride_through(tmp_path: Path) -> None:
    """With appendfsync always (queue.durability = 'safe'); under everysec a SIGKILL lost 143 acknowledged INCRs
    once on this loaded machine (a stuck background fsync postpones Redis's AOF writes, docs/faults.md)."""
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    try:
        port, url = server.port, server.url
        client = connect(url)
        acked: list[int] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def count() -> None:  # a client that never stops writing, as a producer does
            try:
                while not stop.is_set():
                    acked.append(int(client.incr("sluice:{t}:n")))
            except BaseException as e:  # handed to the test
                errors.append(e)

        writer = threading.Thread(target=count)
        writer.start()
        while len(acked) < 200:
            time.sleep(0.01)
        os.kill(server.pid or 0, signal.SIGKILL)  # the server this test started
        time.sleep(3.0)  # longer than a few quick retries would wait: the launcher may be busy for that long
        assert not server.alive() and errors == []  # the writer waits in its retry
        server.restart()
        while len(acked) < 400 and not errors:
            time.sleep(0.01)
        stop.set()
        writer.join()
        assert errors == [] and server.port == port
        # Every acknowledged increment survived the kill: the counter never went back, so no value was handed out
        # twice. An increment Redis applied but could not answer before it died is applied again by the client's
        # retry (at least once, not exactly once): at most one value is skipped there.
        assert acked == sorted(set(acked)) and int(client.get("sluice:{t}:n")) == acked[-1]
        assert acked[-1] - len(acked) <= 1
        client.close()
    finally:
        server.stop()
    assert _redis_pids(tmp_path / "redis") == []


def test_a_run_process_attaches_to_the_launchers_redis_and_never_starts_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = open_run(run_dir=run_dir, create=True)
    try:
        assert launcher.server is not None
        os.kill(launcher.server.pid or 0, signal.SIGKILL)  # the server this test's "launcher" started
        time.sleep(0.3)
        opened: list = []
        # A process of the run opens it while the server is down: it waits in its client's retry...
        opening = threading.Thread(target=lambda: opened.append(open_run(run_dir=run_dir, start_server=False)))
        opening.start()
        time.sleep(1.0)
        assert _redis_pids(run_dir / "redis") == []  # ...and starts no server of its own
        launcher.server.restart()
        opening.join(30)
        child = opened[0]
        assert child.url == launcher.url and child.queue.policy_version() == 0
        child.close(stop_server=True)  # not its server: nothing is stopped
        assert launcher.server.alive()
    finally:
        launcher.close(stop_server=True)
    assert _redis_pids(run_dir / "redis") == []
    with pytest.raises(QueueError, match="not running"):
        open_run(run_dir=run_dir, start_server=False)


def _commit(ledger: Ledger, step: int, *batches: Batch) -> None:
    """What the trainer's commit writes to the ledger: the drain's fates and a 'trained' line per trained sample."""
    for b in batches:
        ledger.record([*b.lines, *(LedgerLine(s.sample_id, e, "trained", step, 0)
                                   for e, g in zip(b.group_entries, b.groups) for s in g)])
    ledger.write_segment(step)
    ledger.mark_committed(step)


def test_an_entry_delivered_again_is_not_trained_twice(queue: SampleQueue, tmp_path: Path) -> None:
    """What a Redis that lost its last writes does to a live trainer, made by moving the group's last-delivered id
    back (``XGROUP SETID``): the entries come again through the ordinary read."""
    rng = np.random.default_rng(6)
    ids = queue.put_many([make_group(rng, 2, version=0) for _ in range(4)])
    ledger = Ledger(tmp_path / "ledger")
    drainer = Drainer(queue, ledger, StalenessConfig(max_lag=10), block_ms=20)
    drainer.recover()
    first = drainer.next_batch(2, step=1, version=lambda: 0)
    assert first.group_entries == ids[:2]
    _commit(ledger, 1, first)  # the commit of step 1: ledger, then acks
    drainer.ack(first.consumed)
    second = drainer.next_batch(1, step=2, version=lambda: 0)
    assert second.group_entries == ids[2:3]
    queue.redis.xgroup_setid(queue.keys.samples, "trainer", "0")  # every delivery forgotten
    third = drainer.next_batch(1, step=3, version=lambda: 0)
    assert third.group_entries == ids[3:]  # not ids[0:3] again: committed ones acked, the held one skipped
    assert set(queue.pending_ids("trainer")) == {ids[2], ids[3]}

    _commit(ledger, 3, second, third)
    drainer.ack([ids[2], ids[3]])
    assert queue.pending_ids("trainer") == []
    # That XACK lost: the committed entry is pending again, though the trainer holds it no more.
    queue.redis.execute_command("XCLAIM", queue.keys.samples, "trainer", "trainer-0", 0, ids[2], "FORCE")
    assert queue.pending_ids("trainer") == [ids[2]]
    drainer.ack([])  # the next commit acks the leftover with its own entries
    assert queue.pending_ids("trainer") == []

    # A put applied twice (redis-py re-sent it: Redis died before answering), then a read whose answer was lost.
    group = make_group(rng, 2, version=0)
    original, copy, other = queue.put_many([group, group, make_group(rng, 2, version=0)])
    fourth = drainer.next_batch(1, step=4, version=lambda: 0)
    assert fourth.group_entries == [original]
    fifth = drainer.next_batch(1, step=5, version=lambda: 0)
    assert fifth.group_entries == [other] and copy not in fifth.consumed  # the copy's samples are held: skipped
    lost = queue.put(make_group(rng, 2, version=0))
    queue.redis.xreadgroup("trainer", "trainer-0", {queue.keys.samples: ">"}, count=1)  # its answer "lost"
    _commit(ledger, 5, fourth, fifth)
    drainer.ack([original, other])  # the copy is now committed: acked; the lost read goes to the backlog
    assert queue.pending_ids("trainer") == [lost]
    sixth = drainer.next_batch(1, step=6, version=lambda: 0)
    assert sixth.group_entries == [lost]
    _commit(ledger, 6, sixth)
    drainer.ack([lost])
    assert queue.pending_ids("trainer") == []


def test_the_safe_profile_fsyncs_every_write_and_checks_an_external_server(tmp_path: Path) -> None:
    assert load_config(None, ["queue.durability=safe"]).queue.appendfsync == "always"
    assert load_config(None, []).queue.appendfsync == "everysec"
    with pytest.raises(ConfigError, match="drop one of the two"):
        load_config(None, ["queue.durability=safe", "queue.appendfsync=everysec"])
    lax = EmbeddedRedis(tmp_path / "lax", appendfsync="everysec").start()
    strict = EmbeddedRedis(tmp_path / "strict", appendfsync="always").start()
    try:
        with pytest.raises(QueueError, match="appendfsync 'everysec'"):
            check_fsync_always(lax.client(), lax.url)
        assert check_fsync_always(strict.client(), strict.url)
        admin = strict.client()
        admin.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "~sluice:*", "+ping")
        limited = connect(f"redis://limited:pw@127.0.0.1:{strict.port}/0")
        assert check_fsync_always(limited, strict.url) is False  # cannot be checked: the caller warns
    finally:
        lax.stop()
        strict.stop()


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "trainer.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_sluice_run_survives_a_sigkill_of_its_embedded_redis(tmp_path: Path) -> None:
    steps = 12
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "recipes/cpu-moe.toml", "--run-dir", str(run_dir),
           "--steps", str(steps), "--set", "trainer.checkpoint_every=4", "--set", "producer.concurrency=2",
           "--set", "warmstart.enabled=false", "--set", "eval.heldout.enabled=false", "--set", "eval.enabled=true",
           "--set", "trainer.batch_groups=4", "--set", "filters.zero_variance=false"]
    log = tmp_path / "launcher.log"
    out = open(log, "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    started: dict = {}
    try:
        deadline = time.monotonic() + 300
        while len(_rows(run_dir)) < 5:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no training progress"
            started.update(run_processes(run_dir))
            time.sleep(0.1)
        state = json.loads((run_dir / "redis" / "redis.json").read_text())
        victim = psutil.Process(state["pid"])
        assert "redis" in victim.name()
        victim.send_signal(signal.SIGKILL)  # the run's own server, started by our launcher
        killed_at = len(_rows(run_dir))
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            started.update(run_processes(run_dir))
            time.sleep(0.2)
        assert proc.wait(timeout=5) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()
    text = log.read_text()
    print("\n".join(line for line in text.splitlines() if "Redis" in line or "restart" in line))
    assert "the embedded Redis (port" in text and "is back on port" in text, text[-3000:]
    assert not (run_dir / "redis" / "redis.json").exists()  # the launcher stopped the restarted server at its end
    assert _redis_pids(run_dir / "redis") == []
    handle = open_run(run_dir=run_dir)
    try:
        audit = audit_trainer(handle.queue, run_dir)
        print(f"killed Redis after step {killed_at}; audit:", audit)
        assert audit.committed_step == steps and audit.lost == 0 and audit.duplicates == 0 and audit.pending == 0
        pushes = [int(e["version"]) for e in handle.queue.events() if e["kind"] == "weight_push"]
        assert pushes == sorted(pushes)
    finally:
        handle.close(stop_server=True)
    assert [p.pid for p in started.values() if alive(p)] == []
