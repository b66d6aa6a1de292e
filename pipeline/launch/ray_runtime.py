"""The Ray instance a run's processes live in: a private one on this machine, or an existing cluster.

A private instance is a ``ray start --head --block`` under ``pipeline.launch.reaper``, watching the launcher, rather
than the one ``ray.init()`` would start inside the launcher. Two reasons, both measured:

- ``ray.init()`` starts GCS and raylet in the launcher's process group with only SIGINT blocked, so a SIGHUP or
  SIGTERM sent to that group (a closing terminal, ``kill -- -PGID``) killed Ray, and with it every process, before
  the launcher's orderly stop could run. Under the reaper, Ray has a session of its own.
- The reaper SIGKILLs Ray's whole group once the launcher is gone, however it went (even SIGKILL), and each process
  of the run dies with its host actor (``pipeline.launch.cluster``): nothing a run started outlives its launcher.

``ray start`` ignores SIGTERM while it blocks, so the instance is stopped with the reaper's SIGUSR1 (a SIGKILL of
the group); it holds no state worth an orderly stop, since everything of the run is in Redis and the run folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import SluiceError
from pipeline.rundir import log_path, logs_dir

log = logging.getLogger(__name__)

# Ray's session folders hold Unix sockets, whose paths may not exceed 107 bytes; Ray appends about 60 to its temp dir.
_MAX_TEMP_DIR = 44
_OBJECT_STORE_BYTES = 128 * 2**20  # no bulk data goes through Ray on this path; the default takes 30% of memory
# Token auth, said on both sides: Ray 2.60 decides it by whether ~/.ray/auth_token exists (for a new head, which then
# refuses to start without a token if the mode says token) and by RAY_AUTH_MODE (for a driver); left to those
# defaults, a private head and its launcher disagreed as soon as any earlier use of Ray had written the file. The
# token is Ray's own, in Ray's own file (created once with `ray get-auth-token --generate`), never in the run's.
_AUTH = {"RAY_AUTH_MODE": "token"}


@dataclass
class RayInstance:
    """The instance a run connected to: its address, its dashboard if any, and the private head if sluice owns it."""

    address: str
    dashboard_url: str | None
    head: PrivateHead | None = None


def temp_dir_for(run_dir: Path) -> Path:
    """The run folder's ``ray`` subfolder when its path is short enough for Ray's sockets, else one in the system's
    temp folder named after the run folder (the same for every launch of the run)."""
    inside = run_dir.resolve() / "ray"
    if len(str(inside)) <= _MAX_TEMP_DIR:
        return inside
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return Path("/tmp") / f"sluice-ray-{digest}"


class PrivateHead:
    """``ray start --head --block`` for one run, tied to the launcher by ``pipeline.launch.reaper``."""

    def __init__(self, temp_dir: Path, state_dir: Path, log_path: Path, *, num_cpus: float,
                 dashboard: bool) -> None:
        self.temp_dir, self.state_dir, self.log_path = temp_dir, state_dir, log_path
        self.num_cpus, self.dashboard = num_cpus, dashboard
        self.reaper_pid: int | None = None

    def start(self) -> None:
        """Begin starting the head; ``address`` waits for it."""
        # A previous launch's session: its sockets and address file would be mistaken for this one's.
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self.temp_dir.mkdir(parents=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        ray_cli = Path(sys.executable).with_name("ray")
        cmd = [str(ray_cli) if ray_cli.exists() else "ray", "start", "--head", "--block", "--port", "0",
               "--temp-dir", str(self.temp_dir), "--num-cpus", f"{self.num_cpus:g}",
               "--object-store-memory", str(_OBJECT_STORE_BYTES), "--disable-usage-stats",
               f"--include-dashboard={'true' if self.dashboard else 'false'}"]
        token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        if "RAY_AUTH_TOKEN" not in os.environ and not token_file.exists():
            # Its output is the token: it goes nowhere.
            subprocess.run([cmd[0], "get-auth-token", "--generate"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=True, timeout=120)
        reaper = [sys.executable, "-m", "pipeline.launch.reaper", str(os.getpid()), str(self.state_dir), "--", *cmd]
        # SLUICE_LOOPBACK reaches every host through Ray's workers: the run's processes bind loopback too.
        env = {**os.environ, "RAY_TMPDIR": str(self.temp_dir), **_AUTH, "SLUICE_LOOPBACK": "1"}
        with open(self.log_path, "ab") as out:
            launcher = subprocess.Popen(reaper, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        if launcher.wait() != 0:
            raise SluiceError(f"could not start Ray's reaper (exit {launcher.returncode}); see {self.log_path}")

    def address(self, timeout_s: float = 120.0, attempts: int = 3) -> str:
        """The GCS address, once the head has written it.

        A head that exits while starting is started again, up to ``attempts`` starts in all: under load (a warm start
        training on every core beside it) Ray's own start-up deadlines can lapse, and a second start then finds the
        machine quieter. Each failed start's log tail is logged; the last one's is in the error.
        """
        for attempt in range(1, attempts + 1):
            if self._wait_for_address(timeout_s):
                return (self.temp_dir / "ray_current_cluster").read_text().strip()
            tail = self.log_tail()
            if attempt == attempts:
                raise SluiceError(f"the run's Ray instance exited while starting ({attempts} starts); "
                                  f"the end of {self.log_path}:\n{tail}")
            log.warning("the run's Ray instance exited while starting (start %d of %d); starting it again. "
                        "The end of its log:\n%s", attempt, attempts, tail)
            self.reaper_pid = None
            self.start()
        raise AssertionError("unreachable")

    def _wait_for_address(self, timeout_s: float) -> bool:
        """True once the address is written, False if the head exited first."""
        address_file = self.temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.reaper_pid is None and (self.state_dir / "reaper.pid").exists():
                self.reaper_pid = int((self.state_dir / "reaper.pid").read_text())
            if address_file.exists() and address_file.read_text().strip():
                return True
            if (self.state_dir / "exit").exists():
                return False
            time.sleep(0.1)
        self.stop()
        raise SluiceError(f"the run's Ray instance did not start within {timeout_s:.0f}s; see {self.log_path}")

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.reaper_pid is None and (self.state_dir / "reaper.pid").exists():
            self.reaper_pid = int((self.state_dir / "reaper.pid").read_text())
        if self.reaper_pid is None:
            return
        try:
            os.kill(self.reaper_pid, signal.SIGUSR1)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while not (self.state_dir / "exit").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.temp_dir.name.startswith("sluice-ray-") and (self.state_dir / "exit").exists():
            # Outside the run folder (its path was too long for Ray's sockets): nothing would ever clean it up.
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_private_head(run_dir: Path, *, num_cpus: float, dashboard: bool) -> PrivateHead:
    """Begin starting a private instance for the run (about 6 s here); ``connected`` waits for it, so the caller
    can prepare the run meanwhile."""
    head = PrivateHead(temp_dir_for(run_dir), logs_dir(run_dir) / ".ray-head.state", log_path(run_dir, "ray"),
                       num_cpus=num_cpus, dashboard=dashboard)
    head.start()
    return head


@contextmanager
def connected(run_dir: Path, target: PrivateHead | str) -> Iterator[RayInstance]:
    """This process as the driver of the run's Ray (a private head, or a cluster's address); on exit it disconnects
    and stops the private head, and with it whatever the run still had on it."""
    head = target if isinstance(target, PrivateHead) else None
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", *_AUTH)}
    if head is not None:
        # Before Ray is imported: it reads its settings from the environment once.
        os.environ["RAY_TMPDIR"] = str(head.temp_dir)  # the driver's session files beside the head's
        os.environ.update(_AUTH)
        if "ray" in sys.modules:  # imported already, and its settings read: have them read again
            from ray._raylet import Config

            Config.initialize("")
    import ray

    try:
        address = head.address() if head is not None else str(target)
        context: Any = ray.init(address=address, namespace=f"sluice-{run_dir.resolve().name}", log_to_driver=False,
                                logging_level=logging.WARNING, configure_logging=False)
        url = getattr(context, "dashboard_url", None) or None
        yield RayInstance(address, f"http://{url}" if url and "://" not in url else url, head)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if head is not None:
            head.stop()
        for k, v in saved.items():  # a later driver in this process may connect to another cluster
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cluster_resources() -> dict[str, float]:
    import ray

    return {k: float(v) for k, v in ray.cluster_resources().items()}
