"""``trainer.profile_steps``: torch.profiler over the chosen steps only, written as a Chrome/Perfetto trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.errors import ConfigError

torch = pytest.importorskip("torch")


def step_marks(trace: Path) -> set[int]:
    """The trainer steps whose ``sluice.step.N`` range is in a Chrome trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    return {int(e["name"].rsplit(".", 1)[1]) for e in events if str(e.get("name", "")).startswith("sluice.step.")}


def test_trace_covers_the_window_and_nothing_else(tmp_path: Path) -> None:
    from pipeline.consumers.trainer.profiling import StepProfiler

    profiler = StepProfiler((3, 5), tmp_path, rank=1)
    x = torch.randn(64, 64)
    for step in range(1, 9):  # the trainer's loop: each step starts at the top of the loop
        profiler.start_step(step)
        for _ in range(3):
            x = torch.tanh(x @ x)
    profiler.finish()
    trace = tmp_path / "profiles" / "trainer-rank1-steps3-5.json"
    assert profiler.written == trace and trace.is_file()
    assert step_marks(trace) == {3, 4, 5}
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("mm" in str(e.get("name", "")) for e in events)  # the steps' own work is in it
    assert not list((tmp_path / "profiles").glob("*.tmp"))


def test_a_window_the_loop_ends_inside_is_written_at_the_end(tmp_path: Path) -> None:
    from pipeline.consumers.trainer.profiling import StepProfiler

    profiler = StepProfiler((2, 10), tmp_path)
    for step in range(1, 4):
        profiler.start_step(step)
        torch.ones(8) @ torch.ones(8)
    profiler.finish()
    assert step_marks(tmp_path / "profiles" / "trainer-rank0-steps2-10.json") == {2, 3}


def test_no_window_profiles_nothing(tmp_path: Path) -> None:
    from pipeline.consumers.trainer.profiling import StepProfiler

    profiler = StepProfiler(None, tmp_path)
    for step in range(1, 4):
        profiler.start_step(step)
    profiler.finish()
    assert profiler.written is None and not (tmp_path / "profiles").exists()


def test_bad_window_is_a_clear_error() -> None:
    assert load_config(None, ["trainer.profile_steps=[2, 4]"]).trainer.profile_steps == (2, 4)
    with pytest.raises(ConfigError, match=r"profile_steps = \[5, 3\]: give \[a, b\] with 1 <= a <= b"):
        load_config(None, ["trainer.profile_steps=[5, 3]"])
