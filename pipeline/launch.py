"""``sluice run``: place, start and supervise every process of a run on this machine.

The launcher owns the run folder and the embedded Redis. It starts the CPU engines (or connects to SGLang servers),
the producers, the trainer ranks and the evaluator as child processes, archives the queue in a thread of its own,
and restarts what dies: a producer or engine simply comes back (producers hold no state; a restarted engine's stale
weights make the trainer's next push fail, and the restarted trainer resynchronises every engine), and the trainer
resumes from its last checkpoint. It stops when the trainer finishes its steps.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

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


def prepare_run(cfg: SluiceConfig) -> tuple[RunHandle, Path]:
    """Create the run folder, start (or reuse) its Redis, write the resolved config, and make sure a model exists.

    Returns the folder engines and trainer start from (``model_folder``). With ``warmstart.enabled`` that is the
    warm start's output, which exists only once ``warm_start`` has run.
    """
    run_dir = Path(cfg.run.run_dir)
    handle = open_run(run_dir=run_dir, redis_url=cfg.queue.redis_url, run=cfg.run.name, create=True,
                      appendfsync=cfg.queue.appendfsync, capacity=cfg.queue.capacity)
    ensure_base_model(cfg)
    (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=1))
    for name in ("trainer", *(["archive"] if cfg.queue.archive.enabled else []),
                 *([cfg.eval.group] if cfg.eval.enabled else [])):
        handle.queue.create_group(name, "0")
    return handle, model_folder(cfg)


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


def warm_start(cfg: SluiceConfig, run_dir: Path, sup: Supervisor) -> None:
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
        time.sleep(0.2)
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

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every child at once, wait for all of them together, then SIGKILL what is left.

        One at a time would make the shutdown the sum of the children's exits, and would leave a trainer rank
        alone in a collective while its peer still runs.
        """
        live = [c for c in self.children.values() if c.proc is not None and c.proc.poll() is None]
        for child in live:
            child.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        for child in live:
            try:
                child.proc.wait(max(deadline - time.monotonic(), 0.0))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                child.proc.kill()  # type: ignore[union-attr]
                child.proc.wait()  # type: ignore[union-attr]
        for child in self.children.values():
            child.reap_group()


def _child_env(threads: int = 1, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.update(extra)
    return env


def wait_healthy(urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for url in list(pending):
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    pending.remove(url)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    if pending:
        raise EngineError(f"engines {pending} did not answer /health within {timeout_s:.0f}s; see their logs")


def start_engines(cfg: SluiceConfig, sup: Supervisor, model_dir: Path, run_dir: Path) -> list[str]:
    if cfg.engine.type == "sglang":
        wait_healthy(list(cfg.engine.urls), cfg.engine.startup_timeout_s)
        return list(cfg.engine.urls)
    urls = []
    for i in range(cfg.engine.count):
        port = free_port()
        cmd = [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--port", str(port),
               "--dtype", cfg.engine.dtype, "--max-batch", str(cfg.engine.max_batch), "--seed", str(cfg.run.seed + i),
               "--log-level", "warning"]
        if cfg.producer.return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        sup.add(Child(f"engine-{i}", cmd, _child_env(), run_dir / "logs" / f"engine-{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    wait_healthy(urls, cfg.engine.startup_timeout_s)
    return urls


def run(cfg: SluiceConfig) -> int:
    """The whole job on this machine; returns the exit code."""
    started = time.monotonic()
    handle, model_dir = prepare_run(cfg)
    run_dir = Path(cfg.run.run_dir)
    sup = Supervisor()
    stop = threading.Event()
    archiver_thread = None
    try:
        if cfg.warmstart.enabled:
            warm_start(cfg, run_dir, sup)
        urls = start_engines(cfg, sup, model_dir, run_dir)
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
        if cfg.queue.archive.enabled:
            archiver = Archiver(handle.queue, run_dir / "archive", segment_samples=cfg.queue.archive.segment_samples,
                                flush_interval_s=cfg.queue.archive.flush_interval_s)
            archiver_thread = threading.Thread(target=archiver.run, kwargs={"stop": stop}, daemon=True)
            archiver_thread.start()
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
            time.sleep(0.5)
        print(format_curve(learning_curve(run_dir / "metrics" / "trainer.jsonl")))
        if cfg.eval.heldout.enabled and cfg.eval.heldout.live:
            _wait_for_heldout(sup, run_dir, cfg.eval.heldout.final_wait_s)
            print(format_heldout(run_dir / "eval" / "metrics.jsonl"))
        print(f"run folder: {run_dir}  (sluice queue audit --run-dir {run_dir})")
        return 0
    finally:
        stop.set()
        sup.stop_all()
        if archiver_thread is not None:
            archiver_thread.join(timeout=60)
        handle.close(stop_server=True)
        print(f"wall time: {time.monotonic() - started:.0f} s, warm start and shutdown included")


def _wait_for_heldout(sup: Supervisor, run_dir: Path, timeout_s: float) -> None:
    """Keep the evaluator supervised until it has evaluated the final snapshot, or ``timeout_s`` passed."""
    from pipeline.consumers.heldout import caught_up

    deadline = time.monotonic() + timeout_s
    while not caught_up(run_dir):
        if time.monotonic() > deadline:
            log.warning("the final snapshot was not evaluated within %.0fs (eval.heldout.final_wait_s); run "
                        "`sluice eval --run-dir %s --heldout` to evaluate it", timeout_s, run_dir)
            return
        sup.poll()
        time.sleep(0.5)


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
