"""The run folder's readers (``pipeline.rundir``) on the files a real run leaves: a last line cut short by a killed
writer, a step written twice because the trainer redid it after a restart, held-out lines among the stream
evaluator's. And the layout itself: the paths every process writes to stay where they were."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from pipeline import rundir
from pipeline.rundir import (
    latest_checkpoint,
    list_snapshots,
    read_heldout,
    read_jsonl,
    run_checkpoints,
    trainer_rows,
)


def _write(path: Path, lines: list[dict[str, Any]], tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in lines) + tail)
    return path


def test_read_jsonl_skips_a_line_cut_short_by_a_killed_writer(tmp_path: Path) -> None:
    path = _write(tmp_path / "metrics" / "producer-0.jsonl", [{"n": 1}, {"n": 2}], tail='{"n": 3, "samp')
    assert read_jsonl(path) == [{"n": 1}, {"n": 2}]


def test_read_jsonl_skips_blank_lines_and_a_missing_file_is_empty(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl", [{"n": 1}], tail="\n   \n")
    assert read_jsonl(path) == [{"n": 1}]
    assert read_jsonl(tmp_path / "nothing.jsonl") == []


def test_trainer_rows_a_step_redone_after_a_restart_keeps_its_last_line(tmp_path: Path) -> None:
    # Steps 1-3, a crash after step 3's line but before its checkpoint; the restart redoes steps 3 and 4.
    path = _write(rundir.trainer_metrics_path(tmp_path), [
        {"step": 1, "reward_mean": 0.1, "time": 1.0},
        {"step": 2, "reward_mean": 0.2, "time": 2.0},
        {"step": 3, "reward_mean": 0.3, "time": 3.0, "attempt": "first"},
        {"step": 3, "reward_mean": 0.35, "time": 9.0, "attempt": "redone"},
        {"step": 4, "reward_mean": 0.4, "time": 10.0},
    ], tail='{"step": 5, "rew')
    rows = trainer_rows(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # in step order, once each, the cut line gone
    assert rows[2]["attempt"] == "redone" and rows[2]["reward_mean"] == 0.35 and rows[2]["time"] == 9.0


def test_trainer_rows_orders_by_step_and_ignores_lines_without_one(tmp_path: Path) -> None:
    path = _write(tmp_path / "trainer.jsonl", [{"step": 2, "x": "b"}, {"event": "resume"}, {"step": 1, "x": "a"}])
    assert [r["x"] for r in trainer_rows(path)] == ["a", "b"]


def test_read_heldout_by_version_last_line_wins_among_stream_lines(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = _write(rundir.eval_metrics_path(tmp_path), [
        {"kind": "eval", "version": 0, "pass_rate": 0.5},
        {"kind": "heldout", "version": 5, "greedy_pass1": 0.2},
        {"kind": "heldout", "version": 0, "greedy_pass1": 0.1},
        {"kind": "eval", "version": 5, "pass_rate": 0.9},
        {"kind": "heldout", "version": 5, "greedy_pass1": 0.25, "source": "checkpoint"},
        {"kind": "heldout", "version": "7", "greedy_pass1": 1.0},  # not an integer version: not a held-out line
        {"note": "mentions heldout", "version": 9},
    ], tail='{"kind": "heldout", "version": 10, "greedy')
    with caplog.at_level(logging.WARNING, logger="pipeline.rundir"):
        got = read_heldout(path)
    assert list(got) == [0, 5]  # by version, ascending, whatever the file's order
    assert got[0]["greedy_pass1"] == 0.1
    assert got[5]["greedy_pass1"] == 0.25 and got[5]["source"] == "checkpoint"  # the last line of version 5
    assert all(d["kind"] == "heldout" for d in got.values())
    assert "not a complete JSON line" in caplog.text
    assert read_heldout(tmp_path / "none.jsonl") == {}


def test_checkpoints_complete_ones_only_oldest_first(tmp_path: Path) -> None:
    assert run_checkpoints(tmp_path) == [] and latest_checkpoint(tmp_path) is None
    for step in (10, 2, 30):
        rundir.checkpoint_path(tmp_path, step).mkdir(parents=True)
    (rundir.checkpoints_dir(tmp_path) / "step-00000040.tmp").mkdir()  # a save cut short
    (rundir.checkpoints_dir(tmp_path) / "step-00000050").touch()  # not a folder
    assert [p.name for p in run_checkpoints(tmp_path)] == ["step-00000002", "step-00000010", "step-00000030"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000030"


def test_snapshots_complete_ones_by_version(tmp_path: Path) -> None:
    root = rundir.snapshots_dir(tmp_path)
    for v in (12, 3):
        (root / rundir.snapshot_name(v)).mkdir(parents=True)
    (root / "v00000020.tmp").mkdir()
    assert list_snapshots(root) == [(3, root / "v00000003"), (12, root / "v00000012")]
    assert list_snapshots(tmp_path / "absent") == []


def test_the_layout_is_where_it_always_was(tmp_path: Path) -> None:
    r = tmp_path
    assert rundir.config_path(r) == r / "config.json"
    assert rundir.run_file_path(r) == r / "run.json"
    assert rundir.engines_path(r) == r / "engines.json"
    assert rundir.trainer_metrics_path(r) == r / "metrics" / "trainer.jsonl"
    assert rundir.producer_metrics_path(r, "producer-1") == r / "metrics" / "producer-1.jsonl"
    assert rundir.warmstart_metrics_path(r) == r / "metrics" / "warmstart.jsonl"
    assert rundir.eval_metrics_path(r) == r / "eval" / "metrics.jsonl"
    assert rundir.eval_metrics_path(r, "side") == r / "eval" / "metrics-side.jsonl"
    assert rundir.checkpoint_path(r, 42) == r / "checkpoints" / "step-00000042"
    assert rundir.snapshots_dir(r) / rundir.snapshot_name(7) == r / "snapshots" / "v00000007"
    assert rundir.log_path(r, "trainer-0") == r / "logs" / "trainer-0.log"
    assert rundir.port_path(r, "engine-1") == r / "logs" / ".engine-1.port"
    assert rundir.placements_path(r) == r / "logs" / "placements.jsonl"
    assert rundir.warmstart_model_dir(r) == r / "warmstart" / "model"
    assert rundir.warmstart_done_path(r) == r / "warmstart" / "done.json"
    assert rundir.base_model_dir(r) == r / "model"
    assert (rundir.plots_dir(r), rundir.archive_dir(r), rundir.redis_dir(r), rundir.ledger_dir(r)) == (
        r / "plots", r / "archive", r / "redis", r / "ledger")
    assert rundir.tensorboard_dir(r, "trainer") == r / "tensorboard" / "trainer"
    assert rundir.producer_metrics_paths(r) == []
    for name in ("producer-1", "producer-0"):
        _write(rundir.producer_metrics_path(r, name), [{}])
    assert [p.stem for p in rundir.producer_metrics_paths(r)] == ["producer-0", "producer-1"]


def test_load_run_config_resolves_the_url_only_through_the_given_resolver(tmp_path: Path) -> None:
    from pipeline.config import SluiceConfig, public_dict

    cfg = SluiceConfig.model_validate({"run": {"run_dir": str(tmp_path)},
                                       "queue": {"redis_url": "redis://user:secret@host:6379/0"}})
    rundir.config_path(tmp_path).write_text(json.dumps(public_dict(cfg)))
    stored = rundir.load_run_config(tmp_path).queue.redis_url
    assert stored is not None and "secret" not in stored  # as saved: redacted
    seen: list[tuple[Path, str | None]] = []

    def resolve(run_dir: Path, url: str | None) -> str | None:
        seen.append((run_dir, url))
        return "redis://user:secret@host:6379/0"

    assert rundir.load_run_config(tmp_path, resolve).queue.redis_url == "redis://user:secret@host:6379/0"
    assert seen == [(tmp_path, stored)]
