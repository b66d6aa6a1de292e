"""``sluice bench pipeline``: what asynchrony buys, as samples trained per second async / sync, in one run.

The benchmark runs the same recipe twice through ``sluice run`` (the real launcher, engines, producers, trainer):
first in ``mode = "async"`` (the recipe's warm start included, so the time from the command to the first trained step
is the one a user sees), then in ``mode = "sync"`` from the weights that warm start wrote, for the same number of
steps. Held-out evaluation is off in both (it would compete for the same cores); everything else is the recipe's.

What it reports, from the trainer's own metrics (``metrics/trainer.jsonl``):

- ``samples_per_s`` of each mode: samples trained over the wall time of the measured steps (the first
  ``skip_steps`` are start-up: engine warm-up, the first checkpoint writer);
- ``t_gen``: the sync run's mean wait for a batch (in sync the producers generate only while the trainer waits), and
  ``t_train``: its mean step + weight push + commit;
- ``bound`` = (t_gen + t_train) / max(t_gen, t_train): the speed-up perfect overlap would give, and
  ``ratio`` = async / sync with ``ratio_of_bound`` = ratio / bound (goal >= 0.9);
- ``idle_fraction``: the share of the async run's wall time the trainer spent waiting for data (goal <= 0.05 when
  producers suffice);
- ``first_step_s``: from the start of ``sluice run`` (async) to its first trained step (goal <= 60 s).

Both modes share the machine with nothing else the benchmark starts; the ratio is measured in one invocation so that
the same load, if any, weighs on both.
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import SluiceError
from pipeline.rundir import logs_dir, trainer_metrics_path, warmstart_model_dir


@dataclass
class PipelineBenchParams:
    """What one ``sluice bench pipeline`` measures."""

    recipe: str = "recipes/cpu-moe.toml"
    """The recipe both modes run."""
    steps: int = 60
    """Trainer steps per mode."""
    skip_steps: int = 5
    """Leading steps left out of the rates (start-up)."""
    max_lag: int = 2
    """staleness.max_lag of the async run."""
    out: str = "runs/bench-pipeline"
    """Folder for the two run folders (replaced on each invocation)."""


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = trainer_metrics_path(run_dir)
    if not path.exists():
        raise SluiceError(f"the benchmark's run {run_dir} wrote no trainer metrics; see {logs_dir(run_dir)}")
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        d = json.loads(line)
        rows[int(d["step"])] = d  # a step redone after a restart: the last one counts
    return [rows[k] for k in sorted(rows)]


def _rate(rows: list[dict[str, Any]], skip: int) -> dict[str, float]:
    measured = rows[skip:]
    if len(measured) < 2:
        raise SluiceError(f"only {len(rows)} steps were trained; raise steps above skip_steps + 1")
    span = measured[-1]["time"] - measured[0]["time"]
    # The first measured step's samples were drained before the span started.
    samples = sum(r["samples"] for r in measured[1:])
    return {
        "samples_per_s": samples / span,
        "steps_per_s": (len(measured) - 1) / span,
        "t_wait": statistics.mean(r["time/drain_s"] for r in measured[1:]),
        "t_train": statistics.mean(r["time/step_s"] + r["time/push_s"] + r["time/commit_s"] for r in measured[1:]),
        "idle_fraction": sum(r["time/drain_s"] for r in measured[1:]) / span,
        "reward_mean": statistics.mean(r["reward_mean"] for r in measured),
        "span_s": span,
    }


def _run(recipe: str, overrides: list[str]) -> float:
    """Run ``sluice run`` in this process; returns its wall-clock start (epoch seconds)."""
    from pipeline.config import load_config
    from pipeline.launch.launcher import run

    cfg = load_config(recipe, overrides)
    start = time.time()
    with contextlib.redirect_stdout(io.StringIO()):
        code = run(cfg)
    if code != 0:
        raise SluiceError(f"sluice run {recipe} {' '.join(overrides)} exited with {code}")
    return start


def run_pipeline_bench(p: PipelineBenchParams) -> dict[str, Any]:
    """Run both modes and return the figures (see the module docstring)."""
    import shutil

    out = Path(p.out)
    shutil.rmtree(out, ignore_errors=True)
    common = [f"trainer.steps={p.steps}", "eval.heldout.enabled=false", "eval.enabled=false",
              f"trainer.checkpoint_every={p.steps}"]
    async_dir, sync_dir = out / "async", out / "sync"
    started = _run(p.recipe, [*common, "mode=\"async\"", f"staleness.max_lag={p.max_lag}",
                              f"run.run_dir=\"{async_dir}\"", "run.name=\"bench-async\""])
    async_rows = _rows(async_dir)
    warm = warmstart_model_dir(async_dir)
    start_model = [f"model.path=\"{warm}\"", "warmstart.enabled=false"] if warm.is_dir() else []
    _run(p.recipe, [*common, "mode=\"sync\"", f"run.run_dir=\"{sync_dir}\"", "run.name=\"bench-sync\"",
                    *start_model])
    sync_rows = _rows(sync_dir)
    a, s = _rate(async_rows, p.skip_steps), _rate(sync_rows, p.skip_steps)
    t_gen, t_train = s["t_wait"], s["t_train"]
    bound = (t_gen + t_train) / max(t_gen, t_train)
    ratio = a["samples_per_s"] / s["samples_per_s"]
    return {
        "params": asdict(p),
        "async": a,
        "sync": s,
        "t_gen": t_gen,
        "t_train": t_train,
        "bound": bound,
        "ratio": ratio,
        "ratio_of_bound": ratio / bound,
        "idle_fraction": a["idle_fraction"],
        "first_step_s": async_rows[0]["time"] - started,
        "goals": {"ratio_of_bound": ">= 0.9", "idle_fraction": "<= 0.05", "first_step_s": "<= 60"},
    }
