"""``sluice run``: place, start and supervise every process of a run on this machine.

The launcher owns the run folder and the embedded Redis. It starts the CPU engines (or connects to SGLang servers),
the producers, the trainer ranks and the evaluator as child processes, archives the queue in a thread of its own,
and restarts what dies: a producer or engine simply comes back (producers hold no state; a restarted engine's stale
weights make the trainer's next push fail, and the restarted trainer resynchronises every engine), and the trainer
resumes from its last checkpoint. It stops when the trainer finishes its steps, or on SIGINT, SIGTERM or SIGHUP
(docs/launcher.md: the stop protocol, and the Redis lock that keeps a second launcher off a live run).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import redis

from pipeline.config import SluiceConfig
from pipeline.consumers.sft_config import format_summary, read_done, warmstart_dir, warmstart_model_dir
from pipeline.errors import EngineError, SluiceError
from pipeline.queue.archive import Archiver
from pipeline.queue.redis_server import free_port
from pipeline.queue.rundir import RunHandle, open_run
from pipeline.report import format_curve, format_heldout, learning_curve

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
MAX_RESTARTS = 5
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long the orderly stop waits for the trainer ranks' last step, push and commit (a checkpoint save) before it
# SIGKILLs them; the data is safe either way (the entries stay pending), only the uncommitted steps are redone.
TRAINER_STOP_S = 120.0
CHILD_STOP_S = 30.0  # the same for every other child, once the trainer ranks are gone
LOCK_TTL_S = 30.0  # a killed launcher's lock lasts this long after its last renewal


class RunLockedError(SluiceError):
    """Another launcher holds the run's lock: the run is live."""


class Interrupted(Exception):
    """Raised in the launcher's main thread once a stop signal has arrived (``StopRequest.pause``)."""


def prepare_run(cfg: SluiceConfig, handle: RunHandle | None = None) -> tuple[RunHandle, Path]:
    """Create the run folder, start (or reuse) its Redis, write the resolved config, and make sure a model exists.

    Returns the folder engines and trainer start from (``model_folder``). With ``warmstart.enabled`` that is the
    warm start's output, which exists only once ``warm_start`` has run. ``sluice run`` passes the handle it opened to
    take the run's lock, so that nothing here touches a live run.
    """
    run_dir = Path(cfg.run.run_dir)
    handle = handle or open_run_folder(cfg)
    ensure_base_model(cfg)
    (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=1))
    for name in ("trainer", *(["archive"] if cfg.queue.archive.enabled else []),
                 *([cfg.eval.group] if cfg.eval.enabled else [])):
        handle.queue.create_group(name, "0")
    return handle, model_folder(cfg)


def open_run_folder(cfg: SluiceConfig) -> RunHandle:
    """The run's queue, the run folder created and the embedded Redis started (or reused) where needed."""
    return open_run(run_dir=Path(cfg.run.run_dir), redis_url=cfg.queue.redis_url, run=cfg.run.name, create=True,
                    appendfsync=cfg.queue.appendfsync, capacity=cfg.queue.capacity)


def ensure_base_model(cfg: SluiceConfig) -> Path:
    """The base model folder; with model.path unset, the tiny model is written into the run folder first."""
    model_dir = base_model_folder(cfg)
    if not (model_dir / "config.json").exists():
        if cfg.model.path is not None:
            raise SluiceError(f"model.path {model_dir} has no config.json; point it at an HF model folder")
        from pipeline.models.tiny import init_tiny_model

        init_tiny_model(cfg.model.init_tiny, model_dir, seed=cfg.model.init_seed, **cfg.model.init_overrides)
    return model_dir


def base_model_folder(cfg: SluiceConfig) -> Path:
    """The HF model a run starts from before any warm start: model.path, else the tiny model in the run folder."""
    return Path(cfg.model.path) if cfg.model.path is not None else Path(cfg.run.run_dir) / "model"


