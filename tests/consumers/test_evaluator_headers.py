"""The stream evaluator counts from entry headers alone: with every payload deleted it still counts every entry
exactly as the samples would be counted, and it sends not one payload read (MGET) to Redis."""

from __future__ import annotations

import numpy as np

from pipeline.config.eval import EvaluatorConfig
from pipeline.consumers.evaluator import Evaluator, aggregate_groups
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample, SampleStatus


def _groups(n: int) -> list[list[Sample]]:
    """Groups over versions 0-3 with every kind of pass verdict (bool, number, none, a string that is no verdict),
    every status, and empty responses."""
    rng = np.random.default_rng(0)
    verdicts: list[object] = [True, False, 1, 0.0, None, "yes"]
    out = []
    for g in range(n):
        group = []
        for i in range(int(rng.integers(1, 5))):
            length = int(rng.integers(0, 6))
            lo = int(rng.integers(0, 3))
            info = {} if (v := verdicts[(g + i) % len(verdicts)]) is None else {"pass": v, "note": "x" * 40}
            group.append(Sample(
                prompt_ids=np.arange(1, 4), response_ids=np.arange(length) + 10,
                rollout_logprobs=np.full(length, -0.5, np.float32),
                token_versions=np.sort(rng.integers(lo, lo + 2, length)).astype(np.int32),
                reward=float(rng.integers(-4, 5)) / 4, reward_info=info, group_id=f"g{g}", prompt_id=f"g{g}",
                status=list(SampleStatus)[int(rng.integers(0, 4))], index=i,
            ))  # fmt: skip
        out.append(group)
    return out


def _mget_calls(queue: SampleQueue) -> int:
    stats = queue.redis.info("commandstats")
    return int(stats.get("cmdstat_mget", {}).get("calls", 0))


def test_the_evaluator_counts_every_entry_from_headers_with_no_payload_fetched(queue: SampleQueue) -> None:
    groups = _groups(24)
    queue.put_many(groups)
    for _, fields in queue.redis.xrange(queue.keys.samples):
        assert queue.redis.delete(fields[b"pkey"].decode()) == 1
    cfg = EvaluatorConfig(block_ms=50, batch_entries=4)
    evaluator = Evaluator(queue, cfg)
    evaluator.attach()
    queue.read_headers(cfg.group, cfg.consumer, count=3)  # held by a previous run of this evaluator: recovered
    before = _mget_calls(queue)

    report = evaluator.run(until_idle_s=0)

    assert _mget_calls(queue) == before  # not one payload read
    assert report.counted_entries == 24 and report.recovered_entries == 3 and report.pending == 0
    assert report.aggregate.summary() == aggregate_groups(groups).summary()
    assert queue.dead_letters() == []
    # The payloads really are gone: a reader that needs them dead-letters every entry.
    queue.create_group("trainer", "0")
    assert queue.read("trainer", "t", count=100) == [] and len(queue.dead_letters()) == 24
