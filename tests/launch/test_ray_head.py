"""The run's private Ray head: one that exits while starting is started again.

Its own module: ``connected`` makes this process Ray's driver, which it cannot be while another module's fixture
(``tests/launch/test_supervisor.py``'s private Ray) still holds it.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from pipeline.launch.ray_runtime import connected


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_head_that_exits_while_starting_is_started_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The first ``ray start`` exits before it wrote its address (as Ray's fixed 30 s raylet deadline made it do on a
    loaded CI machine; here forced by an object store Ray refuses); the head is started again, the warning quotes the
    first start's log, and stopping it leaves nothing."""
    import ray

    from pipeline.launch import ray_runtime

    if ray.is_initialized():  # a driver connection an earlier module left: this test connects to its own head
        ray.shutdown()

    class FirstStartFails(ray_runtime.PrivateHead):
        starts = 0

        def start(self) -> None:
            self.starts += 1
            monkeypatch.setattr(ray_runtime, "_OBJECT_STORE_BYTES", 1 if self.starts == 1 else 128 * 2**20)
            super().start()

    run_dir = tmp_path / "r"
    head = FirstStartFails(ray_runtime.temp_dir_for(run_dir), run_dir / "logs" / ".ray-head.state",
                           run_dir / "logs" / "ray.log", num_cpus=2, dashboard=False)
    head.start()
    reapers: list[int] = []
    try:
        with caplog.at_level("WARNING", logger=ray_runtime.log.name), connected(run_dir, head) as instance:
            assert instance.address and head.starts == 2
            assert head.reaper_pid is not None
            reapers.append(head.reaper_pid)
            ray_pids = [p.pid for p in psutil.Process(head.reaper_pid).children(recursive=True)]
            assert ray_pids, "the second start runs no Ray processes"
        warned = [r.getMessage() for r in caplog.records if "exited while starting" in r.getMessage()]
        assert len(warned) == 1 and "start 1 of 3" in warned[0]
        assert "object store" in warned[0].lower(), warned[0]  # the log's tail says why the first start failed
        assert (head.state_dir / "exit").exists()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in reapers + ray_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in reapers + ray_pids if _alive(p)] == []
    finally:
        head.stop()
