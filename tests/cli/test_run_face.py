"""The run's face on a real ``sluice run`` (CPU engine, producer, megatron trainer, held-out evaluator on Ray):
TensorBoard files with every step's reward, the PNG plots at the end, the profiler's trace of the chosen steps, the
plain progress lines when stdout is no terminal, and ``sluice status`` / ``sluice plot`` on the finished run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.consumers.test_profiling import step_marks
from tests.helpers.tb import read_scalars

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
STEPS = 8


def _sluice(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_a_short_run_leaves_tensorboard_plots_a_profile_and_a_status(tmp_path: Path) -> None:
    from PIL import Image

    run_dir = tmp_path / "run"
    r = _sluice("run", "recipes/cpu-moe.toml", "--run-dir", str(run_dir), "--steps", str(STEPS),
                "--set", "prompts.size=256", "--set", "prompts.heldout=12", "--set", "eval.heldout.every_versions=4",
                "--set", "eval.heldout.samples=2", "--set", "eval.heldout.pass_k=[1, 2]",
                "--set", "eval.heldout.poll_s=0.2", "--set", "warmstart.enabled=false",
                "--set", "trainer.batch_groups=4", "--set", "filters.zero_variance=false",
                "--set", "eval.enabled=true", "--set", "trainer.checkpoint_every=4",
                "--set", "trainer.profile_steps=[3, 4]", "--set", "metrics.producer_every_s=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout[-3000:])
    rows = {d["step"]: d for d in map(json.loads, (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines())}
    assert sorted(rows) == list(range(1, STEPS + 1))

    # TensorBoard: every step's reward, as the JSONL has it (float32 in the event file).
    tb = run_dir / "tensorboard"
    trainer = read_scalars(tb / "trainer")
    assert trainer["reward_mean"] == pytest.approx({s: d["reward_mean"] for s, d in rows.items()}, abs=1e-6)
    assert set(trainer["time/drain_s"]) == set(rows)
    heldout = [d for d in map(json.loads, (run_dir / "eval" / "metrics.jsonl").read_text().splitlines())
               if d["kind"] == "heldout"]
    assert heldout and read_scalars(tb / "evaluator")["heldout/greedy_pass1"] == pytest.approx(
        {d["version"]: d["greedy_pass1"] for d in heldout})
    producer = read_scalars(tb / "producer-0")
    produced = [json.loads(x) for x in (run_dir / "metrics" / "producer-0.jsonl").read_text().splitlines()]
    assert max(producer["samples_total"]) == produced[-1]["samples_total"] >= STEPS * 4 * 8
    assert read_scalars(tb / "eval-stream")["stream/samples"]

    # Plots, written at the end of the run.
    assert "plots: " in r.stdout
    for name in ("reward", "lag", "mismatch", "throughput"):
        with Image.open(run_dir / "plots" / f"{name}.png") as im:
            assert im.format == "PNG" and im.width >= 800 and im.height >= 300
    # The recipe does not measure mismatch without R3; the plot says so rather than draw zeros.
    assert "not measured (trainer.measure_r3 = false)" in (run_dir / "plots" / "README.txt").read_text()

    # The profile of steps 3..4, and only those.
    assert step_marks(run_dir / "profiles" / "trainer-rank0-steps3-4.json") == {3, 4}

    # Not a terminal: no panel drawn into the log; the plain line keeps its old start when one is printed.
    assert "╭" not in r.stdout
    assert all(line.split(":")[0].startswith("step ") for line in r.stdout.splitlines() if "policy version" in line
               and "ETA" in line)

    status = _sluice("status", "--run-dir", str(run_dir), "--json")
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert (st["step"], st["total_steps"], st["policy_version"]) == (STEPS, STEPS, STEPS)
    assert st["reward_last"] == pytest.approx(rows[STEPS]["reward_mean"])
    assert st["heldout_version"] == max(d["version"] for d in heldout) and st["last_push_age_s"] is not None
    shown = _sluice("status", "--run-dir", str(run_dir))
    assert f"{STEPS}/{STEPS}" in shown.stdout and "held-out pass@1" in shown.stdout

    for png in (run_dir / "plots").glob("*.png"):
        png.unlink()
    again = _sluice("plot", "--run-dir", str(run_dir), "--json")
    assert again.returncode == 0 and all(Path(p).is_file() for p in json.loads(again.stdout).values())
