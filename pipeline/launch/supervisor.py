"""The launcher's supervisor: every process of a run as a ``HostedProcess`` (``pipeline.launch.cluster``) on Ray.

Stateless processes (engines, producers, the evaluator, the archiver) come back by themselves after a backoff,
under a restart budget per time window. Processes that are not restartable (trainer ranks, the warm start) are
only watched; the launcher decides about them (trainer ranks restart as one group). The stop runs in two waves
(docs/launcher.md): everything that is not ``stop_last`` at once, then the rest, each wave SIGTERMed together and
waited for together.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import SluiceError
from pipeline.launch.cluster import HostedProcess, ProcessSpec, RestartBudget

log = logging.getLogger(__name__)

_WAIT_SLICE_S = 0.5  # a stop's waits are cut this fine, so that a second signal forces it without delay


@dataclass
class Supervised:
    """One process of the run, and what the supervisor knows about it."""

    process: HostedProcess
    restartable: bool = True
    stop_last: bool = False
    """Others need it until they have stopped (an engine serves the trainer's last push)."""
    done: bool = False
    restart_at: float | None = None
    """When a restart is due (after the budget's backoff); None while none is."""
    on_restart: Callable[[dict[str, Any]], None] | None = None
    """Called with the new host's info after a restart (an engine's new address, say)."""

    @property
    def name(self) -> str:
        return self.process.spec.name

    @property
    def log_path(self) -> str:
        return self.process.spec.log_path


@dataclass
class PendingStart:
    """Processes a ``Supervisor.launch`` set going; ``wait`` for them once something needs them."""

    supervisor: Supervisor
    procs: list[HostedProcess]
    refs: list[Any]

    def wait(self, pause: Callable[[float], None] | None = None) -> list[dict[str, Any]]:
        """Each one's host info (node address, port) once all run. ``pause`` is called between slices of the wait
        (the launcher's, which raises on a stop signal), so a stop need not wait for the slowest start."""
        import ray

        deadline = time.monotonic() + self.supervisor.start_timeout_s + 60
        pending = list(self.refs)
        while pending and time.monotonic() < deadline:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_WAIT_SLICE_S)
            if pause is not None:
                pause(0)  # raises on a stop: whatever was launched is stopped with the rest
        try:
            infos = ray.get(self.refs, timeout=0 if pending else None)
        except Exception as e:
            raise SluiceError(f"could not start {', '.join(p.spec.name for p in self.procs)}: {_reason(e)}") from None
        for proc, info in zip(self.procs, infos):
            self.supervisor._record(proc, proc.started(info))
        return list(infos)


