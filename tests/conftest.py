"""Shared fixtures. Servers are real: a redis-server started on a free port in a temporary folder (AOF on) and
stopped by its PID, unless ``--redis-url`` points the tests at an existing one (which they then never stop)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from pipeline.queue.connection import connect
from pipeline.queue.redis_server import EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample, compact_routing

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis-url", default=None, help="use this Redis server instead of starting one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = request.config.getoption("--redis-url")
    if url:
        yield url
        return
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendfsync="everysec").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = connect(redis_url)
    yield client
    client.close()


@pytest.fixture
def run_name() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def queue(redis_client: redis.Redis, run_name: str) -> Iterator[SampleQueue]:
    q = SampleQueue(redis_client, run_name, capacity=1000)
    yield q
    keys = list(redis_client.scan_iter(match=f"{q.keys.prefix}:*"))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A server of this test's own, for tests that kill or reconfigure it."""
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE written for this test module."""
    from pipeline.models.tiny import init_tiny_model

    return init_tiny_model("qwen3-moe", tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A CPU engine process serving ``model_dir``, started and stopped by this module."""
    from engines import start_engine

    started = start_engine(model_dir, tmp_path_factory.mktemp("engine-logs"))
    yield started
    started.stop()


def make_sample(
    rng: np.random.Generator,
    *,
    prompt_len: int = 5,
    response_len: int = 7,
    version: int | tuple[int, int] = 0,
    layers: int = 2,
    topk: int = 2,
    num_experts: int | None = 8,
    group_id: str = "g",
    index: int = 0,
    reward: float = 1.0,
) -> Sample:
    lo, hi = (version, version) if isinstance(version, int) else version
    versions = np.sort(rng.integers(lo, hi + 1, response_len)).astype(np.int32)
    routed = None
    if num_experts:
        routed = compact_routing(
            rng.integers(0, num_experts, (prompt_len + response_len - 1, layers, topk)), num_experts
        )
    return Sample(
        prompt_ids=rng.integers(0, 1000, prompt_len),
        response_ids=rng.integers(0, 1000, response_len),
        rollout_logprobs=-rng.random(response_len).astype(np.float32),
        token_versions=versions,
        routed_experts=routed,
        reward=reward,
        reward_info={"pass": bool(reward > 0)},
        group_id=group_id,
        prompt_id=group_id,
        index=index,
        producer="test",
        engine="none",
    )


def make_group(rng: np.random.Generator, n: int = 4, **kw: object) -> list[Sample]:
    gid = uuid.uuid4().hex[:8]
    return [make_sample(rng, group_id=gid, index=i, **kw) for i in range(n)]  # type: ignore[arg-type]
