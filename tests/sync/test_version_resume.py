"""The policy version never goes back: on resume it is max(Redis, checkpoint), and the push that follows raises
Redis and the engines past it. Redis's counter is rolled back by hand between two real ``sluice run`` launches, as a
Redis that lost its last second under ``appendfsync everysec`` would leave it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from pipeline.consumers.trainer.loop import RedisClock
from pipeline.queue.redis_streams import RESUME_EVENT, SampleQueue

ROOT = Path(__file__).parents[2]


def test_redis_clock_advances_by_one_and_never_below_the_pushed_version(queue: SampleQueue) -> None:
    clock = RedisClock(queue)
    assert clock.get() == 0
    assert clock.advance() == 1 and clock.advance(at_least=1) == 2
    queue.redis.set(queue.keys.policy_version, 1)  # lost writes
    assert clock.advance(at_least=6) == 6 and clock.get() == 6
    assert clock.advance(at_least=3) == 7  # a floor below the counter changes nothing


def test_a_trainer_that_started_before_is_not_a_fresh_start_even_at_version_0(queue: SampleQueue) -> None:
    """A trainer killed in the middle of its first push, before any checkpoint, leaves the engines with a mix of old
    and new weights still labelled 0; the next one must hold and re-sync them (``Trainer.resume``), so it may not take
    version 0 and no checkpoint for a fresh start. Its "resume" event is what tells."""
    clock = RedisClock(queue)
    for i in range(2500):  # a long run's events: the search pages through them
        queue.log_event("weight_push", version=i)
    assert not clock.started_before() and not queue.has_event(RESUME_EVENT, chunk=100)
    queue.log_event(RESUME_EVENT, step=0, version=0)
    assert clock.started_before() and queue.has_event(RESUME_EVENT, chunk=100)
    assert clock.get() == 0  # the counter alone would have called this a fresh start


def _launch(run_dir: Path, name: str, redis_url: str, steps: int, log: Path) -> None:
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "recipes/cpu-moe.toml", "--run-dir", str(run_dir),
           "--steps", str(steps), "--set", f"run.name={name}", "--set", f"queue.redis_url={redis_url}",
           "--set", "trainer.checkpoint_every=3", "--set", "warmstart.enabled=false",
           "--set", "eval.heldout.enabled=false", "--set", "trainer.batch_groups=2", "--set", "producer.concurrency=2",
           "--set", "filters.zero_variance=false", "--set", "queue.archive.enabled=false"]
    with log.open("ab") as out:
        r = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=600,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, log.read_text()[-4000:]


@pytest.mark.slow
def test_a_resume_after_redis_lost_its_counter_does_not_go_back(tmp_path: Path, redis_url: str,
                                                                 redis_client: redis.Redis) -> None:
    name = f"t{uuid.uuid4().hex[:10]}"
    run_dir = tmp_path / "run"
    log = tmp_path / "launcher.log"
    keys = SampleQueue(redis_client, name).keys
    try:
        _launch(run_dir, name, redis_url, 3, log)
        assert int(redis_client.get(keys.policy_version)) == 3  # three pushes, checkpoint at step 3 with version 3
        redis_client.set(keys.policy_version, 1)  # Redis lost its last writes

        _launch(run_dir, name, redis_url, 5, log)
        rows = [json.loads(x) for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
        versions = [r["policy_version"] for r in rows]
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
        # Resume at max(1, 3) = 3; its resync push is 4; steps 4 and 5 push 5 and 6.
        assert versions == [1, 2, 3, 5, 6], versions
        assert int(redis_client.get(keys.policy_version)) == 6
        events = SampleQueue(redis_client, name).events()
        resumes = [e for e in events if e["kind"] == "resume"]
        assert [int(e["version"]) for e in resumes] == [0, 3]
        pushes = [e for e in events if e["kind"] == "weight_push"]
        # Every push after the resume went to the run's engine, which confirmed it before the version moved.
        assert [int(e["version"]) for e in pushes] == [1, 2, 3, 4, 5, 6]
        assert all(int(e["engines"]) == 1 for e in pushes)
    finally:
        stale = list(redis_client.scan_iter(match=f"{keys.prefix}:*"))
        if stale:
            redis_client.delete(*stale)
