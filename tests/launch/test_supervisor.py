"""The launcher's supervisor on a private Ray instance (``pipeline.launch.ray_runtime``), with plain processes: the stop's
two waves, a process that outlives its timeout, restarts under the budget, and a killed launcher that takes its
Ray instance and every process with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pipeline.errors import SluiceError
from pipeline.launch.cluster import ProcessSpec, RestartBudget
from pipeline.launch.ray_runtime import connected, start_private_head
from pipeline.launch.supervisor import Supervisor

ROOT = Path(__file__).parents[2]

# Appends its name and the time to ORDER when SIGTERM reaches it, then exits 0; READY marks that it runs.
OBEYS = textwrap.dedent("""
    import signal, sys, time
    def bye(*_):
        open({order!r}, 'a').write({name!r} + '\\n')
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    open({ready!r}, 'w').close()
    while True:
        time.sleep(0.05)
""")
STUBBORN = textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open({ready!r}, 'w').close()
    while True:
        time.sleep(0.05)
""")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(paths: list[Path], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def private_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    run_dir = tmp_path_factory.mktemp("sup")
    with connected(run_dir, start_private_head(run_dir, num_cpus=8, dashboard=False)):
        yield


def _spec(tmp_path: Path, name: str, script: str, **fmt: str) -> ProcessSpec:
    code = script.format(name=name, ready=str(tmp_path / f"{name}.ready"), **fmt)
    return ProcessSpec(name, [sys.executable, "-c", code], str(tmp_path / f"{name}.log"), num_cpus=0.5)


def test_the_stop_ends_engines_last_and_names_the_process_that_outlived_its_timeout(private_ray: None,
                                                                                    tmp_path: Path) -> None:
    order = str(tmp_path / "order")
    sup = Supervisor()
    try:
        sup.start([_spec(tmp_path, "trainer-0", OBEYS, order=order), _spec(tmp_path, "producer-0", STUBBORN)])
        sup.start([_spec(tmp_path, "engine-0", OBEYS, order=order)], stop_last=True)
        _wait_for([tmp_path / f"{n}.ready" for n in ("trainer-0", "producer-0", "engine-0")])
        pids = {n: c.process.info["pid"] for n, c in sup.children.items()}
        killed = sup.stop_all(first_timeout_s=2.0, last_timeout_s=20.0)
    finally:
        sup.kill_all()
    assert killed == ["producer-0"]
    # The engine heard of the stop only once the first wave had ended.
    assert Path(order).read_text().split() == ["trainer-0", "engine-0"]
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in pids.items() if _alive(p)]


