"""CPU engine subprocesses for tests: started on a free port, waited for, and stopped by the test that started them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.queue.redis_server import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


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
