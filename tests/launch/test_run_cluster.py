"""``sluice run`` on a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``) with an external redis-server:
custom resources put the engine, producer and archiver on the head and the trainer on the worker; the worker node is
removed mid-run and a new one added; the run recovers on the new node with nothing lost, nothing trained twice, and
a policy version that never goes back."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeline.consumers.trainer.audit import audit_trainer
from pipeline.queue.redis_server import EmbeddedRedis
from pipeline.queue.rundir import open_run
from tests.helpers.runprocs import alive, run_processes

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
ROOT = Path(__file__).parents[2]
STEPS = 14


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "trainer.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _placements(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "logs" / "placements.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [x for x in lines if x["name"] == name]


def test_two_node_run_recovers_when_the_trainer_node_is_removed_and_another_joins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.cluster_utils import Cluster

    server = EmbeddedRedis(tmp_path / "redis", appendfsync="everysec").start()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))  # where the cluster writes its address, not the shared /tmp/ray
    (ray_tmp / "ray").mkdir()
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 4, "resources": {"rollout": 8}, "include_dashboard": False, "temp_dir": str(ray_tmp / "ray")})
        worker = cluster.add_node(num_cpus=2, resources={"train": 2})
        cluster.wait_for_nodes()
    except BaseException:
        server.stop()  # nothing else of the test started yet
        raise
    head_id = cluster.head_node.node_id
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "recipes/cpu-moe.toml", "--run-dir", str(run_dir),
           "--steps", str(STEPS), "--ray-address", cluster.address,
           "--set", f"queue.redis_url={json.dumps(server.url)}",
           "--set", "ray.engine.resources={rollout=1}", "--set", "ray.producer.resources={rollout=1}",
           "--set", "ray.archiver.resources={rollout=1}", "--set", "ray.trainer.resources={train=1}",
           "--set", "trainer.checkpoint_every=4", "--set", "trainer.batch_groups=4",
           "--set", "producer.concurrency=2", "--set", "warmstart.enabled=false",
           "--set", "eval.heldout.enabled=false", "--set", "eval.enabled=false",
           "--set", "filters.zero_variance=false"]
    # The launcher, a driver of the cluster, must use the auth mode the cluster was started with: this process's.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = tmp_path / "launcher.log"
    out = open(log, "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    started: dict = {}
    try:
        deadline = time.monotonic() + 300
        while len(_rows(run_dir)) < 6:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no training progress:\n" + log.read_text()[-3000:]
            started.update(run_processes(run_dir))
            time.sleep(0.2)
        # Placed where the resources are: rollout on the head, the trainer on the worker.
        assert [p["node_id"] for p in _placements(run_dir, "trainer-0")] == [worker.node_id]
        for name in ("engine-0", "producer-0", "archiver"):
            assert [p["node_id"] for p in _placements(run_dir, name)] == [head_id], name

        cluster.remove_node(worker)  # the trainer's node fails
        time.sleep(3)  # long enough for the supervisor to see its trainer lost and wait for a place to restart it
        rejoined = cluster.add_node(num_cpus=2, resources={"train": 2})
        while proc.poll() is None and time.monotonic() < deadline + 600:
            started.update(run_processes(run_dir))
            time.sleep(0.2)
        assert proc.wait(timeout=5) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()
        cluster.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)

    try:
        trainer = _placements(run_dir, "trainer-0")
        assert [p["node_id"] for p in trainer] == [worker.node_id, rejoined.node_id], trainer
        assert "restarting the trainer group" in log.read_text()
        handle = open_run(run_dir=run_dir, redis_url=server.url)
        try:
            audit = audit_trainer(handle.queue, run_dir)
            print("audit:", audit)
            assert audit.committed_step == STEPS and audit.lost == 0 and audit.duplicates == 0 and audit.trained > 0
            events = handle.queue.events()
            assert [e["kind"] for e in events].count("resume") == 2  # the first start and the one on the new node
            pushed = [int(e["version"]) for e in events if e["kind"] == "weight_push"]
            assert pushed == sorted(pushed) and len(set(pushed)) == len(pushed)  # the version never went back
            assert handle.queue.policy_version() >= STEPS
        finally:
            handle.close()
    finally:
        server.stop()
    assert [p.pid for p in started.values() if alive(p)] == []
