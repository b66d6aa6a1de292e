"""The trainer's push over engines that fail and come back (``pipeline.sync.rotation``), with real CPU engines on
gloo: a SIGKILLed engine leaves the rotation and the push reaches the one left; an engine restarted at its address
rejoins and the next push re-syncs it, whether it failed a push first or was restarted between two pushes."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import EngineError, SyncError
from pipeline.models.tiny import init_tiny_model
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.sync.pusher import PushOptions, WeightPusher
from pipeline.sync.rotation import EngineRotation
from tests.helpers.engines import start_engine

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
PROMPT = [11, 12, 13, 14, 15]


async def _connect(members: list) -> WeightPusher:
    return await WeightPusher.connect(members, master_address="127.0.0.1", backend="gloo", timeout_s=60)


async def _greedy(client: SGLangClient) -> np.ndarray:
    return (await client.generate(PROMPT, GREEDY, return_logprob=False)).output_ids


async def _close(rotation: EngineRotation, clients: list[SGLangClient]) -> None:
    await rotation.close()
    for c in clients:
        await c.close()


def _run(scenario: Callable[[], Coroutine[Any, Any, None]], engines: list[Any]) -> None:
    """Run the scenario; every engine in ``engines`` (it may add the ones it restarts) is stopped whatever happens."""
    try:
        asyncio.run(scenario())
    finally:
        for e in engines:
            e.stop()


def test_a_dead_engine_leaves_the_rotation_and_a_restarted_one_is_re_synced(model_dir: Path, tmp_path: Path) -> None:
    new_dir = init_tiny_model("qwen3-moe", tmp_path / "trained", seed=1)  # weights unlike the engines' own
    weights = sorted(load_file(str(new_dir / "model.safetensors")).items())
    a, b = start_engine(model_dir, tmp_path), start_engine(model_dir, tmp_path)
    engines = [a, b]

    async def main() -> None:
        clients = [SGLangClient(a.url, retry=NO_RETRY), SGLangClient(b.url, retry=NO_RETRY)]
        rotation = await EngineRotation.start(clients, _connect, wait_s=3.0)
        try:
            original = await _greedy(clients[0])
            await rotation.push(weights, 1)
            trained = await _greedy(clients[0])
            assert not np.array_equal(original, trained)  # the push changed what the engines answer
            assert [await c.weight_version() for c in clients] == ["1", "1"]

            b.stop(signal.SIGKILL)  # dies between pushes; the next push finds it gone
            await rotation.push(weights, 2)
            assert rotation.engines == [clients[0]] and await clients[0].weight_version() == "2"

            # Back at its address with its start-up weights, holding generation as the launcher restarts it.
            engines.append(await asyncio.to_thread(start_engine, model_dir, tmp_path, b.port, "--hold-until-update"))
            assert await clients[1].weight_version() == "0"
            held = asyncio.create_task(_greedy(clients[1]))
            await asyncio.sleep(2.0)
            assert not held.done()  # nothing sampled with the start-up weights
            await rotation.push(weights, 3)
            assert rotation.engines == clients
            assert [await c.weight_version() for c in clients] == ["3", "3"]
            assert np.array_equal(await held, trained)  # re-synced with every weight before it served

            # Restarted between two pushes, without failing one: its version gives it away.
            engines[-1].stop(signal.SIGKILL)
            engines.append(await asyncio.to_thread(start_engine, model_dir, tmp_path, b.port))
            rebuilds = rotation.rebuilds
            await rotation.push(weights, 4)
            assert rotation.rebuilds == rebuilds + 1
            assert [await c.weight_version() for c in clients] == ["4", "4"]
            assert np.array_equal(await _greedy(clients[1]), trained)

            # With every engine down the push waits for one to come back (the launcher restarts it)...
            for e in engines:
                e.stop(signal.SIGKILL)
            rotation.wait_s = 120.0
            restart = asyncio.create_task(asyncio.to_thread(start_engine, model_dir, tmp_path, a.port))
            await rotation.push(weights, 5)
            engines.append(await restart)
            assert rotation.engines == [clients[0]] and await clients[0].weight_version() == "5"
            # ... and, when none does within its wait, fails naming them rather than pretending.
            engines[-1].stop(signal.SIGKILL)
            rotation.wait_s = 2.0
            with pytest.raises(SyncError, match="no engine answers"):
                await rotation.push(weights, 6)
        finally:
            await _close(rotation, clients)

    _run(main, engines)


def test_a_push_that_fails_before_sending_still_walks_the_exporter() -> None:
    """A trainer's exporter is a collective every rank walks; a push that fails before it sends anything (the engines'
    file unreadable, no engine answering) must walk it too, or the other ranks wait in it until the group's timeout."""
    class _Engine:
        name = "e0"

    def unreadable(known: list[Any]) -> list[Any]:
        raise SyncError("engines.json: unreadable")

    rotation = EngineRotation([_Engine()], connect=None, discover=unreadable)  # type: ignore[arg-type, list-item]
    walked: list[str] = []

    def exporter() -> Iterator[tuple[str, torch.Tensor]]:
        for name in ("a", "b", "c"):
            walked.append(name)
            yield name, torch.zeros(2)

    with pytest.raises(SyncError, match="unreadable"):
        asyncio.run(rotation.push_once(exporter, 1))
    assert walked == ["a", "b", "c"]


