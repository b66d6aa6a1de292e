"""``python -m pipeline.launch.reaper HOST_PID STATE_DIR -- CMD...``: run CMD so that it cannot outlive its Ray host.

The reaper detaches from the host (a fork whose parent exits at once, and a session of its own), because Ray
SIGKILLs the direct children of an actor worker that died, and a reaper killed that way could clean up nothing. It
then starts CMD as the leader of a process group, forwards SIGTERM, SIGINT and SIGHUP to it (an orderly stop stays
the process's own), and watches the host through a pidfd. When the host dies, or on SIGUSR1, it SIGKILLs CMD's whole
group. When CMD exits it kills what is left of the group, so a trainer's multiprocessing manager, say, never
outlives its trainer.

STATE_DIR receives ``child.pid`` (CMD's PID) and ``reaper.pid`` once the reaper runs, and ``exit`` (CMD's exit code,
128 + N for signal N; 137 when the group was killed) when it is done.

Besides the Ray hosts' processes and the private Ray head, the run's embedded Redis runs under a reaper that watches
the launcher (``pipeline.queue.redis_server``), so it too goes when the launcher is SIGKILLed.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType

import psutil

HOST_DIED = 137


def _write(path: Path, text: str) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(text)
    partial.rename(path)


_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Orphans among CMD's descendants are re-parented to the reaper instead of init, so they stay findable."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the process group is all the reaper can reach


def _kill_group(pid: int) -> None:
    """SIGKILL CMD's process group and every other descendant of the reaper.

    The group alone is not enough: Ray's raylet starts its workers in sessions of their own, and a worker whose
    raylet died can take minutes to notice (a ``ray::ProcessHost`` outlived its stopped run under load). As a
    subreaper the reaper is an ancestor of all of them, even of those whose parent already exited.
    """
    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in descendants:
        try:
            p.kill()
        except psutil.Error:
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
        print("usage: python -m pipeline.launch.reaper HOST_PID STATE_DIR -- CMD [ARGS...]", file=sys.stderr)
        return 2
    host_pid, state, cmd = int(argv[0]), Path(argv[1]), argv[3:]
    if os.fork() > 0:
        os._exit(0)  # the host waits for this one only; the reaper lives on, adopted away from the host
    os.setsid()
    _become_subreaper()
    state.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ray worker may ignore SIGINT, and children inherit that
    child = subprocess.Popen(cmd, start_new_session=True)
    _write(state / "child.pid", str(child.pid))
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
    # Wait on a pidfd, not Popen.wait(timeout): that polls waitpid every few milliseconds, and a run has a reaper per
    # process, all on the cores the run itself needs.
    child_fd = os.pidfd_open(child.pid)
    while True:
        if select.select([child_fd], [], [], 0.5)[0]:
            code = child.wait()
            break
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
