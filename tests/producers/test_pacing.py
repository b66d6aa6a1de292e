"""Pacing slots and requeue with real components: a real CPU engine generating real tokens, real producers (one of
them a separate process killed with SIGKILL), the real Redis scripts, and the real drainer.

Each scenario runs at the tightest budget, ``max_lag = 0``: every slot a group keeps without being trained is a slot
the trainer's next batch can never get. With the old bookkeeping (slots given back only on an engine failure) each of
these tests stalls at its first wait for more groups and fails on its deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.config.filters import FilterConfig
from pipeline.config.producer import ProducerConfig, SamplingConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.trainer.drain import Batch, Drainer
from pipeline.consumers.trainer.ledger import Ledger
from pipeline.consumers.trainer.staleness import admission_budget
from pipeline.data.prompts import Prompt, synthetic
from pipeline.producers.cursor import PromptCursor
from pipeline.producers.producer import Pacing, PacingConfig, Producer, ProducerSpec, load_tokenize, read_num_experts
from pipeline.producers.sglang_client import SGLangClient
from pipeline.queue.redis_streams import SampleQueue
from tests.helpers.engines import REPO_ROOT, EngineProcess
from tests.helpers.samples import make_group

DEADLINE_S = 90.0


def make_producer(queue: SampleQueue, url: str, model_dir: Path, *, name: str, pacing: Pacing,
                  reward: Callable[[Prompt, str], Any], **cfg: Any) -> Producer:
    sampling = SamplingConfig(max_new_tokens=4, **cfg.pop("sampling", {}))
    return Producer(
        ProducerConfig(group_size=2, sampling=sampling, admission_poll_s=0.01, **cfg), name=name, queue=queue,
        engine=SGLangClient(url), prompts=synthetic("addition", size=64, seed=1), tokenize=load_tokenize(model_dir),
        reward_fn=reward, pacing=pacing, num_experts=read_num_experts(model_dir),
    )  # fmt: skip


def varied_reward(prompt: Prompt, response: str) -> float:
    return float(len(response))


def constant_reward(prompt: Prompt, response: str) -> float:
    return 1.0


def crashing_reward(prompt: Prompt, response: str) -> float:
    raise RuntimeError("verifier down")


async def _until(cond: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def slots_held(queue: SampleQueue) -> int:
    return int(queue.redis.get(queue.keys.groups_started) or 0)


def drain_until(drainer: Drainer, queue: SampleQueue, entries: int, version: Callable[[], int],
                batch_groups: int = 2) -> Batch:
    """One drain call that stops once ``entries`` entries were delivered (or at the deadline)."""
    deadline = time.monotonic() + DEADLINE_S
    return drainer.next_batch(batch_groups, step=0, version=version, should_stop=lambda: (
        len(queue.pending_ids("trainer")) >= entries or time.monotonic() > deadline))


@pytest.mark.parametrize("cause", ["stale", "invalid", "filtered"])
def test_groups_that_are_not_trained_give_their_slots_back(
    cause: str, engine: EngineProcess, model_dir: Path, queue: SampleQueue, tmp_path: Path
) -> None:
    reward = {"stale": varied_reward, "invalid": crashing_reward, "filtered": constant_reward}[cause]
    filters = FilterConfig(zero_variance=cause == "filtered")
    # "stale": the trainer's clock is past the versions these groups were generated at.
    trainer_version = 3 if cause == "stale" else 0
    fate = {"stale": "stale", "invalid": "invalid", "filtered": "filtered"}[cause]

    async def scenario() -> tuple[Producer, Batch]:
        producer = make_producer(queue, engine.url, model_dir, name="p0", pacing=Pacing(max_lag=0, batch_groups=2),
                                 reward=reward, concurrency=2)
        drainer = Drainer(queue, Ledger(tmp_path / "ledger"), StalenessConfig(max_lag=0, action="drop"),
                          filters=filters, block_ms=50)
        drainer.recover()
        stop = asyncio.Event()
        run = asyncio.ensure_future(producer.run(stop=stop))
        try:
            await _until(lambda: producer.stats.groups_put == 2, "the first two groups")
            waits = producer.stats.paced_waits
            await _until(lambda: producer.stats.paced_waits > waits + 3, "the producer to be paced")
            assert admission_budget(slots_held(queue), queue.policy_version(), 0, 2) == 0
            # The trainer drains: none of these groups trains, so a batch needs producers to make more at version 0.
            batch = await asyncio.to_thread(drain_until, drainer, queue, 6, lambda: trainer_version)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), 60)
            await producer.engine.close()  # type: ignore[attr-defined]
        return producer, batch

    producer, batch = asyncio.run(scenario())
    assert queue.policy_version() == 0  # no weight push gave the producers budget: only released slots did
    assert len(queue.pending_ids("trainer")) >= 6 and producer.stats.groups_put >= 6
    assert batch.groups == [] and batch.slots.released == len(batch.consumed) >= 6
    assert {line.fate for line in batch.lines} == {fate}
    assert len({line.entry_id for line in batch.lines}) == len(batch.consumed)
    # Every queued group not released still holds exactly one slot, and nothing else does.
    undrained = queue.redis.xlen(queue.keys.samples) - len(batch.consumed)
    assert slots_held(queue) == undrained == queue.redis.hlen(queue.keys.group_slots)


def test_a_requeued_prompt_is_generated_again_until_max_requeues(
    engine: EngineProcess, model_dir: Path, queue: SampleQueue, tmp_path: Path
) -> None:
    async def scenario() -> tuple[Producer, Batch]:
        # One slot: each group is drained, requeued and generated again before anything else starts.
        producer = make_producer(queue, engine.url, model_dir, name="p0", pacing=Pacing(max_lag=0, batch_groups=1),
                                 reward=varied_reward, concurrency=1)
        drainer = Drainer(queue, Ledger(tmp_path / "ledger"),
                          StalenessConfig(max_lag=0, action="requeue", max_requeues=2), block_ms=50)
        drainer.recover()
        stop = asyncio.Event()
        run = asyncio.ensure_future(producer.run(stop=stop))
        try:
            batch = await asyncio.to_thread(drain_until, drainer, queue, 5, lambda: 3, 1)  # all stale
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), 60)
            await producer.engine.close()  # type: ignore[attr-defined]
        return producer, batch

    producer, batch = asyncio.run(scenario())
    drained = [entry for entry_id, entry in queue.scan() if entry_id in set(batch.consumed)]
    prompts = [entry.samples[0].prompt_id for entry in drained]
    # add-0 is generated three times (the first try and two requeues), then dropped; add-1 comes next.
    assert prompts == ["add-0", "add-0", "add-0", "add-1", "add-1"]
    assert len({e.samples[0].group_id for e in drained}) == len(drained)  # each one a new generation
    c = batch.counts
    assert (c.groups_requeue, c.groups_drop, c.groups_drop_max_requeues) == (4, 1, 1)
    assert batch.slots.requeued == 4 and producer.stats.prompts_requeued >= 3
    assert PromptCursor(queue.redis, queue.run).position() >= 2


def _tokens_generated(url: str) -> int:
    import httpx

    return int(httpx.get(f"{url}/get_load", timeout=10).json()["tokens_generated"])


_DOOMED = """
import asyncio, sys
from pipeline.producers.producer import ProducerSpec, serve_producer
asyncio.run(serve_producer(ProducerSpec.model_validate_json(sys.argv[1])))
"""


@pytest.mark.parametrize("who", ["restarted", "peer"])
def test_a_killed_producers_in_flight_prompts_come_back(
    who: str, engine: EngineProcess, model_dir: Path, queue: SampleQueue, redis_url: str, tmp_path: Path
) -> None:
    """A producer process is SIGKILLed with its whole budget in flight; its prompts are generated by the next one."""
    pacing = Pacing(max_lag=0, batch_groups=2)
    spec = ProducerSpec(
        name="doomed", run=queue.run, redis_url=redis_url, engine_urls=[engine.url], model_dir=model_dir,
        producer=ProducerConfig(group_size=2, concurrency=2, lease_ttl_s=1.0, admission_poll_s=0.01,
                                sampling=SamplingConfig(max_new_tokens=900, ignore_eos=True)),
        pacing=PacingConfig(max_lag=pacing.max_lag, batch_groups=pacing.batch_groups),
    )  # fmt: skip
    log = open(tmp_path / "doomed.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-c", _DOOMED, spec.model_dump_json()], cwd=REPO_ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    inflight = queue.keys.producer_inflight("doomed")
    try:
        deadline = time.monotonic() + DEADLINE_S
        while queue.redis.hlen(inflight) < 2:
            assert proc.poll() is None, (tmp_path / "doomed.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the doomed producer never had two groups in flight"
            time.sleep(0.05)
        # Killed once its generations are under way and far from done (900 tokens each): an idle machine decodes
        # the tiny model's 2 x 2 sequences faster than any fixed wait would allow for.
        start = _tokens_generated(engine.url)
        while _tokens_generated(engine.url) < start + 8:
            assert time.monotonic() < deadline, "the doomed producer's generations never started"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)  # the process this test started
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert queue.redis.xlen(queue.keys.samples) == 0 and queue.redis.hlen(inflight) == 2 and slots_held(queue) == 2

    async def scenario() -> Producer:
        name = "doomed" if who == "restarted" else "peer"
        producer = make_producer(queue, engine.url, model_dir, name=name, pacing=pacing, reward=varied_reward,
                                 concurrency=2, lease_ttl_s=1.0)
        try:
            await asyncio.wait_for(producer.run(max_groups=2), DEADLINE_S)
        finally:
            await producer.engine.close()  # type: ignore[attr-defined]
        return producer

    producer = asyncio.run(scenario())
    groups = [entry.samples for _, entry in queue.scan()]
    # The very prompts the killed producer had taken were generated, and no new one was needed.
    assert sorted(g[0].prompt_id for g in groups) == ["add-0", "add-1"]
    assert PromptCursor(queue.redis, queue.run).position() == 2
    assert producer.stats.prompts_reclaimed == 2 and producer.stats.prompts_retried == 2
    assert not queue.redis.exists(inflight)
    assert slots_held(queue) == 2 == queue.redis.hlen(queue.keys.group_slots)
    if who == "peer":
        assert b"doomed" not in queue.redis.smembers(queue.keys.producers)
    # A clean stop gives the lease up and leaves nothing in flight.
    assert not queue.redis.exists(queue.keys.producer_lease(producer.name))
    assert not queue.redis.exists(queue.keys.producer_inflight(producer.name))


def test_a_restarted_trainer_decides_again_but_gives_no_slot_back_twice(queue: SampleQueue, tmp_path: Path,
                                                                       model_dir: Path) -> None:
    """Slot records made by the producer's own scripts; a drain, a trainer crash before the commit, a recovery."""
    producer = make_producer(queue, "http://127.0.0.1:9", model_dir, name="p0",
                             pacing=Pacing(max_lag=0, batch_groups=4), reward=varied_reward)
    rng = np.random.default_rng(0)
    groups = []
    for version in (0, 0, 3, 3):  # two stale at version 3, two fresh
        slot = producer._take()
        assert slot is not None
        group = make_group(rng, 2, version=version)
        for s in group:
            s.group_id, s.producer = slot.group_id, "p0"
        queue.put(group)
        producer._mark_put(slot)
        groups.append(group)
    assert slots_held(queue) == 4 and queue.redis.hlen(queue.keys.group_slots) == 4
    ledger = Ledger(tmp_path / "ledger")
    stale_drop = StalenessConfig(max_lag=0, action="drop")
    first = Drainer(queue, ledger, stale_drop, block_ms=10)
    first.recover()
    batch = first.next_batch(2, step=0, version=lambda: 3)
    assert len(batch.groups) == 2 and batch.slots.released == 2 and slots_held(queue) == 2

    # The trainer dies before its commit; a new one re-reads the same four pending entries and judges them again.
    again = Drainer(queue, Ledger(tmp_path / "ledger"), stale_drop, block_ms=10)
    assert again.recover().to_redo == 4
    redo = again.next_batch(2, step=0, version=lambda: 3)
    assert len(redo.groups) == 2 and redo.counts.groups_drop == 2
    assert redo.slots.released == 0 and slots_held(queue) == 2  # the dropped groups' slots went back once only
    # The commit acks the four entries: the trained groups keep their slots, and no record is left behind.
    again.ack(redo.consumed)
    assert queue.pending_ids("trainer") == [] and slots_held(queue) == 2
    assert not queue.redis.hlen(queue.keys.group_slots) and not queue.redis.exists(producer.inflight_key)


