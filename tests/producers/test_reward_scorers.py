"""The producer's reward scorers: a shared concurrency cap, per-sample timeouts, group judges, and a reward service
over HTTP (a real aiohttp server in the test) with retries, failures counted and credentials kept out of logs."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pipeline import plugins
from pipeline.config import load_config
from pipeline.config.producer import ProducerConfig
from pipeline.data.prompts import Prompt
from pipeline.errors import ConfigError
from pipeline.net import free_port
from pipeline.producers.rewards import GroupScorer, HttpScorer, RewardScorer, SampleScorer, setup_scorer

FIXTURES = Path(__file__).parents[1] / "fixtures"
plugins.activate([FIXTURES])  # as a recipe's plugins.paths would
group_rewards = importlib.import_module("group_rewards")

PROMPT = Prompt(prompt_id="p-1", text="12+30=", answer="42")


def _scorer(**cfg: Any) -> RewardScorer:
    return setup_scorer(ProducerConfig(**cfg))


# --------------------------------------------------------------------------------------------------------------------
# The concurrency cap and the timeout
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", ["group_rewards:probe_async", "group_rewards:probe_sync"])
def test_the_cap_holds_across_groups(ref: str) -> None:
    scorer = _scorer(reward=ref, reward_concurrency=3)
    group_rewards.PROBE.peak = 0

    async def scenario() -> list[list[Any]]:
        # Four groups of eight at once: 32 calls, at most 3 of them running at any moment.
        return await asyncio.gather(*(scorer.score_group(PROMPT, [f"r{i}"] * 8) for i in range(4)))

    groups = asyncio.run(scenario())
    assert group_rewards.PROBE.peak == 3  # not more (the cap), and not fewer (the calls do overlap)
    assert all(not o.failed and o.reward == 1.0 for g in groups for o in g)
    assert scorer.stats.calls == 32 and scorer.stats.samples_failed == 0
    asyncio.run(scenario())  # a later event loop gets a cap of its own (a semaphore cannot outlive its loop)
    assert group_rewards.PROBE.peak == 3 and scorer.stats.calls == 64


def test_the_cap_counts_group_calls_too() -> None:
    scorer = _scorer(group_reward="group_rewards:probe_group", reward_concurrency=2)
    group_rewards.PROBE.peak = 0

    async def scenario() -> None:
        await asyncio.gather(*(scorer.score_group(PROMPT, ["a", "b"]) for _ in range(6)))

    asyncio.run(scenario())
    assert group_rewards.PROBE.peak == 2 and scorer.stats.calls == 6


def test_a_timeout_fails_only_its_own_sample() -> None:
    scorer = _scorer(reward="group_rewards:hangs_on_slow", reward_timeout_s=0.3)
    outcomes = asyncio.run(scorer.score_group(PROMPT, ["ab", "slow", "abcd"]))
    assert [o.failed for o in outcomes] == [False, True, False]
    assert [o.reward for o in outcomes] == [2.0, 0.0, 4.0]
    assert outcomes[1].timed_out and "timed out" in outcomes[1].info["error"]
    assert scorer.stats.timeouts == 1 and scorer.stats.samples_failed == 1


# --------------------------------------------------------------------------------------------------------------------
# Group judges
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", ["group_rewards:rank_by_length", "group_rewards:async_rank_by_length"])
def test_a_group_judge_scores_each_response_against_the_others(ref: str) -> None:
    scorer = _scorer(group_reward=ref)
    assert isinstance(scorer, GroupScorer)

    async def scenario() -> tuple[list[Any], list[Any]]:
        return (await scorer.score_group(PROMPT, ["aaa", "a", "aa"]),
                await scorer.score_group(PROMPT, ["aa", "aaaa", "aaaaa"]))

    first, second = asyncio.run(scenario())
    assert [o.reward for o in first] == [1.0, 0.0, 0.5]
    assert [o.info["wins"] for o in first] == [2, 0, 1]
    # The same response "aa" earns 0.5 in one group and 0 in the other: only a judge of the whole group gives that.
    assert first[2].reward == 0.5 and second[0].reward == 0.0
    assert scorer.stats.calls == 2  # one call per group, not per sample


@pytest.mark.parametrize(("ref", "error"), [
    ("group_rewards:wrong_length", "returned 1 values for 3 responses"),
    ("group_rewards:raising_judge", "RuntimeError: judge crashed on purpose"),
])
def test_a_broken_judge_fails_the_group_and_is_counted(ref: str, error: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    scorer = _scorer(group_reward=ref)
    with caplog.at_level(logging.WARNING):
        outcomes = asyncio.run(scorer.score_group(PROMPT, ["a", "b", "c"]))
    assert all(o.failed and error in o.info["error"] for o in outcomes)
    assert scorer.stats.errors == 1 and scorer.stats.samples_failed == 3
    assert error in caplog.text


def test_a_slow_sync_judge_times_out() -> None:
    outcomes = asyncio.run(_scorer(group_reward="group_rewards:slow_judge", reward_timeout_s=0.2)
                           .score_group(PROMPT, ["a", "b"]))
    assert all(o.failed and o.timed_out for o in outcomes)


# --------------------------------------------------------------------------------------------------------------------
# Checked at recipe load
# --------------------------------------------------------------------------------------------------------------------


def test_the_recipe_checks_and_records_the_group_reward() -> None:
    cfg = load_config(overrides=['producer.group_reward="group_rewards:rank_by_length"'])
    assert ("producer.group_reward", "group_rewards:rank_by_length") in [(f, r) for f, r, _ in cfg.plugin_refs()]
    record = next(r for r in cfg.plugin_records() if r["field"] == "producer.group_reward")
    assert record["file"] and record["file"].endswith("group_rewards.py") and record["sha256"]
    with pytest.raises(ConfigError, match=r"producer.group_reward = 'group_rewards:not_a_group_judge': must accept "
                                          r"\(prompt, responses: list\[str\]\)"):
        load_config(overrides=['producer.group_reward="group_rewards:not_a_group_judge"'])
    with pytest.raises(ConfigError, match="producer.group_reward = 'no_such_module:judge': cannot import"):
        load_config(overrides=['producer.group_reward="no_such_module:judge"'])


def test_one_reward_source_at_a_time() -> None:
    with pytest.raises(ConfigError, match="producer.reward and producer.group_reward are both set"):
        load_config(overrides=['producer.group_reward="group_rewards:rank_by_length"', "producer.reward=integer_match"])
    with pytest.raises(ConfigError, match="producer.group_reward and producer.reward_url are both set"):
        load_config(overrides=['producer.group_reward="group_rewards:rank_by_length"',
                               'producer.reward_url="http://127.0.0.1:1/score"'])
    with pytest.raises(ConfigError, match="reward_headers is only sent to producer.reward_url"):
        load_config(overrides=['producer.reward_headers={X = "1"}'])
    # The resolved config, written to config.json and read back by each producer, loads again.
    cfg = load_config(overrides=['producer.group_reward="group_rewards:rank_by_length"'])
    ProducerConfig.model_validate(cfg.producer.model_dump())


def test_secrets_stay_out_of_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=['producer.reward_url="http://judge:hunter2@127.0.0.1:1/score"'])
    assert "hunter2" not in str(e.value) and "env:SLUICE_REWARD_URL" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(overrides=['producer.reward_url="http://127.0.0.1:1/score?api_key=k3y"'])
    assert "k3y" not in str(e.value) and "query string" in str(e.value)
    with pytest.raises(ConfigError, match="SLUICE_TEST_TOKEN is not set"):
        load_config(overrides=['producer.reward_url="http://127.0.0.1:1/score"',
                               'producer.reward_headers={Authorization = "env:SLUICE_TEST_TOKEN"}'])
    with pytest.raises(ConfigError, match="name a variable SLUICE_"):
        load_config(overrides=['producer.reward_url="env:REWARD_URL"'])
    monkeypatch.setenv("SLUICE_TEST_TOKEN", "Bearer tok-s3cret")
    monkeypatch.setenv("SLUICE_TEST_URL", "http://judge:hunter2@127.0.0.1:1/score")
    cfg = load_config(overrides=['producer.reward_url="env:SLUICE_TEST_URL"',
                                 'producer.reward_headers={X-Token = "env:SLUICE_TEST_TOKEN"}'])
    from pipeline.config import dump_config

    assert "hunter2" not in dump_config(cfg) and "tok-s3cret" not in dump_config(cfg)
    scorer = setup_scorer(cfg.producer)
    assert isinstance(scorer, HttpScorer)
    assert scorer.url.endswith("hunter2@127.0.0.1:1/score") and scorer.headers == {"X-Token": "Bearer tok-s3cret"}


# --------------------------------------------------------------------------------------------------------------------
# A reward service over HTTP
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Service:
    """A reward service: reward = 1 for the answer, 0 otherwise; its first ``fail_first`` requests answer ``status``."""

    fail_first: int = 0
    status: int = 503
    requests: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.headers.append(dict(request.headers))
        if self.requests <= self.fail_first:
            return web.Response(status=self.status, text="busy")
        body = await request.json()
        self.bodies.append(body)
        ok = [r == body["answer"] for r in body["responses"]]
        return web.json_response({"rewards": [float(x) for x in ok], "infos": [{"pass": x} for x in ok]})


@asynccontextmanager
async def serve(service: Service) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/score", service.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/score"
    finally:
        await runner.cleanup()


def test_the_service_is_retried_until_the_rewards_arrive() -> None:
    service = Service(fail_first=2)

    async def scenario() -> list[Any]:
        async with serve(service) as url:
            scorer = setup_scorer(ProducerConfig(reward_url=url, reward_backoff_s=0.01))
            try:
                return [await scorer.score_group(PROMPT, ["42", "41", "4"]), scorer]
            finally:
                await scorer.close()

    outcomes, scorer = asyncio.run(scenario())
    assert service.requests == 3  # two 503s, then the answer
    assert [o.reward for o in outcomes] == [1.0, 0.0, 0.0] and not any(o.failed for o in outcomes)
    assert outcomes[0].info == {"pass": True}
    assert service.bodies == [{"prompt_id": "p-1", "prompt": "12+30=", "prompt_ids": None, "answer": "42",
                               "responses": ["42", "41", "4"]}]
    assert scorer.stats.retries == 2 and scorer.stats.calls == 3 and scorer.stats.samples_failed == 0


def test_a_service_that_stays_down_fails_the_samples_and_nothing_crashes(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://judge:hunter2@127.0.0.1:{free_port()}/score?api_key=k3y"  # nothing listens there
    scorer = HttpScorer(url, headers={"X-Token": "tok-s3cret"}, timeout_s=2.0, concurrency=4,
                        retries=2, backoff_s=0.01)

    async def scenario() -> list[list[Any]]:
        try:
            return [await scorer.score_group(PROMPT, ["42", "1"]), await scorer.score_group(PROMPT, ["3"])]
        finally:
            await scorer.close()

    with caplog.at_level(logging.DEBUG):
        first, second = asyncio.run(scenario())
    assert all(o.failed for o in [*first, *second])
    assert "gave up after 3 attempts" in first[0].info["error"]
    assert scorer.stats.calls == 6 and scorer.stats.retries == 4 and scorer.stats.errors == 2
    assert scorer.stats.samples_failed == 3
    shown = caplog.text + "".join(str(o.info) for o in [*first, *second])
    assert "judge:***@127.0.0.1" in shown and "/score?***" in shown
    assert "hunter2" not in shown and "tok-s3cret" not in shown and "k3y" not in shown


def test_a_refusal_is_not_retried_and_credentials_travel() -> None:
    service = Service(fail_first=1, status=401)

    async def scenario() -> list[Any]:
        async with serve(service) as url:
            scorer = HttpScorer(url.replace("http://", "http://judge:hunter2@"), timeout_s=5.0, concurrency=2,
                                headers={"X-Token": "tok-s3cret"})
            try:
                return [await scorer.score_group(PROMPT, ["42"]), await scorer.score_group(PROMPT, ["42"]), scorer]
            finally:
                await scorer.close()

    refused, scored, scorer = asyncio.run(scenario())
    assert service.requests == 2  # the 401 was not tried again; the next group was scored
    assert refused[0].failed and "refused the request with 401" in refused[0].info["error"]
    assert "hunter2" not in refused[0].info["error"]
    assert scored[0].reward == 1.0 and not scored[0].failed
    assert service.headers[1]["X-Token"] == "tok-s3cret"
    assert service.headers[1]["Authorization"].startswith("Basic ")  # the URL's user and password, as HTTP Basic
    assert scorer.stats.retries == 0 and scorer.stats.errors == 1


def test_a_reply_of_the_wrong_shape_fails_the_group() -> None:
    async def handle(request: web.Request) -> web.Response:
        return web.json_response({"rewards": [1.0]})

    async def scenario() -> list[Any]:
        app = web.Application()
        app.router.add_post("/score", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        scorer = HttpScorer(f"http://127.0.0.1:{port}/score", timeout_s=5.0, concurrency=2)
        try:
            return await scorer.score_group(PROMPT, ["a", "b"])
        finally:
            await scorer.close()
            await runner.cleanup()

    outcomes = asyncio.run(scenario())
    assert all(o.failed and "without 2 'rewards'" in o.info["error"] for o in outcomes)


def test_a_per_sample_function_is_the_default() -> None:
    assert isinstance(_scorer(), SampleScorer)


def test_url_credentials_and_an_authorization_header_are_refused_together() -> None:
    with pytest.raises(ConfigError, match="keep one of the two") as e:
        HttpScorer("http://judge:hunter2@127.0.0.1:1/score", headers={"authorization": "x"}, timeout_s=1,
                   concurrency=1)
    assert "hunter2" not in str(e.value)
