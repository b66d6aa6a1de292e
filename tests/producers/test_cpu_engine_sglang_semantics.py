"""The CPU engine behaves as SGLang 0.5.23 does where sluice's weight push and its rollouts can tell: the model-update
lock and the pause (a weight update that comes while generating waits for the generations, one that comes while
paused does not, and one that comes before an in-place pause waits for ever), ``/flush_cache`` only on an idle engine,
and a prefix cache in ``extra_key`` namespaces that reuses the KV of the weights it was computed under.

Each test runs against a real engine process (``engines.start_engine``: a tiny Qwen3-MoE, routing recorded), except
the first two, which check the lock and the cache as objects, and the ordered push's, which serves the engine in this
process (``engines.ServedEngine``) to push into it over gloo."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.models.tiny import init_tiny_model
from pipeline.producers.cpu_engine.prefix_cache import PrefixCache
from pipeline.producers.cpu_engine.update_lock import ModelUpdateLock
from tests.helpers.engines import EngineProcess, ServedEngine, pushing, start_engine

LOGPROB_ATOL = 1e-4  # as tests/producers/test_cpu_engine.py: the same math in another summation order moves logprobs ~1e-6
LONG = 900  # output tokens of a generation that is still running when the calls under test arrive (about 2 s here)
PENDING_S = 3.0  # how long a call that must wait is watched not answering


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other weights of the same architecture."""
    return init_tiny_model("qwen3-moe", tmp_path_factory.mktemp("tiny-moe-new"), seed=1)


@pytest.fixture
def url(engine: EngineProcess) -> Iterator[str]:
    """The module's engine, continued and idle again after each test, whatever the test left."""
    yield engine.url
    httpx.post(f"{engine.url}/continue_generation", json={}, timeout=30)
    httpx.post(f"{engine.url}/abort_request", json={"abort_all": True}, timeout=30)


def _request(prompt: list[int], max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}, **extra}


def _logprobs(answer: dict[str, Any]) -> np.ndarray:
    return np.array([e[0] for e in answer["meta_info"]["output_token_logprobs"]])


