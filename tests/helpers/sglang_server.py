"""A real SGLang 0.5.23 server on this CPU, for the tests marked ``sglang`` and for ``scripts/sglang-soak.py``.

Plain helpers, not fixtures: a test calls ``require_sglang()`` (which skips it when the environment that
``bash scripts/sglang-cpu.sh`` builds is absent), writes a model folder with ``write_model``, and starts a server on it
with ``start_server``; ``SGLangServer.stop`` ends the server's whole process group (SGLang's launcher, scheduler and
detokenizer) and nothing else. Every server runs in a process group of its own, with its log in a folder the caller
gives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.net import free_port

ENV_VAR = "SLUICE_SGLANG_ENV"
DEFAULT_ENV = Path.home() / ".cache" / "sluice" / "sglang-cpu-0.5.23"
COMPLETE_MARKER = ".sluice-sglang-cpu-complete"
WRAPPER = Path("bin") / "sglang-cpu-python"
BUILD_HINT = "bash scripts/sglang-cpu.sh"

CPU_FLAGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    "--max-total-tokens", "4096",
    "--dtype", "bfloat16",
    "--skip-server-warmup",
)  # fmt: skip
"""What SGLang 0.5.23 needs to start on a CPU without AVX-512 kernels (the launch flags of scripts/sglang-cpu.sh's
environment); a managed engine gets them as ``engine.launch_args``."""

HEALTH_TIMEOUT_S = 120.0


def env_dir() -> Path:
    """Where ``scripts/sglang-cpu.sh`` builds (or built) the environment."""
    return Path(os.environ.get(ENV_VAR) or DEFAULT_ENV).expanduser()


def sglang_python() -> Path | None:
    """The environment's ``sglang-cpu-python`` wrapper, or None when the environment is absent or unfinished."""
    env = env_dir()
    wrapper = env / WRAPPER
    if (env / COMPLETE_MARKER).is_file() and os.access(wrapper, os.X_OK):
        return wrapper
    return None


def missing_reason() -> str:
    env = env_dir()
    state = "is unfinished (no completion marker)" if env.exists() else "does not exist"
    return (f"the CPU SGLang environment {env} {state}; build it with `{BUILD_HINT}` (about 3 GB, a few minutes), "
            f"or point {ENV_VAR} at one")


def require_sglang() -> Path:
    """The wrapper interpreter; skips the calling test, saying how to build the environment, when it is absent."""
    import pytest

    python = sglang_python()
    if python is None:
        pytest.skip(missing_reason())
    return python


def write_model(folder: Path, *, seed: int = 0) -> Path:
    """sluice's own tiny Qwen3-MoE (2 layers, 8 experts, top-2, the character tokenizer) in ``folder``."""
    from pipeline.models.tiny import init_tiny_model

    return init_tiny_model("qwen3-moe", folder, seed=seed)


def moe_shape(model_dir: Path) -> tuple[int, int]:
    """``(MoE layers, experts per token)`` from the model's config.json (SGLang's /model_info does not say)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers = int(cfg["num_hidden_layers"])
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return len(moe), int(cfg["num_experts_per_tok"])


@dataclass
class SGLangServer:
    """One ``sglang.launch_server`` a caller started (and is the only one to stop)."""

    proc: subprocess.Popen[bytes]
    port: int
    model_dir: Path
    log: Path
    started_s: float = 0.0
    """Seconds from the start until /health answered."""
    _log_file: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pgid(self) -> int:
        return self.proc.pid  # started with start_new_session: the leader of its own group

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to whatever of it is left after ``timeout``; returns once
        no process of the group is left (so that nothing outlives a test)."""
        try:
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self._group_alive() and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.1)
            if self._group_alive():
                self._signal_group(signal.SIGKILL)
                # A loaded machine can take many seconds to tear down a killed server's memory and threads.
                deadline = time.monotonic() + 60
                while self._group_alive() and time.monotonic() < deadline:
                    self._reap()
                    time.sleep(0.1)
            self._reap()
            if self.proc.poll() is None:
                # The group looked gone (its members exited or are zombies) while the leader was still tearing
                # down: wait for the leader itself, so that ``alive`` is false when this returns.
                self._signal_group(signal.SIGKILL)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if self._log_file is not None:
                self._log_file.close()  # type: ignore[attr-defined]
                self._log_file = None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def _group_alive(self) -> bool:
        self._reap()
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # Only zombies may be left of a group whose leader we reaped: check the members' states.
        return any(_is_running(pid) for pid in _group_members(self.pgid))

    def _reap(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=0.01)
            except subprocess.TimeoutExpired:
                pass


