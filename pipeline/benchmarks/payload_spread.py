"""Where a queued group's bytes land once entries are split into a header and a payload (docs/queue.md, "Entries").

Two figures, each against its goal:

- **control bytes per group**: what one queued group writes into the run's own slot (the node every script and
  MULTI of the run goes to), for a GRPO group of 8 samples at 48 layers x top-8 of 128 experts and 256 prompt +
  2,048 response tokens (2,304 tokens, 2,303 routed rows a sample), through the real encoder: the stream entry's
  fields as ``SampleQueue.put`` writes them, and, on a server, ``MEMORY USAGE`` of the stream per entry. Goal: at most
  16 KB. The payload's bytes are printed beside them.
- **payload bytes per primary** of a Redis Cluster after 2,000 groups put with 6 shard tags: each primary's share
  against the mean (``STRLEN`` of every payload key on it). Goal: within 15%. The groups are small (their sizes vary
  from group to group) so that 2,000 of them fit a test machine; what is measured is where they land.

``python -m pipeline.benchmarks.payload_spread [--redis-url URL] [--groups N] [--shards N] [--json]``: without
``--redis-url`` an embedded server measures the control bytes, and the spread is skipped (it needs a cluster:
``redis+cluster://host:port,...``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from redis.cluster import RedisCluster

from pipeline.queue.connection import RedisClient, connect
from pipeline.queue.keys import payload_prefix, shard_tag
from pipeline.queue.redis_server import EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue, encode_entry
from pipeline.queue.sample import Sample, compact_routing

CONTROL_GOAL_BYTES = 16 * 1024
SPREAD_GOAL = 0.15


def synthetic_group(rng: np.random.Generator, group_id: str, *, size: int = 8, prompt: int = 256,
                    response: int = 2048, layers: int = 48, topk: int = 8, experts: int = 128) -> list[Sample]:
    """A GRPO group: one prompt and its routing rows shared by every sample, uniform top-k ids after it (order
    kept within a row, as an engine returns them)."""
    prompt_ids = rng.integers(0, 150_000, prompt, dtype=np.int32)
    prompt_rows = _rows(rng, prompt, layers, topk, experts)
    out = []
    for i in range(size):
        routed = np.concatenate([prompt_rows, _rows(rng, response - 1, layers, topk, experts)])
        out.append(Sample(
            prompt_ids=prompt_ids, response_ids=rng.integers(0, 150_000, response, dtype=np.int32),
            rollout_logprobs=-rng.random(response, dtype=np.float32) * 5,
            token_versions=np.zeros(response, dtype=np.int32), routed_experts=compact_routing(routed, experts),
            reward=float(rng.integers(0, 2)), reward_info={"pass": bool(i % 2)}, group_id=group_id,
            prompt_id=f"prompt-{group_id[:8]}", index=i, producer="producer-0", engine="http://10.0.0.1:30000",
            finish_reason="length",
        ))  # fmt: skip
    return out


def _rows(rng: np.random.Generator, n: int, layers: int, topk: int, experts: int) -> np.ndarray:
    # argsort of uniform keys: k distinct experts per row, in random order, as a router's top-k is.
    return np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :topk].astype(np.int32)


def _field_bytes(fields: dict[str, Any]) -> int:
    """The bytes of an entry's field names and values as Redis receives them."""
    return sum(len(k) + len(v if isinstance(v, bytes) else str(v).encode()) for k, v in fields.items())


def control_bytes(client: RedisClient | None = None, groups: int = 4, seed: int = 0) -> dict[str, Any]:
    """Header bytes per group for the 48 x top-8 x 2,304-token shape: from the encoder alone, and (given a server)
    as ``MEMORY USAGE`` of a stream holding ``groups`` such entries."""
    rng = np.random.default_rng(seed)
    group = synthetic_group(rng, uuid.UUID(int=int(rng.integers(1 << 62))).hex)
    fields, payload = encode_entry(group)
    fields = {**fields, "seq": 1_000_000, "pkey": payload_prefix(shard_tag("a-run-name", 5)) + "1000000"}
    out: dict[str, Any] = {"shape": "8 samples x (256 + 2048 tokens), 48 layers x top-8 of 128",
                           "header_field_bytes": _field_bytes(fields), "head_bytes": len(fields["head"]),
                           "payload_bytes": len(payload), "goal_bytes": CONTROL_GOAL_BYTES}
    if client is not None:
        queue = SampleQueue(client, f"bench-control-{uuid.uuid4().hex[:8]}", capacity=groups + 1)
        try:
            queue.put_many([synthetic_group(rng, uuid.uuid4().hex) for _ in range(groups)])
            usage = int(client.execute_command("MEMORY", "USAGE", queue.keys.samples, "SAMPLES", 0) or 0)
            out["stream_memory_per_group"] = usage / groups
        finally:
            _drop(queue)
    return out