def model_folder(cfg: SluiceConfig) -> Path:
    """The HF model engines, producers' tokenizer and trainer (and its KL reference) start from: the warm-started
    one when warmstart.enabled, else the base model."""
    if cfg.warmstart.enabled:
        return warmstart_model_dir(Path(cfg.run.run_dir))
    return base_model_folder(cfg)


def warm_start(cfg: SluiceConfig, run_dir: Path, sup: Supervisor,
               pause: Callable[[float], None] = time.sleep) -> None:
    """Run the recipe's warm start as a child process (its time counts in the run's), unless one has finished.

    Returns once the child has written its done marker, which it writes last: the child's own exit (interpreter
    teardown, a few seconds) then overlaps the engines' start-up. The child reads RUN_DIR/config.json, so
    ``prepare_run`` must have written it.
    """
    done = read_done(run_dir)
    if done is not None:
        if done.get("config") != cfg.warmstart.model_dump(mode="json"):
            log.warning("[warmstart] changed since the warm start in %s ran; keeping the finished one (delete that "
                        "folder to train it again)", warmstart_dir(run_dir))
        print(f"warm start skipped, already done ({format_summary(done)})", flush=True)
        return
    child = Child("warmstart", [sys.executable, "-m", "pipeline.processes", "sft", str(run_dir)], _child_env(),
                  run_dir / "logs" / "warmstart.log", restartable=False)
    ws = cfg.warmstart
    stops = ([] if ws.until_loss is None else [f"mean loss <= {ws.until_loss}"]) + (
        [] if ws.until_exact_match is None else [f"exact match >= {ws.until_exact_match}"])
    until = f", or until a {ws.log_every}-step window's {' or '.join(stops)}" if stops else ""
    print(f"warm start: {ws.steps} steps of SFT{until} (log: {child.log_path})", flush=True)
    sup.add(child)
    assert child.proc is not None
    while (done := read_done(run_dir)) is None:
        code = child.proc.poll()
        if code is not None:
            # Read once more: the marker may have landed between the two checks.
            if (done := read_done(run_dir)) is not None:
                break
            raise SluiceError(f"the warm start failed (exit code {code}); see {child.log_path}")
        pause(0.2)
    print(format_summary(done), flush=True)


def load_run_config(run_dir: Path) -> SluiceConfig:
    return SluiceConfig.model_validate(json.loads((run_dir / CONFIG_FILE).read_text()))


