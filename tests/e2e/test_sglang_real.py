"""sluice against a real SGLang 0.5.23 server on this CPU (the environment ``bash scripts/sglang-cpu.sh`` builds; every
test here is skipped, saying so, without it).

One server for the module, on a tiny Qwen3-MoE written by sluice's own writer: generation through ``SGLangClient``
(log-probs, weight-version spans, routed experts shaped from config.json), adoption of a fresh server and of one left
at another run's weights, and a short async ``sluice run`` that trains the very model folder the server serves and
pushes every step's weights into it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pipeline.producers.base import GenerateResult
from pipeline.producers.sglang_client import SGLangClient, adopt_engine_urls
from tests.helpers.sglang_server import (
    SGLangServer,
    assert_clean_run,
    moe_shape,
    require_sglang,
    sluice_run,
    start_server,
    weight_version,
    write_model,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

STEPS = 12
RUN_TIMEOUT_S = 600.0
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_sglang()
    return write_model(tmp_path_factory.mktemp("sglang-model") / "model")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    python = require_sglang()
    started = start_server(model_dir, tmp_path_factory.mktemp("sglang-logs"), python=python)
    try:
        yield started
    finally:
        began = time.monotonic()
        started.stop()
    assert not started.alive(), f"the server outlived its stop ({time.monotonic() - began:.1f} s)"


def _client(server: SGLangServer) -> SGLangClient:
    return SGLangClient(server.url, routed_experts_shape=moe_shape(server.model_dir), timeout=120.0)


async def _generate(server: SGLangServer, prompts: list[list[int]], params: dict, **kw: object) -> list[GenerateResult]:
    client = _client(server)
    try:
        return await client.generate_many(prompts, params, return_routed_experts=True, **kw)  # type: ignore[arg-type]
    finally:
        await client.close()


def _greedy(server: SGLangServer) -> list[GenerateResult]:
    return asyncio.run(_generate(server, PROMPTS, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}))


async def _call(server: SGLangServer, name: str, *args: object, **kw: object) -> object:
    client = _client(server)
    try:
        return await getattr(client, name)(*args, **kw)
    finally:
        await client.close()


def test_the_server_generates_through_sglang_client(server: SGLangServer) -> None:
    layers, topk = moe_shape(server.model_dir)
    cfg = json.loads((server.model_dir / "config.json").read_text())
    assert (layers, topk) == (2, 2)
    version = weight_version(server.url)
    n = 2
    results = asyncio.run(_generate(server, PROMPTS, {"max_new_tokens": 5, "temperature": 1.0, "n": n,
                                                      "ignore_eos": True}))
    assert len(results) == len(PROMPTS) * n
    for i, r in enumerate(results):
        prompt = PROMPTS[i // n]  # prompt-major
        out = len(r.output_ids)
        assert out == 5 and r.finish_reason == "length" and r.prompt_tokens == len(prompt)
        assert r.output_logprobs is not None and r.output_logprobs.shape == (out,)
        assert np.all(np.isfinite(r.output_logprobs)) and np.all(r.output_logprobs <= 0)
        # One span over every output token, at the server's current version.
        assert [(s.version, s.start, s.end) for s in r.weight_versions] == [(version, 0, out)]
        assert r.weight_version == version
        experts = r.routed_experts
        assert experts is not None and experts.shape == (len(prompt) + out - 1, layers, topk)
        assert experts.min() >= 0 and experts.max() < cfg["num_local_experts"]
        assert all(len(set(row)) == topk for row in experts.reshape(-1, topk).tolist())  # distinct top-k experts
    # Loads and the server's own description, as sluice reads them.
    load = asyncio.run(_call(server, "get_load"))
    assert load.num_total_reqs == 0  # type: ignore[attr-defined]
    assert asyncio.run(_call(server, "weight_dtype")) == "bfloat16"
    assert asyncio.run(_call(server, "prefix_cache")) is True


def test_adoption_labels_a_fresh_server_and_reloads_one_left_at_another_runs_weights(
    server: SGLangServer, model_dir: Path, tmp_path: Path
) -> None:
    if weight_version(server.url) != "default":
        # Another test left it elsewhere: the same state as a fresh start (the folder's weights, SGLang's label).
        reply = asyncio.run(_call(server, "update_weights_from_disk", str(model_dir), weight_version="default"))
        assert reply.success, reply  # type: ignore[attr-defined]
    assert weight_version(server.url) == "default"
    original = _greedy(server)

    # A fresh server (SGLang's "default" label) serves the run's starting weights: it is only labelled 0.
    [adopted] = adopt_engine_urls([server.url], version=0, fresh=True, model_path=str(model_dir))
    assert (adopted.found, adopted.action) == ("default", "labelled")
    assert weight_version(server.url) == "0"
    labelled = _greedy(server)
    for a, b in zip(original, labelled, strict=True):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        assert [s.version for s in b.weight_versions] == ["0"]

    # Another run's weights (a model of another seed) at that run's version: the server is left there.
    other = write_model(tmp_path / "other-run", seed=1)
    reply = asyncio.run(_call(server, "update_weights_from_disk", str(other), weight_version="17"))
    assert reply.success, reply  # type: ignore[attr-defined]
    foreign = _greedy(server)
    assert weight_version(server.url) == "17"
    assert any(not np.allclose(a.output_logprobs, b.output_logprobs)  # type: ignore[arg-type]
               for a, b in zip(original, foreign, strict=True)), "the other run's weights were not loaded"

    # A fresh run adopting it reloads its own starting weights from disk and relabels them 0.
    [adopted] = adopt_engine_urls([server.url], version=0, fresh=True, model_path=str(model_dir))
    assert (adopted.found, adopted.action) == ("17", "loaded")
    assert weight_version(server.url) == "0"
    reloaded = _greedy(server)
    for a, b in zip(original, reloaded, strict=True):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)  # type: ignore[arg-type]
        assert [s.version for s in b.weight_versions] == ["0"]
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)  # type: ignore[arg-type]

    # A run that is already the server's (it reports the run's version) is kept as it is.
    [adopted] = adopt_engine_urls([server.url], version=0, fresh=True, model_path=str(model_dir))
    assert adopted.action == "kept"


def test_an_async_sluice_run_trains_the_served_model_and_pushes_every_step(
    server: SGLangServer, model_dir: Path, tmp_path: Path
) -> None:
    run = sluice_run(tmp_path / "run", [
        "engine.type=sglang", f'engine.urls=["{server.url}"]',
        f"model.path={json.dumps(str(model_dir))}",  # the folder the server serves: both start from its weights
        "warmstart.enabled=false", "eval.heldout.enabled=false",
        "trainer.batch_groups=4", "filters.zero_variance=false", "trainer.checkpoint_every=4",
        "producer.concurrency=4",
    ], steps=STEPS, timeout=RUN_TIMEOUT_S, log=tmp_path / "launcher.log")
    print(f"sluice run: {run.seconds:.1f} s, pushes {run.pushes_landed}/{STEPS}, audit {run.ledger}")
    # Every step's push reached the server, in order; every sample accounted for exactly once.
    assert_clean_run(run, STEPS, RUN_TIMEOUT_S)
    assert run.pushes_landed == STEPS, run.pushes
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert run.metrics[-1]["policy_version"] == STEPS
    assert run.ledger["trained"] > 0
    # The trainer's log-probs are those of the weights the server sampled with (bf16 engine, fp32 trainer).
    k3 = [m["mismatch_k3"] for m in run.metrics if "mismatch_k3" in m]
    assert k3 and max(k3) < 1e-2, k3
    # The server holds the run's last weights, at the run's last version, and still serves.
    assert weight_version(server.url) == str(STEPS)
    [after] = asyncio.run(_generate(server, [PROMPTS[0]], {"max_new_tokens": 3, "temperature": 1.0}))
    assert [s.version for s in after.weight_versions] == [str(STEPS)]