def _group_members(pgid: int) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                found.append(p.pid)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return found


def _is_running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_server(
    model_dir: Path,
    log_dir: Path,
    *,
    python: Path | None = None,
    port: int | None = None,
    extra: tuple[str, ...] = (),
    timeout: float = HEALTH_TIMEOUT_S,
) -> SGLangServer:
    """Start ``sglang.launch_server`` on ``model_dir`` (bf16, routed experts on) on a free port of 127.0.0.1, in its
    own process group, logging to ``log_dir/sglang-PORT.log``; return once ``/health`` answers 200. Fails with the
    log's tail if it exits or is not healthy within ``timeout`` seconds (and then stops what it started)."""
    python = python or sglang_python()
    if python is None:
        raise RuntimeError(missing_reason())
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"sglang-{port}.log"
    cmd = [str(python), "-m", "sglang.launch_server", "--model-path", str(Path(model_dir).resolve()), *CPU_FLAGS,
           "--enable-return-routed-experts", "--port", str(port), "--host", "127.0.0.1", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PYTHONPATH", None)  # the env's own site-packages (with the sgl_kernel stand-in), not sluice's
    out = log.open("ab")
    out.write(("$ " + " ".join(cmd) + "\n").encode())
    out.flush()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    server = SGLangServer(proc, port, Path(model_dir), log, _log_file=out)
    try:
        wait_healthy(server, timeout)
    except BaseException:
        server.stop()
        raise
    server.started_s = time.monotonic() - start
    return server


def wait_healthy(server: SGLangServer, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Poll ``/health`` until it answers 200; RuntimeError with the log's tail if the server exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"SGLang exited with {server.proc.returncode} before /health answered; log "
                               f"{server.log}:\n{server.log_tail()}")
        if health(server.url):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"SGLang at {server.url} was not healthy within {timeout:.0f} s; log {server.log}:\n"
                               f"{server.log_tail()}")
        time.sleep(0.5)