# asyncio's default executor has min(32, cores + 4) threads: more waiting puts than that took every one of them, and
# the loop's own short calls (and with them the stop) queued behind puts that waited for the trainer that was gone.
_PAST_THE_DEFAULT_EXECUTOR = min(32, (os.cpu_count() or 1) + 4) + 2


@pytest.mark.parametrize("concurrency", [4, _PAST_THE_DEFAULT_EXECUTOR])
def test_a_stop_while_puts_wait_for_room_hands_their_prompts_back_at_once(
    engine: EngineProcess, model_dir: Path, redis_client: Any, run_name: str, concurrency: int
) -> None:
    """The trainer is gone and the queue is at capacity: puts wait for room. A stop must not wait for them (the run's
    shutdown would hang for put_timeout_s): they give up with nothing written, and their prompts go back."""
    queue = SampleQueue(redis_client, run_name, capacity=2)
    queue.create_group("trainer")

    async def scenario() -> tuple[Producer, float]:
        # put_timeout_s bounds what a regression costs: a stop that waits for the puts takes 20 s, not 600.
        producer = make_producer(queue, engine.url, model_dir, name="p0", pacing=None, reward=varied_reward,
                                 concurrency=concurrency, put_timeout_s=20.0)
        stop = asyncio.Event()
        run = asyncio.ensure_future(producer.run(stop=stop))
        try:
            await _until(lambda: producer.stats.groups_put >= 2, "the queue to fill")
            # Give the next groups time to finish generating and block in their puts.
            await _until(lambda: queue.redis.hlen(queue.keys.producer_inflight("p0")) >= concurrency,
                         f"{concurrency} groups in flight")
            await asyncio.sleep(1.0)
        finally:
            stop.set()
            started = time.monotonic()
            await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), 60)
            seconds = time.monotonic() - started
            await producer.engine.close()  # type: ignore[attr-defined]
        return producer, seconds

    producer, seconds = asyncio.run(scenario())
    assert seconds < 10, f"the stop waited {seconds:.1f} s for puts with no room"
    queued = queue.redis.xlen(queue.keys.samples)
    # Concurrent puts may pass the room check together, so a few more than capacity can land, never all of them.
    assert producer.stats.groups_put == queued < 2 + concurrency
    cursor = PromptCursor(queue.redis, queue.run)
    handed_back = [index for index, _ in cursor.retries()]
    on_queue = [int(e.samples[0].prompt_id.split("-")[1]) for _, e in queue.scan()]  # type: ignore[union-attr]
    assert len(handed_back) >= 1 and sorted(handed_back + on_queue) == list(range(cursor.position()))
    assert slots_held(queue) == queued and queue.redis.hlen(queue.keys.producer_inflight("p0")) == 0
