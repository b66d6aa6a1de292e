"""``sluice bench data-plane`` at toy sizes: every variant drains, decodes and acks every entry, the drain and the
evaluator read the same batch, and the record holds each goal's ratio with its references. Behaviour, not timing:
the ratios are only checked to be finite and positive. Its workers (producer, evaluator, the trainer's gloo ranks)
run under the no-pickle guard."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import psutil
import pytest

from pipeline.benchmarks.data_plane import E2E_VARIANTS, MODES, DataPlaneParams, run_data_plane_bench, summary_lines
from pipeline.queue.local_cluster import cluster_binaries
from tests.helpers.nopickle import ENV_LOG

SITE = Path(__file__).parents[1] / "nopickle_site"
REPO = Path(__file__).parents[2]

TINY = {"samples": 8, "e2e_samples": 12, "group_size": 4, "prompt_tokens": 8, "response_tokens": 24, "layers": 4,
        "topk": 2, "num_experts": 16, "batch_groups": 2, "rounds": 2, "eval_repeats": 2}  # fmt: skip


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


@pytest.mark.skipif(cluster_binaries() is None, reason="needs redis-server and redis-cli of Redis 7 or later")
def test_the_data_plane_bench_measures_every_goal_on_a_cluster_and_a_single_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unpickled = tmp_path / "unpickled.log"
    # The workers inherit this: the guard installs itself in each before its first import.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SITE), str(REPO)]))
    monkeypatch.setenv(ENV_LOG, str(unpickled))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    r = run_data_plane_bench(DataPlaneParams(**TINY), tmp_path)

    assert json.loads((tmp_path / "data-plane.json").read_text()) == json.loads(json.dumps(r))
    assert r["payload_bytes_per_group"] > r["header_bytes_per_group"] > 0

    e2e = r["e2e"]
    assert set(e2e["variants"]) == set(E2E_VARIANTS) and e2e["samples"] == 12
    for name, v in e2e["variants"].items():
        assert len(v["samples_per_s_rounds"]) == 2 and _positive(v["samples_per_s"]), name
        for c in v["checks"]:
            # What the trainer counted, and what the stream and its consumer group say.
            assert c["put"] == c["groups_drained"] == c["stream_length"] == 3 and c["pending"] == 0, (name, c)
            assert c["samples_decoded"] == 12, (name, c)
    # Under rank0 only rank 0 fetches; with readers each rank fetches its own share.
    old, new = (e2e["variants"][v]["fetched_bytes_per_rank"] for v in ("single_rank0", "cluster_readers"))
    assert old[0] > 0 and old[1] == 0 and all(new) and sum(new) == sum(old)  # the same payloads, split

    drain = r["drain"]
    assert set(drain["modes"]) == set(MODES) and drain["samples"] == 8
    for name, m in drain["modes"].items():
        assert _positive(m["critical_s"]) and _positive(m["every_share_ready_s"]), name
        assert sum(m["groups_per_rank"]) == 2 and all(c["pending"] == 0 for c in m["checks"]), name
    # The readers' plan carries keys, rank 0's old broadcast the groups themselves.
    assert drain["modes"]["readers"]["broadcast_bytes"] < drain["modes"]["rank0"]["broadcast_bytes"]

    ev = r["eval"]
    for name, m in ev["modes"].items():
        assert _positive(m["cpu_us_per_sample"]), name
        assert m["samples_counted"] == [8] * 4, name  # every pass counted every sample of the batch

    for part in ("e2e", "drain", "eval"):
        goal = r[part]["goal"]
        assert len(goal["rounds"]) == 2 and all(_positive(x) for x in goal["rounds"]) and _positive(goal["median"])
        assert isinstance(goal["met"], bool) and goal["goal"].split()[0] in (">=", "<=")
    text = "\n".join(summary_lines(r))
    assert text.count("(goal ") == 3 and all(part in text for part in ("(a)", "(b)", "(c)"))

    assert {p.pid for p in psutil.Process().children(recursive=True)} == before  # workers and servers stopped
    assert not unpickled.exists()