@dataclass
class Child:
    """A supervised child process."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    restartable: bool = True
    stop_last: bool = False  # others need it until they have stopped (an engine serves the trainer's last push)
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    done: bool = False

    def start(self) -> None:
        self.reap_group()  # what the previous run of this child left behind
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            # Own session: a Ctrl-C to the launcher reaches children through the launcher's orderly shutdown only.
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.reap_group()  # the child is gone, but what it started may not be
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reap_group()

    def reap_group(self) -> None:
        """SIGKILL what is left of this child's process group once the child itself has exited.

        Each child leads its own session, so its group holds the child and what it started. A multiprocessing
        server a trainer started (a manager for megatron's checkpoint writers) is never told that its parent was
        killed with SIGKILL, and would otherwise outlive the run.
        """
        if self.proc is None or self.proc.poll() is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left in the group


@dataclass
class Supervisor:
    """Starts children and restarts the ones that die, up to MAX_RESTARTS each."""

    children: dict[str, Child] = field(default_factory=dict)

    def add(self, child: Child) -> None:
        self.children[child.name] = child
        child.start()

    def poll(self) -> list[str]:
        """Restart dead children; returns the names of those that finished cleanly and are not restarted."""
        finished = []
        for child in self.children.values():
            if child.done or child.proc is None or child.proc.poll() is None:
                continue
            code = child.proc.returncode
            if not child.restartable:
                # Finished for good, or failed: the caller decides (trainer ranks restart as a group).
                if code == 0:
                    child.done = True
                    finished.append(child.name)
                continue
            if child.restarts >= MAX_RESTARTS:
                raise SluiceError(f"{child.name} died {child.restarts + 1} times (last exit code {code}); see "
                                  f"{child.log_path}")
            child.restarts += 1
            log.warning("%s exited with code %s; restart %d of %d", child.name, code, child.restarts, MAX_RESTARTS)
            child.start()
        return finished

    def stop_all(self, first_timeout_s: float = TRAINER_STOP_S, last_timeout_s: float = CHILD_STOP_S) -> list[str]:
        """The orderly stop, in two waves; each SIGTERMs its children at once and waits for them together.

        First the producers (they stop admitting and hand their in-flight prompts back), the evaluator and the
        trainer ranks (they agree on a step boundary, push and commit), while the engines still serve that last
        push; then the engines. One at a time would make the stop the sum of the children's exits. Returns the
        children that had to be SIGKILLed because they outlived their wave's timeout.
        """
        killed = self._terminate([c for c in self.children.values() if not c.stop_last], first_timeout_s)
        killed += self._terminate([c for c in self.children.values() if c.stop_last], last_timeout_s)
        for child in self.children.values():
            child.reap_group()
        return killed

    def kill_all(self) -> None:
        """SIGKILL every child's process group at once: the forced stop. Safe to call from a signal handler."""
        for child in list(self.children.values()):
            if child.proc is not None and child.proc.returncode is None:
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass  # gone already

    @staticmethod
    def _terminate(children: list[Child], timeout_s: float) -> list[str]:
        live = [c for c in children if c.proc is not None and c.proc.poll() is None]
        for child in live:
            child.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        killed = []
        for child in live:
            try:
                child.proc.wait(max(deadline - time.monotonic(), 0.0))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs of SIGTERM; killing it", child.name, timeout_s)
                child.proc.kill()  # type: ignore[union-attr]
                child.proc.wait()  # type: ignore[union-attr]
                killed.append(child.name)
        return killed


def _child_env(threads: int = 1, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.update(extra)
    return env


def wait_healthy(urls: list[str], timeout_s: float, pause: Callable[[float], None] = time.sleep) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for url in list(pending):
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    pending.remove(url)
            except httpx.HTTPError:
                pass
        pause(0.2)
    if pending:
        raise EngineError(f"engines {pending} did not answer /health within {timeout_s:.0f}s; see their logs")


def start_engines(cfg: SluiceConfig, sup: Supervisor, model_dir: Path, run_dir: Path,
                  pause: Callable[[float], None] = time.sleep) -> list[str]:
    if cfg.engine.type == "sglang":
        wait_healthy(list(cfg.engine.urls), cfg.engine.startup_timeout_s, pause)
        return list(cfg.engine.urls)
    urls = []
    for i in range(cfg.engine.count):
        port = free_port()
        cmd = [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--port", str(port),
               "--dtype", cfg.engine.dtype, "--max-batch", str(cfg.engine.max_batch), "--seed", str(cfg.run.seed + i),
               "--log-level", "warning"]
        if cfg.producer.return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        sup.add(Child(f"engine-{i}", cmd, _child_env(), run_dir / "logs" / f"engine-{i}.log", stop_last=True))
        urls.append(f"http://127.0.0.1:{port}")
    wait_healthy(urls, cfg.engine.startup_timeout_s, pause)
    return urls


def run(cfg: SluiceConfig) -> int:
    """The whole job on this machine; returns the exit code (128 + the signal's number after a stop by signal)."""
    started = time.monotonic()
    run_dir = Path(cfg.run.run_dir)
    sup = Supervisor()
    stop = StopRequest(sup)
    stop.install()  # first: from here on a signal leads to the orderly stop, whatever is starting
    try:
        handle = open_run_folder(cfg)
        try:
            lock = RunLock.acquire(handle.queue.redis, handle.queue.keys.launcher, f"run {handle.run!r} in {run_dir}",
                                   on_lost=stop.request)
        except BaseException:
            handle.close(stop_server=True)  # stops the embedded Redis only if this launcher started it
            raise
        archiver_stop = threading.Event()
        archiver_thread = None
        try:
            _, model_dir = prepare_run(cfg, handle)
            stop.pause(0)
            archiver_thread = _start_children(cfg, sup, handle, model_dir, stop.pause, archiver_stop)
            _supervise(cfg, sup, handle, stop.pause)
            print(format_curve(learning_curve(run_dir / "metrics" / "trainer.jsonl")))
            if cfg.eval.heldout.enabled and cfg.eval.heldout.live:
                _wait_for_heldout(sup, run_dir, cfg.eval.heldout.final_wait_s, stop.pause)
                print(format_heldout(run_dir / "eval" / "metrics.jsonl"))
            print(f"run folder: {run_dir}  (sluice queue audit --run-dir {run_dir})")
            return 0
        except Interrupted:
            if lock.lost:
                raise RunLockedError(f"another launcher took the lock of {run_dir} while this one ran (see the log "
                                     "above); this launcher stopped its processes") from None
            assert stop.signum is not None
            return 128 + stop.signum
        finally:
            stop.begin_stop()  # a signal from here on forces the stop
            stop.killed = sup.stop_all()
            archiver_stop.set()
            if archiver_thread is not None:
                archiver_thread.join(timeout=5 if stop.forced else 60)
            lock.release()
            handle.close(stop_server=True)  # the embedded Redis flushes its AOF and exits
            if stop.signum is not None:
                print(_stopped_summary(run_dir, stop), flush=True)
            print(f"wall time: {time.monotonic() - started:.0f} s, warm start and shutdown included")
    finally:
        stop.uninstall()


def _start_children(cfg: SluiceConfig, sup: Supervisor, handle: RunHandle, model_dir: Path,
                    pause: Callable[[float], None], archiver_stop: threading.Event) -> threading.Thread | None:
    """Warm start, engines, producers, trainer ranks, evaluator, and the archiver thread (returned, if any)."""
    run_dir = Path(cfg.run.run_dir)
    if cfg.warmstart.enabled:
        warm_start(cfg, run_dir, sup, pause)
    urls = start_engines(cfg, sup, model_dir, run_dir, pause)
    (run_dir / "engines.json").write_text(json.dumps(urls))
    base = [sys.executable, "-m", "pipeline.processes"]
    for i in range(cfg.producers):
        sup.add(Child(f"producer-{i}", [*base, "producer", str(run_dir), f"producer-{i}"], _child_env(),
                      run_dir / "logs" / f"producer-{i}.log"))
    master_port = str(free_port())
    for rank in range(cfg.trainer.world_size):
        env = _child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cfg.trainer.world_size),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=master_port)
        sup.add(Child(f"trainer-{rank}", [*base, "trainer", str(run_dir)], env,
                      run_dir / "logs" / f"trainer-{rank}.log", restartable=False))
    if cfg.eval.enabled or (cfg.eval.heldout.enabled and cfg.eval.heldout.live):
        sup.add(Child("evaluator", [*base, "evaluator", str(run_dir)], _child_env(),
                      run_dir / "logs" / "evaluator.log"))
    if not cfg.queue.archive.enabled:
        return None
    archiver = Archiver(handle.queue, run_dir / "archive", segment_samples=cfg.queue.archive.segment_samples,
                        flush_interval_s=cfg.queue.archive.flush_interval_s)
    thread = threading.Thread(target=archiver.run, kwargs={"stop": archiver_stop}, daemon=True)
    thread.start()
    return thread


