"""TensorBoard files beside the JSONL metrics, read back with TensorBoard's own event reader."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pipeline.config import load_config
from pipeline.config.metrics import MetricsConfig
from pipeline.errors import ConfigError
from pipeline.metrics import check_metrics_config, open_sinks, scalars
from tests.helpers.tb import read_scalars
from tests.helpers.wandb_log import read_history


def test_rows_become_tensorboard_scalars_at_their_step(tmp_path: Path) -> None:
    sinks = open_sinks(tmp_path, "trainer", MetricsConfig())
    rows = [{"step": s, "time": 1000.0 + s, "reward_mean": s / 10, "time/drain_s": 0.5, "lag_max": s % 3,
             "pass_at_k": {"4": 0.25 * s}, "note": "text is no scalar", "nan": float("nan"), "flag": True}
            for s in range(1, 8)]
    for row in rows:
        sinks.add(row, row["step"])
    sinks.close()
    series = read_scalars(tmp_path / "tensorboard" / "trainer")
    assert set(series) == {"reward_mean", "time/drain_s", "lag_max", "pass_at_k/4", "flag"}
    assert series["reward_mean"] == pytest.approx({s: s / 10 for s in range(1, 8)})
    assert series["pass_at_k/4"] == pytest.approx({s: 0.25 * s for s in range(1, 8)})


def test_prefix_and_skipped_keys() -> None:
    assert dict(scalars({"version": 3, "step": 1, "time": 2.0, "greedy_pass1": 0.5}, "heldout/")) == {
        "heldout/greedy_pass1": 0.5}


def test_tensorboard_off_writes_nothing(tmp_path: Path) -> None:
    sinks = open_sinks(tmp_path, "trainer", MetricsConfig(tensorboard=False))
    sinks.add({"reward_mean": 1.0}, 1)
    sinks.close()
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_asked_for_but_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    cfg = load_config(None, ["metrics.wandb=true"])
    with pytest.raises(ConfigError, match="pip install wandb"):
        check_metrics_config(cfg.metrics)
    assert json.loads(json.dumps(cfg.model_dump(mode="json")))["metrics"]["wandb_mode"] == "offline"


def test_wandb_offline_run_holds_every_step(tmp_path: Path) -> None:
    """The W&B sink in offline mode, as `[metrics] wandb = true` runs it: every row lands in the run's record log at
    its step, nested keys flattened. In a child process, as in a run: W&B's service process goes with it."""
    code = (
        "import sys; from pathlib import Path; from pipeline.metrics import MetricsConfig, open_sinks\n"
        "s = open_sinks(Path(sys.argv[1]), 'trainer', MetricsConfig(wandb=True, tensorboard=False), 'wb-test')\n"
        "for step in range(1, 7):\n"
        "    s.add({'step': step, 'reward_mean': step / 10, 'loss': {'policy': -step}, 'note': 'text'}, step)\n"
        "s.close()\n"
    )
    env = dict(os.environ, WANDB_SILENT="true")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, timeout=120, capture_output=True)
    [run_file] = (tmp_path / "wandb").rglob("offline-run-*/run-*.wandb")
    rows = read_history(run_file)
    assert [r["_step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["reward_mean"] for r in rows] == pytest.approx([s / 10 for s in range(1, 7)])
    assert [r["loss/policy"] for r in rows] == [-s for s in range(1, 7)]
    assert not any("note" in r for r in rows)
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
