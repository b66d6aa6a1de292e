"""Announcements ahead of the answers (docs/weight-push.md, "Announcements ahead of the answers").

The CPU engine says ``ordered_updates``: it receives a window's announcements in the order of their ``bucket_index``,
whatever order they arrive in, so the pusher posts bucket k+1 while bucket k is on the wire. These tests run a real
CPU engine (served in this process, so its parameters can be read) on a real gloo weight group:

- bucket 1 announced before bucket 0 still gets bucket 1's bytes;
- a bucket that fails, or a window that closes, refuses what waits behind it without receiving anything;
- the pusher really announces ahead for such an engine, and one at a time for an engine that does not say so
  (SGLang), and the weights land either way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.models.tiny import init_tiny_model
from pipeline.producers.cpu_engine.update_turns import UpdateTurns
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.sync.packing import FLAT_FORMAT
from pipeline.sync.pusher import PushOptions, WeightPusher
from tests.helpers.engines import RecordingImpl, ServedEngine, Weights, pushing, served_with_new_weights

KB = 1 << 10
GATE, UP = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ServedEngine, Weights]]:
    with served_with_new_weights(tmp_path) as pair:
        yield pair


def _announce(client: SGLangClient, pusher: WeightPusher, index: int, name: str, shape: list[int],
              push_id: str = "push-a") -> asyncio.Future[Any]:
    return asyncio.ensure_future(client.update_weights_from_distributed(
        names=[name], dtypes=["float32"], shapes=[shape], group_name=pusher.group.group_name, flush_cache=False,
        weight_version=None, load_format=FLAT_FORMAT, bucket_index=index, push_id=push_id))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_an_engine_receives_announcements_in_bucket_order_whatever_order_they_arrive_in(
    served: tuple[ServedEngine, Weights],
) -> None:
    engine, _ = served
    params = engine.engine.model.state_dict()
    shape = list(params[GATE].shape)
    assert list(params[UP].shape) == shape  # same bytes: taken in the wrong order, they would land swapped
    gate, up = torch.full(shape, 1.0), torch.full(shape, 2.0)

    async def scenario() -> tuple[bool, bool, bool, bool]:
        async with pushing(engine.url) as (client, pusher):
            says = await client.ordered_updates()
            assert (await client.begin_weight_update()).success
            second = _announce(client, pusher, 1, UP, shape)
            await asyncio.sleep(0.3)
            waited = not second.done()  # arrived first, waits for bucket 0
            first = _announce(client, pusher, 0, GATE, shape)

            def send() -> None:  # in the order of the indices, as the pusher does
                pusher.group.broadcast(_flat(gate), 0)
                pusher.group.broadcast(_flat(up), 0)

            await asyncio.gather(asyncio.to_thread(send), asyncio.wait_for(asyncio.gather(first, second), 30))
            ended = (await client.end_weight_update()).success
            return says, waited, (first.result().success and second.result().success), ended

    says, waited, received, ended = asyncio.run(scenario())
    assert says and waited and received and ended
    assert torch.equal(params[GATE], gate) and torch.equal(params[UP], up)


def test_a_failed_bucket_or_a_closed_window_refuses_what_waits_behind_it_and_receives_nothing(
    served: tuple[ServedEngine, Weights],
) -> None:
    engine, weights = served
    params = engine.engine.model.state_dict()
    shape = list(params[UP].shape)
    before = params[UP].clone()

    async def scenario() -> tuple[str, str, str, int, str]:
        async with pushing(engine.url) as (client, pusher):
            received = engine.engine.weight_bytes_received
            assert (await client.begin_weight_update()).success
            behind = _announce(client, pusher, 1, UP, shape)
            await asyncio.sleep(0.2)
            refused = await _announce(client, pusher, 0, "model.layers.0.mlp.no_such.weight", shape)
            assert not refused.success
            after_failure = (await asyncio.wait_for(behind, 10)).message
            assert (await client.end_weight_update()).success

            assert (await client.begin_weight_update()).success
            waiting = _announce(client, pusher, 1, UP, shape, push_id="push-b")
            await asyncio.sleep(0.2)
            assert (await client.end_weight_update()).success
            after_close = (await asyncio.wait_for(waiting, 10)).message
            nothing = engine.engine.weight_bytes_received - received
            # The engine is whole: the next push lands.
            stats = await pusher.push(weights, 1)
            assert stats.buckets >= 1
            return refused.message, after_failure, after_close, nothing, (await client.model_info()).weight_version

    refused, after_failure, after_close, nothing, version = asyncio.run(scenario())
    assert "no_such" in refused
    assert "bucket 0 of this window failed" in after_failure and "nothing was received" in after_failure
    assert "window closed" in after_close and "nothing was received" in after_close
    assert nothing == 0
    assert not torch.equal(before, params[UP]) and version == "1"
    assert torch.equal(params[UP], dict(weights)[UP])


class _TimedClient(SGLangClient):
    """A real client that records when each announcement went out and when its answer came back, and can be told
    to answer ``ordered_updates`` as SGLang does (it does not say so)."""

    events: list[tuple[str, int]]
    says_ordered: bool
    indexed: list[int | None]

    async def ordered_updates(self) -> bool:
        return self.says_ordered and await super().ordered_updates()

    async def update_weights_from_distributed(self, **kw: Any) -> Any:  # type: ignore[override]
        index = sum(1 for kind, _ in self.events if kind == "post")
        self.indexed.append(kw.get("bucket_index"))
        self.events.append(("post", index))
        try:
            return await super().update_weights_from_distributed(**kw)
        finally:
            self.events.append(("reply", index))


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered-engine", "sglang-like"])
def test_the_pusher_announces_ahead_only_to_engines_that_take_announcements_in_order(
    served: tuple[ServedEngine, Weights], ordered: bool,
) -> None:
    engine, weights = served

    async def scenario() -> tuple[list[tuple[str, int]], list[int | None], int, str]:
        client = _TimedClient(engine.url, retry=NO_RETRY)
        client.events, client.says_ordered, client.indexed = [], ordered, []
        async with pushing(engine.url, client, PushOptions(bucket_bytes=16 * KB)) as (_, pusher):
            stats = None
            for version in (1, 2):
                stats = await pusher.push(weights, version)
            assert stats is not None
            return client.events, client.indexed, stats.buckets, (await client.model_info()).weight_version

    events, indexed, buckets, version = asyncio.run(scenario())
    assert buckets >= 8 and version == "2"
    params = engine.engine.model.state_dict()
    assert all(torch.equal(params[n], t) for n, t in weights)
    when = {event: i for i, event in enumerate(events)}
    ahead = [k for k in range(len(indexed) - 1) if when[("post", k + 1)] < when[("reply", k)]]
    if ordered:
        assert ahead  # some bucket was announced before the one before it was answered
        assert indexed == list(range(buckets)) * 2  # every push counts its buckets from 0
    else:
        assert ahead == [] and set(indexed) == {None}


def test_a_tensor_the_packer_refuses_after_buckets_went_ahead_fails_the_push_and_keeps_the_group(
    served: tuple[ServedEngine, Weights],
) -> None:
    """The bucket on the wire lands before the push fails, so the group stays in step and the next push uses it."""
    engine, weights = served

    def exporter() -> Any:
        yield from weights[: len(weights) // 2]
        yield weights[0]  # a name twice: refused by the packer, several buckets into the push

    async def scenario() -> tuple[str, str | None, str]:
        async with pushing(engine.url, options=PushOptions(bucket_bytes=16 * KB)) as (client, pusher):
            with pytest.raises(Exception) as failed:
                await asyncio.wait_for(pusher.push(exporter(), 1), 60)
            broken = pusher.group.broken
            await asyncio.wait_for(pusher.push(weights, 2), 60)
            return str(failed.value), broken, (await client.model_info()).weight_version

    failed, broken, version = asyncio.run(scenario())
    assert "appears twice" in failed
    assert broken is None and version == "2"
    params = engine.engine.model.state_dict()
    assert all(torch.equal(params[n], t) for n, t in weights)


def test_turns_refuse_another_push_and_a_repeated_index_and_let_the_right_one_through() -> None:
    async def scenario() -> list[str | None]:
        turns = UpdateTurns()
        await turns.open()
        got = [await turns.take(0, "a")]
        stale = asyncio.ensure_future(turns.take(1, "b"))
        waiting = asyncio.ensure_future(turns.take(1, "a"))
        await asyncio.sleep(0.05)
        got.append(await stale)  # another push than bucket 0's: refused without waiting for its turn
        assert not waiting.done()
        await turns.done(0, None)
        got.append(await waiting)
        await turns.done(1, None)
        got.append(await turns.take(1, "a"))  # bucket 1 again
        await turns.open()  # a new window starts again at 0, for whichever push
        got.append(await turns.take(0, "b"))
        return got

    got = asyncio.run(scenario())
    assert got[0] is None and got[2] is None and got[4] is None
    assert got[1] is not None and "another" not in got[1] and "push 'a'" in got[1]
    assert got[3] is not None and "came after bucket 1" in got[3]


def _announce_run(client: SGLangClient, pusher: WeightPusher, index: int, named: list[tuple[str, torch.Tensor]],
                  push_id: str = "push-a", **extra: Any) -> asyncio.Future[Any]:
    """A run on the per-tensor wire (one broadcast per tensor), as the pusher announces zero-copy tensors."""
    return asyncio.ensure_future(client.update_weights_from_distributed(
        names=[n for n, _ in named], dtypes=["float32"] * len(named), shapes=[list(t.shape) for _, t in named],
        group_name=pusher.group.group_name, flush_cache=False, weight_version=None, bucket_index=index,
        push_id=push_id, **extra))


async def _until(events: list[str], wanted: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while wanted not in events and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_the_engine_starts_receiving_the_next_bucket_while_the_one_before_is_still_arriving(
    served: tuple[ServedEngine, Weights],
) -> None:
    """An in-place bucket hands its turn on once its receives have started (``UpdateTurns.started``): bucket 1's
    receive is posted behind bucket 0's before a byte of either was sent, so the wire never waits for the engine
    between buckets. Bucket 1 and the end also come before the window-opening bucket 0 here, and wait for it."""
    engine, weights = served
    new = dict(weights)
    gate, up, down = (f"model.layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
    events: list[str] = []

    async def scenario() -> tuple[list[str], list[Any], bool]:
        async with pushing(engine.url) as (client, pusher):
            member = engine.engine.groups[pusher.group.group_name].members[0]
            member._impl = RecordingImpl(member._impl, events)
            second = _announce_run(client, pusher, 1, [(down, new[down])])
            end = asyncio.ensure_future(client.end_weight_update(push_id="push-a", buckets=2,
                                                                 continue_generation=True))
            await asyncio.sleep(0.2)  # both wait: no window is open yet
            assert not second.done() and not end.done()
            first = _announce_run(client, pusher, 0, [(gate, new[gate]), (up, new[up])], begin_window=True)
            await _until(events, "issue 2")
            posted = list(events)  # the engine's side, before the trainer sent anything
            await asyncio.to_thread(pusher.group.broadcast_all, [new[gate], new[up], new[down]])
            replies = [await asyncio.wait_for(f, 10) for f in (first, second, end)]
            return posted, replies, engine.engine.scheduler.paused

    posted, replies, paused = asyncio.run(scenario())
    assert posted == ["issue 0", "issue 1", "issue 2"]  # bucket 1's receive behind bucket 0's, none done
    assert all(r.success for r in replies), replies
    assert "generation continues" in replies[2].message and paused is False
    params = engine.engine.model.state_dict()
    assert all(torch.equal(params[n], new[n]) for n in (gate, up, down))


def test_the_pusher_starts_the_next_buckets_broadcasts_while_the_one_before_is_on_the_wire(tmp_path: Path) -> None:
    """Rank 0 issues bucket 1's broadcasts once bucket 0's have all started (``WeightGroup.issue``), not once they
    are through: here the engine holds off receiving bucket 0 for 0.3 s, and bucket 1 is already on its way. The
    second push goes out without /pause_generation and /begin_weight_update (bucket 0 carries them), and both
    land bit for bit."""
    shape = {"hidden_size": 128, "intermediate_size": 2048, "num_hidden_layers": 2}  # MLP tensors of 1 MB
    model = ServedEngine(init_tiny_model("qwen3", tmp_path / "m", seed=0, **shape))
    new_dir = init_tiny_model("qwen3", tmp_path / "new", seed=1, **shape)
    weights = sorted(load_file(str(new_dir / "model.safetensors")).items())
    receive = model.engine.weights.receive_in_place
    held = []

    def late(*args: Any, **kw: Any) -> Any:
        if not held:
            held.append(True)
            time.sleep(0.3)
        return receive(*args, **kw)

    model.engine.weights.receive_in_place = late  # type: ignore[method-assign]
    events: list[str] = []

    async def scenario() -> tuple[list[list[str]], list[str], str]:
        client = _Calls(model.url, retry=NO_RETRY)
        client.calls, client.announced = [], []
        async with pushing(model.url, client, PushOptions(bucket_bytes=2 << 20, zero_copy_bytes=1 << 20)) as (_, pusher):
            pusher.group._impl = RecordingImpl(pusher.group._impl, events)
            await pusher.push(weights, 1)
            first = len(client.calls)
            await pusher.push(weights, 2)
            return client.announced, client.calls[first:], (await client.model_info()).weight_version

    try:
        announced, second_push, version = asyncio.run(scenario())
    finally:
        model.stop()
    in_first = len(announced[0])
    assert in_first >= 1  # the push's first bucket is small (a sixteenth of a bucket): here one tensor
    assert events.index(f"issue {in_first}") < events.index(f"done {in_first - 1}"), events[: 3 * in_first]
    assert "pause" not in second_push and "begin" not in second_push and second_push[0] == "update+begin"
    assert version == "2"
    params = model.engine.model.state_dict()
    assert all(torch.equal(params[n], t) for n, t in weights)


class _Calls(SGLangClient):
    """A real client that records its weight calls and the names of each announcement."""

    calls: list[str]
    announced: list[list[str]]

    async def pause_generation(self, mode: Any = "abort") -> Any:
        self.calls.append("pause")
        return await super().pause_generation(mode)

    async def begin_weight_update(self) -> Any:
        self.calls.append("begin")
        return await super().begin_weight_update()

    async def update_weights_from_distributed(self, **kw: Any) -> Any:  # type: ignore[override]
        self.calls.append("update+begin" if kw.get("begin_window") else "update")
        self.announced.append(list(kw["names"]))
        return await super().update_weights_from_distributed(**kw)


def test_turns_of_a_push_that_died_are_refused_once_another_window_opens() -> None:
    """A trainer killed mid-push leaves announcements and an end waiting at the engine; the next trainer's window
    (opened by a plain /begin_weight_update, so not yet claimed by any push) must not be taken for theirs."""

    async def scenario() -> tuple[str | None, str | None, str | None]:
        turns = UpdateTurns()
        await turns.open()
        assert await turns.take(0, "dead") is None
        await turns.started(0)
        waiting = asyncio.ensure_future(turns.take(2, "dead"))  # bucket 1 never comes
        ending = asyncio.ensure_future(turns.settled(3, "dead"))
        await asyncio.sleep(0.05)
        assert not waiting.done() and not ending.done()
        await turns.open()  # the next trainer's first push
        refused = await asyncio.wait_for(waiting, 5)
        ended = await asyncio.wait_for(ending, 5)
        return refused, ended, await turns.take(0, "next")

    refused, ended, fresh = asyncio.run(scenario())
    assert refused is not None and "window closed" in refused
    assert ended is not None and "window closed" in ended
    assert fresh is None