def _supervise(cfg: SluiceConfig, sup: Supervisor, handle: RunHandle, pause: Callable[[float], None]) -> None:
    """Restart what dies and trim the stream until every trainer rank has finished its steps."""
    run_dir = Path(cfg.run.run_dir)
    trainers = {f"trainer-{r}" for r in range(cfg.trainer.world_size)}
    finished: set[str] = set()
    last_trim = last_report = time.monotonic()
    while not trainers <= finished:
        finished.update(sup.poll())
        _restart_trainer_group_if_needed(sup, trainers)
        now = time.monotonic()
        if now - last_trim > 10:
            handle.queue.trim()  # drops only what every group has acked
            last_trim = now
        if now - last_report > 10:
            _progress(run_dir)
            last_report = now
        pause(0.5)


def _stopped_summary(run_dir: Path, stop: StopRequest) -> str:
    from pipeline.consumers.checkpoints import latest_checkpoint

    latest = latest_checkpoint(run_dir / "checkpoints")
    committed = "no checkpoint yet" if latest is None else f"last checkpoint {latest.name}"
    if stop.forced:
        how = "forced"
    elif stop.killed:
        how = f"stopped; {', '.join(stop.killed)} outlived the stop's timeout and were SIGKILLed"
    else:
        how = "stopped in order"
    return (f"{how} after {signal.Signals(stop.signum or signal.SIGTERM).name} ({committed}); run the same command "
            "again to resume")


