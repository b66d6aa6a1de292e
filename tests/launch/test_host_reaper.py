"""``pipeline.launch.reaper``: what a process started leaves behind goes when it does, whatever session it moved to."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.helpers.runprocs import alive

# CMD starts a grandchild in a session of its own (as Ray's raylet starts its workers), reports its PID and exits:
# the grandchild is outside CMD's process group, and its parent is gone.
ESCAPING = (
    "import subprocess, sys\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
    "open(sys.argv[1], 'w').write(str(p.pid))\n"
)


def _reap(tmp_path: Path, host_pid: int) -> tuple[psutil.Process, Path]:
    pid_file = tmp_path / "grandchild.pid"
    state = tmp_path / "state"
    subprocess.run([sys.executable, "-m", "pipeline.launch.reaper", str(host_pid), str(state), "--", sys.executable,
                    "-c", ESCAPING, str(pid_file)], check=True, timeout=30)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return psutil.Process(int(pid_file.read_text())), state


def test_a_descendant_in_another_session_dies_when_its_process_exits(tmp_path: Path) -> None:
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        grandchild, state = _reap(tmp_path, host.pid)
        deadline = time.monotonic() + 30
        while not (state / "exit").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (state / "exit").read_text() == "0"
        deadline = time.monotonic() + 10
        while alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(grandchild)
    finally:
        host.kill()
        host.wait()
