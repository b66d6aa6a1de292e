"""The evaluator consumer: exact per-version aggregates, its independence from the trainer group, and exactly-once
counting across a kill -9, against a real Redis server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from pipeline.config.eval import EvaluatorConfig
from pipeline.consumers.evaluator import (
    ALL,
    EvalAggregate,
    Evaluator,
    aggregate_groups,
    eval_key,
    read_eval_summary,
    run_eval,
    sample_passed,
    sample_version,
)
from pipeline.errors import ConfigError
from pipeline.queue.base import QueueEntry
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.rundir import write_run_file
from pipeline.queue.sample import Sample
from pipeline.rundir import eval_metrics_path

_FLOATS = ("reward_mean", "reward_std", "reward_min", "reward_max", "pass_rate", "response_len_mean")


def mk(reward: float, version: int | Sequence[int] = 0, *, length: int = 3, status: str = "completed",
       info: dict[str, Any] | None = None, group: str = "g") -> Sample:
    versions = [version] * length if isinstance(version, int) else list(version)
    n = len(versions)
    return Sample(prompt_ids=np.arange(1, 4), response_ids=np.arange(n) + 10,
                  rollout_logprobs=np.full(n, -0.5, np.float32), token_versions=np.array(versions, np.int32),
                  reward=reward, reward_info=info or {}, status=status, group_id=group, prompt_id=group)


def hand_groups() -> list[list[Sample]]:
    return [
        # v0 only
        [mk(1.0, 0, length=2, info={"pass": True}), mk(0.0, 0, length=4, info={"pass": False})],
        # v1, one sample spanning a push 0 -> 1 (credited to 1)
        [mk(0.5, 1, length=3), mk(-0.5, 1, length=5), mk(1.0, [0, 1, 1], status="truncated", info={"pass": True})],
        # mixed: v0, v2, and an aborted empty response that falls back to the group's newest version (2)
        [mk(0.25, 0, length=1, info={"pass": 1}), mk(0.75, 2, length=6, info={"pass": "yes"}),
         mk(0.0, [], status="aborted")],
    ]


def many_groups(n: int, seed: int = 0) -> list[list[Sample]]:
    """Prompt groups over versions 0..4 with dyadic rewards (sums exact in binary) and varied statuses."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        base = g // max(n // 5, 1)
        out.append([mk(float(rng.integers(-4, 5)) / 4, int(min(base + rng.integers(0, 2), 4)),
                       length=int(rng.integers(1, 9)), status=str(rng.choice(["completed", "truncated"])),
                       group=f"g{g}") for _ in range(int(rng.integers(1, 5)))])
    return out


def assert_same(got: EvalAggregate, want: EvalAggregate) -> None:
    a, b = got.summary(), want.summary()
    assert a.keys() == b.keys()
    for key in b:
        for stat, value in b[key].items():
            if stat in _FLOATS and value is not None:
                assert a[key][stat] == pytest.approx(value, rel=1e-12, abs=1e-12), (key, stat)
            else:
                assert a[key][stat] == value, (key, stat)


def drain(queue: SampleQueue, group: str = "trainer", consumer: str = "trainer-0", count: int = 4) -> list[QueueEntry]:
    """A plain trainer-like consumer: read everything undelivered to its group and ack it."""
    seen: list[QueueEntry] = []
    while entries := queue.read(group, consumer, count=count):
        queue.ack(group, [e.id for e in entries])
        seen.extend(entries)
    return seen


def fast_cfg(**kw: Any) -> EvaluatorConfig:
    return EvaluatorConfig(**{"block_ms": 50, "batch_entries": 4, **kw})


def pending(queue: SampleQueue, group: str) -> int:
    return int(queue.redis.xpending(queue.keys.samples, group)["pending"])


