"""Producers placed as Ray actors: two actors against one real CPU engine and a real Redis fill one run's queue.

Ray is optional (the ``ray`` extra); without it this module is skipped. Ray keeps its session files under a
temporary RAY_TMPDIR, and the engine is a subprocess this module started and stops by PID.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.producers.producer import ProducerConfig, ProducerSpec, SamplingConfig
from pipeline.producers.prompts import PromptConfig, PromptCursor
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.queue.redis_streams import SampleQueue

ray = pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.models.tiny import init_tiny_model

    return init_tiny_model("qwen3-moe", tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def engine_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("engine-log") / "engine.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--host", "127.0.0.1",
             "--port", str(port), "--enable-return-routed-experts", "--num-threads", "1", "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_healthy(url, proc, log))
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120.0) -> None:
    async with SGLangClient(url, retry=NO_RETRY, health_timeout=2.0) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}: {log.read_text()[-2000:]}")
            if await client.health():
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"engine at {url} did not become healthy in {timeout}s")


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    tmp = tmp_path_factory.mktemp("ray")
    os.environ["RAY_TMPDIR"] = str(tmp)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(tmp))
    try:
        yield
    finally:
        ray.shutdown()


def _spec(name: str, queue: SampleQueue, redis_url: str, engine_url: str, model_dir: Path) -> ProducerSpec:
    return ProducerSpec(
        name=name, run=queue.run, redis_url=redis_url, engine_urls=[engine_url], model_dir=model_dir,
        producer=ProducerConfig(group_size=2, concurrency=2, sampling=SamplingConfig(max_new_tokens=8)),
        prompts=PromptConfig(type="synthetic", task="addition", size=64), queue_capacity=1000,
    )  # fmt: skip


def _prompt_numbers(queue: SampleQueue) -> list[int]:
    out = []
    for _, entry in queue.scan():
        assert not isinstance(entry, Exception), entry
        out.append(int(entry.samples[0].prompt_id.split("-")[1]))
    return out


def test_two_producer_actors_fill_one_queue_and_stop_cleanly(
    ray_session: None, engine_url: str, model_dir: Path, redis_url: str, queue: SampleQueue
) -> None:
    from pipeline.producers.ray_actor import start_producers, stop_producers

    actors = start_producers([_spec(f"p{i}", queue, redis_url, engine_url, model_dir) for i in range(2)])
    assert ray.get([a.name.remote() for a in actors], timeout=120) == ["p0", "p1"]

    # Bounded runs: each actor queues exactly its share, and the shared cursor hands out every prompt once.
    first: list[dict[str, Any]] = ray.get([a.run.remote(max_groups=3) for a in actors], timeout=120)
    assert [s["groups_put"] for s in first] == [3, 3] and [s["samples_put"] for s in first] == [6, 6]
    assert sorted(_prompt_numbers(queue)) == list(range(6))
    producers = {s.producer for _, e in queue.scan() if not isinstance(e, Exception) for s in e.samples}
    assert producers == {"p0", "p1"}

    # Open-ended runs, stopped from outside: each prompt taken before the stop is either on the queue or handed back
    # to the cursor (what was in flight), never both and never lost; nothing is produced after the stop.
    runs = [a.run.remote() for a in actors]
    deadline = time.monotonic() + 60
    while queue.redis.xlen(queue.keys.samples) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    live = ray.get([a.stats.remote() for a in actors], timeout=30)
    assert all(s["groups_put"] > 0 for s in live)
    final = stop_producers(actors, runs)
    queued = sum(s["groups_put"] for s in final)
    assert queue.redis.xlen(queue.keys.samples) == 6 + queued >= 12
    time.sleep(0.3)
    assert queue.redis.xlen(queue.keys.samples) == 6 + queued  # nothing is produced after run() returned
    cursor = PromptCursor(queue.redis, queue.run)
    handed_back = [index for index, _ in cursor.retries()]
    on_queue = _prompt_numbers(queue)
    assert len(set(on_queue)) == len(on_queue) and not set(on_queue) & set(handed_back)
    assert sorted(on_queue + handed_back) == list(range(cursor.position()))
    assert ray.get([a.stats.remote() for a in actors], timeout=30) == final
    for actor in actors:
        ray.kill(actor)
