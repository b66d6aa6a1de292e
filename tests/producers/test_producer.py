"""The producer loop against a real CPU engine process and a real Redis, on a tiny Qwen3-MoE built locally.

Every engine here is a subprocess this module started (``python -m pipeline.producers.cpu_engine``) and is stopped by
its PID. What is checked is what lands on the queue: decoded back from Redis, every sample must agree with the engine,
with an independent HF forward pass of the same model, with its reward function and with the run's pacing budget.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.config.producer import ProducerConfig, SamplingConfig
from pipeline.data.prompts import ListPrompts, Prompt, synthetic
from pipeline.producers.base import GenerateResult
from pipeline.producers.cursor import PromptCursor
from pipeline.producers.engine_pool import EnginePool
from pipeline.producers.producer import Pacing, Producer, load_tokenize, read_num_experts
from pipeline.producers.sglang_client import NO_RETRY, ExponentialBackoff, SGLangClient
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample, SampleStatus
from tests.helpers.engines import EngineProcess, free_port, start_engine

# The engine runs fp32 like this reference; a KV-cached batched decode and one full forward differ only by rounding
# of differently shaped matmuls (~1e-6 on these logprobs). 1e-4 leaves room for other BLAS builds and is still far
# below what a real bug gives (a wrong temperature, position or token moves logprobs by > 1e-2).
LOGPROB_ATOL = 1e-4
# Eight ordinary characters end a response, so that a seeded run has both `stop` and `length` endings.
STOP_IDS = [10, 15, 20, 25, 30, 35, 40, 45]


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class RecordingClient:
    """Passes every call to a real engine client and keeps what it answered, to compare queued samples with it."""

    def __init__(self, inner: SGLangClient | EnginePool) -> None:
        self.inner = inner
        self.results: list[GenerateResult] = []

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], **kw: Any) -> GenerateResult:
        result = await self.inner.generate(input_ids, sampling_params, **kw)
        self.results.append(result)
        return result

    async def generate_many(
        self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, Any], **kw: Any
    ) -> list[GenerateResult]:
        results = await self.inner.generate_many(prompts, sampling_params, **kw)
        self.results.extend(results)
        return results

    async def close(self) -> None:
        await self.inner.close()


def length_reward(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    """A reward the test can recompute: the response length plus the prompt number / 100, with the text."""
    return len(response) + int(prompt.prompt_id.split("-")[1]) / 100, {"text": response}


def make_producer(
    queue: SampleQueue,
    engine: Any,
    model_dir: Path,
    *,
    name: str = "p0",
    reward: Callable[[Prompt, str], Any] = length_reward,
    pacing: Pacing | None = None,
    **cfg: Any,
) -> Producer:
    sampling = cfg.pop("sampling", {})
    config = ProducerConfig(sampling=SamplingConfig(**{"max_new_tokens": 8, **sampling}), **cfg)
    return Producer(
        config, name=name, queue=queue, engine=engine, prompts=synthetic("addition", size=64, seed=1),
        tokenize=load_tokenize(model_dir), reward_fn=reward, pacing=pacing, num_experts=read_num_experts(model_dir),
    )  # fmt: skip


def queued(queue: SampleQueue) -> list[list[Sample]]:
    """Every group on the queue, decoded back from Redis."""
    groups = []
    for _, entry in queue.scan():
        assert not isinstance(entry, Exception), entry
        groups.append(entry.samples)
    return groups


def reference(model: Any, sample: Sample, temperature: float) -> dict[str, np.ndarray]:
    """One independent fp32 forward over prompt + response: argmax, logprobs at the temperature, router top-k."""
    captured: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: captured.append(out[2]))
             for layer in model.model.layers]  # fmt: skip
    tokens = np.concatenate([sample.prompt_ids, sample.response_ids]).astype(np.int64)
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(tokens)[None]).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    p, r = sample.num_prompt_tokens, sample.num_response_tokens
    predicting = logits[p - 1 : p + r - 1]  # row i predicts response token i
    logprobs = torch.log_softmax(predicting / (temperature if temperature > 0 else 1.0), dim=-1)
    targets = torch.from_numpy(sample.response_ids.astype(np.int64))
    return {
        "argmax": predicting.argmax(-1).numpy(),
        "logprobs": logprobs.gather(-1, targets[:, None])[:, 0].numpy(),
        # The last response token never went through the model: P + R - 1 rows, as SGLang returns.
        "routing": torch.stack(captured, dim=1)[: p + r - 1].numpy(),
    }


# --------------------------------------------------------------------------------------------------------------------
# What lands on the queue
# --------------------------------------------------------------------------------------------------------------------


def test_queued_samples_are_consistent_and_match_an_independent_forward(
    engine: EngineProcess, model_dir: Path, hf_model: Any, queue: SampleQueue
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    layers, topk = hf_model.config.num_hidden_layers, hf_model.config.num_experts_per_tok
    sampling = {"temperature": 0.8, "max_new_tokens": 10, "stop_token_ids": STOP_IDS, "seed": 1000}

    async def scenario() -> tuple[Producer, RecordingClient]:
        client = RecordingClient(SGLangClient(engine.url))
        producer = make_producer(queue, client, model_dir, group_size=3, concurrency=2, sampling=sampling)
        try:
            await producer.run(max_groups=4)
        finally:
            await client.close()
        return producer, client

    producer, client = asyncio.run(scenario())
    groups = queued(queue)
    assert producer.stats.groups_put == len(groups) == 4 and producer.stats.samples_put == 12
    prompts = synthetic("addition", size=64, seed=1)
    by_tokens = {(tuple(r.output_ids.tolist()), tuple(r.output_logprobs.tolist())): r for r in client.results}  # type: ignore[union-attr]
    assert len(by_tokens) == len(client.results) == 12
    seen_prompts, finishes, max_diff = set(), set(), 0.0
    for group in groups:
        assert [s.index for s in group] == [0, 1, 2]
        assert len({s.group_id for s in group}) == 1 and len({s.sample_id for s in group}) == 3
        prompt_index = int(group[0].prompt_id.split("-")[1])
        seen_prompts.add(prompt_index)
        prompt = prompts[prompt_index]
        for s in group:
            p, r = s.num_prompt_tokens, s.num_response_tokens
            assert s.prompt_id == prompt.prompt_id and s.prompt_ids.tolist() == tokenizer(prompt.text)["input_ids"]
            assert 1 <= r <= 10 and s.prompt_ids.dtype == s.response_ids.dtype == np.int32
            assert len(s.rollout_logprobs) == len(s.loss_mask) == len(s.token_versions) == r
            assert s.rollout_logprobs.dtype == np.float32 and s.token_versions.dtype == np.int32
            assert s.loss_mask.dtype == np.uint8 and s.loss_mask.tolist() == [1] * r
            assert s.routed_experts is not None and s.routed_experts.dtype == np.uint8  # 8 experts fit uint8
            assert s.routed_experts.shape == (p + r - 1, layers, topk) and int(s.routed_experts.max()) < 8
            # The engine's own answer for this sample: versions expand its spans, finish maps to status.
            res = by_tokens[(tuple(s.response_ids.tolist()), tuple(s.rollout_logprobs.tolist()))]
            assert s.token_versions.tolist() == [int(v) for v in res.token_versions()]
            assert s.finish_reason == res.finish_reason and s.engine == engine.url and s.producer == "p0"
            expected_status = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}[s.finish_reason]
            assert s.status == expected_status
            if s.finish_reason == "stop":
                assert int(s.response_ids[-1]) in [*STOP_IDS, tokenizer.eos_token_id]
            else:
                assert r == 10 and not set(s.response_ids.tolist()) & {*STOP_IDS, tokenizer.eos_token_id}
            finishes.add(s.finish_reason)
            # The reward is the reward function's value on the engine's text, which is the decoded response.
            text = tokenizer.decode(s.response_ids.tolist(), skip_special_tokens=True)
            assert s.reward_info == {"text": text} and s.reward == length_reward(prompt, text)[0]
            assert s.sampling.to_dict() == {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 10,
                                            "seed": 1000 + prompt_index * 3 + s.index}
            # Generation is real: an independent forward of the same model gives these logprobs and this routing.
            ref = reference(hf_model, s, temperature=0.8)
            max_diff = max(max_diff, float(np.abs(ref["logprobs"] - s.rollout_logprobs).max()))
            assert np.array_equal(ref["routing"], s.routed_experts.astype(np.int64))
    print(f"sampled: max |logprob - HF forward| = {max_diff:.2e} over 12 samples")
    assert max_diff < LOGPROB_ATOL
    assert seen_prompts == {0, 1, 2, 3} and finishes == {"stop", "length"}
    assert PromptCursor(queue.redis, queue.run).position() == 4


def test_greedy_samples_are_the_models_argmax(
    engine: EngineProcess, model_dir: Path, hf_model: Any, queue: SampleQueue
) -> None:
    async def scenario() -> None:
        client = SGLangClient(engine.url)
        producer = make_producer(queue, client, model_dir, group_size=2,
                                 sampling={"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
        try:
            await producer.run(max_groups=2)
        finally:
            await client.close()

    asyncio.run(scenario())
    groups = queued(queue)
    assert len(groups) == 2
    max_diff = 0.0
    for group in groups:
        assert np.array_equal(group[0].response_ids, group[1].response_ids)  # greedy: one answer per prompt
        for s in group:
            ref = reference(hf_model, s, temperature=0.0)
            assert s.num_response_tokens == 12 and s.status == SampleStatus.TRUNCATED
            assert np.array_equal(ref["argmax"], s.response_ids)
            assert s.routed_experts is not None and np.array_equal(ref["routing"], s.routed_experts.astype(np.int64))
            max_diff = max(max_diff, float(np.abs(ref["logprobs"] - s.rollout_logprobs).max()))
    print(f"greedy: max |logprob - HF forward| = {max_diff:.2e}")
    assert max_diff < LOGPROB_ATOL


# --------------------------------------------------------------------------------------------------------------------
# Pacing
# --------------------------------------------------------------------------------------------------------------------


async def _until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout}s")
        await asyncio.sleep(0.01)


def test_pacing_stops_at_the_staleness_budget_and_resumes_on_a_new_version(
    engine: EngineProcess, model_dir: Path, queue: SampleQueue
) -> None:
    pacing = Pacing(max_lag=1, batch_groups=2)  # budget (version + 2) * 2 groups, shared by both producers
    redis = queue.redis

    async def scenario() -> list[Producer]:
        producers = [
            make_producer(queue, SGLangClient(engine.url), model_dir, name=f"p{i}", group_size=2, concurrency=3,
                          pacing=pacing, admission_poll_s=0.01, sampling={"max_new_tokens": 4})
            for i in range(2)
        ]  # fmt: skip
        stop = asyncio.Event()
        runs = [asyncio.ensure_future(p.run(stop=stop)) for p in producers]
        try:
            for version, budget in ((0, 4), (1, 6), (3, 10)):
                if version:
                    # What the trainer does after each push: INCR the run's policy version.
                    redis.incrby(queue.keys.policy_version, version - queue.policy_version())
                await _until(lambda b=budget: sum(p.stats.groups_put for p in producers) >= b, what=f"{budget} groups")
                # Both producers keep asking and are refused: nothing more starts while the version stands.
                waits = [p.stats.paced_waits for p in producers]
                await _until(lambda ws=waits: all(p.stats.paced_waits > w + 2 for p, w in zip(producers, ws)))
                assert int(redis.get(producers[0].started_key) or 0) == budget
                assert sum(p.stats.groups_put for p in producers) == budget == redis.xlen(queue.keys.samples)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*runs), 30)
        finally:
            stop.set()
            await asyncio.gather(*runs, return_exceptions=True)
            await asyncio.gather(*(p.engine.close() for p in producers))
        return producers

    producers = asyncio.run(scenario())
    assert all(p.stats.groups_put > 0 for p in producers)
    assert redis.xlen(queue.keys.samples) == 10


# --------------------------------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------------------------------


def odd_prompts_crash(prompt: Prompt, response: str) -> float:
    if int(prompt.prompt_id.split("-")[1]) % 2:
        raise RuntimeError("verifier crashed on purpose")
    return 1.0


def test_a_raising_reward_fails_its_samples_and_the_producer_goes_on(
    engine: EngineProcess, model_dir: Path, queue: SampleQueue
) -> None:
    async def scenario() -> Producer:
        client = SGLangClient(engine.url)
        producer = make_producer(queue, client, model_dir, group_size=2, reward=odd_prompts_crash)
        try:
            await producer.run(max_groups=4)
        finally:
            await client.close()
        return producer

    producer = asyncio.run(scenario())
    groups = queued(queue)
    assert len(groups) == 4 and producer.stats.samples_failed_reward == 4
    for group in groups:
        odd = int(group[0].prompt_id.split("-")[1]) % 2 == 1
        for s in group:
            if odd:
                assert s.status == SampleStatus.FAILED and s.reward == 0.0
                assert s.reward_info == {"error": "RuntimeError: verifier crashed on purpose"}
            else:
                assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and s.reward == 1.0
            assert s.finish_reason in ("stop", "length")  # the generation itself is kept


def test_an_engine_at_sglangs_default_version_fails_its_samples_and_the_producer_goes_on(
    model_dir: Path, queue: SampleQueue, tmp_path: Path
) -> None:
    """SGLang started without --weight-version says "default": such samples are queued as failed, the producer keeps
    producing (it used to crash-loop), and once the engine is labelled its samples are trainable again."""
    engine = start_engine(model_dir, tmp_path, None, "--weight-version", "default")

    async def scenario() -> Producer:
        client = SGLangClient(engine.url)
        producer = make_producer(queue, client, model_dir, group_size=2)
        try:
            await producer.run(max_groups=3)
            assert (await client.update_weight_version("0")).success
            await producer.run(max_groups=5)  # max_groups counts from the start: two more groups
        finally:
            await client.close()
        return producer

    try:
        producer = asyncio.run(scenario())
    finally:
        engine.stop()
    groups = queued(queue)
    assert len(groups) == 5 and producer.stats.samples_failed_version == 6
    for group in groups[:3]:
        for s in group:
            assert s.status == SampleStatus.FAILED and s.num_response_tokens > 0
            assert "reported weight versions ['default'], not integers" in s.reward_info["error"]
    for group in groups[3:]:
        for s in group:
            assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
            assert (s.token_versions == 0).all() and "error" not in s.reward_info


async def _until_running(url: str, timeout: float = 30.0) -> None:
    """Wait until the engine at ``url`` reports a running request that has produced tokens."""
    async with SGLangClient(url, retry=NO_RETRY) as probe:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            load = await probe.get_load()
            if load.num_running_reqs >= 1 and load.total("tokens_generated") > 0:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"engine {url} never reported a running request")


def test_killed_engine_is_skipped_and_its_requests_finish_on_the_other(
    engine: EngineProcess, model_dir: Path, queue: SampleQueue, tmp_path: Path
) -> None:
    doomed = start_engine(model_dir, tmp_path)
    long = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}

    async def scenario() -> Producer:
        live = SGLangClient(engine.url, retry=NO_RETRY)
        dying = SGLangClient(doomed.url, retry=NO_RETRY)
        pool = EnginePool([live, dying], probe_backoff=ExponentialBackoff(0.05, 0.2, jitter=False))
        producer = make_producer(queue, pool, model_dir, group_size=2, concurrency=4, sampling=long)
        try:
            run = asyncio.ensure_future(producer.run(max_groups=6))
            await _until(lambda: dying.in_flight >= 1, what="a request on the doomed engine")
            await _until_running(doomed.url)
            doomed.stop(signal.SIGKILL)  # the engine this test started, killed mid-generation
            await asyncio.wait_for(run, 120)
            assert not pool.is_healthy(dying) and pool.healthy_clients() == [live]
        finally:
            await pool.close()
        return producer

    try:
        producer = asyncio.run(scenario())
    finally:
        doomed.stop()
    groups = queued(queue)
    # Failover happened inside the pool: the producer saw no error, and no prompt was lost or produced twice.
    assert producer.stats.engine_errors == 0 and producer.stats.groups_put == 6
    assert sorted(int(g[0].prompt_id.split("-")[1]) for g in groups) == list(range(6))
    assert {s.engine for g in groups for s in g} == {engine.url}
    assert all(s.num_response_tokens == 400 for g in groups for s in g)


def test_with_every_engine_down_prompts_go_back_and_are_retried(
    model_dir: Path, queue: SampleQueue, tmp_path: Path
) -> None:
    port = free_port()
    cursor = PromptCursor(queue.redis, queue.run)

    async def scenario() -> Producer:
        only = SGLangClient(f"http://127.0.0.1:{port}", retry=NO_RETRY, connect_timeout=0.5)
        pool = EnginePool([only], retry=NO_RETRY, probe_backoff=ExponentialBackoff(0.05, 0.2, jitter=False))
        producer = make_producer(queue, pool, model_dir, group_size=2, concurrency=2, engine_retry_s=0.05)
        restarted: EngineProcess | None = None
        try:
            run = asyncio.ensure_future(producer.run(max_groups=3))
            await _until(lambda: producer.stats.engine_errors >= 6, what="failed generations")
            # While nothing answers, the prompts taken go back and forth; nothing is queued, nothing skipped. A prompt
            # handed back is taken again before the cursor moves, so under load the second worker may find add-0
            # waiting and the cursor stays at 1: at most one prompt per worker is ever out.
            assert queue.redis.xlen(queue.keys.samples) == 0 and 1 <= cursor.position() <= 2
            restarted = await asyncio.to_thread(start_engine, model_dir, tmp_path, port)
            await asyncio.wait_for(run, 60)
        finally:
            await pool.close()
            if restarted is not None:
                restarted.stop()
        return producer

    producer = asyncio.run(scenario())
    groups = queued(queue)
    assert producer.stats.groups_put == 3 and producer.stats.prompts_retried >= 6
    assert sorted(int(g[0].prompt_id.split("-")[1]) for g in groups) == [0, 1, 2]
    assert cursor.position() == 3 and queue.redis.llen(cursor.retry_key) == 0


def test_refused_prompt_is_skipped_not_retried(engine: EngineProcess, model_dir: Path, queue: SampleQueue) -> None:
    too_long = Prompt(prompt_id="long-0", input_ids=tuple([5] * 2000))  # beyond the engine's 1024-token context
    fine = Prompt(prompt_id="ok-1", input_ids=(5, 6, 7))

    async def scenario() -> Producer:
        client = SGLangClient(engine.url)
        producer = make_producer(queue, client, model_dir, group_size=1, concurrency=1, reward=lambda p, t: 0.0)
        producer.prompts = ListPrompts([too_long, fine])
        try:
            await producer.run(max_groups=1)
        finally:
            await client.close()
        return producer

    producer = asyncio.run(scenario())
    assert producer.stats.prompts_refused == 1 and producer.stats.engine_errors == 0
    assert [g[0].prompt_id for g in queued(queue)] == ["ok-1"]


# --------------------------------------------------------------------------------------------------------------------
# A weight push mid-run
# --------------------------------------------------------------------------------------------------------------------


def test_weight_push_mid_run_gives_samples_straddling_two_versions(
    engine: EngineProcess, model_dir: Path, queue: SampleQueue, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from pipeline.models.tiny import init_tiny_model
    from pipeline.sync.pusher import WeightPusher

    original = load_file(str(model_dir / "model.safetensors"))
    other = load_file(str(init_tiny_model("qwen3-moe", tmp_path / "other", seed=1) / "model.safetensors"))

    async def scenario() -> tuple[RecordingClient, str]:
        client = RecordingClient(SGLangClient(engine.url))
        admin = SGLangClient(engine.url)
        before = await admin.weight_version()
        new = int(before) + 1
        producer = make_producer(queue, client, model_dir, group_size=2, concurrency=2,
                                 sampling={"max_new_tokens": 800, "ignore_eos": True})
        pusher = await WeightPusher.connect(
            [admin], master_address="127.0.0.1", master_port=free_port(), group_name="producer-test", timeout_s=60,
        )  # fmt: skip
        try:
            run = asyncio.ensure_future(producer.run(max_groups=2))
            await _until_running(engine.url)
            await pusher.push(sorted(other.items()), weight_version=new)
            await asyncio.wait_for(run, 120)
        finally:
            # Later tests expect the original weights (under a newer version label).
            await pusher.push(original.items(), weight_version=new + 1)
            await pusher.close()
            await client.close()
            await admin.close()
        return client, before

    client, before = asyncio.run(scenario())
    groups = queued(queue)
    assert len(groups) == 2
    old, new = int(before), int(before) + 1
    by_tokens = {tuple(r.output_ids.tolist()): r for r in client.results}
    straddling = 0
    for group in groups:
        for s in group:
            res = by_tokens[tuple(s.response_ids.tolist())]
            assert s.token_versions.tolist() == [int(v) for v in res.token_versions()]
            versions = s.token_versions.tolist()
            assert versions == sorted(versions) and set(versions) <= {old, new}
            assert s.version_max == new  # every generation ran past the push
            straddling += int(s.version_min == old)
        entry_versions = {v for s in group for v in s.token_versions.tolist()}
        assert group[0].version_max == max(entry_versions)
    assert straddling >= 1, "no sample straddled the push"
    first = next(s for g in groups for s in g if s.version_min == old)
    switch = int(np.argmax(first.token_versions == new))
    spans = [(sp.version, sp.start, sp.end) for sp in by_tokens[tuple(first.response_ids.tolist())].weight_versions]
    assert spans == [(str(old), 0, switch), (str(new), switch, 800)]