async def _load(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    return (await client.get(f"{url}/v1/loads")).json()["loads"][0]


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "the engine never reached the state the test waits for"
        await asyncio.sleep(0.01)


async def _long_generation(client: httpx.AsyncClient, url: str, prompt: list[int]) -> asyncio.Task[httpx.Response]:
    """A generation of ``LONG`` tokens, returned once it is decoding."""
    start = (await _load(client, url))["tokens_generated"]
    body = {**_request(prompt, LONG), "return_routed_experts": False}
    task = asyncio.ensure_future(client.post(f"{url}/generate", json=body))

    async def decoding() -> bool:
        assert not task.done(), f"the long generation ended early: {task.result().text}"
        return (await _load(client, url))["tokens_generated"] > start + 5

    await _until(decoding)
    return task


async def _frozen(client: httpx.AsyncClient, url: str) -> int:
    """Tokens generated so far, read once a forward pass that was running when the pause came has ended."""
    await asyncio.sleep(0.2)
    return int((await _load(client, url))["tokens_generated"])


async def _still_pending(task: asyncio.Future[Any], seconds: float) -> bool:
    done, _ = await asyncio.wait([task], timeout=seconds)
    return not done


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


# ---- the lock and the cache as objects ------------------------------------------------------------------------------


def test_the_update_lock_prefers_writers_and_a_writer_that_gives_up_lets_readers_in() -> None:
    async def scenario() -> list[str]:
        lock, events = ModelUpdateLock(), []
        held = asyncio.Event()

        async def reader(name: str, hold: asyncio.Event | None = None) -> None:
            async with lock.reading():
                events.append(f"{name} in")
                if hold is not None:
                    await hold.wait()
            events.append(f"{name} out")

        async def writer() -> None:
            async with lock.writing():
                events.append("writer in")
            events.append("writer out")

        first = asyncio.ensure_future(reader("r1", held))
        await asyncio.sleep(0.01)
        write = asyncio.ensure_future(writer())
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(reader("r2"))  # arrives while the writer waits: waits behind it
        await asyncio.sleep(0.01)
        assert events == ["r1 in"] and lock.writers_waiting == 1
        held.set()
        await asyncio.gather(first, write, second)
        # A writer cancelled while it waits lets the readers it held back go.
        blocker = asyncio.Event()
        holder = asyncio.ensure_future(reader("r3", blocker))
        await asyncio.sleep(0.01)
        stuck = asyncio.ensure_future(writer())
        await asyncio.sleep(0.01)
        late = asyncio.ensure_future(reader("r4"))
        await asyncio.sleep(0.01)
        assert "r4 in" not in events
        stuck.cancel()
        await asyncio.wait_for(late, 5)
        blocker.set()
        await holder
        assert lock.readers == 0 and lock.writers_waiting == 0 and not lock.writer
        return events

    events = asyncio.run(scenario())
    assert events[:6] == ["r1 in", "r1 out", "writer in", "writer out", "r2 in", "r2 out"]
    assert events[6:] == ["r3 in", "r4 in", "r4 out", "r3 out"]


def test_the_prefix_cache_keeps_namespaces_apart_matches_whole_entries_and_evicts_the_least_recently_used() -> None:
    def kv(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(2, length, 4), torch.zeros(2, length, 4))]  # 64 bytes a position

    cache = PrefixCache(capacity_bytes=64 * 12)
    cache.insert(("", "a"), [1, 2, 3], kv(3), None)
    cache.insert(("", "a"), [1, 2, 3, 4, 5], kv(5), None)
    hit = cache.lookup(("", "a"), [1, 2, 3, 4, 5, 6], limit=5)
    assert hit is not None and hit.entry.tokens == (1, 2, 3, 4, 5) and hit.length == 5  # the longest entry
    hit = cache.lookup(("", "a"), [1, 2, 3, 4, 5], limit=4)
    assert hit is not None and hit.length == 4  # the same prompt again: its last position is computed
    hit = cache.lookup(("", "a"), [1, 2, 3, 9], limit=3)
    assert hit is not None and hit.entry.tokens == (1, 2, 3)
    assert cache.lookup(("", "b"), [1, 2, 3, 4], limit=3) is None  # another extra_key shares nothing
    assert cache.lookup(("s", "a"), [1, 2, 3, 4], limit=3) is None  # nor another cache_salt
    assert cache.lookup(("", "a"), [1, 2, 9, 9], limit=3) is None  # an entry that is no prefix of the prompt
    # [1, 2, 3] was used last; a new entry of 5 positions needs room: [1..5] (least recently used) goes.
    cache.insert(("", "b"), [7, 7, 7, 7, 7], kv(5), None)
    assert len(cache) == 2 and cache.nbytes == 64 * 8
    assert cache.lookup(("", "a"), [1, 2, 3, 4, 5, 6], limit=5).entry.tokens == (1, 2, 3)  # type: ignore[union-attr]
    assert cache.clear() == 2 and cache.lookup(("", "b"), [7, 7, 7, 7, 7, 1], limit=5) is None


# ---- the model-update lock and the pause, on a real engine -----------------------------------------------------------


def test_a_begin_while_generating_waits_for_the_generation_but_not_once_paused_in_place(url: str) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            # Not paused: the begin takes the writer lock, so it answers only once the generation has finished.
            order: list[str] = []
            generation = await _long_generation(client, url, [5, 6, 7, 8])
            generation.add_done_callback(lambda _: order.append("generation"))
            begin = asyncio.ensure_future(client.post(f"{url}/begin_weight_update", json={}))
            begin.add_done_callback(lambda _: order.append("begin"))
            assert await _still_pending(begin, 0.5)
            assert not generation.done()  # the generation is not held up by the waiting writer
            assert (await generation).json()["meta_info"]["completion_tokens"] == LONG
            assert (await asyncio.wait_for(begin, 30)).json()["success"]
            assert order == ["generation", "begin"]
            assert (await client.post(f"{url}/end_weight_update", json={})).json()["success"]

            # Paused in place first: the begin (and the end) run without the lock, the generation frozen meanwhile.
            generation = await _long_generation(client, url, [5, 6, 7, 9])
            paused = await client.post(f"{url}/pause_generation", json={"mode": "in_place"})
            assert paused.json()["success"]
            frozen = await _frozen(client, url)
            begin_reply = await asyncio.wait_for(client.post(f"{url}/begin_weight_update", json={}), 2.0)
            assert begin_reply.json()["success"]
            assert (await asyncio.wait_for(client.post(f"{url}/end_weight_update", json={}), 2.0)).json()["success"]
            load = await _load(client, url)
            assert not generation.done() and load["tokens_generated"] == frozen and load["num_running_reqs"] == 1
            assert (await client.post(f"{url}/continue_generation", json={})).json()["success"]
            assert (await generation).json()["meta_info"]["completion_tokens"] == LONG

    asyncio.run(scenario())


