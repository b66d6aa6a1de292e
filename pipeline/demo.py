"""``sluice demo``: the queue end to end on one machine, until the CPU training recipe lands.

A producer thread streams versioned prompt groups into a run's durable queue; a drain loop applies the staleness
policy, "trains" (advances the policy version every few groups, as weight pushes would), and acks; an archiver
writes Parquet segments beside it. At the end it prints the queue's stats and audit. Samples are synthetic here:
real generation comes with the CPU engine (``pipeline.producers``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from pipeline.consumers.staleness import GroupVersions, StalenessConfig, apply_policy, may_admit
from pipeline.queue.archive import ArchiveReader, Archiver
from pipeline.queue.inspect import audit
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.rundir import open_run
from pipeline.queue.sample import Sample, compact_routing


def _synthetic_group(rng: np.random.Generator, gid: str, version: int, n: int = 4) -> list[Sample]:
    out = []
    for i in range(n):
        p, r = int(rng.integers(8, 16)), int(rng.integers(4, 24))
        out.append(Sample(
            prompt_ids=rng.integers(0, 100, p), response_ids=rng.integers(0, 100, r),
            rollout_logprobs=-rng.random(r).astype(np.float32), token_versions=np.full(r, version, np.int32),
            routed_experts=compact_routing(rng.integers(0, 8, (p + r - 1, 2, 2)), 8),
            reward=float(rng.random() > 0.5), group_id=gid, prompt_id=gid, index=i, producer="demo",
        ))
    return out


def _produce(queue: SampleQueue, groups: int, batch_groups: int, max_lag: int, stop: threading.Event) -> None:
    rng = np.random.default_rng(0)
    for g in range(groups):
        while not may_admit(g, queue.policy_version(), max_lag, batch_groups) and not stop.is_set():
            time.sleep(0.01)  # pacing: a group started now would be too stale to train
        if stop.is_set():
            return
        queue.put(_synthetic_group(rng, f"g{g:05d}", queue.policy_version()))


def run_demo(run_dir: Path, groups: int = 64, batch_groups: int = 4, max_lag: int = 1) -> None:
    console = Console()
    handle = open_run(run_dir=run_dir, create=True)
    queue = handle.queue
    for name in ("trainer", "archive"):
        queue.create_group(name, "0")
    stop = threading.Event()
    archiver = Archiver(queue, run_dir / "archive", segment_samples=64, flush_interval_s=1.0, block_ms=100)
    threads = [threading.Thread(target=_produce, args=(queue, groups, batch_groups, max_lag, stop)),
               threading.Thread(target=archiver.run, kwargs={"stop": stop})]
    for t in threads:
        t.start()
    cfg = StalenessConfig(max_lag=max_lag, action="drop")
    trained = 0
    try:
        while trained < groups:
            entries = queue.read("trainer", "demo-trainer", count=batch_groups, block_ms=1000)
            if not entries:
                continue
            version = queue.policy_version()
            result = apply_policy([GroupVersions.from_samples(e.samples) for e in entries], version, cfg)
            trained += len(entries)
            queue.ack("trainer", [e.id for e in entries])
            queue.redis.incr(queue.keys.policy_version)  # one "weight push" per batch
            queue.log_event("weight_push", version=version + 1)
            m = result.counts.as_metrics()
            console.print(f"version {version:3d}: drained {len(entries)} groups, train {m['staleness/groups_train']:.0f}"
                          f", drop {m['staleness/groups_drop']:.0f}, queue lag {queue.lag('trainer')}")
    finally:
        stop.set()
        for t in threads:
            t.join()
    queue.trim()
    rep = audit(queue)
    console.print(f"[bold]queue[/]: produced {rep.entries_produced} groups, archived "
                  f"{sum(1 for _ in ArchiveReader(run_dir / 'archive').samples())} samples, trimmed "
                  f"{rep.entries_trimmed}, dead-lettered {rep.deadlettered}, policy version {queue.policy_version()}")
    console.print(f"inspect it: sluice queue stats --run-dir {run_dir}")
    handle.close(stop_server=True)
