"""The launcher's stop request (SIGINT, SIGTERM, SIGHUP), its run lock in Redis (docs/launcher.md), and its watch over
the embedded Redis (docs/faults.md)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import redis

from pipeline.errors import SluiceError
from pipeline.launch.cluster import RestartBudget
from pipeline.queue.connection import RedisClient
from pipeline.queue.redis_server import EmbeddedRedis

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOCK_TTL_S = 30.0  # a killed launcher's lock lasts this long after its last renewal


class RunLockedError(SluiceError):
    """Another launcher holds the run's lock: the run is live."""


class Interrupted(Exception):
    """Raised in the launcher's main thread once a stop signal has arrived (``StopRequest.pause``)."""


class StopRequest:
    """The launcher's SIGINT, SIGTERM and SIGHUP: the first asks for the orderly stop, any later one forces it.

    The handler only sets a flag, and the main thread unwinds into the orderly stop at its next ``pause`` (at most
    half a second away). Raising from the handler instead, as Python's KeyboardInterrupt does, could land between a
    process's start and the supervisor recording it, and that process would outlive the run. Forcing kills the
    processes on this machine from the handler itself (``on_force``), and the main thread, which waits in short
    slices, kills the rest through Ray.
    """

    def __init__(self, on_force: Callable[[], None] = lambda: None) -> None:
        self.on_force = on_force  # runs in the handler on a second signal: it may signal processes, never block
        self.signum: int | None = None
        self.forced = False
        self.killed: list[str] = []  # children the orderly stop had to SIGKILL after their timeout
        self._stopping = False
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers (an embedding caller keeps its own)
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            # An ignored signal stays ignored: nohup ignores SIGHUP, and a shell without job control starts a
            # background job with SIGINT ignored, so that a Ctrl-C meant for the foreground job does not reach it.
            if previous is signal.SIG_IGN:
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._on_signal)

    def reinstall(self) -> None:
        """Put the handlers back after a library replaced them at the C level (Ray's core worker installs its own
        SIGTERM handler when it connects, which prints a stack and exits)."""
        for sig in self._previous:
            signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def request(self) -> None:
        """Ask for the orderly stop without a signal (the run's lock was lost)."""
        self._event.set()

    def begin_stop(self) -> None:
        """The orderly stop has begun (after a signal or at the end of the run): a signal from now on forces it."""
        self._stopping = True

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``; raise ``Interrupted`` as soon as a stop has been asked for."""
        if self._event.wait(seconds):
            raise Interrupted

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self._stopping and self.signum is None:
            self.signum = signum
            self._event.set()
            _say(f"\n{name}: stopping (producers stop admitting, the trainer commits at a step boundary); "
                 "Ctrl-C again forces it\n")
            return
        self.forced = True
        _say(f"\n{name}: forcing the stop (SIGKILL of every process; the trainer redoes its uncommitted steps)\n")
        self.on_force()


def _say(text: str) -> None:
    # os.write, not print: a handler that prints while the main thread is inside print raises a reentrancy error.
    os.write(sys.stderr.fileno(), text.encode())


_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


@dataclass
class RunLock:
    """One launcher per run: the key ``sluice:{run}:launcher`` in the run's Redis, set NX with a TTL.

    It lives in Redis rather than in the run folder, so it holds across machines that share the queue (a file lock on
    a network file system does not), and the TTL frees it once a killed launcher stops renewing it. The value names
    the holder (host, PID, start time) for the refusal, and its random token lets only the holder renew or delete it.
    """

    client: RedisClient
    key: str
    value: str
    ttl_s: float = LOCK_TTL_S
    on_lost: Callable[[], None] = lambda: None
    lost: bool = False
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, client: RedisClient, key: str, what: str, ttl_s: float = LOCK_TTL_S,
                on_lost: Callable[[], None] = lambda: None) -> RunLock:
        """Take the lock and start renewing it, or raise ``RunLockedError`` naming the live launcher."""
        value = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": round(time.time(), 3),
                            "token": uuid.uuid4().hex})
        for _ in range(3):  # the holder's key may lapse between our SET and the GET that names it
            if client.set(key, value, nx=True, px=int(ttl_s * 1000)):
                lock = cls(client, key, value, ttl_s, on_lost)
                lock._thread = threading.Thread(target=lock._renew_until_released, name="run-lock", daemon=True)
                lock._thread.start()
                return lock
            held, ttl_ms = client.pipeline().get(key).pttl(key).execute()
            if held is not None:
                raise RunLockedError(_holder_message(held, ttl_ms, what, ttl_s))
        raise RunLockedError(f"{what}: the launcher lock {key} keeps changing hands; is a launcher restarting in a "
                             "loop?")

    def release(self) -> None:
        """Stop renewing and delete the key, if it is still ours."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.client.eval(_RELEASE, 1, self.key, self.value)
        except redis.RedisError as exc:  # the stop goes on; the lock lapses by itself
            log.warning("could not release the run's lock %s (%s); it lapses within %.0f s", self.key, exc, self.ttl_s)

    def _renew_until_released(self) -> None:
        while not self._done.wait(self.ttl_s / 3):
            try:
                if self.client.eval(_RENEW, 1, self.key, self.value, int(self.ttl_s * 1000)):
                    continue
                # Lapsed: this launcher stalled (suspended, or Redis out of reach) for longer than the TTL.
                if self.client.set(self.key, self.value, nx=True, px=int(self.ttl_s * 1000)):
                    log.warning("the run's lock %s had lapsed (did this launcher stall for over %.0f s?); took it "
                                "again", self.key, self.ttl_s)
                    continue
                log.error("another launcher holds the run's lock %s now (%s); stopping this one", self.key,
                          self.client.get(self.key))
                self.lost = True
                self.on_lost()
                return
            except redis.RedisError as exc:
                # Retried at the next tick (the client retries each call too); the TTL leaves Redis two more ticks.
                log.warning("could not renew the run's lock %s (%s); retrying", self.key, exc)