def test_a_begin_sent_before_an_in_place_pause_waits_for_ever_until_generation_continues(url: str) -> None:
    """The order sluice's pusher used to send: the begin, not yet paused, waits for the generation as a writer, and
    the pause arriving next freezes that generation. SGLang stays so until its watchdog kills it; here a
    ``/continue_generation`` lets the generation finish and then the begin."""

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            generation = await _long_generation(client, url, [5, 6, 7, 10])
            begin = asyncio.ensure_future(client.post(f"{url}/begin_weight_update", json={}))

            async def begin_waits() -> bool:
                return (await _load(client, url))["model_update_writers_waiting"] == 1

            await _until(begin_waits)
            paused = await client.post(f"{url}/pause_generation", json={"mode": "in_place"})
            assert paused.json()["success"]
            frozen = await _frozen(client, url)
            assert await _still_pending(begin, PENDING_S)
            load = await _load(client, url)
            assert not generation.done() and load["tokens_generated"] == frozen
            assert load["model_update_writers_waiting"] == 1 and load["model_update_readers"] == 1
            # Unblocked: the generation finishes, then the begin gets the lock and opens the window.
            assert (await client.post(f"{url}/continue_generation", json={})).json()["success"]
            assert (await generation).json()["meta_info"]["completion_tokens"] == LONG
            assert (await asyncio.wait_for(begin, 30)).json()["success"]
            assert (await client.post(f"{url}/end_weight_update", json={})).json()["success"]

    asyncio.run(scenario())


def test_a_new_generation_waits_at_the_gate_while_paused_until_continued(url: str) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            assert (await client.post(f"{url}/pause_generation", json={"mode": "in_place"})).json()["success"]
            pending = asyncio.ensure_future(client.post(f"{url}/generate", json=_request([3, 4, 5], 4)))
            assert await _still_pending(pending, 1.0)
            # It waits before the scheduler and before the reader lock, so a weight update that comes while paused
            # never waits for it, and an idle engine stays idle (a flush is accepted).
            load = await _load(client, url)
            assert load["num_waiting_reqs"] == 0 and load["model_update_readers"] == 0
            flushed = await client.post(f"{url}/flush_cache", json={})
            assert flushed.status_code == 200 and flushed.json()["success"], flushed.text
            assert (await client.post(f"{url}/continue_generation", json={})).json()["success"]
            answer = (await asyncio.wait_for(pending, 30)).json()
            assert answer["meta_info"]["completion_tokens"] == 4

    asyncio.run(scenario())


def test_the_ordered_fast_path_pauses_before_it_would_need_the_lock_even_for_announcements_that_came_first(
    tmp_path: Path,
) -> None:
    """sluice's own ordered push (``begin_window`` on bucket 0) while a generation runs: bucket 1 and the end arrive
    before bucket 0, when the engine is not paused yet. Were they to decide on the lock as they arrive, they would
    wait as writers for the generation, which bucket 0's pause then freezes. They decide at their turn, after the
    pause: the push lands with the generation frozen, and the end continues it."""
    served = ServedEngine(init_tiny_model("qwen3", tmp_path / "m", seed=0))
    new = dict(load_file(str(init_tiny_model("qwen3", tmp_path / "new", seed=1) / "model.safetensors")))
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"

    async def scenario() -> tuple[Any, ...]:
        async with pushing(served.url) as (client, pusher), httpx.AsyncClient(timeout=120) as http:
            generation = await _long_generation(http, served.url, [5, 6, 7, 12])

            def announce(index: int, name: str, **extra: Any) -> asyncio.Future[Any]:
                return asyncio.ensure_future(client.update_weights_from_distributed(
                    names=[name], dtypes=["float32"], shapes=[list(new[name].shape)],
                    group_name=pusher.group.group_name, flush_cache=False, weight_version=None, bucket_index=index,
                    push_id="push-a", **extra))

            second = announce(1, up)
            end = asyncio.ensure_future(client.end_weight_update(push_id="push-a", buckets=2,
                                                                 continue_generation=True))
            await asyncio.sleep(0.3)
            waiting = (not second.done(), not end.done(), served.engine.paused,
                       (await _load(http, served.url))["model_update_writers_waiting"])
            assert waiting == (True, True, False, 0)  # they wait for their window, not for the lock
            first = announce(0, gate, begin_window=True)
            await asyncio.to_thread(pusher.group.broadcast_all, [new[gate], new[up]])
            replies = [await asyncio.wait_for(f, 10) for f in (first, second, end)]
            answer = (await asyncio.wait_for(generation, 60)).json()
            return replies, answer

    try:
        replies, answer = asyncio.run(scenario())
        params = served.engine.model.state_dict()
        landed = all(torch.equal(params[n], new[n]) for n in (gate, up))
    finally:
        served.stop()
    assert all(r.success for r in replies), replies
    assert landed
    assert [s["version"] for s in answer["meta_info"]["weight_versions"]] == ["0"]  # no label in this push
    assert answer["meta_info"]["completion_tokens"] == LONG


