"""Trainer hooks: checked at recipe load, called with each step's metrics, after each step and after each commit of
a real trainer run (a megatron-core trainer process on a tiny Qwen3-MoE, real Redis), and a hook that raises or hangs
is counted and never stops training."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline import plugins
from pipeline.config import load_config
from pipeline.config.hooks import HooksConfig
from pipeline.consumers.trainer.hooks import HookRunner
from pipeline.errors import ConfigError
from pipeline.launch.launcher import prepare_run
from pipeline.net import free_port
from pipeline.producers.producer import read_num_experts
from tests.helpers.train_samples import routed_groups

FIXTURES = Path(__file__).parents[1] / "fixtures"
plugins.activate([FIXTURES])


def _runner(**hooks: object) -> HookRunner:
    runner = HookRunner.from_config(HooksConfig.model_validate(hooks))
    assert runner is not None
    return runner


def _calls(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_hooks_are_checked_at_load() -> None:
    cfg = load_config(overrides=['hooks.metrics=["user_hooks:record_metrics"]',
                                 'hooks.after_commit=["user_hooks:record_commit"]'])
    fields = [r["field"] for r in cfg.plugin_records()]
    assert fields == ["hooks.metrics[0]", "hooks.after_commit[0]"]
    with pytest.raises(ConfigError, match=r"hooks.metrics\[0\] = 'user_hooks:async_hook': is async"):
        load_config(overrides=['hooks.metrics=["user_hooks:async_hook"]'])
    with pytest.raises(ConfigError, match=r"hooks.after_step\[1\] = 'user_hooks:one_argument_hook': must accept "
                                          r"\(step, info: dict\)"):
        load_config(overrides=['hooks.after_step=["user_hooks:record_step", "user_hooks:one_argument_hook"]'])
    with pytest.raises(ConfigError, match=r"hooks.after_commit\[0\] = 'user_hooks:missing'"):
        load_config(overrides=['hooks.after_commit=["user_hooks:missing"]'])
    assert HookRunner.from_config(HooksConfig()) is None


def test_a_raising_hook_is_counted_logged_once_and_the_next_hooks_still_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SLUICE_TEST_HOOK_LOG", str(tmp_path / "hooks.jsonl"))
    runner = _runner(metrics=["user_hooks:raising_hook", "user_hooks:record_metrics"])
    with caplog.at_level(logging.WARNING):
        counters = [runner.on_step(step, {}, {"loss": 0.5, "step": step, "note": "text"}) for step in (1, 2, 3)]
    assert [c["hooks/errors"] for c in counters] == [1.0, 2.0, 3.0]
    assert counters[-1]["hooks/errors/metrics/user_hooks.raising_hook"] == 3.0
    assert counters[-1]["hooks/errors/metrics/user_hooks.record_metrics"] == 0.0
    assert [c["metrics"] for c in _calls(tmp_path / "hooks.jsonl")] == [
        {"loss": 0.5, "step": float(s)} for s in (1, 2, 3)]  # numeric fields only
    warnings = [r for r in caplog.records if "raising_hook" in r.getMessage()]
    assert len(warnings) == 1 and "hook crashed on purpose at step 1" in warnings[0].getMessage()
    assert "user_hooks.py" in warnings[0].getMessage()  # the traceback's last frames


def test_a_hanging_hook_does_not_stall_training() -> None:
    runner = _runner(metrics=["user_hooks:sleepy_hook"], timeout_s=0.1)
    start = time.monotonic()
    counters = [runner.on_step(step, {}, {}) for step in (1, 2, 3)]
    assert time.monotonic() - start < 0.6  # the hook sleeps 1 s per call; three calls waited for would take 3 s
    assert counters[-1]["hooks/errors"] == 1.0 and counters[-1]["hooks/skipped"] == 2.0


STEPS, BATCH_GROUPS, GROUP_SIZE = 4, 2, 2


@pytest.mark.slow
def test_a_trainer_run_calls_every_hook_and_survives_a_raising_one(tmp_path: Path) -> None:
    run_dir, hook_log = tmp_path / "run", tmp_path / "hooks.jsonl"
    cfg = load_config(None, [
        f"run.run_dir={json.dumps(str(run_dir))}", "run.name=hooks", f"trainer.steps={STEPS}",
        f"trainer.batch_groups={BATCH_GROUPS}", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=10",
        "trainer.drain_block_ms=100", "staleness.max_lag=1000", "eval.enabled=false", "queue.archive.enabled=false",
        f"plugins.paths=[{json.dumps(str(FIXTURES))}]",
        'hooks.metrics=["user_hooks:raising_hook", "user_hooks:record_metrics"]',
        'hooks.after_step=["user_hooks:record_step"]', 'hooks.after_commit=["user_hooks:record_commit"]',
    ])
    handle, model_dir = prepare_run(cfg)
    try:
        (run_dir / "engines.json").write_text("[]")
        hf = json.loads((model_dir / "config.json").read_text())
        handle.queue.put_many(routed_groups(np.random.default_rng(0), STEPS * BATCH_GROUPS, GROUP_SIZE, hf["vocab_size"],
                                      hf["num_hidden_layers"], hf["num_experts_per_tok"],
                                      read_num_experts(model_dir)))
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", SLUICE_TEST_HOOK_LOG=str(hook_log))
        with open(run_dir / "trainer-test.log", "ab") as log:
            proc = subprocess.run([sys.executable, "-m", "pipeline.launch.processes", "trainer", str(run_dir)], env=env,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=600, check=False)
        out = (run_dir / "trainer-test.log").read_text()
        assert proc.returncode == 0, out[-3000:]
    finally:
        handle.close(stop_server=True)

    lines = [json.loads(x) for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [1, 2, 3, 4]  # every step ran despite the raising hook
    calls = _calls(hook_log)
    metrics = [c for c in calls if c["kind"] == "metrics"]
    # Each step's metrics arrive, with their step, equal to the line the trainer wrote (the hook counters aside).
    assert [c["step"] for c in metrics] == [1, 2, 3, 4]
    for call, row in zip(metrics, lines, strict=True):
        assert call["metrics"]["step"] == row["step"] and call["metrics"]["loss"] == row["loss"]
    steps = [c for c in calls if c["kind"] == "after_step"]
    assert [(c["step"], c["info"]["samples"], c["info"]["groups"]) for c in steps] == [
        (s, BATCH_GROUPS * GROUP_SIZE, BATCH_GROUPS) for s in (1, 2, 3, 4)]
    commits = [c for c in calls if c["kind"] == "after_commit"]
    assert [(c["step"], Path(c["dir"]).name, c["is_dir"]) for c in commits] == [
        (2, "step-00000002", True), (4, "step-00000004", True)]
    assert all(c["files"] for c in commits)
    # A commit's hook runs after the commit: it follows that step's metrics call.
    order = [(c["kind"], c["step"]) for c in calls]
    assert order.index(("after_commit", 2)) > order.index(("metrics", 2))
    assert order.index(("after_commit", 2)) < order.index(("after_step", 3))
    # The raising hook is counted in every line, and logged once.
    assert [row["hooks/errors"] for row in lines] == [1, 2, 3, 4]
    assert lines[-1]["hooks/errors/metrics/user_hooks.raising_hook"] == 4
    assert out.count("'user_hooks:raising_hook' raised ValueError") == 1
