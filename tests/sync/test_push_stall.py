"""A weight push that stalls is abandoned within ``stall_timeout_s``, and what it leaves the engines with.

SGLang's scheduler watchdog kills a server that stays paused for 300 s, so a push must never keep generation paused
for long: these engines stop answering at one step of the push, and the pusher must give up in time, name the step,
close the update windows, and continue generation only if no weight can have changed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from pipeline.net import free_port
from pipeline.sync.base import EngineReply
from pipeline.sync.pusher import PushOptions, PushStalledError, WeightPusher
from pipeline.sync.rotation import EngineRotation
from pipeline.sync.weights import init_weight_group


class _StallingEngine:
    """Answers every call at once, except ``stall_on`` (an endpoint name), which never answers the first
    ``stalls`` times it is called. Records every call in order."""

    def __init__(self, stall_on: str | None, stalls: int = 1) -> None:
        self.name = f"stalls-on-{stall_on}"
        self.stall_on = stall_on
        self.stalls = stalls
        self.calls: list[str] = []

    async def _answer(self, endpoint: str) -> EngineReply:
        self.calls.append(endpoint)
        if endpoint == self.stall_on and self.stalls > 0:
            self.stalls -= 1
            await asyncio.Event().wait()  # never set: the engine hangs in this call
        return EngineReply(True, "")

    async def init_weights_update_group(self, **kw: Any) -> EngineReply:
        return await self._answer("init")

    async def pause_generation(self, mode: str = "abort") -> EngineReply:
        return await self._answer("pause")

    async def begin_weight_update(self) -> EngineReply:
        return await self._answer("begin")

    async def update_weights_from_distributed(self, **kw: Any) -> EngineReply:
        return await self._answer("update")

    async def end_weight_update(self, **kw: Any) -> EngineReply:
        return await self._answer("end")

    async def continue_generation(self) -> EngineReply:
        return await self._answer("continue")

    async def destroy_weights_update_group(self, group_name: str) -> EngineReply:
        return await self._answer("destroy")

    async def health(self) -> bool:
        return True


def _weights() -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.ones(4, 4)), ("b", torch.zeros(4))]


def _pusher(engine: _StallingEngine, stall_timeout_s: float) -> WeightPusher:
    # A group of rank 0 alone: the broadcasts complete locally, so only the engine's HTTP answers can stall.
    group = init_weight_group("127.0.0.1", free_port(), 0, 1, f"stall-{time.monotonic_ns()}", timeout_s=10)
    return WeightPusher(group, [engine], PushOptions(stall_timeout_s=stall_timeout_s))


@pytest.mark.parametrize("stall_on", ["pause", "begin"])
def test_a_push_stalled_before_any_weight_moved_is_abandoned_and_generation_continues(stall_on: str) -> None:
    engine = _StallingEngine(stall_on)
    pusher = _pusher(engine, stall_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(PushStalledError, match=f"{stall_on}_generation|{stall_on}_weight_update") as err:
        asyncio.run(pusher.push(_weights(), weight_version=1))
    assert time.monotonic() - start < 5.0
    assert "continues on the old weights" in str(err.value)
    assert "update" not in engine.calls  # nothing announced
    assert engine.calls[-1] == "continue"  # the engine serves again, on weights that never changed
    if stall_on == "begin":
        assert engine.calls == ["pause", "begin", "end", "continue"]  # the window it may have opened is closed
    assert pusher.group.broken is not None  # rebuilt before the next push
    pusher.group.close()


def test_a_push_stalled_mid_bucket_closes_the_windows_but_keeps_generation_paused() -> None:
    engine = _StallingEngine("update")
    pusher = _pusher(engine, stall_timeout_s=0.5)
    with pytest.raises(PushStalledError, match="bucket 0") as err:
        asyncio.run(pusher.push(_weights(), weight_version=1))
    assert "stays paused" in str(err.value)
    assert engine.calls == ["pause", "begin", "update", "end"]  # no continue: its weights may be half new
    pusher.group.close()


def test_the_rotation_makes_a_stalled_push_again_on_a_new_group_and_it_lands() -> None:
    engine = _StallingEngine("begin", stalls=1)

    async def connect(members: list[Any]) -> WeightPusher:
        return _pusher(engine, stall_timeout_s=0.5)

    async def run() -> EngineRotation:
        rotation = await EngineRotation.start([engine], connect)
        stats = await rotation.push(_weights(), weight_version=1)
        assert stats.weight_version == "1" and stats.tensors == 2
        await rotation.close()
        return rotation

    rotation = asyncio.run(run())
    assert rotation.stalls == 1 and rotation.rebuilds == 2
    # The abandoned attempt continued the engine, the second one landed and continued it again.
    assert engine.calls == ["pause", "begin", "end", "continue", "destroy",
                            "pause", "begin", "update", "end", "continue", "destroy"]


def test_stall_timeout_must_be_positive() -> None:
    group = init_weight_group("127.0.0.1", free_port(), 0, 1, "stall-bad", timeout_s=10)
    try:
        with pytest.raises(Exception, match="stall_timeout_s"):
            WeightPusher(group, [_StallingEngine(None)], PushOptions(stall_timeout_s=0))
    finally:
        group.close()
