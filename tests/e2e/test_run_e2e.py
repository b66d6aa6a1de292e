"""``sluice run`` end to end on CPU: engine, producer, trainer, archiver and evaluator as real processes; a kill -9 of
the trainer and of the producer mid-run; the run still finishes with every sample accounted for exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.benchmarks.fault_kinds import rows as _steps  # skips a row being written
from pipeline.consumers.trainer.audit import audit_trainer
from pipeline.queue.archive import ArchiveReader
from pipeline.queue.redis_streams import RESUME_EVENT
from pipeline.queue.rundir import open_run
from tests.helpers.runprocs import alive, find_role, run_processes

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
STEPS = 12


def test_sluice_run_survives_kill_9_of_trainer_and_producer(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "recipes/cpu-moe.toml", "--run-dir", str(run_dir),
           "--steps", str(STEPS), "--set", "trainer.checkpoint_every=4", "--set", "producer.concurrency=2",
           "--set", "warmstart.enabled=false", "--set", "eval.heldout.enabled=false", "--set", "trainer.batch_groups=4",
           "--set", "filters.zero_variance=false", "--set", "eval.enabled=true",
           "--set", "queue.claim_idle_ms=1000"]
    out = open(tmp_path / "launcher.log", "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    # Every process the run ever started, by the run folder each inherits in its environment: under Ray none is the
    # launcher's descendant, and one orphaned by the kill (a trainer's multiprocessing server) is found the same way.
    started: dict[int, psutil.Process] = {}

    def watch() -> None:
        started.update(run_processes(run_dir))

    try:
        deadline = time.monotonic() + 300
        while len(_steps(run_dir)) < 5:
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no training progress"
            watch()
            time.sleep(0.1)
        watch()
        victims = [find_role(run_dir, "trainer"), find_role(run_dir, "producer")]
        assert all(victims)
        for v in victims:
            v.send_signal(signal.SIGKILL)  # a crash, not a shutdown; both were started by our launcher
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            watch()
            time.sleep(0.2)
        assert proc.wait(timeout=5) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()

    log = (tmp_path / "launcher.log").read_text()
    assert "reward (mean over the steps of each row)" in log  # the learning curve is printed at the end
    handle = open_run(run_dir=run_dir)
    try:
        audit = audit_trainer(handle.queue, run_dir)
        print("audit:", audit)
        assert audit.committed_step == STEPS and audit.duplicates == 0 and audit.lost == 0
        assert audit.trained + audit.stale + audit.invalid > 0 and audit.pending == 0
        kinds = [e["kind"] for e in handle.queue.events()]
        assert kinds.count("resume") >= 2  # the first start and the restart after the kill
        assert handle.queue.policy_version() >= STEPS
        pushes = [e for e in handle.queue.events() if e["kind"] == "weight_push"]
        assert pushes and all(e["engines"] == "1" for e in pushes)  # every push reached the engine
        # The archive and the evaluator consumed the same stream beside the trainer.
        archived = sum(1 for _ in ArchiveReader(run_dir / "archive").samples())
        assert archived > 0
        eval_lines = (run_dir / "eval" / "metrics.jsonl").read_text().splitlines()
        assert eval_lines and "reward" in eval_lines[-1]
    finally:
        handle.close(stop_server=True)
    # The trainer ranks start while the engines load: rank 0 was running, its store bound, before engines.json
    # existed, and it waited for that file.
    placed = [json.loads(line) for line in (run_dir / "logs" / "placements.jsonl").read_text().splitlines()]
    names = [p["name"] for p in placed]
    assert names.index("trainer-0") < names.index("engine-0") < names.index("producer-0"), names
    assert placed[names.index("trainer-0")]["at"] < (run_dir / "engines.json").stat().st_mtime
    assert "the engines are up (engines.json)" in (run_dir / "logs" / "trainer-0.log").read_text()
    # Nothing of the run is left behind.
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert len(started) > 5

    left = [p.pid for p in started.values() if alive(p)]
    assert not left, f"processes of the run still alive: {left}"


def test_sluice_run_with_two_expert_parallel_trainer_ranks_survives_kill_9_of_rank_1(tmp_path: Path) -> None:
    """Each rank pushes the experts it holds (and half the rest) over a weight group of its own, and the engine's
    label moves once both landed. Rank 1 is killed after the first checkpoint: rank 0's next collective fails, the
    launcher restarts both ranks as one group, they resume from the checkpoint, and the run finishes with every
    sample trained once."""
    run_dir = tmp_path / "ep2"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "recipes/cpu-moe.toml", "--run-dir", str(run_dir),
           "--steps", "6", "--set", "trainer.world_size=2", "--set", "trainer.ep=2",
           "--set", "warmstart.enabled=false", "--set", "eval.heldout.enabled=false", "--set", "trainer.batch_groups=4",
           "--set", "filters.zero_variance=false",
           "--set", "trainer.checkpoint_every=3"]
    log = tmp_path / "launcher.log"
    out = open(log, "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    checkpoints = run_dir / "checkpoints"
    try:
        deadline = time.monotonic() + 400
        while not (checkpoints / "step-00000003").exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no training progress:\n" + log.read_text()[-3000:]
            time.sleep(0.02)
        rank0, victim = find_role(run_dir, "trainer", rank=0), find_role(run_dir, "trainer", rank=1)
        assert rank0 is not None and victim is not None
        # Rank 0 held still, so the kill lands between the two saves: steps go by in a fraction of a second here.
        rank0.send_signal(signal.SIGSTOP)
        try:
            assert not [p.name for p in checkpoints.iterdir() if p.name.startswith("step-00000006")]
            victim.send_signal(signal.SIGKILL)
        finally:
            rank0.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()
    assert "restarting the trainer group" in log.read_text()
    placements = [json.loads(x)["name"] for x in (run_dir / "logs" / "placements.jsonl").read_text().splitlines()]
    assert placements.count("trainer-0") >= 2 and placements.count("trainer-1") >= 2, placements  # both restarted
    handle = open_run(run_dir=run_dir)
    try:
        audit = audit_trainer(handle.queue, run_dir)
        assert audit.committed_step == 6 and audit.duplicates == 0 and audit.lost == 0 and audit.trained > 0
        # Every push, before and after the restart, was confirmed by the engine.
        pushes = [e for e in handle.queue.events() if e["kind"] == "weight_push"]
        assert len(pushes) >= 6 and all(e["engines"] == "1" for e in pushes)
        resumes = [e for e in handle.queue.events() if e["kind"] == RESUME_EVENT]
        assert [e["step"] for e in resumes][-1] == "3", resumes
    finally:
        handle.close(stop_server=True)
    assert sorted(p.name for p in (run_dir / "logs").glob("trainer-*.log")) == ["trainer-0.log", "trainer-1.log"]
    rows = [json.loads(x) for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    shares = [r["sync/rank0_share"] for r in rows if "sync/rank0_share" in r]
    assert shares and all(r.get("sync/sources") == 2.0 for r in rows if "sync/sources" in r), rows[-1]
    assert all(0.4 < share < 0.6 for share in shares), shares  # rank 0 sent about half, not the whole model


def test_sluice_run_with_many_stale_drops_and_a_killed_producer_completes(tmp_path: Path) -> None:
    """One prompt in three is slow to score, so its group arrives several pushes late and is dropped; a producer is
    SIGKILLed with groups in flight. Each such group would keep its pacing slot for good with slots given back only on
    engine failures: past max_lag * batch_groups = 4 of them, producers could start nothing and the trainer would
    wait forever. The run must finish every step, account for every sample, and the restarted producer must hand
    back what its killed predecessor had in flight."""
    steps = 16
    run_dir = tmp_path / "stale"
    fixtures = ROOT / "tests" / "fixtures"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "recipes/cpu-moe.toml", "--run-dir", str(run_dir),
           "--steps", str(steps), "--set", "trainer.checkpoint_every=4", "--set", "staleness.action=drop",
           "--set", "staleness.max_lag=1", "--set", "trainer.batch_groups=4", "--set", "producers=2",
           "--set", "producer.concurrency=4", "--set", "producer.reward=pacing_rewards:one_in_three_slow",
           "--set", f"plugins.paths=[{str(fixtures)!r}]",
           "--set", "prompts.task=addition", "--set", "prompts.digits=2", "--set", "prompts.size=1000",
           "--set", "eval.enabled=false", "--set", "queue.archive.enabled=false",
           "--set", "warmstart.enabled=false", "--set", "eval.heldout.enabled=false", "--set", "filters.zero_variance=false",
           # A lease far longer than the run: the restarted producer-0 itself must hand its leftovers back (a peer
           # taking them after lease expiry is tested in test_pacing.py).
           "--set", "producer.lease_ttl_s=600"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = open(tmp_path / "launcher.log", "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while len(_steps(run_dir)) < 4:
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no training progress"
            time.sleep(0.1)
        handle = open_run(run_dir=run_dir)
        try:
            inflight = handle.queue.keys.producer_inflight("producer-0")
            while not handle.queue.redis.hlen(inflight):
                assert time.monotonic() < deadline, "producer-0 never had a group in flight"
                time.sleep(0.02)
            victim = find_role(run_dir, "producer", "producer-0")
            assert victim is not None
            victim.send_signal(signal.SIGKILL)  # started by our launcher
        finally:
            handle.close()
        # With leaked slots this never returns: the trainer waits for groups no producer may start.
        assert proc.wait(timeout=600) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()

    rows = _steps(run_dir)
    dropped = sum(r["staleness/groups_drop"] for r in rows)
    released = sum(r["pacing/slots_released"] for r in rows)
    print(f"stale groups dropped {dropped:.0f}, slots released {released:.0f} over {len(rows)} steps")
    assert dropped > 4 and released >= dropped  # more drops than the budget could ever absorb without release
    producer_log = (run_dir / "logs" / "producer-0.log").read_text()
    assert "a previous run of this producer left in flight" in producer_log
    handle = open_run(run_dir=run_dir)
    try:
        audit = audit_trainer(handle.queue, run_dir)
        print("audit:", audit)
        assert audit.committed_step == steps and audit.duplicates == 0 and audit.lost == 0 and audit.pending == 0
        assert audit.stale > 0 and audit.trained > 0
    finally:
        handle.close(stop_server=True)
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