# ---- /flush_cache and the prefix cache, on a real engine -------------------------------------------------------------


def test_flush_is_refused_while_a_generation_is_paused_in_place_and_empties_the_cache_when_idle(url: str) -> None:
    prompt = [11, 12, 13, 14, 15, 16]
    body = _request(prompt, 3, extra_key="flush")
    assert _post(url, "/generate", body)["meta_info"]["cached_tokens"] == 0
    assert _post(url, "/generate", body)["meta_info"]["cached_tokens"] == len(prompt) - 1

    async def refused_while_paused() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            generation = await _long_generation(client, url, [5, 6, 7, 11])
            assert (await client.post(f"{url}/pause_generation", json={"mode": "in_place"})).json()["success"]
            flushed = await client.post(f"{url}/flush_cache", json={})
            assert (await client.post(f"{url}/continue_generation", json={})).json()["success"]
            await generation
            return flushed

    refused = asyncio.run(refused_while_paused())
    assert refused.status_code == 400, refused.text
    assert refused.json()["success"] is False and "pending requests" in refused.json()["message"]
    assert _post(url, "/generate", body)["meta_info"]["cached_tokens"] == len(prompt) - 1  # kept

    flushed = httpx.post(f"{url}/flush_cache", json={}, timeout=30)
    assert flushed.status_code == 200 and flushed.json()["success"], flushed.text
    assert httpx.get(f"{url}/v1/loads", timeout=10).json()["loads"][0]["prefix_cache_entries"] == 0
    assert _post(url, "/generate", body)["meta_info"]["cached_tokens"] == 0


def test_a_cached_prefix_keeps_the_kv_of_the_weights_it_was_computed_under_in_its_own_namespace(
    url: str, model_dir: Path, new_dir: Path
) -> None:
    """The staleness a weight update leaves in the cache (SGLang's, when its flush is refused), and why a request
    salted by weight version does not see it: same key, old KV; another key, a fresh computation."""
    from transformers import AutoModelForCausalLM

    prompt = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    first = _post(url, "/generate", _request(prompt, 6, extra_key="w0"))
    assert first["meta_info"]["cached_tokens"] == 0
    try:
        loaded = _post(url, "/update_weights_from_disk",
                       {"model_path": str(new_dir), "weight_version": "1", "flush_cache": False})
        assert loaded["success"], loaded
        stale = _post(url, "/generate", _request(prompt, 6, extra_key="w0"))
        fresh = _post(url, "/generate", _request(prompt, 6, extra_key="w1"))
    finally:
        restored = _post(url, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "0"})
        assert restored["success"], restored
    assert stale["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert stale["meta_info"]["weight_versions"][0]["version"] == "1" == fresh["meta_info"]["weight_versions"][0][
        "version"]

    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()

    def fresh_logprobs(output: list[int]) -> np.ndarray:
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logprobs = torch.log_softmax(new(input_ids=ids).logits[0].float(), dim=-1)
        rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(output)]
        return rows.gather(-1, torch.tensor(output)[:, None]).squeeze(-1).numpy()

    # The other namespace computed the prompt afresh under the new weights.
    assert np.abs(_logprobs(fresh) - fresh_logprobs(fresh["output_ids"])).max() < LOGPROB_ATOL
    # The same namespace reused the old weights' keys and values: its first token is the new model's last prompt
    # position attending to the old model's cache, and it is not what the new weights compute afresh.
    with torch.no_grad():
        past = old(input_ids=torch.tensor([prompt[:-1]]), use_cache=True).past_key_values
        logits = new(input_ids=torch.tensor([prompt[-1:]]), cache=past, use_cache=True).logits[0, -1]
    mixed = torch.log_softmax(logits.float(), dim=-1)
    assert stale["output_ids"][0] == int(mixed.argmax())
    assert abs(_logprobs(stale)[0] - float(mixed[stale["output_ids"][0]])) < LOGPROB_ATOL
    assert np.abs(_logprobs(stale) - fresh_logprobs(stale["output_ids"])).max() > 0.01


