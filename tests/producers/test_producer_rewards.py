"""A producer scoring through a reward service and a group judge: a real CPU engine process, a real Redis, a real
aiohttp reward service. The rewards land on the queue; a service that is down fails the samples, which are counted
in the producer's metrics line, and the producer finishes its groups."""

from __future__ import annotations

import asyncio
import importlib
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from pipeline import plugins
from pipeline.config.metrics import MetricsConfig
from pipeline.config.producer import ProducerConfig, SamplingConfig
from pipeline.data.prompts import synthetic
from pipeline.net import free_port
from pipeline.producers.producer import Producer, load_tokenize, read_num_experts
from pipeline.producers.reporting import ProducerReporter
from pipeline.producers.rewards import RewardScorer, setup_scorer
from pipeline.producers.sglang_client import SGLangClient
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import SampleStatus
from tests.helpers.engines import EngineProcess

plugins.activate([Path(__file__).parents[1] / "fixtures"])
group_rewards = importlib.import_module("group_rewards")

GROUPS, GROUP_SIZE = 3, 4


def _producer(queue: SampleQueue, engine: Any, model_dir: Path, scorer: RewardScorer) -> Producer:
    cfg = ProducerConfig(group_size=GROUP_SIZE, concurrency=2, sampling=SamplingConfig(max_new_tokens=6))
    return Producer(cfg, name="p0", queue=queue, engine=engine, prompts=synthetic("addition", size=16, seed=1),
                    tokenize=load_tokenize(model_dir), scorer=scorer, pacing=None,
                    num_experts=read_num_experts(model_dir))


async def _run(producer: Producer, engine_url: str, run_dir: Path) -> dict[str, Any]:
    client = SGLangClient(engine_url)
    producer.engine = client
    try:
        await producer.run(max_groups=GROUPS)
    finally:
        await client.close()
        await producer.scorer.close()
    return await asyncio.to_thread(ProducerReporter(producer, run_dir, MetricsConfig(tensorboard=False)).report)


def _queued(queue: SampleQueue) -> list[Any]:
    return [s for _, entry in queue.scan() for s in entry.samples]  # type: ignore[union-attr]


def test_rewards_from_a_flaky_service_land_on_the_queue(engine: EngineProcess, model_dir: Path, queue: SampleQueue,
                                                        tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    requests = [0]

    async def handle(request: web.Request) -> web.Response:
        requests[0] += 1
        if requests[0] <= 2:  # the first two requests find the service overloaded
            return web.Response(status=503)
        body = await request.json()
        seen.append(body)
        return web.json_response({"rewards": [len(r) + 0.5 for r in body["responses"]],
                                  "infos": [{"chars": len(r)} for r in body["responses"]]})

    async def scenario() -> dict[str, Any]:
        app = web.Application()
        app.router.add_post("/score", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            scorer = setup_scorer(ProducerConfig(reward_url=f"http://127.0.0.1:{port}/score", reward_backoff_s=0.01))
            return await _run(_producer(queue, None, model_dir, scorer), engine.url, tmp_path)
        finally:
            await runner.cleanup()

    row = asyncio.run(scenario())
    samples = _queued(queue)
    assert len(samples) == GROUPS * GROUP_SIZE and len(seen) == GROUPS and requests[0] == GROUPS + 2
    by_text = {(b["prompt_id"], i): r for b in seen for i, r in enumerate(b["responses"])}
    for s in samples:
        text = by_text[(s.prompt_id, s.index)]
        assert s.status != SampleStatus.FAILED and s.reward == len(text) + 0.5 and s.reward_info == {"chars": len(text)}
    assert row["reward_retries"] == 2 and row["reward_samples_failed"] == 0 and row["samples_failed_reward"] == 0
    assert json.loads((tmp_path / "metrics" / "p0.jsonl").read_text().splitlines()[-1])["reward_retries"] == 2


def test_a_service_that_is_down_fails_samples_and_the_producer_goes_on(
        engine: EngineProcess, model_dir: Path, queue: SampleQueue, tmp_path: Path) -> None:
    scorer = setup_scorer(ProducerConfig(reward_url=f"http://127.0.0.1:{free_port()}/score", reward_retries=2,
                                         reward_backoff_s=0.01))
    row = asyncio.run(_run(_producer(queue, None, model_dir, scorer), engine.url, tmp_path))
    samples = _queued(queue)
    assert len(samples) == GROUPS * GROUP_SIZE
    assert all(s.status == SampleStatus.FAILED and "gave up after 3 attempts" in s.reward_info["error"]
               for s in samples)
    assert row["samples_failed_reward"] == GROUPS * GROUP_SIZE == row["reward_samples_failed"]
    assert row["reward_errors"] == GROUPS and row["reward_retries"] == 2 * GROUPS


def test_a_group_judge_scores_the_producer_groups(engine: EngineProcess, model_dir: Path, queue: SampleQueue,
                                                  tmp_path: Path) -> None:
    scorer = setup_scorer(ProducerConfig(group_reward="group_rewards:rank_by_length"))
    asyncio.run(_run(_producer(queue, None, model_dir, scorer), engine.url, tmp_path))
    groups: dict[str, list[Any]] = {}
    for s in _queued(queue):
        groups.setdefault(s.group_id, []).append(s)
    assert len(groups) == GROUPS
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for group in groups.values():
        group.sort(key=lambda s: s.index)
        texts = [tokenizer.decode(s.response_ids.tolist(), skip_special_tokens=True) for s in group]
        # Each sample's reward is its rank among its own group's responses, as the judge computes it from them all.
        assert [(s.reward, s.reward_info) for s in group] == [
            (r, {"wins": i["wins"]}) for r, i in group_rewards.rank_by_length(None, texts)]
    assert scorer.stats.calls == GROUPS


def test_a_producer_built_from_its_spec_scores_with_the_recipe_group_reward(
        engine: EngineProcess, model_dir: Path, queue: SampleQueue, redis_url: str) -> None:
    from pipeline.producers.producer import ProducerSpec, serve_producer

    spec = ProducerSpec(name="p0", run=queue.run, redis_url=redis_url, engine_urls=[engine.url], model_dir=model_dir,
                        producer=ProducerConfig(group_size=GROUP_SIZE, group_reward="group_rewards:rank_by_length",
                                                sampling=SamplingConfig(max_new_tokens=6)),
                        prompts={"type": "synthetic", "task": "addition", "size": 16})
    stats = asyncio.run(serve_producer(spec, max_groups=2))
    samples = _queued(queue)
    assert stats.groups_put == 2 and len(samples) == 2 * GROUP_SIZE
    assert all(set(s.reward_info) == {"wins"} and s.status != SampleStatus.FAILED for s in samples)