def test_a_process_that_dies_is_restarted_after_its_backoff_until_the_budget_is_spent(private_ray: None,
                                                                                     tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    crash = f"open({str(starts)!r}, 'a').write('x'); import time; time.sleep(0.3); raise SystemExit(3)"
    sup = Supervisor(budget=lambda: RestartBudget(limit=2, window_s=60.0, backoff_s=0.2))
    try:
        sup.start([ProcessSpec("flaky", [sys.executable, "-c", crash], str(tmp_path / "flaky.log"), num_cpus=0.5)])
        deadline = time.monotonic() + 60
        with pytest.raises(SluiceError, match="flaky: 3 failures within 60s.*flaky.log"):
            while time.monotonic() < deadline:
                sup.poll()
                time.sleep(0.1)
        assert starts.read_text() == "xxx"  # the first start and the two restarts the budget allowed
    finally:
        sup.kill_all()


def test_a_restart_that_dies_before_it_binds_its_port_is_tried_again_within_the_budget(private_ray: None,
                                                                                       tmp_path: Path) -> None:
    """A restart that fails to start (here: the second start exits before it writes its port) spends one restart of
    the budget and is tried again; it does not end the run."""
    starts, port_file = tmp_path / "starts", tmp_path / "svc.port"
    code = textwrap.dedent(f"""
        import os, time
        with open({str(starts)!r}, 'a') as f:
            f.write('x')
        n = len(open({str(starts)!r}).read())
        if n == 2:
            raise SystemExit(4)  # before it binds
        open({str(port_file)!r} + '.tmp', 'w').write('4321')
        os.rename({str(port_file)!r} + '.tmp', {str(port_file)!r})
        if n == 1:
            time.sleep(0.3)
            raise SystemExit(3)
        while True:
            time.sleep(0.05)
    """)
    sup = Supervisor(budget=lambda: RestartBudget(limit=3, window_s=60.0, backoff_s=0.2), start_timeout_s=20)
    try:
        sup.start([ProcessSpec("svc", [sys.executable, "-c", code], str(tmp_path / "svc.log"), num_cpus=0.5,
                               port_file=str(port_file))])
        deadline = time.monotonic() + 90
        while starts.read_text() != "xxx" or sup.children["svc"].restart_at is not None:
            assert time.monotonic() < deadline, starts.read_text()
            sup.poll()
            time.sleep(0.1)
        assert sup.exit_code("svc") is None and sup.children["svc"].process.info["port"] == 4321
    finally:
        sup.kill_all()


def test_a_stop_while_processes_start_ends_the_wait_at_once(private_ray: None, tmp_path: Path) -> None:
    """The launcher waits for the engines while they load their model (minutes for a large one); a stop signal then
    must not wait for them to bind."""
    class Stopped(Exception):
        pass

    sup = Supervisor(start_timeout_s=120)
    never = ProcessSpec("slow", [sys.executable, "-c", "import time; time.sleep(600)"], str(tmp_path / "slow.log"),
                        num_cpus=0.5, port_file=str(tmp_path / "slow.port"))  # never binds
    asked = time.monotonic() + 2.0

    def pause(_: float) -> None:
        if time.monotonic() > asked:
            raise Stopped

    try:
        pending = sup.launch([never], stop_last=True)
        with pytest.raises(Stopped):
            pending.wait(pause)
        assert time.monotonic() - asked < 5  # not the 120 s the start may take
        assert "slow" in sup.children  # supervised already: the stop that follows ends it
    finally:
        sup.kill_all()


def test_a_process_that_is_not_restartable_is_reported_and_left_alone(private_ray: None, tmp_path: Path) -> None:
    sup = Supervisor()
    try:
        sup.start([ProcessSpec("rank", [sys.executable, "-c", "raise SystemExit(5)"], str(tmp_path / "r.log"),
                               num_cpus=0.5)], restartable=False)
        deadline = time.monotonic() + 30
        while sup.exit_code("rank") is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert sup.poll() == [] and sup.exit_code("rank") == 5
    finally:
        sup.kill_all()


LAUNCHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from pipeline.launch.cluster import ProcessSpec
    from pipeline.launch.ray_runtime import connected, start_private_head
    from pipeline.launch.supervisor import Supervisor
    run_dir = Path(sys.argv[1])
    with connected(run_dir, start_private_head(run_dir, num_cpus=4, dashboard=False)):
        sup = Supervisor()
        info = sup.start([ProcessSpec("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"],
                                      str(run_dir / "sleeper.log"), num_cpus=0.5)])[0]
        print(info["pid"], flush=True)
        time.sleep(600)
""")


def test_a_launcher_killed_with_sigkill_takes_its_ray_instance_and_processes_with_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True, start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        line = launcher.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), f"the launcher printed {line!r}"
        reaper = int(line)
        ray_reaper = int((run_dir / "logs" / ".ray-head.state" / "reaper.pid").read_text())
        # The sleeper under its reaper, and Ray's GCS, raylet and workers under theirs.
        pids = [reaper, ray_reaper] + [p.pid for r in (reaper, ray_reaper)
                                       for p in psutil.Process(r).children(recursive=True)]
        assert len(pids) >= 4 and all(_alive(p) for p in pids)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids if _alive(p)] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()




def test_the_trainer_waits_for_the_engines_file_and_takes_it_whole_once_it_appears(tmp_path: Path) -> None:
    from pipeline.launch.processes import wait_for_engines

    urls = ["http://10.0.0.1:4000", "http://10.0.0.2:4001"]

    def publish() -> None:
        time.sleep(0.5)
        partial = tmp_path / "engines.tmp"
        partial.write_text(json.dumps(urls))
        partial.rename(tmp_path / "engines.json")

    writer = threading.Thread(target=publish)
    writer.start()
    start = time.monotonic()
    assert wait_for_engines(tmp_path, timeout_s=30, poll_s=0.05) == urls
    assert time.monotonic() - start >= 0.4  # it waited for the file rather than failing on its absence
    writer.join()
    (tmp_path / "engines.json").unlink()
    with pytest.raises(SluiceError, match="engines.json did not appear within 0 s.*engines' logs"):
        wait_for_engines(tmp_path, timeout_s=0.2, poll_s=0.05)
