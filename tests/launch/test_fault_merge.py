"""Folding `sluice bench faults` invocations into one record: summaries come from the trials, a re-run seed replaces
its earlier trial, and a file that is not a run's result is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.benchmarks.fault_merge import merge
from pipeline.cli import main
from pipeline.errors import ConfigError


def _trial(kind: str, seed: int, *, lost: int = 0, wasted: int = 0, finished: bool = True) -> dict:
    return {"kind": kind, "seed": seed, "injection": {"landed": True}, "finished": finished, "recovered": finished,
            "resumes": 0, "stale": wasted, "wasted": wasted, "lost": lost, "duplicated": 0, "phantom": 0,
            "version_problems": [], "archive_problems": [], "recover_s": 1.0 + seed, "restart_s": 2.0}


def _run(*trials: dict, baselines: tuple[int, ...] = ()) -> dict:
    by_kind: dict[str, list[dict]] = {}
    for t in trials:
        by_kind.setdefault(t["kind"], []).append(t)
    return {"trials": by_kind, "baselines": [{"seed": s, "stale": 0} for s in baselines]}


def test_merged_summaries_count_every_invocation_and_a_rerun_seed_once(tmp_path: Path) -> None:
    record = merge({}, _run(_trial("producer", 0), _trial("redis", 0, wasted=32), baselines=(0,)), "first")
    record["trials"].append({**_trial("redis", 0, wasted=900), "era": "before", "invocation": "old"})
    record = merge(record, _run(_trial("redis", 1, lost=2), _trial("redis", 0, wasted=8), baselines=(0, 1)),
                   "second")
    redis = next(s for s in record["summary_after"] if s["kind"] == "redis")
    # Seed 0 again replaced its earlier trial; seed 1 was added; the 'before' trial stays apart.
    assert (redis["trials"], redis["seeds"], redis["wasted_per_trial"], redis["lost"]) == (2, [0, 1], [8, 0], 2)
    assert [s["trials"] for s in record["summary_before"]] == [1]
    assert [b["seed"] for b in record["baselines"]] == [0, 1]
    assert {t["invocation"] for t in record["trials"] if t["era"] == "after"} == {"first", "second"}

    into = tmp_path / "faults.json"
    (tmp_path / "third").mkdir()
    (tmp_path / "third" / "faults.json").write_text(json.dumps(_run(_trial("producer", 3, finished=False))))
    into.write_text(json.dumps(record))
    assert main(["bench", "faults-merge", str(tmp_path / "third"), "--into", str(into)]) == 0
    producer = next(s for s in json.loads(into.read_text())["summary_after"] if s["kind"] == "producer")
    assert (producer["trials"], producer["finished"]) == (2, 1)


def test_a_file_that_is_not_a_run_result_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="trials"):
        merge({}, {"summary": []}, "x")
    assert main(["bench", "faults-merge", str(tmp_path / "nowhere"), "--into", str(tmp_path / "r.json")]) != 0
    assert "nowhere does not exist" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
