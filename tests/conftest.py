"""Shared fixtures (helpers that tests import live in ``tests/helpers/``). Servers are real: a redis-server started on a free port in a temporary folder (AOF on) and
stopped by its PID, unless ``--redis-url`` points the tests at an existing one (which they then never stop)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.queue.connection import connect
from pipeline.queue.redis_server import EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Scripts the tests start (worker ranks, engines, `python tests/.../test_x.py`) import `pipeline` and `tests.helpers`
# from this checkout, whatever their working directory.
_REPO = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, [_REPO, os.environ.get("PYTHONPATH")])))


try:
    from hypothesis import settings

    # Property tests check what holds, not how fast: on a loaded 2-core machine one example once took 593 ms against
    # hypothesis's default 200 ms deadline, and failed a run whose every property held.
    settings.register_profile("sluice", deadline=None)
    settings.load_profile("sluice")
except ImportError:  # hypothesis is a dev dependency; the tests that use it import it themselves
    pass


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
    from tests.helpers.engines import start_engine

    started = start_engine(model_dir, tmp_path_factory.mktemp("engine-logs"))
    yield started
    started.stop()
