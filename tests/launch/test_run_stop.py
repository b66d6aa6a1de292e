"""The launcher's stop and its run lock (docs/launcher.md).

The slow tests share one run folder and one chain of real ``sluice run`` launches with two trainer ranks, since each
launch costs tens of seconds here: a second launcher is refused while the first lives, then the first is stopped by
SIGINT (a Ctrl-C), and a rerun of the same command resumes and is stopped by SIGTERM (SIGHUP takes the same path
through the launcher's handler, tested in-process below, so it costs no third launch). Each stop must
end every child by its own orderly exit (none outlives the stop's timeout into a SIGKILL, which is what made the
old one-at-a-time stop take 67 s) and leave no process it started; the reruns must pick up at the step the stop committed;
``sluice queue audit`` must find every sample accounted for exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import redis

from pipeline.launch.control import Interrupted, StopRequest
from pipeline.launch.launcher import CHILD_STOP_S, TRAINER_STOP_S, RunLock, RunLockedError
from pipeline.queue.keys import RunKeys
from pipeline.queue.rundir import open_run
from tests.helpers.runprocs import alive, is_role, run_processes

ROOT = Path(__file__).parents[2]
STOPS = (signal.SIGINT, signal.SIGTERM)
# Many more steps than the chain trains: every launch ends by a signal. checkpoint_every is out of reach too, so each
# launch's only commit is the one its stop makes.
RUN_ARGS = ["--steps", "60", "--set", "trainer.world_size=2", "--set", "trainer.ep=2",
            "--set", "trainer.checkpoint_every=1000", "--set", "trainer.batch_groups=4",
            "--set", "producer.concurrency=2", "--set", "warmstart.enabled=false",
            "--set", "eval.heldout.enabled=false", "--set", "filters.zero_variance=false"]


# A background job of a non-interactive shell (CI) inherits SIGINT ignored, and Python then never sees a Ctrl-C. The
# child restores it itself and then becomes the launcher: a preexec_fn would run Python between fork and exec, which
# crashed the child (SIGSEGV before exec) once earlier tests had left this process with many threads.
_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _sluice_run(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", _DEFAULT_SIGINT, "-m", "pipeline.cli", "run", "recipes/cpu-moe.toml", "--run-dir",
            str(run_dir), *RUN_ARGS, *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1")


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "trainer.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@dataclass
class Launch:
    """One ``sluice run`` in its own session, and every process seen among its descendants while it ran."""

    proc: subprocess.Popen[bytes]
    log: Path
    run_dir: Path
    started: dict[int, psutil.Process] = field(default_factory=dict)
    exit_s: float = float("nan")

    @classmethod
    def start(cls, run_dir: Path, log: Path) -> Launch:
        with open(log, "ab") as out:
            proc = subprocess.Popen(_sluice_run(run_dir), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=_env())
        return cls(proc, log, run_dir)

    def watch(self) -> None:
        # By the run folder each process inherits: under Ray none is the launcher's descendant.
        self.started.update(run_processes(self.run_dir))

    def wait_for_steps(self, run_dir: Path, n: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while len(_rows(run_dir)) < n:
            assert self.proc.poll() is None, f"launcher exited with {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no training progress:\n{self.tail()}"
            self.watch()
            time.sleep(0.1)
        self.watch()

    def stop(self, sig: signal.Signals) -> int:
        """Send ``sig`` to the launcher's process group, as a terminal's Ctrl-C or hang-up does; its exit code."""
        sent = time.monotonic()
        os.killpg(self.proc.pid, sig)
        try:
            code = self.proc.wait(timeout=TRAINER_STOP_S + CHILD_STOP_S + 60)
        finally:
            self.exit_s = time.monotonic() - sent
        return code

    def left(self) -> list[str]:
        return [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in self.started.values() if alive(p)]

    def kill(self) -> None:
        """What a failed test must not leave behind: this launch's processes, by PID."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in self.started.values():
            if alive(p):
                p.kill()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class Chain:
    run_dir: Path
    refused: subprocess.CompletedProcess[str]
    refused_s: float
    live_pid: int
    undisturbed: dict[str, bool]
    stops: dict[str, Launch]
    codes: dict[str, int]
    rows_at_exit: dict[str, list[dict]]  # the metrics when each stopped launcher had exited
    events: list[dict]
    audit: dict


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    tmp = tmp_path_factory.mktemp("stop")
    run_dir = tmp / "run"
    launches: list[Launch] = []
    stops: dict[str, Launch] = {}
    codes: dict[str, int] = {}
    rows_at_exit: dict[str, list[dict]] = {}
    try:
        for i, sig in enumerate(STOPS):
            launch = Launch.start(run_dir, tmp / f"launcher-{i}.log")
            launches.append(launch)
            launch.wait_for_steps(run_dir, len(_rows(run_dir)) + 2)
            if i == 0:
                refused, refused_s, undisturbed = _second_launcher(run_dir, launch)
                launch.wait_for_steps(run_dir, len(_rows(run_dir)) + 1)  # the live run trains on
            codes[sig.name] = launch.stop(sig)
            stops[sig.name] = launch
            rows_at_exit[sig.name] = _rows(run_dir)
        handle = open_run(run_dir=run_dir)
        try:
            events = handle.queue.events()
        finally:
            handle.close(stop_server=True)
        r = subprocess.run([sys.executable, "-m", "pipeline.cli", "queue", "audit", "--run-dir", str(run_dir),
                            "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=_env())
        assert r.returncode == 0, r.stderr
        yield Chain(run_dir, refused, refused_s, launches[0].proc.pid, undisturbed, stops, codes, rows_at_exit,
                    events, json.loads(r.stdout))
    finally:
        for launch in launches:
            launch.kill()


def _second_launcher(run_dir: Path, live: Launch) -> tuple[subprocess.CompletedProcess[str], float, dict[str, bool]]:
    """Run the same command (with another override) against the live run; report what of the live run changed."""
    config = (run_dir / "config.json").read_bytes()
    live.watch()
    children = {pid: p for pid, p in live.started.items() if is_role(p)}  # not Ray's short-lived helpers
    assert len(children) >= 4, children
    start = time.monotonic()
    refused = subprocess.run(_sluice_run(run_dir, "--set", "producer.concurrency=3"), cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env=_env())
    refused_s = time.monotonic() - start
    handle = open_run(run_dir=run_dir)  # the live run's Redis: reused, left running
    try:
        holder = json.loads(handle.queue.redis.get(handle.queue.keys.launcher))
    finally:
        handle.close()
    undisturbed = {
        "launcher alive": live.proc.poll() is None,
        "children alive": all(alive(p) for p in children.values()),
        "config.json unchanged": (run_dir / "config.json").read_bytes() == config,
        "lock still the live launcher's": holder["pid"] == live.proc.pid,
    }
    return refused, refused_s, undisturbed


@pytest.mark.slow
def test_second_sluice_run_on_a_live_run_is_refused_naming_host_and_pid(chain: Chain) -> None:
    assert chain.refused.returncode == 2, chain.refused.stdout + chain.refused.stderr
    message = chain.refused.stderr
    assert f"PID {chain.live_pid}" in message and f"host {socket.gethostname()}" in message, message
    assert "is live" in message and "Nothing was started" in message
    print(f"refused in {chain.refused_s:.1f} s")
    assert all(chain.undisturbed.values()), chain.undisturbed
    # And once the first launcher stopped, the next launch on the folder started and trained.
    assert len(chain.rows_at_exit["SIGTERM"]) > len(chain.rows_at_exit["SIGINT"])


@pytest.mark.slow
@pytest.mark.parametrize("sig", [s.name for s in STOPS])
def test_stop_signal_with_two_trainer_ranks_ends_every_child_in_order_and_leaves_nothing(chain: Chain,
                                                                                         sig: str) -> None:
    launch = chain.stops[sig]
    # Wall time is reported, not asserted: on a shared 2-core machine it swings 14-41 s. What decides it is whether
    # each child exits by itself or sits out its wave's timeout into a SIGKILL, and that the summary line says.
    print(f"{sig}: the launcher exited {launch.exit_s:.1f} s after the signal")
    assert chain.codes[sig] == 128 + signal.Signals[sig].value, launch.tail()
    assert "SIGKILLed" not in launch.tail() and "did not stop within" not in launch.tail(), launch.tail()
    # Engine, producer, two trainer ranks, their reapers and Ray's own processes.
    assert len(launch.started) >= 8, launch.started
    assert not launch.left(), f"processes of the launch still alive: {launch.left()}"
    assert "stopped in order" in launch.tail()


@pytest.mark.slow
def test_reruns_resume_at_the_step_each_stop_committed(chain: Chain) -> None:
    resumes = [e for e in chain.events if e["kind"] == "resume"]
    assert len(resumes) == len(STOPS), resumes  # one per launch: no trainer restart along the way
    for sig, resume in zip([s.name for s in STOPS], resumes[1:]):
        last = chain.rows_at_exit[sig][-1]
        # The stop committed the last step it trained, and the rerun resumed right there, its version and all.
        assert int(resume["step"]) == last["step"] > 0
        assert int(resume["version"]) >= last["policy_version"] > 0
    rows = [json.loads(x) for x in (chain.run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # no step trained twice, none skipped
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)


@pytest.mark.slow
def test_audit_after_the_stops_shows_nothing_lost_or_duplicated(chain: Chain) -> None:
    ledger = chain.audit["trainer_ledger"]
    print("audit:", ledger)
    assert ledger["lost"] == 0 and ledger["duplicates"] == 0
    assert ledger["committed_step"] == chain.rows_at_exit[STOPS[-1].name][-1]["step"]
    assert ledger["trained"] > 0 and chain.audit["duplicate_sample_ids"] == 0


# ---- the handler alone, in this process: fast ----------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_each_stop_signal_asks_for_the_orderly_stop_and_a_second_one_forces_it(sig: signal.Signals) -> None:
    forced = []
    stop = StopRequest(on_force=lambda: forced.append(1))
    previous = signal.signal(sig, signal.SIG_DFL)  # what a terminal's job starts with (pytest may have its own)
    stop.install()
    try:
        os.kill(os.getpid(), sig)
        with pytest.raises(Interrupted):
            stop.pause(5)
        assert stop.signum == sig and not stop.forced and not forced
        stop.begin_stop()
        os.kill(os.getpid(), sig)
        time.sleep(0.1)  # the handler runs between bytecodes of this thread
        assert stop.forced and forced == [1]
    finally:
        stop.uninstall()
        signal.signal(sig, previous)


def test_an_ignored_stop_signal_stays_ignored() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    stop = StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        stop.pause(0.2)  # no Interrupted: the signal never reached the launcher
        assert stop.signum is None
    finally:
        stop.uninstall()
        signal.signal(signal.SIGHUP, previous)


# ---- the lock alone, against a real Redis: fast ------------------------------------------------------------------
def test_run_lock_refuses_renews_and_releases(redis_client: redis.Redis, run_name: str) -> None:
    key = RunKeys(run_name).launcher
    lock = RunLock.acquire(redis_client, key, "run x", ttl_s=0.6)
    try:
        with pytest.raises(RunLockedError, match=f"PID {os.getpid()} on host {socket.gethostname()}"):
            RunLock.acquire(redis_client, key, "run x", ttl_s=0.6)
        time.sleep(1.5)  # over two TTLs: only the renewals keep it
        assert json.loads(redis_client.get(key))["pid"] == os.getpid()
    finally:
        lock.release()
    assert redis_client.get(key) is None
    RunLock.acquire(redis_client, key, "run x", ttl_s=0.6).release()


def test_run_lock_of_a_killed_launcher_lapses_after_its_ttl(redis_client: redis.Redis, run_name: str) -> None:
    key = RunKeys(run_name).launcher
    # What a SIGKILLed launcher leaves: its key, no longer renewed.
    redis_client.set(key, json.dumps({"host": "elsewhere", "pid": 4242, "since": time.time(), "token": "t"}), px=400)
    with pytest.raises(RunLockedError, match="PID 4242 on host elsewhere"):
        RunLock.acquire(redis_client, key, "run x")
    time.sleep(0.5)
    RunLock.acquire(redis_client, key, "run x").release()


def test_run_lock_taken_over_by_another_launcher_asks_this_one_to_stop(redis_client: redis.Redis,
                                                                       run_name: str) -> None:
    key = RunKeys(run_name).launcher
    asked = []
    lock = RunLock.acquire(redis_client, key, "run x", ttl_s=0.3, on_lost=lambda: asked.append(1))
    try:
        redis_client.set(key, json.dumps({"host": "h", "pid": 1, "since": 0, "token": "other"}))
        deadline = time.monotonic() + 5
        while not asked and time.monotonic() < deadline:
            time.sleep(0.02)
        assert asked and lock.lost
    finally:
        lock.release()
    assert json.loads(redis_client.get(key))["token"] == "other"  # the release deleted nothing of the new holder's
