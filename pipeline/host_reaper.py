"""``python -m pipeline.host_reaper HOST_PID STATE_DIR -- CMD...``: run CMD so that it cannot outlive its Ray host.

The reaper detaches from the host (a fork whose parent exits at once, and a session of its own), because Ray
SIGKILLs the direct children of an actor worker that died, and a reaper killed that way could clean up nothing. It
then starts CMD as the leader of a process group, forwards SIGTERM, SIGINT and SIGHUP to it (an orderly stop stays
the process's own), and watches the host through a pidfd. When the host dies, or on SIGUSR1, it SIGKILLs CMD's whole
group. When CMD exits it kills what is left of the group, so a trainer's multiprocessing manager, say, never
outlives its trainer.

STATE_DIR receives ``reaper.pid`` once the reaper runs and ``exit`` (CMD's exit code, 128 + N for signal N; 137 when
the group was killed) when it is done.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType

HOST_DIED = 137


def _write(path: Path, text: str) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(text)
    partial.rename(path)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _watch(host_pid: int, on_death: threading.Event) -> None:
    try:
        fd = os.pidfd_open(host_pid)
    except ProcessLookupError:
        on_death.set()
        return
    select.select([fd], [], [])  # readable once the host has exited
    on_death.set()


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m pipeline.host_reaper HOST_PID STATE_DIR -- CMD [ARGS...]", file=sys.stderr)
        return 2
    host_pid, state, cmd = int(argv[0]), Path(argv[1]), argv[3:]
    if os.fork() > 0:
        os._exit(0)  # the host waits for this one only; the reaper lives on, adopted away from the host
    os.setsid()
    state.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ray worker may ignore SIGINT, and children inherit that
    child = subprocess.Popen(cmd, start_new_session=True)
    done = threading.Event()

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    def kill_all(signum: int, frame: FrameType | None) -> None:
        done.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    signal.signal(signal.SIGUSR1, kill_all)
    host_gone = threading.Event()
    threading.Thread(target=_watch, args=(host_pid, host_gone), daemon=True).start()
    _write(state / "reaper.pid", str(os.getpid()))
    while True:
        try:
            code = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if host_gone.is_set() or done.is_set():
                _kill_group(child.pid)
                child.wait()
                _write(state / "exit", str(HOST_DIED))
                return HOST_DIED
    _kill_group(child.pid)  # what the process started and left behind
    code = code if code >= 0 else 128 - code
    _write(state / "exit", str(code))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