@dataclass
class Supervisor:
    budget: Callable[[], RestartBudget] = RestartBudget
    start_timeout_s: float = 300.0
    placements: Path | None = None
    """Where each start is recorded, one JSON line (name, node, address, pid, time): which process ran where."""
    children: dict[str, Supervised] = field(default_factory=dict)
    forced: bool = False

    def start(self, specs: Sequence[ProcessSpec], *, restartable: bool = True, stop_last: bool = False,
              scheduling: Sequence[Any] | None = None) -> list[dict[str, Any]]:
        """Start these processes at once; returns each one's host info (node address, port) once all run."""
        return self.launch(specs, restartable=restartable, stop_last=stop_last, scheduling=scheduling).wait()

    def launch(self, specs: Sequence[ProcessSpec], *, restartable: bool = True, stop_last: bool = False,
               scheduling: Sequence[Any] | None = None) -> PendingStart:
        """Start these processes at once without waiting for them: other starts can go on meanwhile. They are
        supervised (and stopped by ``stop_all``) from here on; ``wait`` gives their host info."""
        procs = [HostedProcess(spec, scheduling=None if scheduling is None else scheduling[i], budget=self.budget())
                 for i, spec in enumerate(specs)]
        for proc in procs:
            if proc.spec.name in self.children:
                raise SluiceError(f"a process named {proc.spec.name!r} is already supervised")
            self.children[proc.spec.name] = Supervised(proc, restartable=restartable, stop_last=stop_last)
        return PendingStart(self, procs, [proc.launch(self.start_timeout_s) for proc in procs])

    def exit_code(self, name: str) -> int | None:
        """None while ``name`` runs; its exit code once it exited (137 when its host was lost)."""
        from pipeline.launch.reaper import HOST_DIED

        child = self.children[name]
        if child.done:
            return 0
        proc = child.process
        state = proc.state()
        if state == "running":
            return None
        return proc.exit_code if state == "exited" and proc.exit_code is not None else HOST_DIED

    def poll(self) -> list[str]:
        """Restart what is due and what died; returns the names of the processes that finished cleanly."""
        finished = []
        now = time.monotonic()
        for child in self.children.values():
            if child.done:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child)
                continue
            code = self.exit_code(child.name)
            if code is None:
                continue
            if code == 0 and not child.restartable:
                child.done = True
                child.process.discard()  # its host's reservation goes back to the cluster
                finished.append(child.name)
                continue
            if not child.restartable:
                continue  # the launcher decides (a failed trainer rank restarts its whole group)
            delay = child.process.restart_delay()  # raises once the budget is spent
            log.warning("%s exited with code %s; restarting it in %.0f s (log: %s)", child.name, code, delay,
                        child.log_path)
            child.process.discard()
            child.restart_at = now + delay
        return finished

    def _restart(self, child: Supervised) -> None:
        child.restart_at = None
        try:
            info = child.process.start(self.start_timeout_s)
        except Exception as e:  # it died before it bound its port, or no node took it in time: one more failure
            child.process.discard()
            delay = child.process.restart_delay()  # raises once the budget is spent
            log.warning("%s did not come back (%s); trying again in %.0f s (log: %s)", child.name, _reason(e), delay,
                        child.log_path)
            child.restart_at = time.monotonic() + delay
            return
        self._record(child.process, info)
        log.warning("%s restarted on %s", child.name, info.get("node_ip"))
        if child.on_restart is not None:
            child.on_restart(info)

    def _record(self, proc: HostedProcess, info: dict[str, Any]) -> None:
        if self.placements is None:
            return
        line = {"name": proc.spec.name, "node_id": info.get("node_id"), "node_ip": info.get("node_ip"),
                "host": info.get("host"), "pid": info.get("pid"), "port": info.get("port"), "at": time.time()}
        self.placements.parent.mkdir(parents=True, exist_ok=True)
        with open(self.placements, "a") as f:
            f.write(json.dumps(line) + "\n")

    def stop_all(self, first_timeout_s: float, last_timeout_s: float) -> list[str]:
        """The orderly stop in two waves; returns the processes that outlived their wave's timeout and were
        killed."""
        first = [c for c in self.children.values() if not c.stop_last]
        killed = self._terminate(first, first_timeout_s)
        killed += self._terminate([c for c in self.children.values() if c.stop_last], last_timeout_s)
        for child in self.children.values():
            child.process.discard()
        return killed

    def _terminate(self, children: list[Supervised], timeout_s: float) -> list[str]:
        import ray

        live = [c for c in children if c.process.actor is not None and c.restart_at is None]
        for child in live:
            child.process.actor.signal.remote(int(signal.SIGTERM))
        deadline = time.monotonic() + timeout_s
        pending = {c.name: c for c in live}
        while pending and time.monotonic() < deadline and not self.forced:
            for name, child in list(pending.items()):
                try:
                    code = ray.get(child.process.actor.wait.remote(0.0), timeout=10)
                except Exception:
                    code = -1  # its host is gone, and the process with it
                if code is not None:
                    del pending[name]
            if pending:
                time.sleep(_WAIT_SLICE_S / 5)
        killed = []
        for name, child in pending.items():
            if not self.forced:
                log.warning("%s did not stop within %.0fs of SIGTERM; killing it", name, timeout_s)
                killed.append(name)
            child.process.discard()
        return killed

    def kill_group(self, names: Sequence[str]) -> None:
        """Kill these processes at once, hosts and all (a trainer group that lost a rank, a forced stop)."""
        for name in names:
            self.children[name].process.discard()

    def force(self) -> None:
        """The forced stop, from a signal handler: the processes on this machine are killed at once (their
        reapers kill their groups on SIGUSR1); the main thread's next wait kills the rest through Ray."""
        self.forced = True
        here = socket.gethostname()
        for child in list(self.children.values()):
            info = child.process.info
            if info.get("host") == here and isinstance(info.get("pid"), int):
                try:
                    os.kill(info["pid"], signal.SIGUSR1)
                except (ProcessLookupError, PermissionError):
                    pass

    def kill_all(self) -> None:
        for child in self.children.values():
            child.process.discard()


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
