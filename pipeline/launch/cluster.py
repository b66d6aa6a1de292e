"""Ray placement and supervision of a run's processes: one Ray actor per process, on whichever node Ray picks.

Ray places, starts and watches; it never carries samples or weights (those go through Redis and NCCL/gloo). Each
long-lived process of a run (an engine, a producer, a trainer rank, the evaluator, the archiver) keeps its own
``python -m ...`` entry point and runs as a child of a small ``ProcessHost`` actor placed with the process's
resources. That keeps every process's signal handling, logs and crash behaviour exactly what the tests of each
process exercise, and gives the run Ray's placement (custom resources, placement groups, GPUs) and node-failure
detection: a host whose node goes away surfaces as ``RayActorError`` and is replaced like a crashed process.

A process is tied to its host: it runs under ``pipeline.launch.reaper``, which forwards stop signals and SIGKILLs the
process's whole group when the host's worker dies, so neither a stop nor a lost node leaves anything running. A
port is chosen by the process that binds it and read back through the host (``--port 0`` with a port file), so no
port is picked by one process and bound by another.
"""

from __future__ import annotations

import dataclasses
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, SluiceError
from pipeline.launch.reaper import HOST_DIED


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a run: what to execute, where its log goes, and what Ray must reserve for it.

    The host replaces ``{node_ip}`` in ``cmd`` with its node's address and sets ``SLUICE_NODE_IP`` to it: only once
    Ray has placed the process is it known where others reach it.
    """

    name: str
    cmd: list[str]
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    """Added to the host's environment."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources, e.g. ``{"trainer_node": 1}`` to pin the process to nodes that offer it."""
    port_file: str | None = None
    """Where the process writes the port it bound (for ``--port 0``); ``ProcessHost.start`` waits for it."""
    cwd: str | None = None
    """The process's working folder, where the node has it (recipes name paths relative to where they were
    launched); else the host's own."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProcessSpec:
        return cls(**dict(d))


class ProcessHost:
    """The actor body: runs one ``ProcessSpec`` as a process on this actor's node, under ``pipeline.launch.reaper``.

    Methods return small dicts and ints only. ``start`` returns once the process runs (and, with a port file, once
    it has bound its port), with the node's address, so that callers build URLs from where the process really is.
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.spec = ProcessSpec.from_dict(spec)
        self.state: Path | None = None
        self.reaper_pid: int | None = None
        self._pidfd: int | None = None

    def start(self, timeout_s: float = 300.0) -> dict[str, Any]:
        if self.poll() is None and self.reaper_pid is not None:
            raise SluiceError(f"{self.spec.name} is already running (reaper pid {self.reaper_pid})")
        log_path = Path(self.spec.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        port_file = Path(self.spec.port_file) if self.spec.port_file else None
        if port_file is not None:
            port_file.unlink(missing_ok=True)  # a previous run's file would announce a dead port
        # Beside the log: the run folder owns it, and a restart replaces it.
        self.state = log_path.parent / f".{self.spec.name}.state"
        shutil.rmtree(self.state, ignore_errors=True)
        ip = node_ip()
        # Where Ray placed this host is known only here: the process binds and announces this node's address.
        env = {**os.environ, **self.spec.env, "SLUICE_NODE_IP": ip}
        argv = [arg.replace("{node_ip}", ip) for arg in self.spec.cmd]
        cmd = [sys.executable, "-m", "pipeline.launch.reaper", str(os.getpid()), str(self.state), "--", *argv]
        with open(log_path, "ab") as out:
            cwd = self.spec.cwd if self.spec.cwd and os.path.isdir(self.spec.cwd) else None
            launcher = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        cwd=cwd)
        if launcher.wait() != 0:  # the reaper never forked: bad arguments, or it could not start at all
            raise SluiceError(f"{self.spec.name}: the reaper failed to start (exit {launcher.returncode}); see "
                              f"{self.spec.log_path}")
        self.reaper_pid = int(self._wait_for(self.state / "reaper.pid", timeout_s, "start"))
        self._pidfd = os.pidfd_open(self.reaper_pid)
        info: dict[str, Any] = {"pid": self.reaper_pid, "node_ip": ip, "node_id": node_id(),
                                "host": socket.gethostname()}
        if port_file is not None:
            info["port"] = int(self._wait_for(port_file, timeout_s, "bind its port"))
        return info

    def _wait_for(self, path: Path, timeout_s: float, what: str) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists():
                text = path.read_text().strip()
                if text.isdigit():
                    return text
            if self.reaper_pid is not None and (code := self.poll()) is not None:
                raise SluiceError(f"{self.spec.name} exited with code {code} before it could {what}; see "
                                  f"{self.spec.log_path}")
            time.sleep(0.05)
        self.kill()
        raise SluiceError(f"{self.spec.name} did not {what} within {timeout_s:.0f}s; see {self.spec.log_path}")

    def poll(self) -> int | None:
        """The exit code, or None while the process runs (or before it started)."""
        if self._pidfd is None or self.state is None:
            return None
        if select.select([self._pidfd], [], [], 0)[0] == []:
            return None
        exit_file = self.state / "exit"
        return int(exit_file.read_text()) if exit_file.exists() else HOST_DIED

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process (the reaper forwards it; the process decides what its children get)."""
        if self.reaper_pid is not None and self.poll() is None:
            os.kill(self.reaper_pid, signum)

    def wait(self, timeout_s: float) -> int | None:
        """The exit code once the process exits within ``timeout_s``, else None."""
        if self._pidfd is None:
            return None
        select.select([self._pidfd], [], [], max(timeout_s, 0.0))
        return self.poll()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then kill; whatever the process started goes with it (the reaper
        kills the process's group once the process has exited)."""
        if self.reaper_pid is None:
            return None
        self.signal(signal.SIGTERM)
        if self.wait(timeout_s) is None:
            self.kill()
        return self.poll()

    def kill(self) -> None:
        """Kill the process and its group at once (a forced stop)."""
        if self.reaper_pid is None or self.poll() is not None:
            return
        os.kill(self.reaper_pid, signal.SIGUSR1)
        if self.wait(10.0) is None:
            os.kill(self.reaper_pid, signal.SIGKILL)


