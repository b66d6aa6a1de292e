"""``sluice bench queue``: SampleQueue put+read+ack against raw redis-py XADD/XREADGROUP/XACK of same-size blobs.

Both run against one embedded redis-server with AOF, in alternating rounds, so noise hits both alike. The raw
reference moves pre-encoded payloads of exactly the size sluice's codec produces and does no validation; the ratio
therefore prices everything sluice adds: encoding, decoding and validation, the Lua put with its sequence counter,
the backpressure check and entry bookkeeping.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from pipeline.queue.codec import decode_samples, encode_samples
from pipeline.queue.redis_server import EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample, compact_routing


@dataclass
class QueueBenchParams:
    samples: int = 256
    group_size: int = 8
    prompt_tokens: int = 256
    response_tokens: int = 2048
    layers: int = 48
    topk: int = 8
    num_experts: int = 128
    batch_entries: int = 4
    rounds: int = 5
    appendfsync: str = "everysec"


def make_group(p: QueueBenchParams, rng: np.random.Generator, version: int = 0) -> list[Sample]:
    group_id = f"g{rng.integers(1 << 62)}"
    out = []
    for i in range(p.group_size):
        r = p.response_tokens
        out.append(Sample(
            prompt_ids=rng.integers(0, 150_000, p.prompt_tokens, dtype=np.int32),
            response_ids=rng.integers(0, 150_000, r, dtype=np.int32),
            rollout_logprobs=-rng.random(r, dtype=np.float32) * 5,
            token_versions=np.full(r, version, dtype=np.int32),
            routed_experts=compact_routing(
                rng.integers(0, p.num_experts, (p.prompt_tokens + r - 1, p.layers, p.topk), dtype=np.int32),
                p.num_experts),
            reward=float(rng.random()), group_id=group_id, prompt_id=group_id, index=i, producer="bench",
        ))
    return out


def _raw_round(client: redis.Redis, key: str, blobs: list[bytes], p: QueueBenchParams) -> float:
    client.delete(key)
    client.xgroup_create(key, "trainer", id="0", mkstream=True)
    gc.collect()
    t0 = time.perf_counter()
    for i in range(0, len(blobs), p.batch_entries):
        pipe = client.pipeline(transaction=False)
        for b in blobs[i : i + p.batch_entries]:
            pipe.xadd(key, {"v": 1, "n": p.group_size, "vmin": 0, "vmax": 0, "data": b})
        pipe.execute()
    got = 0
    while got < len(blobs):
        reply = client.xreadgroup("trainer", "c", {key: ">"}, count=p.batch_entries)
        ids = [eid for eid, _ in reply[0][1]]
        client.xack(key, "trainer", *ids)
        got += len(ids)
    dt = time.perf_counter() - t0
    client.delete(key)
    return dt


def _sluice_round(queue: SampleQueue, groups: list[list[Sample]], p: QueueBenchParams) -> float:
    queue.redis.delete(queue.keys.samples, queue.keys.produced)
    queue.create_group("trainer", "0")
    gc.collect()
    t0 = time.perf_counter()
    for i in range(0, len(groups), p.batch_entries):
        queue.put_many(groups[i : i + p.batch_entries])
    got = 0
    while got < len(groups):
        entries = queue.read("trainer", "c", count=p.batch_entries)
        queue.ack("trainer", [e.id for e in entries])
        got += len(entries)
    dt = time.perf_counter() - t0
    queue.redis.delete(queue.keys.samples, queue.keys.produced)
    return dt


def run_queue_bench(p: QueueBenchParams, folder: Path | None = None) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    n_groups = max(1, p.samples // p.group_size)
    groups = [make_group(p, rng) for _ in range(n_groups)]
    blobs = [encode_samples(g) for g in groups]
    sample_bytes = sum(len(b) for b in blobs) / (n_groups * p.group_size)

    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        encode_samples(groups[0])
    enc_us = (time.perf_counter() - t0) / (reps * p.group_size) * 1e6
    t0 = time.perf_counter()
    for _ in range(reps):
        decode_samples(blobs[0])
    dec_us = (time.perf_counter() - t0) / (reps * p.group_size) * 1e6

    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", appendfsync=p.appendfsync).start()  # type: ignore[arg-type]
        try:
            client = server.client()
            # A background AOF rewrite forks and rewrites the whole file at a moment that depends on history, which
            # would land on one side of a round at random; turning it off here makes rounds comparable.
            client.config_set("auto-aof-rewrite-percentage", 0)
            queue = SampleQueue(client, "bench", capacity=n_groups + 1)
            version = client.info("server")["redis_version"]
            raw_t, sluice_t = [], []
            for r in range(p.rounds):
                # Alternate which goes first, so a drift in the machine's load or the AOF's size hits both alike.
                if r % 2 == 0:
                    raw_t.append(_raw_round(client, "bench:raw", blobs, p))
                    sluice_t.append(_sluice_round(queue, groups, p))
                else:
                    sluice_t.append(_sluice_round(queue, groups, p))
                    raw_t.append(_raw_round(client, "bench:raw", blobs, p))
        finally:
            server.stop()
    n = n_groups * p.group_size
    raw_s, sluice_s = statistics.median(raw_t), statistics.median(sluice_t)
    mb = n * sample_bytes / 1e6
    return {
        "benchmark": "queue",
        "params": asdict(p),
        "redis_version": version,
        "sample_bytes": round(sample_bytes),
        "raw": {"samples_per_s": n / raw_s, "MB_per_s": mb / raw_s, "seconds": raw_t},
        "sluice": {"samples_per_s": n / sluice_s, "MB_per_s": mb / sluice_s, "seconds": sluice_t},
        # The median of per-round ratios: each pair ran back to back, so their ratio cancels most shared noise.
        "ratio": statistics.median(r / s for r, s in zip(raw_t, sluice_t)),
        "goal": ">= 0.8",
        "codec_us_per_sample": {"encode": enc_us, "decode": dec_us},
    }
