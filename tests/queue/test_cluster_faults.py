"""Exactly once at queue level under Redis Cluster faults: one trial of ``sluice bench cluster-faults`` per case, each
on a fresh real cluster (``pipeline.queue.local_cluster``) with the real SampleQueue, Drainer, Ledger and trim in
processes of their own, and the checks of docs/faults.md, "Redis Cluster faults". The cases cover each kind, and
both a control-tag primary (even seeds) and a payload-only one (odd seeds). A trim that never deleted the trash's
payloads fails the trimmer case (payload keys left, trash not empty); a drain that acked before the commit fails
the trainer case (lost prompts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.benchmarks.cluster_faults import FAULTS, ClusterFaultsParams, run_trial
from pipeline.queue.local_cluster import cluster_binaries

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cluster_binaries() is None, reason="needs redis-server and redis-cli of Redis 7 or later"),
]

# Small trials: 64 prompts in groups of 8 samples, 4 groups a step, a commit every 4 steps. Fewer leave a node fault
# drawn after a commit too little work in flight to land on.
PARAMS = ClusterFaultsParams(groups=64, trials=1, stall_s=20.0, timeout_s=150.0, out="")


def assert_exactly_once(rec: dict[str, Any]) -> None:
    """Every check of a trial, one assertion each, so that a failure names what broke."""
    assert "error" not in rec and "fault_error" not in rec, rec
    assert rec["landed"], f"the fault missed its window: {rec['note']}"
    assert not rec["timed_out"], rec
    assert rec["trained_twice"] == 0, rec
    assert rec["prompts_trained_twice"] == 0, rec
    assert rec["lost"] == 0, (rec["lost_prompts"], rec["lost_groups"])
    assert rec["audit"]["duplicates"] == 0 and rec["audit"]["lost"] == 0, rec["audit"]
    # A group lost with its payload must have handed its prompt back (and so been trained in another group).
    assert rec["dead_lettered_handed_back"] == rec["dead_lettered"], rec["dead_letter_reasons"]
    assert rec["version_readings"] > 0
    assert rec["version_went_back"] == 0, rec["version_max_drop"]
    assert rec["trainer_versions_increasing"]
    assert rec["payload_keys_left"] == 0, rec["payload_keys_left_sample"]
    assert rec["trash_left"] == 0
    assert rec["unacked_left"] == 0 and rec["stream_left"] == 0 and rec["undelivered_left"] == 0, rec
    assert rec["ok"]


@pytest.mark.parametrize(("kind", "seed"), [
    ("trimmer", 0),
    ("master-kill", 0),  # the control tag's primary
    ("master-kill", 1),  # a payload-only primary
    ("failover", 1),
    ("failover-kill", 0),
    ("trainer", 0),
])
def test_a_fault_loses_nothing_trains_nothing_twice_and_leaves_nothing_behind(kind: str, seed: int,
                                                                              tmp_path: Path) -> None:
    rec = run_trial(PARAMS, kind, seed, tmp_path)
    assert_exactly_once(rec)
    if kind == "trimmer":
        # Killed with payload keys in the trash: only the next pass's second move can have deleted them.
        assert rec["details"]["trash_after_kill"] > 0 and rec["restarts"]["trimmer"] == 1
    if kind in ("master-kill", "failover", "failover-kill"):
        assert rec["details"]["control"] == (seed % 2 == 0)
    if kind == "trainer":
        assert rec["restarts"]["trainer"] == 1


def test_every_kind_is_registered_with_what_it_needs() -> None:
    assert set(FAULTS) >= {"trimmer", "master-kill", "failover", "failover-kill", "trainer"}
    assert all(FAULTS[k].replicas == 1 for k in ("failover", "failover-kill"))
    assert FAULTS["master-kill"].replicas == 0
