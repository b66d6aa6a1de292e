"""``sluice bench archive`` at toy sizes: both archiver counts run against one server, every entry lands in the
archive exactly once, the two archivers split it, and the record and its summary hold the lag figures."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.benchmarks.archive import ArchiveBenchParams, run_archive_bench, summary_lines


def test_the_archive_bench_measures_one_and_two_archivers_on_one_server(tmp_path: Path) -> None:
    out = tmp_path / "archive.json"
    params = ArchiveBenchParams(groups=12, group_size=2, prompt_tokens=8, response_tokens=16, layers=2, topk=2,
                                num_experts=8, templates=2, segment_samples=4, timeout_s=120, out=str(out))
    res = run_archive_bench(params)
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    for m in ("1", "2"):
        (run,) = res["runs"][m]
        assert sum(run["entries_per_archiver"].values()) == 12  # each entry archived once, by one archiver
        assert len(run["entries_per_archiver"]) == int(m) and all(run["entries_per_archiver"].values())
        assert 0 <= run["lag_entries"] <= 12 and run["catch_up_s"] >= 0
    assert res["ratio_catch_up_s"] >= 0 and res["goal"] == 0.5
    lines = summary_lines(res)
    assert any("M = 2 / M = 1" in line for line in lines) and len(lines) == 4
