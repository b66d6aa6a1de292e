"""Ray hosting of a run's processes: a real CPU engine on a port it chose, stops that leave nothing behind, processes
that die with their host, and a simulated two-node cluster (``ray.cluster_utils.Cluster``) whose worker node is
removed and added back under a process pinned to it."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pipeline.errors import ConfigError, SluiceError
from pipeline.launch.cluster import HostedProcess, ProcessHost, ProcessSpec, RestartBudget, check_resources

ray = pytest.importorskip("ray")

# A process that starts a grandchild and sleeps: stopping it must take the grandchild too.
PARENT = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
          "time.sleep(300)']); print(child.pid, flush=True); time.sleep(300)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a parent that is itself gone) counts as dead.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _grandchild(log: Path, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.strip():
            return int(text.split()[0])
        time.sleep(0.05)
    raise AssertionError(f"no grandchild pid in {log}")


def test_an_engine_started_on_port_0_reports_the_port_it_bound(model_dir: Path, tmp_path: Path) -> None:
    port_file = tmp_path / "engine.port"
    host = ProcessHost(ProcessSpec(
        "engine-0", [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--port", "0",
                     "--port-file", str(port_file), "--log-level", "warning"],
        str(tmp_path / "engine.log"), env={"OMP_NUM_THREADS": "1"}, port_file=str(port_file)).to_dict())
    info = host.start(timeout_s=120)
    try:
        assert info["port"] > 0 and int(port_file.read_text()) == info["port"]
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{info['port']}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "engine.log").read_text()[-2000:]
            time.sleep(0.2)
    finally:
        code = host.stop(timeout_s=30)
    assert code is not None and _wait_dead([info["pid"]]) == []


def test_a_process_that_exits_before_binding_its_port_fails_start_with_its_log(tmp_path: Path) -> None:
    host = ProcessHost(ProcessSpec("broken", [sys.executable, "-c", "raise SystemExit(3)"],
                                   str(tmp_path / "broken.log"), port_file=str(tmp_path / "p")).to_dict())
    with pytest.raises(SluiceError, match="exited with code 3 before it could bind its port.*broken.log"):
        host.start(timeout_s=30)


def test_a_reaper_that_cannot_start_fails_at_once_naming_the_log(tmp_path: Path) -> None:
    host = ProcessHost(ProcessSpec("empty", [], str(tmp_path / "empty.log")).to_dict())  # no command to run
    t0 = time.monotonic()
    with pytest.raises(SluiceError, match="empty: the reaper failed to start \\(exit 2\\).*empty.log"):
        host.start(timeout_s=120)
    assert time.monotonic() - t0 < 30  # not the whole start timeout


def test_stop_takes_what_the_process_started(tmp_path: Path) -> None:
    log = tmp_path / "parent.log"
    host = ProcessHost(ProcessSpec("parent", [sys.executable, "-c", PARENT], str(log)).to_dict())
    info = host.start()
    grandchild = _grandchild(log)
    assert host.poll() is None and _alive(grandchild)
    assert host.stop(timeout_s=5) == 128 + signal.SIGTERM
    assert _wait_dead([info["pid"], grandchild]) == []


def test_the_restart_budget_backs_off_and_refills_after_a_quiet_window() -> None:
    budget = RestartBudget(limit=3, window_s=100.0, backoff_s=1.0, max_backoff_s=3.0)
    assert [budget.next_delay(t, up_since=t - 1) for t in (0.0, 1.0, 2.0)] == [1.0, 2.0, 3.0]
    with pytest.raises(SluiceError, match="4 failures within 100s"):
        budget.next_delay(3.0, up_since=2.5)
    # Old failures leave the window; a process that stayed up a whole window starts over.
    assert budget.next_delay(101.5, up_since=101.0) == 2.0  # the failure at 2.0 is still in the window
    assert budget.next_delay(500.0, up_since=300.0) == 1.0


def test_a_request_no_node_can_meet_is_refused_before_anything_starts() -> None:
    spec = ProcessSpec("trainer-0", ["true"], "x.log", num_gpus=1, resources={"trainer_node": 1})
    with pytest.raises(ConfigError, match=r"trainer-0 asks for \{'GPU': 1, 'trainer_node': 1\}"):
        check_resources(spec, {"CPU": 4.0, "trainer_node": 0.0})
    check_resources(spec, {"CPU": 4.0, "GPU": 1.0, "trainer_node": 1.0})


# --- on a simulated two-node Ray cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from ray.cluster_utils import Cluster

    tmp = tmp_path_factory.mktemp("ray")
    os.environ["RAY_TMPDIR"] = str(tmp)  # Ray keeps its session files and its auth token there, not in ~
    (tmp / "ray").mkdir()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1},
                                                      "include_dashboard": False, "temp_dir": str(tmp / "ray")})
    c.add_node(num_cpus=1, resources={"worker": 1})
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_a_hosted_process_dies_with_its_host(cluster: object, tmp_path: Path) -> None:
    log = tmp_path / "parent.log"
    hosted = HostedProcess(ProcessSpec("parent", [sys.executable, "-c", PARENT], str(log), num_cpus=0.1))
    info = hosted.start()
    grandchild = _grandchild(log)
    assert hosted.state() == "running"
    hosted.discard()  # the host's worker is killed, as when its node fails
    # The reaper hears of its parent's death and takes the process's whole group with it.
    assert _wait_dead([info["pid"], grandchild]) == []


def test_a_process_pinned_to_a_removed_node_comes_back_when_a_node_rejoins(cluster: object, tmp_path: Path) -> None:
    worker = [n for n in cluster.list_all_nodes() if not n.head][0]  # type: ignore[attr-defined]
    log = tmp_path / "pinned.log"
    hosted = HostedProcess(
        ProcessSpec("pinned", [sys.executable, "-c", "import time; time.sleep(300)"], str(log), num_cpus=0.1,
                    resources={"worker": 1}),
        budget=RestartBudget(backoff_s=0.1))
    info = hosted.start(timeout_s=60)
    assert info["node_id"] == worker.node_id and hosted.state() == "running"

    cluster.remove_node(worker)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 60
    while hosted.state(timeout_s=2) != "lost":
        assert time.monotonic() < deadline, "the supervisor never saw the node go"
        time.sleep(0.2)
    assert _wait_dead([info["pid"]]) == []

    cluster.add_node(num_cpus=1, resources={"worker": 1})  # type: ignore[attr-defined]
    again = hosted.restart(timeout_s=60)
    try:
        assert hosted.state() == "running" and again["pid"] != info["pid"]
        head = [n for n in cluster.list_all_nodes() if n.head][0]  # type: ignore[attr-defined]
        assert again["node_id"] not in (worker.node_id, head.node_id)  # on the node that joined
    finally:
        hosted.stop(timeout_s=5)
    assert _wait_dead([again["pid"]]) == []