class _DiesAtBucket(SGLangClient):
    """An engine's client that SIGKILLs its engine process as the pusher announces a given bucket of a push: the
    buckets before are on the wire or through, so the engine dies inside the push's broadcasts."""

    def __init__(self, url: str, engine: Any, bucket: int) -> None:
        super().__init__(url, retry=NO_RETRY)
        self.engine, self.bucket, self.armed, self.killed_at = engine, bucket, False, None

    async def update_weights_from_distributed(self, **kw: Any) -> Any:
        if self.armed and kw.get("bucket_index") == self.bucket:
            self.armed = False
            self.engine.stop(signal.SIGKILL)
            self.killed_at = kw["bucket_index"]
        return await super().update_weights_from_distributed(**kw)


def test_an_engine_killed_inside_a_push_leaves_the_rotation_and_the_push_lands_on_the_others_at_once(
        model_dir: Path, tmp_path: Path) -> None:
    """The weight group is one collective: an engine killed while a push's broadcasts are on the wire fails them for
    every member, the one still alive included, which may be left waiting for bytes that will never come. The
    rotation must route around the dead engine without waiting for the group's timeout (60 s here), and the survivor
    must end up with every weight of the step, serving again; the dead one, restarted, is re-synced by the next
    push."""
    new_dir = init_tiny_model("qwen3-moe", tmp_path / "trained", seed=1)
    weights = sorted(load_file(str(new_dir / "model.safetensors")).items())
    a, b = start_engine(model_dir, tmp_path), start_engine(model_dir, tmp_path)
    engines = [a, b]

    async def connect(members: list) -> WeightPusher:
        # Small buckets: the push streams many of them, so the kill lands between its first and its last.
        return await WeightPusher.connect(members, master_address="127.0.0.1", backend="gloo", timeout_s=60,
                                          options=PushOptions(bucket_bytes=64 * 1024))

    async def main() -> None:
        dying = _DiesAtBucket(b.url, b, bucket=2)
        clients: list[SGLangClient] = [SGLangClient(a.url, retry=NO_RETRY), dying]
        rotation = await EngineRotation.start(clients, connect, wait_s=3.0)
        try:
            first = await rotation.push(weights, 1)
            assert first.buckets >= 4, first  # the kill at bucket 2 falls inside a push
            trained = await _greedy(clients[0])

            dying.armed = True
            start = time.monotonic()
            await rotation.push(weights, 2)
            took = time.monotonic() - start
            assert dying.killed_at == 2
            assert took < 30, f"the push waited {took:.0f}s for the dead engine"
            assert rotation.engines == [clients[0]] and await clients[0].weight_version() == "2"
            # Every weight the pushed one, and the survivor serves (a failed push leaves it paused until a whole one).
            assert np.array_equal(await _greedy(clients[0]), trained)
            load = await clients[0].get_load()
            assert load.ranks[0]["paused"] is False

            engines.append(await asyncio.to_thread(start_engine, model_dir, tmp_path, b.port))
            await rotation.push(weights, 3)
            assert rotation.engines == clients
            assert [await c.weight_version() for c in clients] == ["3", "3"]
            assert np.array_equal(await _greedy(clients[1]), trained)
        finally:
            await _close(rotation, clients)

    _run(main, engines)


def test_an_engine_leaving_a_group_with_a_receive_stuck_in_it_keeps_serving(model_dir: Path, tmp_path: Path) -> None:
    """Leaving a weight group waits for the receives still in it, and one the trainer will never send to ends only
    when the trainer's end closes or the group times out. The engine must answer meanwhile."""
    engine = start_engine(model_dir, tmp_path)

    async def main() -> None:
        client = SGLangClient(engine.url, retry=NO_RETRY, health_timeout=2.0)
        pusher = await WeightPusher.connect([client], master_address="127.0.0.1", backend="gloo", timeout_s=60)
        group = pusher.group.group_name
        try:
            assert (await client.weight_group_probe(group, 1024, prepare=True)).success
            stuck = asyncio.ensure_future(client.weight_group_probe(group, 1024))  # this end never sends it
            await asyncio.sleep(0.5)
            leaving = asyncio.ensure_future(client.destroy_weights_update_group(group))
            await asyncio.sleep(0.5)
            assert not leaving.done() and not stuck.done()  # the receive holds the leaving up, as gloo does
            assert await client.health()
            assert (await client.get_load()).ranks[0]["paused"] is False
            assert np.array_equal(await _greedy(client), await _greedy(client))  # and generates
            pusher.group.close()  # this end goes: the receive fails, and the engine has left
            assert (await asyncio.wait_for(leaving, 30)).success
            with pytest.raises(EngineError, match="probe failed"):
                await asyncio.wait_for(stuck, 30)
        finally:
            pusher.group.close()
            await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.stop()