# --------------------------------------------------------------------------------------------- pure aggregation
def test_hand_computed_per_version_aggregates() -> None:
    agg = aggregate_groups(hand_groups())
    s = agg.summary()
    assert list(s) == ["0", "1", "2", "all"]
    v0, v1, v2, tot = s["0"], s["1"], s["2"], s["all"]
    # v0: rewards 1.0, 0.0 (group 1) and 0.25 (group 3); passes True, False, 1
    assert (v0["samples"], v0["groups"]) == (3, 2)
    assert v0["reward_mean"] == pytest.approx(1.25 / 3)
    assert v0["pass_rate"] == pytest.approx(2 / 3)
    assert (v0["reward_min"], v0["reward_max"]) == (0.0, 1.0)
    assert (v0["response_len_min"], v0["response_len_max"], v0["response_len_mean"]) == (1, 4, pytest.approx(7 / 3))
    # v1: 0.5 passes by threshold, -0.5 fails by threshold, the spanning sample passes by info
    assert (v1["samples"], v1["groups"], v1["spanning"]) == (3, 1, 1)
    assert v1["reward_mean"] == pytest.approx(1.0 / 3)
    assert v1["pass_rate"] == pytest.approx(2 / 3)
    assert v1["status"] == {"completed": 2, "truncated": 1}
    # v2: 0.75 ("pass": "yes" is not a verdict, so reward > 0 decides) and the empty aborted one (0.0 fails)
    assert (v2["samples"], v2["groups"]) == (2, 1)
    assert v2["reward_mean"] == 0.375
    assert v2["pass_rate"] == 0.5
    assert v2["status"] == {"aborted": 1, "completed": 1}
    assert (v2["response_len_min"], v2["response_len_max"]) == (0, 6)
    # totals count each prompt group once
    assert (tot["samples"], tot["groups"], tot["spanning"]) == (8, 3, 1)
    rewards = [1.0, 0.0, 0.5, -0.5, 1.0, 0.25, 0.75, 0.0]
    assert tot["reward_mean"] == pytest.approx(np.mean(rewards))
    assert tot["reward_std"] == pytest.approx(np.std(rewards))
    assert tot["pass_rate"] == pytest.approx(5 / 8)
    assert tot["status"] == {"aborted": 1, "completed": 6, "truncated": 1}


def test_pass_rules_and_version_choice() -> None:
    assert sample_passed(mk(-1.0, info={"pass": True}), 0.0)
    assert not sample_passed(mk(5.0, info={"pass": False}), 0.0)
    assert not sample_passed(mk(5.0, info={"pass": 0}), 0.0)
    assert sample_passed(mk(0.6, info={"other": 1}), 0.5)
    assert not sample_passed(mk(0.5), 0.5)  # strictly above the threshold
    assert sample_passed(mk(0.9, info={"pass": None}), 0.5)
    assert sample_version(mk(0.0, [2, 3, 5])) == 5
    assert sample_version(mk(0.0, []), 7) == 7
    assert sample_version(mk(0.0, [])) == -1


def test_merge_equals_aggregating_everything() -> None:
    groups = many_groups(40)
    a, b = aggregate_groups(groups[:17]), aggregate_groups(groups[17:])
    a.merge(b)
    assert_same(a, aggregate_groups(groups))


def test_infinite_reward_is_counted_apart() -> None:
    agg = aggregate_groups([[mk(float("inf"), 0), mk(1.0, 0)]])
    s = agg.summary()["0"]
    assert (s["samples"], s["reward_nonfinite"], s["reward_mean"], s["pass_rate"]) == (2, 1, 1.0, 1.0)


# ------------------------------------------------------------------------------------------------ against Redis
def test_eval_group_sees_every_sample_the_trainer_sees(queue: SampleQueue) -> None:
    queue.create_group("trainer", "0")
    ev = Evaluator(queue, fast_cfg())
    ev.attach()
    groups = hand_groups() + many_groups(25, seed=1)
    queue.put_many(groups)
    seen = drain(queue)
    assert len(seen) == len(groups)
    report = ev.run(until_idle_s=0)
    assert report.counted_entries == len(groups) and report.skipped_entries == 0
    assert (report.pending, report.lag) == (0, 0)
    # the evaluator's aggregates equal those of what the trainer received, and of what was put
    assert_same(report.aggregate, aggregate_groups([e.samples for e in seen]))
    assert_same(report.aggregate, aggregate_groups(groups))
    # and what Redis holds (what `sluice queue stats` would show) is the same
    assert_same(read_eval_summary(queue), aggregate_groups(groups))


def test_exact_hand_figures_through_the_queue(queue: SampleQueue) -> None:
    queue.put_many(hand_groups())
    report = Evaluator(queue, fast_cfg()).run(until_idle_s=0)
    s = report.aggregate.summary()
    assert {k: (v["samples"], v["groups"]) for k, v in s.items()} == {"0": (3, 2), "1": (3, 1), "2": (2, 1),
                                                                     "all": (8, 3)}
    assert s["2"]["reward_mean"] == 0.375 and s["2"]["pass_rate"] == 0.5
    assert s["1"]["spanning"] == 1
    assert "all" in report.format_table()


