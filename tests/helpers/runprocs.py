"""Finding a ``sluice run``'s processes by the ``SLUICE_RUN_DIR`` the launcher gives each of them: under Ray they are
not the launcher's descendants (each runs under a reaper that detached from its Ray host)."""

from __future__ import annotations

from pathlib import Path

import psutil


def run_processes(run_dir: Path) -> dict[int, psutil.Process]:
    """Every live process started for the run: Ray's, the reapers, and the run's own."""
    want = str(run_dir.resolve())
    found = {}
    for p in psutil.process_iter():
        try:
            if p.environ().get("SLUICE_RUN_DIR") == want:
                found[p.pid] = p
        except psutil.Error:
            continue
    return found


def is_role(p: psutil.Process) -> bool:
    """One of the run's own processes (a trainer rank, producer, engine, ...), not a reaper or one of Ray's."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return False
    return "pipeline.launch.reaper" not in cmd and ("pipeline.launch.processes" in cmd or "pipeline.producers.cpu_engine" in cmd)


def find_role(run_dir: Path, role: str, name: str | None = None, rank: int | None = None) -> psutil.Process | None:
    """The process of ``pipeline.launch.processes ROLE`` (optionally the one named ``name``, or of a trainer the one of
    ``rank``), not its reaper."""
    for p in run_processes(run_dir).values():
        try:
            cmd = p.cmdline()
            if rank is not None and p.environ().get("RANK") != str(rank):
                continue
        except psutil.Error:
            continue
        if "pipeline.launch.reaper" in cmd or "pipeline.launch.processes" not in cmd:
            continue
        if cmd[cmd.index("pipeline.launch.processes") + 1] == role and (name is None or name in cmd):
            return p
    return None


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