def node_ip() -> str:
    """This node's address as Ray reports it (an interface address, not loopback), or loopback outside Ray."""
    try:
        import ray

        if not ray.is_initialized() or os.environ.get("SLUICE_LOOPBACK") == "1":
            return "127.0.0.1"  # outside Ray, or on a run's private instance, which serves this machine only
        return str(ray.util.get_node_ip_address())
    except ImportError:
        return "127.0.0.1"


def node_id() -> str | None:
    """The Ray node this process runs on, or None outside Ray."""
    try:
        import ray

        # Checked first: get_runtime_context() would start a local Ray instance where none runs.
        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None
    except ImportError:
        return None


def host_actor_class() -> Any:
    """``ProcessHost`` as a Ray actor class. ``max_restarts=0``: the supervisor, not Ray, decides on restarts (with
    its own backoff and budget), and a restart must start the process, not just the actor."""
    import ray

    # One call at a time: a stop and a start of the same host never interleave.
    return ray.remote(max_restarts=0, max_concurrency=1)(ProcessHost)


@dataclass
class RestartBudget:
    """At most ``limit`` restarts in any ``window_s``, each after an exponential backoff that resets once the process
    has stayed up for a window."""

    limit: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    restarts: deque[float] = field(default_factory=deque)

    def next_delay(self, now: float, up_since: float) -> float:
        """Seconds to wait before the next restart; raises ``SluiceError`` once the budget is spent."""
        while self.restarts and now - self.restarts[0] > self.window_s:
            self.restarts.popleft()
        if now - up_since > self.window_s:
            self.restarts.clear()  # it ran a whole window: a fresh failure, not a crash loop
        if len(self.restarts) >= self.limit:
            raise SluiceError(f"{len(self.restarts) + 1} failures within {self.window_s:.0f}s")
        delay = min(self.backoff_s * 2 ** len(self.restarts), self.max_backoff_s)
        self.restarts.append(now)
        return delay


