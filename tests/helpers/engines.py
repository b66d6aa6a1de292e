"""CPU engine subprocesses for tests: started on a free port, waited for, and stopped by the test that started them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from pipeline.net import free_port
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.sync.pusher import PushOptions, WeightPusher

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class EngineProcess:
    """A CPU engine subprocess a test started (and is the only one to stop)."""

    proc: subprocess.Popen[bytes]
    url: str
    port: int
    log: Path

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_engine(model_dir: Path, log_dir: Path, port: int | None = None, *extra: str) -> EngineProcess:
    port = port or free_port()
    log = log_dir / f"engine-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--host", "127.0.0.1",
             "--port", str(port), "--enable-return-routed-experts", "--num-threads", "1", "--log-level", "warning", *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    engine = EngineProcess(proc, f"http://127.0.0.1:{port}", port, log)
    try:
        asyncio.run(wait_healthy(engine))
    except BaseException:
        engine.stop()
        raise
    return engine


async def wait_healthy(engine: EngineProcess, timeout: float = 120.0) -> None:
    async with SGLangClient(engine.url, retry=NO_RETRY, health_timeout=2.0) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if engine.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {engine.proc.returncode}: {engine.log.read_text()[-2000:]}")
            if await client.health():
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"engine at {engine.url} did not become healthy in {timeout}s")


class ServedEngine:
    """The CPU engine's own ``Engine`` and HTTP app, served from a thread of this process (its own event loop), so
    that the test can read the engine's parameters and its loader's counters."""

    def __init__(self, model_dir: Path, **options: Any) -> None:
        from pipeline.producers.cpu_engine.config import CpuEngineConfig
        from pipeline.producers.cpu_engine.server import Engine

        self.engine = Engine(CpuEngineConfig(model_path=str(model_dir), **options))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self._app())
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), name="test-cpu-engine", daemon=True)
        self._thread.start()
        if not started.wait(60):
            raise RuntimeError("the in-process CPU engine did not start")

    def _app(self) -> web.Application:
        from pipeline.producers.cpu_engine.server import build_app

        return build_app(self.engine)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@asynccontextmanager
async def pushing(url: str, client: SGLangClient | None = None, options: PushOptions | None = None
                  ) -> AsyncIterator[tuple[SGLangClient, WeightPusher]]:
    """A client of the engine at ``url`` (or the one given) and a pusher connected to it over gloo; both closed
    after."""
    client = client or SGLangClient(url, retry=NO_RETRY)
    pusher = await WeightPusher.connect([client], master_address="127.0.0.1", backend="gloo", timeout_s=60,
                                        options=options or PushOptions())
    try:
        yield client, pusher
    finally:
        await pusher.close()
        await client.close()


class RecordingImpl:
    """A real process group that records, in order, when each broadcast was issued ("issue N") and when it was first
    seen done ("done N": its wait returned, or ``is_completed`` said so); thread-safe, as several threads issue and
    wait on one weight group."""

    def __init__(self, impl: Any, events: list[str]) -> None:
        self._impl, self._events, self._issued = impl, events, 0
        self._lock = threading.Lock()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        with self._lock:
            index = self._issued
            self._issued += 1
            self._events.append(f"issue {index}")
        return _RecordedWork(self._impl.broadcast(tensors, opts), index, self._events, self._lock)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._impl, name)


class _RecordedWork:
    def __init__(self, work: Any, index: int, events: list[str], lock: threading.Lock) -> None:
        self._work, self._index, self._events, self._lock = work, index, events, lock
        self._seen = False

    def wait(self) -> Any:
        done = self._work.wait()
        self._seen_done()
        return done

    def is_completed(self) -> bool:
        completed = bool(self._work.is_completed())
        if completed:
            self._seen_done()
        return completed

    def _seen_done(self) -> None:
        with self._lock:
            if not self._seen:  # a work may be waited for again (WeightGroup.wait), as a real one may
                self._seen = True
                self._events.append(f"done {self._index}")


Weights = list[tuple[str, torch.Tensor]]


@contextmanager
def served_with_new_weights(folder: Path) -> Iterator[tuple[ServedEngine, Weights]]:
    """A CPU engine served in this process on a tiny Qwen3, and another model's weights to push into it."""
    from safetensors.torch import load_file

    from pipeline.models.tiny import init_tiny_model

    engine = ServedEngine(init_tiny_model("qwen3", folder / "m", seed=0))
    new_dir = init_tiny_model("qwen3", folder / "new", seed=1)
    try:
        yield engine, sorted(load_file(str(new_dir / "model.safetensors")).items())
    finally:
        engine.stop()
