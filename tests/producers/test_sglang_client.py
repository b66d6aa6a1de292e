"""The SGLang HTTP client, the engine pool and the weight pusher against real engines.

Most tests run against sluice's CPU engine started as a real subprocess (``python -m pipeline.producers.cpu_engine``)
on a tiny Qwen3-MoE written by ``init_tiny_model``; each engine is stopped by the PID this file started. The retry and
health logic is also checked against a small aiohttp server that fails on command, which tests the client's error
handling rather than standing in for an engine.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from pipeline.errors import EngineError
from pipeline.producers.engine_pool import EnginePool
from pipeline.producers.sglang_client import (
    NO_RETRY,
    EngineRequestError,
    EngineUnavailableError,
    ExponentialBackoff,
    Retry,
    SGLangClient,
)
from tests.helpers.engines import EngineProcess, free_port, start_engine

HAVE_ENGINE = importlib.util.find_spec("pipeline.producers.cpu_engine") is not None and (
    importlib.util.find_spec("pipeline.models.tiny") is not None
)
needs_engine = pytest.mark.skipif(
    not HAVE_ENGINE, reason="pipeline.producers.cpu_engine / pipeline.models.tiny are not in this checkout yet"
)
FAST = Retry(backoff=ExponentialBackoff(base=0.0, cap=0.0, jitter=False), retries=3)


def _moe_shape(model_dir: Path) -> tuple[int, int, int]:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return config["num_hidden_layers"], config["num_experts_per_tok"], config["num_local_experts"]


GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


@needs_engine
def test_generate_decodes_every_field_consistently(engine: EngineProcess, model_dir: Path) -> None:
    layers, topk, num_experts = _moe_shape(model_dir)
    prompt = [5, 9, 12, 7, 3]

    async def scenario() -> Any:
        async with SGLangClient(engine.url, retry=FAST) as client:
            full = await client.generate(prompt, GREEDY, return_routed_experts=True, rid="req-1")
            tail = await client.generate(prompt, GREEDY, return_routed_experts=True, routed_experts_start_len=3)
            no_lp = await client.generate(prompt, GREEDY, return_logprob=False)
            shape = await client.routed_experts_shape()
            return full, tail, no_lp, shape

    full, tail, no_lp, shape = asyncio.run(scenario())
    assert shape == (layers, topk)  # discovered from /model_info
    r = len(full.output_ids)
    assert 1 <= r <= GREEDY["max_new_tokens"]
    assert full.output_ids.dtype == np.int32 and full.output_logprobs is not None
    assert full.output_logprobs.dtype == np.float32 and len(full.output_logprobs) == r == full.completion_tokens
    assert np.all(np.isfinite(full.output_logprobs)) and np.all(full.output_logprobs <= 0)
    assert full.prompt_tokens == len(prompt)
    assert full.finish_reason in ("length", "stop") and full.finish_detail["type"] == full.finish_reason
    if full.finish_reason == "length":
        assert r == GREEDY["max_new_tokens"]
    assert full.rid == "req-1" and full.engine == engine.url
    # Spans tile the output and agree with the engine's current version.
    assert full.weight_versions[0].start == 0 and full.weight_versions[-1].end == r
    assert len(full.token_versions()) == r and full.token_versions()[-1] == full.weight_version
    # Routed experts: one row per token that went through the model, real expert ids, top-k distinct per row.
    experts = full.routed_experts
    assert experts is not None and experts.dtype == np.int32
    assert experts.shape == (len(prompt) + r - 1, layers, topk)
    assert experts.min() >= 0 and experts.max() < num_experts
    assert all(len(set(row)) == topk for row in experts.reshape(-1, topk).tolist())
    # Greedy is deterministic, and start_len drops exactly the leading rows.
    assert np.array_equal(tail.output_ids, full.output_ids)
    assert tail.routed_experts is not None and np.array_equal(tail.routed_experts, experts[3:])
    assert no_lp.output_logprobs is None and np.array_equal(no_lp.output_ids, full.output_ids)


@needs_engine
def test_generate_many_is_prompt_major_and_seeded(engine: EngineProcess, model_dir: Path) -> None:
    layers, topk, _ = _moe_shape(model_dir)
    prompts = [[4, 5, 6], [10, 11, 12, 13, 14, 15]]
    params = {"max_new_tokens": 6, "temperature": 1.0, "n": 2, "sampling_seed": 42}

    async def scenario() -> Any:
        async with SGLangClient(engine.url, retry=FAST, routed_experts_shape=(layers, topk)) as client:
            first = await client.generate_many(prompts, params, return_routed_experts=True)
            again = await client.generate_many(prompts, params, return_routed_experts=True)
            return first, again

    first, again = asyncio.run(scenario())
    assert len(first) == 4
    assert [res.prompt_tokens for res in first] == [3, 3, 6, 6]
    for res, rerun in zip(first, again):
        assert np.array_equal(res.output_ids, rerun.output_ids)  # same seed, same tokens
        assert np.allclose(res.output_logprobs, rerun.output_logprobs)  # type: ignore[arg-type]
        assert res.routed_experts is not None
        assert res.routed_experts.shape[0] == res.prompt_tokens + len(res.output_ids) - 1


@needs_engine
def test_pool_skips_killed_engine_and_retries_on_the_other(
    engine: EngineProcess, model_dir: Path, tmp_path: Path
) -> None:
    doomed = start_engine(model_dir, tmp_path)
    long_params = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}

    async def scenario() -> None:
        live = SGLangClient(engine.url, retry=NO_RETRY)
        dying = SGLangClient(doomed.url, retry=NO_RETRY)
        pool = EnginePool([live, dying], probe_backoff=ExponentialBackoff(base=0.05, cap=0.2, jitter=False))
        try:
            # Keep the live engine busy so that the pool's least-loaded choice is the doomed one.
            busy = asyncio.ensure_future(live.generate([1, 2, 3], {"max_new_tokens": 40, "temperature": 0.0}))
            await asyncio.sleep(0)
            assert live.in_flight == 1
            routed = asyncio.ensure_future(pool.generate([7, 8, 9], long_params, return_routed_experts=True))
            await _until(lambda: dying.in_flight == 1)
            await _until_running(dying)
            doomed.stop(signal.SIGKILL)  # the engine this test started, killed mid-generation
            result = await asyncio.wait_for(routed, 120)
            assert result.engine == engine.url and len(result.output_ids) == 300
            assert not pool.is_healthy(dying) and pool.healthy_clients() == [live]
            await busy
            # While it is down, every request lands on the live engine, and probes keep failing.
            results = await asyncio.gather(*(pool.generate([i + 3, 4], GREEDY) for i in range(4)))
            assert {res.engine for res in results} == {engine.url}
            assert await pool.probe_all() == [True, False]
            assert not pool.is_healthy(dying)
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        doomed.stop()


@needs_engine
def test_pool_takes_a_restarted_engine_back(engine: EngineProcess, model_dir: Path, tmp_path: Path) -> None:
    port = free_port()

    async def scenario() -> None:
        live = SGLangClient(engine.url, retry=NO_RETRY)
        later = SGLangClient(f"http://127.0.0.1:{port}", retry=NO_RETRY)
        pool = EnginePool([later, live], probe_backoff=ExponentialBackoff(base=0.05, cap=0.2, jitter=False))
        try:
            # Nothing listens on `port` yet: the first requests fail over and mark it unhealthy.
            results = await asyncio.gather(*(pool.generate([5, 6], GREEDY) for _ in range(3)))
            assert {res.engine for res in results} == {engine.url}
            assert not pool.is_healthy(later)
            restarted = await asyncio.to_thread(start_engine, model_dir, tmp_path, port)
            try:
                # Background /health probes (scheduled as requests come in) put it back in rotation.
                deadline = time.monotonic() + 30
                while not pool.is_healthy(later) and time.monotonic() < deadline:
                    await pool.generate([5, 6], GREEDY)
                    await asyncio.sleep(0.1)
                assert pool.is_healthy(later)
                results = await asyncio.gather(*(pool.generate([5, 6], GREEDY) for _ in range(4)))
                assert {res.engine for res in results} == {engine.url, later.base_url}
            finally:
                restarted.stop()
        finally:
            await pool.close()

    asyncio.run(scenario())


@needs_engine
def test_weight_push_changes_version_and_greedy_output(engine: EngineProcess, model_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from pipeline.models.tiny import init_tiny_model
    from pipeline.sync.pusher import PushOptions, WeightPusher

    original = load_file(str(model_dir / "model.safetensors"))
    other = load_file(str(init_tiny_model("qwen3-moe", tmp_path / "other", seed=1) / "model.safetensors"))
    assert other.keys() == original.keys()
    assert any(not torch.equal(other[k], original[k]) for k in original)
    prompt = [3, 14, 15, 9, 2, 6]
    long_params = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}

    async def scenario() -> None:
        async with SGLangClient(engine.url, retry=FAST) as client:
            before = await client.generate(prompt, GREEDY)
            pusher = await WeightPusher.connect(
                [client], master_address="127.0.0.1", master_port=free_port(), group_name="client-test",
                timeout_s=60, options=PushOptions(bucket_bytes=64 * 1024),
            )  # fmt: skip
            try:
                # A long generation straddles the push: its spans must show both versions, old then new.
                straddling = asyncio.ensure_future(client.generate(prompt, long_params))
                await _until_running(client)
                stats = await pusher.push(sorted(other.items()), weight_version=101)
                assert stats.buckets > 1 and stats.tensors == len(other)
                assert await client.weight_version() == "101"
                after = await client.generate(prompt, GREEDY)
                assert after.weight_version == "101" and [s.version for s in after.weight_versions] == ["101"]
                assert not np.allclose(after.output_logprobs, before.output_logprobs)  # type: ignore[arg-type]
                spanning = await straddling
                assert spanning.weight_versions[0].version == before.weight_version
                assert spanning.weight_versions[-1].version == "101"
                assert spanning.weight_versions[-1].end == 400
                # Pushing the original weights back restores the original greedy output exactly.
                await pusher.push(original.items(), weight_version=102)
                restored = await client.generate(prompt, GREEDY)
                assert restored.weight_version == "102"
                assert np.array_equal(restored.output_ids, before.output_ids)
                assert np.array_equal(restored.output_logprobs, before.output_logprobs)  # type: ignore[arg-type]
            finally:
                await pusher.close()
            # The engine left the group, so the same group name can be set up again and used.
            pusher = await WeightPusher.connect(
                [client], master_address="127.0.0.1", master_port=free_port(), group_name="client-test", timeout_s=60
            )
            try:
                await pusher.push(original.items(), weight_version=104)
                assert (await client.generate(prompt, GREEDY)).weight_version == "104"
            finally:
                await pusher.close()
            # A bare relabel, without aborting anything (the client's default).
            reply = await client.update_weight_version("105")
            assert reply.success and await client.weight_version() == "105"

    asyncio.run(scenario())


@needs_engine
def test_control_endpoints(engine: EngineProcess) -> None:
    async def scenario() -> None:
        async with SGLangClient(engine.url, retry=FAST) as client:
            assert await client.health()
            info = await client.model_info()
            assert info.moe_layers is not None and info.topk is not None and info.weight_version
            assert (await client.flush_cache()).success
            assert await client.prefix_cache() is True  # the CPU engine keeps one, as SGLang does: a pusher flushes it
            assert (await client.pause_generation("in_place")).success
            # While paused, a request waits; it finishes once generation continues.
            waiting = asyncio.ensure_future(client.generate([4, 4, 4], GREEDY))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            assert (await client.continue_generation()).success
            result = await asyncio.wait_for(waiting, 60)
            assert len(result.output_ids) > 0
            refused = await client.update_weights_from_distributed(
                names=["nope"], dtypes=["float32"], shapes=[[1]], group_name="none", flush_cache=False,
                weight_version=None,
            )  # fmt: skip
            assert not refused.success and refused.message

    asyncio.run(scenario())


async def _until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def _until_running(client: SGLangClient, timeout: float = 30.0) -> None:
    """Wait until the engine reports a running request (/v1/loads, with the CPU engine's token counter)."""
    probe = SGLangClient(client.base_url, retry=NO_RETRY)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            load = await probe.get_load()
            if load.num_running_reqs >= 1 and load.total("tokens_generated") > 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the engine never reported a running request")
    finally:
        await probe.close()


# --------------------------------------------------------------------------------------------------------------------
# Error handling against a server that fails on command
# --------------------------------------------------------------------------------------------------------------------


def _generate_answer(prompt_len: int, output_ids: list[int], version: str = "3") -> dict[str, Any]:
    rows = prompt_len + len(output_ids) - 1
    experts = np.arange(rows * 2 * 2, dtype="<i4").reshape(rows, 2, 2) % 8
    return {
        "text": "x" * len(output_ids),
        "output_ids": output_ids,
        "meta_info": {
            "finish_reason": {"type": "length", "length": len(output_ids)},
            "prompt_tokens": prompt_len,
            "completion_tokens": len(output_ids),
            "weight_version": version,
            "weight_versions": [
                {"version": "2", "start": 0, "end": 1},
                {"version": version, "start": 1, "end": len(output_ids)},
            ],
            "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(output_ids)],
            "routed_experts": base64.b64encode(experts.tobytes()).decode(),
        },
    }


@dataclass
class FlakyServer:
    """An aiohttp server whose answers the test scripts: a queue of statuses, a delay, a health flag."""

    statuses: list[int] = field(default_factory=list)
    delay: float = 0.0
    healthy: bool = True
    hits: dict[str, int] = field(default_factory=dict)
    answer: Any = None
    server_info: dict[str, Any] | None = None
    prefix_cache: bool | None = False
    """What /get_model_info says of a prefix cache (None: nothing). The scripted answers span a push from version 2
    to 3 however they are keyed, which a keyed client would take for a request the push overtook, every time."""
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FlakyServer:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_model_info", self._info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_post("/update_weights_from_distributed", self._refuse)
        app.router.add_post("/flush_cache", self._text)
        app.router.add_get("/v1/loads", self._loads)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _hit(self, name: str) -> None:
        self.hits[name] = self.hits.get(name, 0) + 1

    async def _generate(self, request: web.Request) -> web.Response:
        self._hit("generate")
        body = await request.json()
        if self.delay:
            await asyncio.sleep(self.delay)
        status = self.statuses.pop(0) if self.statuses else 200
        if status != 200:
            return web.json_response({"error": {"message": f"scripted {status}"}}, status=status)
        prompt = body["input_ids"][0]
        return web.json_response(self.answer if self.answer is not None else [_generate_answer(len(prompt), [7, 8, 9])])

    async def _health(self, request: web.Request) -> web.Response:
        self._hit("health")
        return web.Response(status=200 if self.healthy else 503)

    async def _info(self, request: web.Request) -> web.Response:
        info = {"model_path": "m", "weight_version": "3", "num_moe_layers": 2, "topk": 2}
        return web.json_response(info if self.prefix_cache is None else {**info, "prefix_cache": self.prefix_cache})

    async def _server_info(self, request: web.Request) -> web.Response:
        self._hit("server_info")
        return web.json_response(self.server_info if self.server_info is not None else {"tp_size": 1})

    async def _refuse(self, request: web.Request) -> web.Response:
        self._hit("update")
        return web.json_response({"success": False, "message": "outside a begin/end window"}, status=400)

    async def _text(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")

    async def _loads(self, request: web.Request) -> web.Response:
        # SGLang 0.5.23's answer for two data-parallel ranks (it serves no /get_load route any more).
        self._hit("loads")
        ranks = [{"dp_rank": i, "num_running_reqs": 3 + i, "num_waiting_reqs": 2 * i, "num_total_reqs": 3 + 3 * i,
                  "num_used_tokens": 100, "max_total_num_tokens": 1000, "token_usage": 0.1} for i in range(2)]
        return web.json_response({"timestamp": "2026-01-01T00:00:00+00:00", "version": "0.5.23",
                                  "dp_rank_count": 2, "loads": ranks, "aggregate": {}})


def _with_server(test: Any) -> None:
    async def scenario() -> None:
        server = await FlakyServer().start()
        try:
            await test(server)
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_get_load_reads_sglangs_v1_loads() -> None:
    async def test(server: FlakyServer) -> None:
        async with SGLangClient(server.url, retry=FAST) as client:
            load = await client.get_load()
        assert server.hits["loads"] == 1
        assert (load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (7, 2, 9)
        assert load.total("num_used_tokens") == 200 and len(load.ranks) == 2

    _with_server(test)


def test_prefix_cache_follows_sglangs_server_info_and_defaults_to_flushing() -> None:
    async def test(server: FlakyServer) -> None:
        server.prefix_cache = None
        async with SGLangClient(server.url, retry=FAST) as client:
            said = [await client.prefix_cache()]  # /model_info says nothing, /get_server_info neither: flush
            server.server_info = {"disable_radix_cache": False}
            said.append(await client.prefix_cache())
            server.server_info = {"disable_radix_cache": True}
            said.append(await client.prefix_cache())
        assert said == [True, True, False]
        assert server.hits["server_info"] == 3

    _with_server(test)


def test_retry_rides_out_5xx_then_succeeds() -> None:
    async def test(server: FlakyServer) -> None:
        server.statuses = [503, 502]
        async with SGLangClient(server.url, retry=FAST) as client:
            result = await client.generate([1, 2], GREEDY, return_routed_experts=True)
        assert server.hits["generate"] == 3
        assert result.output_ids.tolist() == [7, 8, 9] and result.output_logprobs is not None
        assert result.output_logprobs.tolist() == [-0.5, -1.0, -1.5]
        assert result.routed_experts is not None and result.routed_experts.shape == (4, 2, 2)
        assert result.token_versions() == ["2", "3", "3"] and result.weight_version == "3"

    _with_server(test)


def test_retries_run_out_and_4xx_is_not_retried() -> None:
    async def test(server: FlakyServer) -> None:
        server.statuses = [503] * 10
        async with SGLangClient(server.url, retry=Retry(ExponentialBackoff(0.0, 0.0, False), retries=2)) as client:
            with pytest.raises(EngineUnavailableError, match="503"):
                await client.generate([1, 2], GREEDY)
            assert server.hits["generate"] == 3
            server.statuses = [400]
            with pytest.raises(EngineRequestError, match="400"):
                await client.generate([1, 2], GREEDY)
            assert server.hits["generate"] == 4

    _with_server(test)


def test_timeout_is_unavailable_and_weight_calls_are_not_retried() -> None:
    async def test(server: FlakyServer) -> None:
        server.delay = 2.0
        async with SGLangClient(server.url, timeout=0.2, retry=Retry(ExponentialBackoff(0.0, 0.0, False), 1)) as client:
            with pytest.raises(EngineUnavailableError, match="did not answer"):
                await client.generate([1, 2], GREEDY)
            assert server.hits["generate"] == 2
            reply = await client.update_weights_from_distributed(
                names=["a"], dtypes=["float32"], shapes=[[1]], group_name="g", flush_cache=False, weight_version="1"
            )
            assert not reply.success and reply.message == "outside a begin/end window"
            assert server.hits["update"] == 1
            info = await client.model_info()  # falls back to /get_model_info on a 404
            assert (info.moe_layers, info.topk, info.weight_version) == (2, 2, "3")
            assert (await client.flush_cache()).success

    _with_server(test)


def test_inconsistent_answers_are_rejected() -> None:
    async def test(server: FlakyServer) -> None:
        async with SGLangClient(server.url, retry=FAST, routed_experts_shape=(2, 2)) as client:
            bad = _generate_answer(2, [7, 8, 9])
            bad["meta_info"]["output_token_logprobs"].pop()
            server.answer = [bad]
            with pytest.raises(EngineError, match="output_token_logprobs"):
                await client.generate([1, 2], GREEDY)
            bad = _generate_answer(2, [7, 8, 9])
            bad["meta_info"]["weight_versions"][1]["end"] = 2
            server.answer = [bad]
            with pytest.raises(EngineError, match="spans"):
                await client.generate([1, 2], GREEDY)
            bad = _generate_answer(2, [7, 8, 9])
            bad["meta_info"]["routed_experts"] = _generate_answer(3, [7, 8, 9])["meta_info"]["routed_experts"]
            server.answer = [bad]  # one routing row too many
            with pytest.raises(EngineError, match="routed_experts"):
                await client.generate([1, 2], GREEDY, return_routed_experts=True)
            server.answer = [_generate_answer(3, [7, 8, 9])]  # an answer for some other prompt
            with pytest.raises(EngineError, match="prompt_tokens"):
                await client.generate([1, 2], GREEDY)
            server.answer = [_generate_answer(2, [7, 8, 9])] * 2  # two sequences for one
            with pytest.raises(EngineError, match="answered 2 sequences"):
                await client.generate([1, 2], GREEDY)

    _with_server(test)


def test_clients_satisfy_the_engine_and_weight_protocols() -> None:
    from pipeline.producers.base import EngineClient
    from pipeline.sync.base import WeightUpdateEngine

    client = SGLangClient("http://127.0.0.1:1")
    assert isinstance(client, EngineClient) and isinstance(client, WeightUpdateEngine)
    assert isinstance(EnginePool([client]), EngineClient)


def test_pool_marks_failing_engine_unhealthy_and_probes_it_back() -> None:
    async def scenario() -> None:
        bad, good = await FlakyServer().start(), await FlakyServer().start()
        bad.statuses = [503] * 100
        bad.healthy = False
        clients = [SGLangClient(bad.url, retry=NO_RETRY), SGLangClient(good.url, retry=NO_RETRY)]
        pool = EnginePool(clients, probe_backoff=ExponentialBackoff(0.05, 0.05, jitter=False))
        try:
            results = await asyncio.gather(*(pool.generate([1, 2], GREEDY) for _ in range(6)))
            assert {r.engine for r in results} == {good.url}
            assert bad.hits["generate"] >= 1 and not pool.is_healthy(clients[0])
            hits = bad.hits["generate"]
            await asyncio.gather(*(pool.generate([1, 2], GREEDY) for _ in range(4)))
            assert bad.hits["generate"] == hits  # skipped while unhealthy
            bad.healthy, bad.statuses = True, []
            deadline = time.monotonic() + 10
            while not pool.is_healthy(clients[0]) and time.monotonic() < deadline:
                await pool.generate([1, 2], GREEDY)
                await asyncio.sleep(0.05)
            assert pool.is_healthy(clients[0]) and bad.hits["health"] >= 1
        finally:
            await pool.close()
            await bad.stop()
            await good.stop()

    asyncio.run(scenario())


def test_pool_with_no_healthy_engine_raises_after_retries() -> None:
    async def scenario() -> None:
        dead = SGLangClient(f"http://127.0.0.1:{free_port()}", retry=NO_RETRY, connect_timeout=0.5)
        pool = EnginePool([dead], retry=Retry(ExponentialBackoff(0.01, 0.01, False), retries=2))
        with pytest.raises(EngineUnavailableError):
            await pool.generate([1], GREEDY)
        await pool.close()

    asyncio.run(scenario())
