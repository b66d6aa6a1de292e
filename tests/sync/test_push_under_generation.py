"""The weight push against an engine with SGLang's locking, while it generates: no deadlock, and no stale prefix.

The CPU engine keeps SGLang 0.5.23's model-update lock (every generation holds it as a reader; a begin, update or
end takes it as a writer unless the engine is already paused) and its idle-only flush. Each push here runs the way
it runs against SGLang (pause, begin, one announcement at a time, end, flush, continue), while long generations are
in flight. A pusher that sent the begin before every pause was answered deadlocked (the begin waits for the
generations, the pause freezes them); a client that kept no version key let a new request reuse a prompt prefix
cached under the weights before a push.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.producers.sglang_client import SGLangClient
from pipeline.sync.pusher import PushOptions, WeightPusher
from tests.helpers.engines import EngineProcess, free_port, start_engine

LONG = {"max_new_tokens": 600, "temperature": 0.0, "ignore_eos": True}
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    from pipeline.models.tiny import init_tiny_model

    return _weights(init_tiny_model("qwen3-moe", tmp_path_factory.mktemp("other"), seed=1))


class _SlowPauseClient(SGLangClient):
    """A client whose pause takes a slower way to the engine than its other calls (0.3 s more), as two requests
    sent together may: a pusher that sent the begin before the pause was answered would have it overtake the pause."""

    async def pause_generation(self, mode: Any = "abort") -> Any:
        await asyncio.sleep(0.3)
        return await super().pause_generation(mode)


async def _sglang_like(client: SGLangClient) -> WeightPusher:
    pusher = await WeightPusher.connect([client], master_address="127.0.0.1", master_port=free_port(),
                                        group_name=f"order-{free_port()}", timeout_s=60,
                                        options=PushOptions(stall_timeout_s=30))
    pusher._ordered = False  # noqa: SLF001 - every push takes SGLang's path: one announcement at a time
    return pusher


def test_pushes_while_generations_are_in_flight_never_deadlock_and_refused_flushes_are_counted(
    engine: EngineProcess, model_dir: Path, other_weights: dict[str, torch.Tensor]
) -> None:
    original = _weights(model_dir)

    async def scenario() -> tuple[list[Any], list[Any]]:
        async with _SlowPauseClient(engine.url) as client:
            pusher = await _sglang_like(client)
            try:
                running = [asyncio.ensure_future(client.generate([5 + i, 9, 12, 7], LONG)) for i in range(3)]
                await asyncio.sleep(0.1)  # admitted and decoding: each holds the update lock as a reader
                stats = []
                for version in range(1, 5):
                    weights = other_weights if version % 2 else original
                    # Bounded here too, so that a deadlock fails the test instead of hanging it.
                    stats.append(await asyncio.wait_for(pusher.push(weights.items(), version), 60))
                return stats, await asyncio.gather(*running)
            finally:
                await pusher.close()

    stats, results = asyncio.run(scenario())
    assert [s.weight_version for s in stats] == ["1", "2", "3", "4"]
    # Each generation ran to its end across the pushes, and its tokens carry the versions they were made under.
    for result in results:
        assert len(result.output_ids) == LONG["max_new_tokens"]
        assert len({span.version for span in result.weight_versions}) >= 2
    # The engine kept its prefix cache whenever a generation was paused in place, and said so.
    assert stats[0].flush_refused == 1


def test_a_request_made_before_a_push_and_prefilled_after_it_never_reuses_the_old_prefix(
    engine: EngineProcess, model_dir: Path, other_weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """A prompt cached under the old weights; then a request for the same prompt made while a push has the engine
    paused, keyed to the version the engine still says. The engine prefills it after the push, under the new
    weights; its log-probs must be those of the new weights from scratch, not of the new weights over the old
    prompt's KV."""
    from pipeline.models.tiny import init_tiny_model

    fresh_engine_dir = init_tiny_model("qwen3-moe", tmp_path / "fresh", seed=1)
    prompt = [4, 18, 22, 9, 31, 7, 3, 12]

    async def reference(url: str) -> Any:
        async with SGLangClient(url) as client:
            return await client.generate(prompt, GREEDY)

    async def scenario() -> tuple[Any, int]:
        async with SGLangClient(engine.url) as client:
            pusher = await _sglang_like(client)
            try:
                await client.generate(prompt, GREEDY)  # cached under the weights now loaded, keyed to their version
                before = client.key_retries
                # A generation paused in place through the push: the engine refuses the flush, the cache keeps the
                # old prefix, as SGLang's does in every async run.
                running = asyncio.ensure_future(client.generate([6, 9, 12, 7], LONG))
                await asyncio.sleep(0.1)
                # The push has paused the engine (as the pusher does first) when the request is made: the engine
                # still says the old version, so that is its key, and it waits at the gate until the push is done.
                assert (await client.pause_generation("in_place")).success
                made = asyncio.ensure_future(client.generate(prompt, GREEDY))
                await asyncio.sleep(0.2)
                assert not made.done()
                stats = await pusher.push(other_weights.items(), "77")
                assert stats.flush_refused == 1
                after = await made
                retries = client.key_retries - before
                await running
                await pusher.push(_weights(model_dir).items(), "78")  # leave the shared engine as it was
                return after, retries
            finally:
                await pusher.close()

    # The new weights, served by an engine that never saw the old ones.
    fresh = start_engine(fresh_engine_dir, tmp_path)
    try:
        want = asyncio.run(reference(fresh.url))
    finally:
        fresh.stop()
    got, retries = asyncio.run(scenario())
    assert got.weight_version == "77" and {s.version for s in got.weight_versions} == {"77"}
    assert np.array_equal(got.output_ids, want.output_ids)
    assert np.allclose(got.output_logprobs, want.output_logprobs, atol=1e-5)  # type: ignore[arg-type]
    assert retries == 1  # sent again, keyed to version 77
