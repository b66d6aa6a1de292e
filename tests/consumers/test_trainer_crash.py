"""kill -9 of the trainer during a step and during a checkpoint save: the restarted trainer loses no sample and
trains none twice. Real megatron-core trainer process, real Redis with AOF, a tiny Qwen3-MoE."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.consumers.megatron.checkpoint import read_checkpoint_meta
from pipeline.consumers.trainer.audit import audit_trainer
from pipeline.launch.launcher import prepare_run
from pipeline.net import free_port
from pipeline.producers.producer import read_num_experts
from pipeline.queue.archive import parse_id
from tests.helpers.train_samples import routed_groups

pytestmark = pytest.mark.slow

STEPS, BATCH_GROUPS, GROUP_SIZE = 8, 2, 4


def _start_trainer(run_dir: Path, preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    log = open(run_dir / "trainer-test.log", "ab")  # noqa: SIM115 - the child keeps it
    # Own process group: the checkpoint writer is a child of the trainer, and a crash takes both.
    return subprocess.Popen([sys.executable, "-m", "pipeline.launch.processes", "trainer", str(run_dir)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec_fn)


def _kill_9(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait(predicate, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early with {proc.returncode}")
        time.sleep(0.005)
    raise AssertionError("timed out waiting for the trainer")


def _metric_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics" / "trainer.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_kill_9_during_step_and_during_checkpoint_loses_nothing_and_trains_nothing_twice(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(None, [
        f"run.run_dir={json.dumps(str(run_dir))}", "run.name=crash", f"trainer.steps={STEPS}",
        f"trainer.batch_groups={BATCH_GROUPS}", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=10",
        "trainer.drain_block_ms=100", "staleness.max_lag=1000", "eval.enabled=false", "queue.archive.enabled=false",
        "queue.appendfsync=always", "queue.claim_idle_ms=1000",
    ])
    handle, model_dir = prepare_run(cfg)
    try:
        (run_dir / "engines.json").write_text("[]")
        hf = json.loads((model_dir / "config.json").read_text())
        groups = routed_groups(np.random.default_rng(0), STEPS * BATCH_GROUPS + 3, GROUP_SIZE, hf["vocab_size"],
                         hf["num_hidden_layers"], hf["num_experts_per_tok"], read_num_experts(model_dir))
        ids = handle.queue.put_many(groups)

        # 1. Killed in the middle of training, between commits (the last commit was step 2).
        proc = _start_trainer(run_dir)
        _wait(lambda: max(_metric_steps(run_dir), default=0) >= 3, 300, proc)
        _kill_9(proc)
        assert (run_dir / "checkpoints" / "step-00000002").is_dir()
        assert not (run_dir / "checkpoints" / "step-00000004").exists()

        # 2. Killed while it writes a checkpoint: the folder is still `.tmp`, not renamed, so not committed.
        proc = _start_trainer(run_dir)
        _wait(lambda: any(p.name.endswith(".tmp") for p in (run_dir / "checkpoints").glob("step-*")), 300, proc)
        _kill_9(proc)
        torn = [p.name for p in (run_dir / "checkpoints").glob("step-*.tmp")]
        assert torn, "the kill landed after the rename; the test meant to hit the save"

        # 3. A clean restart finishes the job.
        proc = _start_trainer(run_dir)
        assert proc.wait(timeout=600) == 0, (run_dir / "trainer-test.log").read_text()[-3000:]
        assert len(_metric_steps(run_dir)) > STEPS  # some steps really were done twice, and rolled back

        audit = audit_trainer(handle.queue, run_dir)
        print("audit after two kill -9:", audit)
        assert audit.committed_step == STEPS
        assert audit.duplicates == 0 and audit.lost == 0
        assert audit.trained == STEPS * BATCH_GROUPS * GROUP_SIZE and audit.pending == 0

        # Independent check: the ledger files against the stream, with no sluice code in between.
        committed = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*")
                        if not p.name.endswith(".tmp"))
        lines = [row for p in sorted((run_dir / "ledger").glob("seg-*.parquet"))
                 if int(p.stem.split("-")[1]) <= committed for row in pq.read_table(p).to_pylist()]
        counts = Counter(row["sample_id"] for row in lines)
        assert set(counts.values()) == {1}
        raw = handle.queue.redis.xinfo_groups(handle.queue.keys.samples)
        last = parse_id(next(g for g in raw if g["name"] == b"trainer")["last-delivered-id"].decode())
        acked = [s.sample_id for i, g in zip(ids, groups) if parse_id(i) <= last for s in g]
        assert set(acked) == set(counts) and len(acked) == STEPS * BATCH_GROUPS * GROUP_SIZE
        assert handle.queue.redis.xpending(handle.queue.keys.samples, "trainer")["pending"] == 0
        meta = read_checkpoint_meta(run_dir / "checkpoints" / f"step-{STEPS:08d}")
        assert meta["step"] == STEPS and meta["policy_version"] == handle.queue.policy_version()
    finally:
        handle.close(stop_server=True)