def health(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def weight_version(url: str, timeout: float = 10.0) -> str:
    """What ``/model_info`` reports as the server's weight version."""
    with urllib.request.urlopen(f"{url}/model_info", timeout=timeout) as r:
        return str(json.loads(r.read())["weight_version"])


# --------------------------------------------------------------------------------------------------------------------
# A `sluice run` against such a server, watched with a wall-clock limit (shared by the tests and the soak harness)
# --------------------------------------------------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunResult:
    """What one ``sluice run`` did: how it ended, and what its queue and metrics say."""

    run_dir: Path
    log: Path
    steps: int
    seconds: float
    returncode: int | None
    """The launcher's exit status; None when it had to be killed."""
    hung: bool
    """It was still running at the wall-clock limit (then stopped: SIGTERM, a second SIGTERM, SIGKILL)."""
    pushes: list[dict[str, str]] = field(default_factory=list)
    """The run's ``weight_push`` events, oldest first."""
    audit: dict | None = None
    """``sluice queue audit --json`` (None if it could not be read)."""
    audit_error: str = ""
    metrics: list[dict] = field(default_factory=list)
    """``RUN_DIR/metrics/trainer.jsonl``, one dict per step."""
    left_behind: list[int] = field(default_factory=list)
    """PIDs of the run's processes still alive after the launcher ended (each then killed)."""

    @property
    def ledger(self) -> dict:
        return (self.audit or {}).get("trainer_ledger") or {}

    @property
    def lost(self) -> int | None:
        return self.ledger.get("lost")

    @property
    def duplicated(self) -> int | None:
        if not self.audit:
            return None
        return int(self.ledger.get("duplicates", 0)) + int(self.audit.get("duplicate_sample_ids", 0))

    @property
    def pushes_landed(self) -> int:
        """Pushes every engine confirmed (``engines`` is the count the push reached)."""
        return sum(1 for e in self.pushes if int(e.get("engines", "0") or 0) >= 1)

    def tail(self, chars: int = 4000) -> str:
        """The end of the launcher's log and of the trainer's, for a failure message."""
        parts = []
        for path in (self.log, self.run_dir / "logs" / "trainer-0.log"):
            try:
                parts.append(f"--- {path} ---\n{path.read_text(errors='replace')[-chars:]}")
            except OSError:
                continue
        return "\n".join(parts)


def sluice_run(
    run_dir: Path,
    overrides: list[str],
    *,
    steps: int,
    timeout: float,
    recipe: str = "recipes/cpu-moe.toml",
    log: Path | None = None,
    python: str | None = None,
) -> RunResult:
    """Run ``sluice run RECIPE --run-dir RUN_DIR --steps STEPS --set ...`` (from the repository root) to its end or
    ``timeout`` seconds, whichever comes first; a run past its limit is a hang: it is stopped (SIGTERM, then a second
    SIGTERM after 30 s, which forces the launcher's stop, then SIGKILL to its process group and to every process of
    the run) and its logs are kept. Then reads the run's pushes, audit and metrics."""
    import sys

    from tests.helpers.runprocs import alive, run_processes

    log = log or run_dir.parent / f"{run_dir.name}.launcher.log"
    cmd = [python or sys.executable, "-m", "pipeline.cli", "run", recipe, "--run-dir", str(run_dir),
           "--steps", str(steps)]
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started: dict[int, object] = {}
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        hung = False
        try:
            deadline = start + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                started.update(run_processes(run_dir))
                time.sleep(0.5)
            if proc.poll() is None:
                hung = True
                for grace in (30.0, 30.0):  # the first asks for the orderly stop, the second forces it
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(grace)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    seconds = time.monotonic() - start
    # The run's processes (under Ray none is the launcher's child) go within a few seconds of an orderly end.
    started.update(run_processes(run_dir))
    settle = time.monotonic() + 15
    while any(alive(p) for p in started.values()) and time.monotonic() < settle:  # type: ignore[arg-type]
        time.sleep(0.5)
    left = [pid for pid, p in started.items() if alive(p)]  # type: ignore[arg-type]
    for pid in left:
        try:
            started[pid].kill()  # type: ignore[attr-defined]  # started by this run's launcher
        except Exception:
            pass
    result = RunResult(run_dir, log, steps, seconds, None if hung else proc.returncode, hung, left_behind=left)
    _read_outcome(result, python or sys.executable)
    return result


def assert_clean_run(run: RunResult, steps: int, timeout: float) -> None:
    """A run that ended on its own, left no process behind, pushed every step's version in order and accounted for
    every sample exactly once."""
    assert not run.hung, f"the run hung (still running after {timeout:.0f} s):\n{run.tail()}"
    assert run.returncode == 0, run.tail()
    assert not run.left_behind, f"processes of the run still alive after it ended: {run.left_behind}"
    assert [int(e["version"]) for e in run.pushes] == list(range(1, steps + 1)), run.pushes
    assert run.audit is not None, run.audit_error
    assert run.ledger["committed_step"] == steps and run.lost == 0 and run.duplicated == 0, run.audit


def _read_outcome(result: RunResult, python: str) -> None:
    metrics = result.run_dir / "metrics" / "trainer.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                result.metrics.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    if not (result.run_dir / "run.json").exists():
        result.audit_error = "the run folder holds no run"
        return
    try:
        audit = subprocess.run([python, "-m", "pipeline.cli", "queue", "audit", "--run-dir", str(result.run_dir),
                                "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        result.audit_error = "sluice queue audit did not answer within 300 s"
        return
    if audit.returncode == 0:
        try:
            result.audit = json.loads(audit.stdout)
        except json.JSONDecodeError as exc:
            result.audit_error = f"unreadable audit: {exc}: {audit.stdout[-500:]}"
    else:
        result.audit_error = f"sluice queue audit exited {audit.returncode}: {audit.stderr[-1500:]}"
    from pipeline.queue.rundir import open_run

    try:
        handle = open_run(run_dir=result.run_dir)
    except Exception as exc:
        result.audit_error += f"; events unreadable: {exc}"
        return
    try:
        result.pushes = [e for e in handle.queue.events() if e.get("kind") == "weight_push"]
    finally:
        handle.close(stop_server=True)