def test_slow_evaluator_does_not_hold_back_the_trainer(redis_client: redis.Redis, run_name: str) -> None:
    # A small capacity shows that backpressure follows the trainer only: the stalled evaluator lags far beyond it.
    queue = SampleQueue(redis_client, run_name, capacity=8)
    try:
        queue.create_group("trainer", "0")
        release = threading.Event()

        class Stalled(Evaluator):
            def commit(self, entries: Sequence[QueueEntry]) -> int:
                assert release.wait(30), "the test never released the evaluator"
                return super().commit(entries)

        ev = Stalled(queue, fast_cfg(batch_entries=2))
        ev.attach()
        report: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: report.update(r=ev.run(until_idle_s=0.3)))
        worker.start()
        groups = many_groups(40, seed=2)
        trained: list[QueueEntry] = []
        for i in range(0, 40, 5):
            queue.put_many(groups[i:i + 5], timeout_s=2.0)  # would raise QueueFullError if the evaluator counted
            trained += drain(queue)
        # the trainer has everything, in stream order, while the evaluator has counted nothing
        assert [e.id for e in trained] == [i for i, _ in queue.scan()]
        assert pending(queue, "trainer") == 0 and queue.lag("trainer") == 0
        assert ev.counted_entries == 0 and queue.lag("eval") >= 40 - 8
        release.set()
        worker.join(60)
        assert not worker.is_alive()
        assert report["r"].counted_entries == 40 and (report["r"].pending, report["r"].lag) == (0, 0)
        assert_same(report["r"].aggregate, aggregate_groups(groups))
    finally:
        keys = list(redis_client.scan_iter(match=f"{queue.keys.prefix}:*"))
        if keys:
            redis_client.delete(*keys)


def test_crash_between_read_and_commit_counts_once(queue: SampleQueue) -> None:
    groups = many_groups(12, seed=3)
    queue.put_many(groups)
    crashed = Evaluator(queue, fast_cfg(batch_entries=5))
    crashed.attach()
    held = crashed.read()  # read, then "die" before committing
    assert len(held) == 5 and pending(queue, "eval") == 5
    # same consumer name: it re-reads its pending entries, committing them in chunks of its own smaller batch
    report = Evaluator(queue, fast_cfg(batch_entries=2)).run(until_idle_s=0)
    assert report.recovered_entries == 5 and report.counted_entries == 12
    assert_same(report.aggregate, aggregate_groups(groups))


def test_two_holders_of_an_entry_count_it_once(queue: SampleQueue) -> None:
    groups = many_groups(6, seed=4)
    queue.put_many(groups)
    slow = Evaluator(queue, fast_cfg(consumer="slow", batch_entries=6))
    slow.attach()
    held = slow.read()
    peer = Evaluator(queue, fast_cfg(consumer="peer", claim_idle_ms=0))
    assert peer.claim() == 6  # the peer took the slow one's entries and counted them
    assert slow.commit(held) == 0 and slow.skipped_entries == 6  # the slow one wakes up: nothing counted twice
    assert_same(read_eval_summary(queue), aggregate_groups(groups))


