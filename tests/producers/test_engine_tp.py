"""Engines with TP > 1 in the weight group: a CPU engine with ``--tp 2`` (two ranks, as an SGLang server with TP 2
joins) and one with TP 1, pushed to through the trainer's own connect path. The trainer must count every rank: a
world of 1 + 2 + 1, offsets 1 and 3. Both engines then serve the pushed weights, and each rank of the TP-2 engine
took every byte off the group."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import SluiceConfig
from pipeline.consumers.trainer.main import _connect_pusher
from pipeline.models.tiny import init_tiny_model
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from tests.helpers.engines import start_engine

pytestmark = pytest.mark.slow
PROMPT = [11, 12, 13, 14, 15]
GREEDY = {"temperature": 0.0, "max_new_tokens": 10}


def _greedy_reference(model_dir: Path) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(GREEDY["max_new_tokens"]):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(PROMPT):].tolist()


def test_a_push_reaches_every_rank_of_a_tp2_engine_and_a_tp1_engine(model_dir: Path, tmp_path: Path) -> None:
    trained = init_tiny_model("qwen3-moe", tmp_path / "trained", seed=1)
    weights = sorted(load_file(str(trained / "model.safetensors")).items())
    wire_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    engines = [start_engine(model_dir, tmp_path, None, "--tp", "2"), start_engine(model_dir, tmp_path)]
    cfg = SluiceConfig.model_validate({"sync": {"backend": "gloo"}})

    async def scenario() -> tuple[Any, list[Any], list[Any]]:
        clients = [SGLangClient(e.url, retry=NO_RETRY) for e in engines]
        rotation = await _connect_pusher(cfg.sync, list(clients), tmp_path, model_dir)
        try:
            world_size = rotation.pusher.group.world_size
            ranks = [(await c.model_info()).raw["weight_groups"] for c in clients]
            await rotation.push(weights, 1)
            outputs = [await c.generate(PROMPT, GREEDY, return_logprob=False) for c in clients]
            loads = [await c.get_load() for c in clients]
            return (world_size, ranks), outputs, loads
        finally:
            await rotation.close()
            for c in clients:
                await c.close()

    try:
        (world_size, ranks), outputs, loads = asyncio.run(scenario())
    finally:
        for e in engines:
            e.stop()
    assert world_size == 1 + 2 + 1
    assert ranks == [{"sluice_weights": [1, 2]}, {"sluice_weights": [3]}]  # rank offsets 1 and 3
    expected = _greedy_reference(trained)
    for out in outputs:
        assert out.output_ids.tolist() == expected and out.token_versions() == ["1"] * len(expected)
    tp2, tp1 = (load.ranks[0]["weight_bytes_received_per_tp_rank"] for load in loads)
    assert tp2 == [wire_bytes, wire_bytes] and tp1 == [wire_bytes]


def test_an_engine_with_more_tp_ranks_than_asyncios_thread_pool_joins_and_receives_on_each() -> None:
    """Every rank's join blocks until the whole world joined, so the ranks must not queue in a shared pool: asyncio's
    default one has min(32, cores + 4) threads, and a TP above that never formed the group."""
    import os
    import threading

    from pipeline.net import free_port
    from pipeline.producers.cpu_engine.tp_group import TpWeightGroup
    from pipeline.sync.weights import init_weight_group

    tp = min(32, (os.cpu_count() or 1) + 4) + 1
    port = free_port()
    trainer: dict[str, Any] = {}

    def host() -> None:
        group = init_weight_group("127.0.0.1", port, 0, 1 + tp, "tp-join", "gloo", 60)
        trainer["group"] = group

    thread = threading.Thread(target=host)
    thread.start()
    engine = asyncio.run(TpWeightGroup.join(tp, master_address="127.0.0.1", master_port=port, rank_offset=1,
                                            world_size=1 + tp, group_name="tp-join", timeout_s=60))
    thread.join(timeout=60)
    try:
        assert len(engine.members) == tp and "group" in trainer
        buffers = [torch.zeros(4096, dtype=torch.uint8) for _ in engine.members]
        receiving = [threading.Thread(target=m.broadcast, args=(b, 0)) for m, b in zip(engine.members, buffers)]
        for t in receiving:
            t.start()
        trainer["group"].broadcast(torch.full((4096,), 7, dtype=torch.uint8), src=0)
        for t in receiving:
            t.join(timeout=60)
        assert all(bool((b == 7).all()) for b in buffers)  # every rank took the broadcast
    finally:
        for member in engine.members:
            member.close()
        trainer["group"].close()


def test_the_bench_reference_receives_into_its_prepared_buffers_and_frees_them_only_at_the_next_prepare() -> None:
    """``sluice bench sync``'s reference times ``probe``. Freeing a model-sized buffer costs about 0.1 ms per MB
    (220 ms for 2 GB), so a probe that dropped its buffers would time the free as part of the bare broadcast and
    flatter every push measured against it."""
    import threading
    import weakref

    from pipeline.producers.cpu_engine.tp_group import TpWeightGroup
    from pipeline.sync.weights import bind_weight_store, init_weight_group

    store = bind_weight_store(3, timeout_s=30)
    hosted: dict[str, Any] = {}
    host = threading.Thread(target=lambda: hosted.setdefault("group", init_weight_group(
        "127.0.0.1", int(store.port), 0, 3, "probe", timeout_s=30, store=store)))
    host.start()
    engine = asyncio.run(TpWeightGroup.join(2, master_address="127.0.0.1", master_port=int(store.port), rank_offset=1,
                                            world_size=3, group_name="probe", timeout_s=30))
    host.join(30)
    trainer = hosted["group"]
    try:
        sent = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)
        engine.prepare_probe(sent.numel())
        kept = [weakref.ref(b) for b in engine._probe or []]
        receiving = threading.Thread(target=engine.probe, args=(sent.numel(),))
        receiving.start()
        trainer.broadcast(sent, 0)
        receiving.join(30)
        assert len(kept) == 2 and all(ref() is not None for ref in kept)  # both TP ranks' buffers outlive the probe
        assert all(torch.equal(ref(), sent) for ref in kept)  # type: ignore[arg-type]
        engine.prepare_probe(16)
        assert all(ref() is None for ref in kept)
    finally:
        engine.close()
        trainer.close()