class StopRequest:
    """The launcher's SIGINT, SIGTERM and SIGHUP: the first asks for the orderly stop, any later one forces it.

    The handler only sets a flag, and the main thread unwinds into the orderly stop at its next ``pause`` (at most
    half a second away). Raising from the handler instead, as Python's KeyboardInterrupt does, could land between a
    child's fork and the supervisor recording it, and that child would outlive the run. Forcing SIGKILLs every
    child's process group from the handler itself, so a launcher blocked waiting for a child returns at once.
    """

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
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
        _say(f"\n{name}: forcing the stop (SIGKILL of every child; the trainer redoes its uncommitted steps)\n")
        self.sup.kill_all()


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

    client: redis.Redis
    key: str
    value: str
    ttl_s: float = LOCK_TTL_S
    on_lost: Callable[[], None] = lambda: None
    lost: bool = False
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, client: redis.Redis, key: str, what: str, ttl_s: float = LOCK_TTL_S,
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


def _wait_for_heldout(sup: Supervisor, run_dir: Path, timeout_s: float,
                      pause: Callable[[float], None] = time.sleep) -> None:
    """Keep the evaluator supervised until it has evaluated the final snapshot, or ``timeout_s`` passed."""
    from pipeline.consumers.heldout import caught_up

    deadline = time.monotonic() + timeout_s
    while not caught_up(run_dir):
        if time.monotonic() > deadline:
            log.warning("the final snapshot was not evaluated within %.0fs (eval.heldout.final_wait_s); run "
                        "`sluice eval --run-dir %s --heldout` to evaluate it", timeout_s, run_dir)
            return
        sup.poll()
        pause(0.5)


def _progress(run_dir: Path) -> None:
    path = run_dir / "metrics" / "trainer.jsonl"
    if path.exists():
        lines = path.read_text().splitlines()
        if lines:
            d = json.loads(lines[-1])
            print(f"step {d['step']}: policy version {d['policy_version']}, reward {d['reward_mean']:.3f}, "
                  f"lag max {d['lag_max']}", flush=True)


def _restart_trainer_group_if_needed(sup: Supervisor, trainers: set[str]) -> None:
    """Trainer ranks live and die together: if one failed, stop the others and start the whole group again."""
    procs = [sup.children[n] for n in sorted(trainers)]
    failed = [c for c in procs if c.proc is not None and c.proc.poll() not in (None, 0)]
    if not failed:
        return
    for c in procs:
        c.stop()
    if max(c.restarts for c in procs) >= MAX_RESTARTS:
        raise SluiceError(f"the trainer failed {MAX_RESTARTS + 1} times; see {failed[0].log_path}")
    for c in procs:
        c.restarts += 1
        log.warning("restarting %s from its last checkpoint (restart %d)", c.name, c.restarts)
        c.start()
