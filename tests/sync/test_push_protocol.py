"""The push boundary (``pipeline.sync.base.WeightPush``): both pushers the trainer may hold, ``WeightPusher`` and
``EngineRotation``, answer every member of it against a real CPU engine on a real gloo weight group, so the trainer
drives either without asking which one it holds; and the trainer never probes its pusher or step function."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.sync.base import WeightPush, WeightUpdateEngine
from pipeline.sync.packing import PackedBucket
from pipeline.sync.pusher import PushOptions, WeightPusher
from pipeline.sync.rotation import EngineRotation
from tests.helpers.engines import ServedEngine, Weights, served_with_new_weights

KB = 1 << 10
TRAINER = Path(__file__).resolve().parents[2] / "pipeline" / "consumers" / "trainer"
MEMBERS = {name for name in vars(WeightPush) if not name.startswith("_")}
"""Every member of the protocol: the scenario below must call each one."""

@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ServedEngine, Weights]]:
    with served_with_new_weights(tmp_path) as pair:
        yield pair


async def _connect(members: list[WeightUpdateEngine]) -> WeightPusher:
    return await WeightPusher.connect(members, master_address="127.0.0.1", backend="gloo", timeout_s=60,
                                      options=PushOptions(bucket_bytes=64 * KB))


async def _every_member(push: WeightPush, client: SGLangClient, weights: Weights) -> dict[str, Any]:
    """Each member of the protocol once, in the order a trainer uses them; what each gave back."""
    called: set[str] = set()
    seen: dict[str, Any] = {"isinstance": isinstance(push, WeightPush)}
    seen["engines"], seen["all"] = list(push.engines), list(push.all)
    seen["dtype"] = push.dtype
    called |= {"engines", "all", "dtype"}
    seen["push"] = (await push.push(weights, 1)).weight_version
    seen["push_once"] = await push.push_once(lambda: iter(weights), 2)
    packed = push.pack(weights)
    seen["pack"] = all(isinstance(b, PackedBucket) for b in packed) and len(packed) > 1
    # A resumed run holds every engine until its next push, which continues them.
    seen["adopt"] = [a.action for a in await push.adopt(2, fresh=False)]
    seen["pushed packed"] = (await push.push(packed, 3)).weight_version
    seen["version"] = await client.weight_version()
    seen["counters"] = push.counters()
    called |= {"push", "push_once", "pack", "adopt", "counters"}
    await push.close()
    called.add("close")
    seen["called"] = called
    return seen


@pytest.mark.parametrize("kind", ["pusher", "rotation"])
def test_both_pushers_answer_every_member_of_the_push_protocol(served: tuple[ServedEngine, Weights],
                                                               kind: str) -> None:
    engine, weights = served

    async def scenario() -> dict[str, Any]:
        client = SGLangClient(engine.url, retry=NO_RETRY)
        try:
            push: WeightPush = await (_connect([client]) if kind == "pusher"
                                      else EngineRotation.start([client], _connect))
            seen = await _every_member(push, client, weights)
            seen["client"] = client
            return seen
        finally:
            await client.close()

    seen = asyncio.run(scenario())
    assert seen["called"] == MEMBERS  # a member added to the protocol is added to this scenario too
    assert seen["isinstance"]
    assert seen["engines"] == [seen["client"]] and seen["all"] == [seen["client"]]
    assert seen["dtype"] is None  # the connect above names no wire dtype: each tensor travels in its own
    assert seen["push"] == "1" and seen["push_once"] is not None and seen["push_once"].weight_version == "2"
    assert seen["pack"]
    assert seen["adopt"] == ["held"]
    assert seen["pushed packed"] == "3" and seen["version"] == "3"
    expected = {"flush_refused"} if kind == "pusher" else {"flush_refused", "stalls"}
    assert set(seen["counters"]) == expected and all(isinstance(v, float) for v in seen["counters"].values())
    params = engine.engine.model.state_dict()
    landed = [torch.equal(params[name], tensor) for name, tensor in weights if name in params]
    assert landed and all(landed)


def test_a_pusher_missing_any_member_is_not_a_weight_push() -> None:
    def member() -> None: ...

    assert isinstance(type("Whole", (), dict.fromkeys(MEMBERS, member))(), WeightPush)
    for missing in sorted(MEMBERS):
        partial = type(f"Without_{missing}", (), dict.fromkeys(MEMBERS - {missing}, member))
        assert not isinstance(partial(), WeightPush), missing


def test_the_trainer_never_probes_its_pusher_or_step_function() -> None:
    """The trainer uses the ``WeightPush`` and ``StepFn`` protocols as they are: no getattr/hasattr to ask what
    an object has, which would let a pusher lacking a member slip through and silently skip its part."""
    probes = []
    for module in ("loop.py", "push.py"):
        tree = ast.parse((TRAINER / module).read_text())
        probes += [f"{module}:{node.lineno} {node.func.id}" for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                   and node.func.id in ("getattr", "hasattr")]
    assert probes == []


def test_rank_zero_alone_holds_the_rank_zero_collaborators(tmp_path: Path) -> None:
    from pipeline.consumers.trainer.loop import Trainer, TrainerSettings

    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="rank 0 alone"):
        Trainer(TrainerSettings(steps=1, batch_groups=1, checkpoint_every=1, keep_checkpoints=1, run_dir=tmp_path),
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step_fn=None,  # type: ignore[arg-type]
                export_weights=lambda: iter(()), lead=None)