def check_resources(spec: ProcessSpec, cluster: Mapping[str, float]) -> None:
    """Refuse, before anything starts, a process that asks for a resource no node of the cluster has."""
    wanted = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
    missing = {k: v for k, v in wanted.items() if v > 0 and cluster.get(k, 0.0) < v}
    if missing:
        raise ConfigError(f"{spec.name} asks for {missing} but the Ray cluster offers "
                          f"{ {k: cluster.get(k, 0.0) for k in missing} }; add nodes with those resources or lower "
                          "the request in the recipe")


class HostedProcess:
    """One supervised process: its spec, the actor hosting it, and its restart budget.

    ``state()`` is "running", "exited" (with ``exit_code``), or "lost" when the host itself is gone (its node left
    the cluster, or its worker died). A lost or exited process comes back with ``restart()``, on any node that offers
    its resources; until such a node exists the restart waits for one.
    """

    def __init__(self, spec: ProcessSpec, *, scheduling: Any = None, budget: RestartBudget | None = None) -> None:
        self.spec = spec
        self.scheduling = scheduling
        self.budget = budget or RestartBudget()
        self.actor: Any = None
        self.info: dict[str, Any] = {}
        self.exit_code: int | None = None
        self.up_since = 0.0

    def start(self, timeout_s: float = 300.0) -> dict[str, Any]:
        import ray

        return self.started(ray.get(self.launch(timeout_s), timeout=timeout_s + 60))

    def launch(self, timeout_s: float = 300.0) -> Any:
        """Create the host and ask it to start the process; returns the reference ``started`` takes the answer of,
        so that many processes start at once. Creating the actor waits for a node with the resources; the timeout
        bounds that wait and the start."""
        options: dict[str, Any] = {"num_cpus": self.spec.num_cpus, "num_gpus": self.spec.num_gpus,
                                   "resources": dict(self.spec.resources) or None}
        if self.scheduling is not None:
            options["scheduling_strategy"] = self.scheduling
        self.actor = host_actor_class().options(**options).remote(self.spec.to_dict())
        return self.actor.start.remote(timeout_s)

    def started(self, info: dict[str, Any]) -> dict[str, Any]:
        self.info = info
        self.exit_code = None
        self.up_since = time.monotonic()
        return info

    def state(self, timeout_s: float = 10.0) -> str:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self.actor is None:
            return "lost"
        try:
            code = ray.get(self.actor.poll.remote(), timeout=timeout_s)
        except (RayActorError, GetTimeoutError):
            return "lost"
        if code is None:
            return "running"
        self.exit_code = code
        return "exited"

    def restart(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Replace the host (wherever Ray now places it) after the budget's backoff; raises once it is spent."""
        delay = self.restart_delay()
        self.discard()
        time.sleep(delay)
        return self.start(timeout_s)

    def restart_delay(self) -> float:
        """Spend one restart of the budget: the backoff to wait before it; raises once the budget is spent."""
        try:
            return self.budget.next_delay(time.monotonic(), self.up_since)
        except SluiceError as e:
            raise SluiceError(f"{self.spec.name}: {e}; see {self.spec.log_path}") from None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Orderly stop of the process, then of its host."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self.actor is not None:
            try:
                ray.get(self.actor.stop.remote(timeout_s), timeout=timeout_s + 30)
            except (RayActorError, GetTimeoutError):
                pass  # the host is gone, and its process with it (it dies with its host)
        self.discard()

    def discard(self) -> None:
        """Drop the host without waiting; its process dies with it."""
        import ray

        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
            self.actor = None