def test_a_cached_prompt_returns_the_routing_tokens_and_logprobs_of_an_uncached_one(url: str) -> None:
    prompt = [31, 32, 33, 34, 35, 36, 37, 38]
    body = _request(prompt, 8, extra_key="routing")
    uncached, cached = _post(url, "/generate", body), _post(url, "/generate", body)
    assert uncached["meta_info"]["cached_tokens"] == 0 and cached["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert cached["output_ids"] == uncached["output_ids"]
    assert np.abs(_logprobs(cached) - _logprobs(uncached)).max() < LOGPROB_ATOL
    rows = len(prompt) + 8 - 1
    routing = [np.frombuffer(base64.b64decode(a["meta_info"]["routed_experts"]), dtype="<i4") for a in (uncached,
                                                                                                     cached)]
    assert routing[0].size == rows * 2 * 2  # [P + R - 1, layers, topk]
    assert (routing[0] == routing[1]).all()
    # Input logprobs from the first position need every prompt position computed: no reuse then.
    with_inputs = _post(url, "/generate", {**body, "logprob_start_len": 0})
    assert with_inputs["meta_info"]["cached_tokens"] == 0 and with_inputs["output_ids"] == uncached["output_ids"]


def _hits_of_different_lengths_batched_together_match_uncached(url: str) -> None:
    """Two prompts admitted together, one with all but its last position cached and one with a short prefix cached:
    one forward over cached KV with padding between the cached and the computed positions of the first row. Every
    token, logprob and routing row is that of the uncached prompts."""
    prompts = [[51, 52, 53, 54, 55, 56], [51, 52, 53, 57, 58, 59, 60, 3, 4]]
    body = {"input_ids": prompts, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 7, "ignore_eos": True}}
    uncached = _post(url, "/generate", {**body, "extra_key": "reference"})
    assert [a["meta_info"]["cached_tokens"] for a in uncached] == [0, 0]
    _post(url, "/generate", _request(prompts[0], 2, extra_key="batched"))
    _post(url, "/generate", _request(prompts[1][:3], 2, extra_key="batched"))
    cached = _post(url, "/generate", {**body, "extra_key": "batched"})
    assert [a["meta_info"]["cached_tokens"] for a in cached] == [5, 3]
    for got, want in zip(cached, uncached, strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert np.abs(_logprobs(got) - _logprobs(want)).max() < LOGPROB_ATOL
        assert got["meta_info"]["routed_experts"] == want["meta_info"]["routed_experts"]


def test_hits_of_different_lengths_batched_together_match_uncached(url: str) -> None:
    _hits_of_different_lengths_batched_together_match_uncached(url)


@pytest.mark.slow
def test_hits_batched_together_match_uncached_on_deepseek_v3(tmp_path: Path) -> None:
    """The same on MLA, whose keys and values differ in width."""
    engine = start_engine(init_tiny_model("deepseek-v3", tmp_path / "model", seed=0), tmp_path)
    try:
        _hits_of_different_lengths_batched_together_match_uncached(engine.url)
    finally:
        engine.stop()


def test_n_samples_of_one_prompt_prefill_it_once_and_report_it_cached(url: str) -> None:
    """SGLang prefills an ``n > 1`` prompt alone, caches it, then runs the samples on it."""
    prompt = [41, 42, 43, 44, 45, 46, 47]
    body = {"input_ids": prompt, "extra_key": "group",
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 4, "n": 4, "sampling_seed": 3}}
    before = httpx.get(f"{url}/v1/loads", timeout=10).json()["loads"][0]["forward_passes"]
    answers = _post(url, "/generate", body)
    assert [a["meta_info"]["cached_tokens"] for a in answers] == [len(prompt) - 1] * 4
    # One prefill and three decode steps for the four samples together.
    assert httpx.get(f"{url}/v1/loads", timeout=10).json()["loads"][0]["forward_passes"] - before == 4
    again = _post(url, "/generate", {**body, "sampling_params": {**body["sampling_params"], "n": 1}})
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1


@pytest.mark.slow
def test_an_engine_started_without_the_cache_says_so_and_reuses_nothing(model_dir: Path, tmp_path: Path) -> None:
    engine = start_engine(model_dir, tmp_path, None, "--disable-radix-cache")
    try:
        assert httpx.get(f"{engine.url}/model_info", timeout=10).json()["prefix_cache"] is False
        body = _request([1, 2, 3, 4, 5], 3)
        assert [_post(engine.url, "/generate", body)["meta_info"]["cached_tokens"] for _ in range(2)] == [0, 0]
    finally:
        engine.stop()
    assert engine.proc.poll() is not None
