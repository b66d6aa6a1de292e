"""Nothing a run started outlives its launcher, even a launcher killed with SIGKILL: the embedded Redis dies with it
(it runs under a reaper watching the launcher, ``pipeline.queue.redis_server``), as Ray and every process already
did (docs/launcher.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pipeline.queue.redis_server import REAPER_DIR, EmbeddedRedis
from tests.helpers.runprocs import alive, run_processes

ROOT = Path(__file__).parents[2]
RUN_ARGS = ["--steps", "200", "--set", "trainer.checkpoint_every=1000", "--set", "trainer.batch_groups=4",
            "--set", "producer.concurrency=2", "--set", "warmstart.enabled=false",
            "--set", "eval.heldout.enabled=false", "--set", "filters.zero_variance=false"]


def _wait(cond: object, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def owner() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in for the launcher: a process the test kills."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_tied_embedded_redis_dies_with_its_owner_and_adopting_an_untied_one_ties_it(
        tmp_path: Path, owner: subprocess.Popen[bytes]) -> None:
    untied = EmbeddedRedis(tmp_path / "redis").start()
    pids: list[int] = []
    try:
        assert untied.tied_to is None and untied.client().set("sluice:{r}:k", "kept")
        pids.append(untied.pid)  # type: ignore[arg-type]
        # What the launcher does with a server an older launcher left untied: adopt it, tied to itself.
        adopted = EmbeddedRedis(tmp_path / "redis").start()
        assert adopted.pid == untied.pid  # reused
        adopted.adopt(owner_pid=owner.pid)
        pids.append(adopted.pid)  # type: ignore[arg-type]
        assert adopted.pid != untied.pid and adopted.tied_to == owner.pid
        assert adopted.client().get("sluice:{r}:k") == b"kept"  # restarted on its AOF
        assert json.loads((tmp_path / "redis" / "redis.json").read_text())["owner"] == owner.pid
        reaper = psutil.Process(int((tmp_path / "redis" / REAPER_DIR / "reaper.pid").read_text()))
        # A restart after a crash (the launcher's watch) is tied too.
        adopted.kill()
        adopted.restart()
        pids.append(adopted.pid)  # type: ignore[arg-type]
        assert not alive(reaper)  # the crashed server's reaper left with it
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        _wait(lambda: not psutil.pid_exists(adopted.pid) or not alive(psutil.Process(adopted.pid)),  # type: ignore
              "the server to follow its owner", 10)
        assert (tmp_path / "redis" / REAPER_DIR / "exit").read_text() == "137"
    finally:
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if alive(p) and "redis" in p.name():
                    p.kill()
            except psutil.Error:
                pass


def _sluice_run(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "run", "recipes/cpu-moe.toml", "--run-dir", str(run_dir), *RUN_ARGS]


def _of_the_run(run_dir: Path, extra: set[int]) -> dict[int, psutil.Process]:
    """Every live process of the run: by the run folder in its environment (what the launcher gives each process
    and Ray) or on its command line, and by PID (a redis-server rewrites its command line to its address)."""
    want = str(run_dir.resolve())
    found = dict(run_processes(run_dir))
    for p in psutil.process_iter():
        try:
            if p.pid in extra or any(want in arg for arg in p.cmdline()):
                found[p.pid] = p
        except psutil.Error:
            continue
    return {pid: p for pid, p in found.items() if alive(p)}


@pytest.mark.slow
def test_nothing_of_a_run_outlives_its_launcher_killed_with_sigkill(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    log = tmp_path / "launcher.log"
    with open(log, "ab") as out:
        launcher = subprocess.Popen(_sluice_run(run_dir), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    seen: dict[int, psutil.Process] = {}
    try:
        state = run_dir / "redis" / "redis.json"
        rows = run_dir / "metrics" / "trainer.jsonl"

        def up() -> bool:
            assert launcher.poll() is None, f"the launcher exited:\n{log.read_text(errors='replace')[-3000:]}"
            return state.exists() and rows.exists() and bool(rows.read_text().strip())

        _wait(up, "the run's first trained step", 300)
        redis_pid = int(json.loads(state.read_text())["pid"])
        seen.update(_of_the_run(run_dir, {redis_pid}))
        names = " ".join(" ".join(p.cmdline()) for p in seen.values())
        assert redis_pid in seen and all(role in names for role in ("trainer", "producer", "cpu_engine", "ray"))
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while (left := _of_the_run(run_dir, set(seen))) and time.monotonic() < deadline:
            seen.update(left)
            time.sleep(0.2)
        outlived = [f"{pid} {' '.join(p.cmdline())[:100]}" for pid, p in left.items()]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for p in seen.values():  # what a failed test must not leave behind, by PID
            if alive(p):
                p.kill()
    assert not outlived, f"outlived the launcher by 30 s: {'; '.join(outlived)}"
