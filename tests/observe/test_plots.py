"""The run's PNG plots from its metrics files (a real short run's are checked in test_run_face.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.observe.plots import moving_mean, write_plots

pytest.importorskip("matplotlib")


def _write(run_dir: Path, measure_r3: bool) -> None:
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "eval").mkdir()
    rows = []
    for s in range(1, 61):
        row = {"step": s, "policy_version": s, "time": 100.0 + s, "reward_mean": s / 60, "samples": 32,
               "num_tokens": 128, "time/drain_s": 0.3, "lag_max": 1, "staleness/lag_0": 3.0, "staleness/lag_1": 1.0,
               "r3/mismatch_k3_replay": 1e-4}
        if measure_r3:
            row["r3/mismatch_k3_no_replay"] = 1e-2
        rows.append(row)
    (run_dir / "metrics" / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "metrics" / "producer-0.jsonl").write_text("".join(
        json.dumps({"time": 100.0 + 10 * i, "samples_per_s": 40.0, "samples_total": 400 * i}) + "\n"
        for i in range(7)))
    (run_dir / "eval" / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "heldout", "version": v, "greedy_pass1": v / 60, "sampled_pass1": v / 70}) + "\n"
        for v in (0, 30, 60)))


@pytest.mark.parametrize("measure_r3", [False, True])
def test_every_plot_is_drawn_and_a_missing_series_is_named(tmp_path: Path, measure_r3: bool) -> None:
    from PIL import Image

    _write(tmp_path, measure_r3)
    out = write_plots(tmp_path)
    assert sorted(out) == ["lag", "mismatch", "reward", "throughput"]
    for path in out.values():
        with Image.open(path) as im:
            assert im.format == "PNG" and im.width >= 800
            # Something is drawn: a blank axes is almost all white.
            colors = im.convert("RGB").getcolors(maxcolors=1 << 20) or []
            assert len(colors) > 50
    note = (tmp_path / "plots" / "README.txt").read_text()
    assert ("not measured (trainer.measure_r3 = false)" in note) is (not measure_r3)


def test_an_empty_run_still_gets_its_plots(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    assert all(p.is_file() for p in write_plots(tmp_path).values())


def test_moving_mean() -> None:
    assert moving_mean([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