def test_killed_evaluator_restarts_without_losing_or_double_counting(queue: SampleQueue, redis_url: str,
                                                                     tmp_path: Path) -> None:
    queue.create_group("trainer", "0")
    groups = many_groups(60, seed=5)
    queue.put_many(groups[:30])
    # A deliberately slow evaluator in a process of its own: it holds each batch for 100 ms before committing it.
    script = (
        "import sys, time\n"
        "from pipeline.consumers.evaluator import Evaluator, EvaluatorConfig\n"
        "from pipeline.queue.connection import connect\n"
        "from pipeline.queue.redis_streams import SampleQueue\n"
        "class Slow(Evaluator):\n"
        "    def commit(self, entries):\n"
        "        time.sleep(0.1)\n"
        "        return super().commit(entries)\n"
        "q = SampleQueue(connect(sys.argv[1]), sys.argv[2])\n"
        "Slow(q, EvaluatorConfig(consumer='ev-a', batch_entries=2, block_ms=100)).run()\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script, redis_url, queue.run], env=env)
    trained: list[QueueEntry] = []
    try:
        key = eval_key(queue.run)
        deadline = time.monotonic() + 60
        while int(queue.redis.hget(key, "all:groups") or 0) < 8 or pending(queue, "eval") == 0:
            assert proc.poll() is None, "the evaluator subprocess exited early"
            assert time.monotonic() < deadline, "the evaluator subprocess made no progress"
            for e in queue.read("trainer", "trainer-0", count=1):  # the trainer keeps going meanwhile
                queue.ack("trainer", [e.id])
                trained.append(e)
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    counted_at_kill = int(queue.redis.hget(key, "all:groups") or 0)
    held_at_kill = pending(queue, "eval")
    assert 8 <= counted_at_kill < 30  # killed mid-run

    queue.put_many(groups[30:])  # the run goes on after the evaluator died
    trained += drain(queue)
    assert [e.id for e in trained] == [i for i, _ in queue.scan()]  # every entry, once, in order
    assert pending(queue, "trainer") == 0 and queue.lag("trainer") == 0

    write_run_file(tmp_path / "run", queue.run, redis_url)
    report = run_eval(tmp_path / "run", config=fast_cfg(consumer="ev-b", claim_idle_ms=0), until_idle_s=0.2)
    assert report.recovered_entries == held_at_kill
    assert report.counted_entries == 60 - counted_at_kill
    assert (report.pending, report.lag) == (0, 0)
    assert_same(report.aggregate, aggregate_groups(groups))
    assert_same(read_eval_summary(queue), aggregate_groups(groups))
    # the metrics file's newest line per version is the final figure
    lines = [json.loads(x) for x in eval_metrics_path(tmp_path / "run").read_text().splitlines()]
    newest = {str(rec["version"]): rec for rec in lines}
    assert newest[ALL]["groups"] == 60 and newest[ALL]["samples"] == report.aggregate.total.samples
    for v, st in report.aggregate.by_version.items():
        assert newest[str(v)]["samples"] == st.samples


def test_attach_to_finished_run_at_zero_or_dollar(queue: SampleQueue) -> None:
    queue.create_group("trainer", "0")
    old, new = many_groups(10, seed=6), many_groups(5, seed=7)
    queue.put_many(old)
    drain(queue)  # the run finished: the trainer has acked everything
    history = Evaluator(queue, fast_cfg(group="eval-all", start="0")).run(until_idle_s=0)
    assert history.counted_entries == 10
    assert_same(history.aggregate, aggregate_groups(old))

    fresh = Evaluator(queue, fast_cfg(group="eval-new", start="$"))
    assert fresh.attach()
    queue.put_many(new)
    report = fresh.run(until_idle_s=0)
    assert report.counted_entries == 5
    assert_same(report.aggregate, aggregate_groups(new))
    # the groups keep separate counters; the default group's hash was never written
    assert_same(read_eval_summary(queue, "eval-all"), aggregate_groups(old))
    assert queue.redis.exists(eval_key(queue.run)) == 0


def test_reattach_resumes_and_reset_starts_over(queue: SampleQueue) -> None:
    groups = many_groups(8, seed=8)
    queue.put_many(groups)
    assert Evaluator(queue, fast_cfg()).run(until_idle_s=0).counted_entries == 8
    again = Evaluator(queue, fast_cfg(start="$")).run(until_idle_s=0)  # existing group: start is not used
    assert again.counted_entries == 0
    assert_same(again.aggregate, aggregate_groups(groups))
    redo = Evaluator(queue, fast_cfg()).run(until_idle_s=0, reset=True)
    assert redo.counted_entries == 8
    assert_same(redo.aggregate, aggregate_groups(groups))


def test_undecodable_entry_is_dead_lettered_not_counted(queue: SampleQueue) -> None:
    queue.put_many(many_groups(3, seed=9))
    queue.redis.xadd(queue.keys.samples, {"v": 1, "n": 1, "vmin": 0, "vmax": 0, "data": b"not msgpack"})
    report = Evaluator(queue, fast_cfg()).run(until_idle_s=0)
    assert report.counted_entries == 3 and report.aggregate.total.groups == 3
    assert (report.pending, report.lag) == (0, 0)
    assert len(queue.dead_letters()) == 1


def test_bad_start_and_missing_run_are_refused(queue: SampleQueue, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not '0', '\\$' or a stream id"):
        fast_cfg(start="latest")
    assert fast_cfg(start="1700000000000-5").start == "1700000000000-5"
    with pytest.raises(ConfigError, match="not a sluice run folder"):
        run_eval(tmp_path / "nothing", until_idle_s=0)
    with pytest.raises(ConfigError, match="until_idle_s"):
        run_eval(tmp_path / "nothing", until_idle_s=-1)
