"""``sluice bench queue --e2e`` on tiny shapes: every variant moves every entry from its producer process to its
consumer process, which acks them all, and the benchmark leaves no process or key behind. Behaviour, not timing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest

from pipeline.benchmarks.queue_e2e import VARIANTS, QueueE2EParams, record_engine_routing, run_queue_e2e_bench
from pipeline.queue.connection import connect

TINY = {"samples": 16, "group_size": 4, "prompt_tokens": 8, "response_tokens": 32, "layers": 4, "topk": 2,
        "num_experts": 16, "batch_entries": 3, "rounds": 2}  # fmt: skip


def _assert_every_entry_delivered(source: dict[str, Any], groups: int, rounds: int) -> None:
    assert set(source["variants"]) == set(VARIANTS)
    for name, v in source["variants"].items():
        assert v["samples_per_s"] > 0, name
        assert len(v["checks"]) == rounds, name
        for c in v["checks"]:
            # What the consumer counted, and what the stream and its consumer group say.
            assert c["put"] == c["stream_length"] == c["received"] == c["acked"] == groups, (name, c)
            assert c["pending"] == 0 and c["last_delivered_is_last"], (name, c)
        assert v["all_delivered_and_acked"], name
        assert v["payload_bytes_per_sample"] > 0 and v["redis_memory_per_sample"]["memory_usage"] > 0, name
    for ratio in source["ratios"].values():
        assert len(ratio["rounds"]) == rounds and ratio["median"] > 0
    assert {"compact", "plain"} <= set(source["codec_us_per_sample"])


def _children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def test_e2e_bench_delivers_and_acks_every_entry(redis_url: str, tmp_path: Path) -> None:
    before = {p.pid for p in _children()}
    r = run_queue_e2e_bench(QueueE2EParams(**TINY, redis_url=redis_url), tmp_path)

    assert list(r["sources"]) == ["synthetic"]
    s = r["sources"]["synthetic"]
    _assert_every_entry_delivered(s, groups=4, rounds=2)
    # Compact routing stores the group's shared prompt rows once, so it is smaller even for uniform random ids.
    assert s["routing_bytes_per_sample"]["compact"] < s["routing_bytes_per_sample"]["plain"]
    assert s["variants"]["sluice_compact"]["payload_bytes_per_sample"] < \
        s["variants"]["sluice_plain"]["payload_bytes_per_sample"]
    assert json.loads((tmp_path / "queue-e2e.json").read_text())["sources"]["synthetic"]["samples"] == 16

    assert {p.pid for p in _children()} == before
    client = connect(redis_url)
    try:
        assert not list(client.scan_iter(match="sluice:{bench-e2e-*"))
    finally:
        client.close()


def test_e2e_bench_on_its_own_server_with_engine_routing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    before = {p.pid for p in _children()}
    # The engine shape is the recipe's, so one recording serves both the measured source and the recipe-shape bytes.
    p = QueueE2EParams(**{**TINY, "num_experts": 8, "topk": 2, "rounds": 1}, routing="engine", engine_layers=2,
                       engine_prompt_tokens=4, engine_response_tokens=12, engine_samples=16)
    r = run_queue_e2e_bench(p, tmp_path)

    assert r["server"] == "embedded"
    s = r["sources"]["engine"]
    _assert_every_entry_delivered(s, groups=4, rounds=1)
    assert s["routing_bytes_per_sample"]["uint8_array"] == (4 + 12 - 1) * 2 * 2
    assert r["recipe_shape"]["routing_ratio"] > 0
    cache = next((tmp_path / "cache").glob("*.npz"))
    again, info = record_engine_routing(tmp_path / "cache", 2, 8, 2, 4, 4, 12)
    assert again == cache and info["cached"]

    assert {p.pid for p in _children()} == before  # the engine and the embedded redis-server were stopped
