"""Engines sluice did not start (``pipeline.sync.lifecycle``), with real CPU engine processes speaking SGLang's
protocol: one at SGLang's default version label, one holding another run's weights at that run's version, on a fresh
run and on a resumed one. What is checked is what the engine serves afterwards: its version, whether requests were
aborted, and whether its greedy tokens are those of the run's weights (an independent HF forward)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeline.models.tiny import init_tiny_model
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient, adopt_engine_urls
from pipeline.sync.pusher import WeightPusher
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


def _generate(url: str) -> Any:
    async def go() -> Any:
        async with SGLangClient(url, retry=NO_RETRY) as client:
            return await client.generate(PROMPT, GREEDY, return_logprob=False)

    return asyncio.run(go())


def _version(url: str) -> str:
    async def go() -> str:
        async with SGLangClient(url, retry=NO_RETRY) as client:
            return await client.weight_version()

    return asyncio.run(go())


def test_a_default_engine_is_labelled_without_aborting_its_requests(model_dir: Path, tmp_path: Path) -> None:
    engine = start_engine(model_dir, tmp_path, None, "--weight-version", "default")

    async def scenario() -> tuple[Any, Any]:
        async with SGLangClient(engine.url, retry=NO_RETRY) as client:
            long = asyncio.ensure_future(client.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 300,
                                                                  "ignore_eos": True}, return_logprob=False))
            await asyncio.sleep(0.5)
            adopted = await asyncio.to_thread(adopt_engine_urls, [engine.url], version=0, fresh=True,
                                              model_path=str(model_dir))
            return adopted, await long

    try:
        adopted, long = asyncio.run(scenario())
        assert [(a.found, a.action) for a in adopted] == [("default", "labelled")]
        assert _version(engine.url) == "0"
        assert long.finish_reason == "length" and len(long.output_ids) == 300  # labelling aborted nothing
        after = _generate(engine.url)
        assert after.token_versions() == ["0"] * len(after.output_ids)
        assert after.output_ids.tolist() == _greedy_reference(model_dir)  # its own weights were the run's already
    finally:
        engine.stop()


def test_an_engine_at_a_foreign_version_gets_the_runs_weights_before_it_serves(model_dir: Path,
                                                                                tmp_path: Path) -> None:
    other = init_tiny_model("qwen3-moe", tmp_path / "other-run", seed=1)
    theirs = _greedy_reference(other)
    ours = _greedy_reference(model_dir)
    assert theirs != ours
    # An earlier run trained it to version 10 (its weights are another model's).
    engine = start_engine(other, tmp_path, None, "--weight-version", "10")
    try:
        # A fresh run: the run's weights are its model folder, which the engine reloads.
        adopted = adopt_engine_urls([engine.url], version=0, fresh=True, model_path=str(model_dir))
        assert [(a.found, a.action) for a in adopted] == [("10", "loaded")]
        served = _generate(engine.url)
        assert served.token_versions() == ["0"] * len(served.output_ids)
        assert served.output_ids.tolist() == ours

        # A resumed run at version 7: the run's weights exist only in the trainer, so the engine waits for its push.
        adopted = adopt_engine_urls([engine.url], version=7, fresh=False, model_path=str(model_dir))
        assert [(a.found, a.action) for a in adopted] == [("0", "held")]

        async def resume() -> Any:
            async with SGLangClient(engine.url, retry=NO_RETRY) as client:
                waiting = asyncio.ensure_future(client.generate(PROMPT, GREEDY, return_logprob=False))
                await asyncio.sleep(2.0)
                assert not waiting.done()  # held: nothing sampled from weights that are not the run's
                started = time.monotonic()
                pusher = await WeightPusher.connect([client], master_address="127.0.0.1", backend="gloo",
                                                    timeout_s=60)
                trained = sorted(load_file(str(other / "model.safetensors")).items())  # "the trainer's" weights
                await pusher.push(trained, 8)
                await pusher.close()
                result = await asyncio.wait_for(waiting, 60)
                assert time.monotonic() - started < 60
                return result

        result = asyncio.run(resume())
        assert result.token_versions() == ["8"] * len(result.output_ids)
        assert result.output_ids.tolist() == theirs  # every token came from the pushed weights
    finally:
        engine.stop()