def _holder_message(held: bytes | str, ttl_ms: int, what: str, ttl_s: float) -> str:
    info = json.loads(held)
    host, pid = info.get("host", "?"), info.get("pid", "?")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("since", 0))))
    return (f"{what} is live: its launcher is PID {pid} on host {host}, running since {since}. Nothing was started. "
            f"Stop that launcher first (Ctrl-C in its terminal, or `kill -TERM {pid}` on {host}), then run this "
            f"command again; if that launcher was killed, its lock lapses {ttl_s:.0f} s after its last renewal "
            f"(in at most {max(ttl_ms, 0) / 1000:.0f} s).")


@dataclass
class RedisWatch:
    """The run's embedded Redis under its launcher: one that died (a crash, an OOM kill, a SIGKILL) is started again
    on its AOF at the port it had, so that every process's client reconnects through its retry (about 15 s of
    tries, ``pipeline.queue.connection.DEFAULT_RETRY``), under a restart budget like any process's.

    After a restart ``on_restart`` runs: the launcher restarts the producers, each of which then hands back the
    prompts its in-flight hash in Redis still records. That covers a put the server acknowledged but lost before
    its AOF held it (docs/faults.md, "Durability"): its record is still in flight, and nothing else would ever hand
    it back while the producer lives.
    """

    server: EmbeddedRedis
    budget: RestartBudget
    on_restart: Callable[[], None] = lambda: None
    restarts: int = 0

    def check(self, pause: Callable[[float], None]) -> None:
        """Restart the server if it died; raises SluiceError once the budget is spent."""
        if self.server.alive():
            return
        log_path = self.server.folder / "redis.log"
        try:
            delay = self.budget.next_delay(time.monotonic(), self.server.up_since)
        except SluiceError as e:
            raise SluiceError(f"the run's embedded Redis died again: {e}; see {log_path}") from None
        log.warning("the embedded Redis (port %s) died; restarting it on its AOF in %.1f s (log: %s)",
                    self.server.port, delay, log_path)
        pause(delay)
        started = time.monotonic()
        self.server.restart()
        self.restarts += 1
        log.warning("the embedded Redis is back on port %s after %.1f s (pid %s); restarting the producers so that "
                    "each hands back what it had in flight", self.server.port, time.monotonic() - started,
                    self.server.pid)
        self.on_restart()