def small_group(rng: random.Random, group_id: str) -> list[Sample]:
    """A group of 4 with sizes that vary from group to group (24-88 prompt, 16-240 response tokens, 8 layers x
    top-4 of 64): kilobytes, not megabytes."""
    prompt, nrng = rng.randint(24, 88), np.random.default_rng(rng.getrandbits(32))
    out = []
    for i in range(4):
        r = rng.randint(16, 240)
        out.append(Sample(
            prompt_ids=nrng.integers(0, 50_000, prompt, dtype=np.int32),
            response_ids=nrng.integers(0, 50_000, r, dtype=np.int32),
            rollout_logprobs=-nrng.random(r, dtype=np.float32), token_versions=np.zeros(r, dtype=np.int32),
            routed_experts=compact_routing(_rows(nrng, prompt + r - 1, 8, 4, 64), 64), reward=float(i % 2),
            group_id=group_id, prompt_id=group_id, index=i, producer="producer-0",
        ))  # fmt: skip
    return out


def payload_spread(client: RedisCluster, groups: int = 2000, shards: int = 6, seed: int = 0,
                   batch: int = 50) -> dict[str, Any]:
    """Put ``groups`` small groups on a fresh run with ``shards`` shard tags; each primary's payload bytes."""
    rng = random.Random(seed)
    queue = SampleQueue(client, f"bench-spread-{uuid.uuid4().hex[:8]}", capacity=groups + 1, payload_shards=shards)
    try:
        for start in range(0, groups, batch):
            queue.put_many([small_group(rng, uuid.UUID(int=rng.getrandbits(128)).hex)
                            for _ in range(min(batch, groups - start))])
        per_primary: dict[str, int] = {}
        for node in client.get_primaries():
            server = client.get_redis_connection(node)
            keys = list(server.scan_iter(match=f"sluice:{{{queue.run}/*}}:payload:*", count=1000))
            pipe = server.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(k)
            per_primary[node.name] = sum(pipe.execute()) if keys else 0
        mean = statistics.fmean(per_primary.values())
        tags_per_primary: dict[str, int] = {}
        for tag in queue.shard_tags():
            name = client.get_node_from_key(payload_prefix(tag)).name
            tags_per_primary[name] = tags_per_primary.get(name, 0) + 1
        return {"groups": groups, "shards": shards, "payload_bytes_per_primary": per_primary,
                "tags_per_primary": tags_per_primary, "mean": mean,
                "max_deviation": max(abs(b - mean) / mean for b in per_primary.values()), "goal": SPREAD_GOAL,
                "control_stream_bytes": int(client.execute_command("MEMORY", "USAGE", queue.keys.samples,
                                                                   "SAMPLES", 0) or 0)}
    finally:
        _drop(queue)


def _drop(queue: SampleQueue) -> None:
    keys = [queue.keys.samples, queue.keys.produced, queue.keys.payload_shards,
            queue.keys.producer_payloads("producer-0")]
    pkeys = [f[b"pkey"].decode() for _, f in queue.redis.xrange(queue.keys.samples) if b"pkey" in f]
    for k in keys + pkeys:
        queue.redis.delete(k)


def report_lines(control: dict[str, Any], spread: dict[str, Any] | None) -> Sequence[str]:
    lines = [f"control node per group ({control['shape']}): {control['header_field_bytes']:,} B of stream fields "
             f"(header {control['head_bytes']:,} B)"
             + (f", {control['stream_memory_per_group']:,.0f} B of stream memory"
                if "stream_memory_per_group" in control else "")
             + f"; goal <= {control['goal_bytes']:,} B. The payload, on its shard: {control['payload_bytes']:,} B"]
    if spread is None:
        lines.append("payload spread: skipped (give --redis-url redis+cluster://... to measure it)")
    else:
        lines.append(f"payload bytes per primary after {spread['groups']:,} groups with {spread['shards']} shard tags "
                     f"(mean {spread['mean']:,.0f} B; largest deviation {spread['max_deviation']:.1%}, goal within "
                     f"{spread['goal']:.0%}):")
        for name, b in sorted(spread["payload_bytes_per_primary"].items()):
            lines.append(f"  {name}: {b:,} B ({b / spread['mean'] - 1:+.1%}), "
                         f"{spread['tags_per_primary'].get(name, 0)} tags")
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m pipeline.benchmarks.payload_spread", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", help="a server or cluster; none: an embedded server, and no spread")
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = None if args.redis_url else EmbeddedRedis(Path(tmp) / "redis").start()
        try:
            client = connect(args.redis_url or server.url)  # type: ignore[union-attr]
            control = control_bytes(client)
            spread = payload_spread(client, args.groups, args.shards) if isinstance(client, RedisCluster) else None
            client.close()
        finally:
            if server is not None:
                server.stop()
    result = {"control": control, "spread": spread}
    print(json.dumps(result, indent=1) if args.json else "\n".join(report_lines(control, spread)))
    return result


if __name__ == "__main__":
    main()
