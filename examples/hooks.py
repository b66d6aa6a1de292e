"""Trainer hooks (the recipe's ``[hooks]`` section): plain functions sluice calls on the trainer's rank 0.

Recipe lines::

    [plugins]
    paths = ["examples"]

    [hooks]
    metrics = ["hooks:append_csv"]             # fn(step, metrics: dict[str, float]) with each step's line
    after_step = ["hooks:warn_on_empty_step"]  # fn(step, info) after each optimizer step
    after_commit = ["hooks:mark_latest"]       # fn(step, checkpoint_dir: str) after each checkpoint commit
    timeout_s = 30                             # a call running longer is counted as an error; training goes on

A hook that raises is logged once and counted in the metrics (``hooks/errors``); it never stops the run.
"""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("sluice.hooks")

COLUMNS = ("step", "policy_version", "reward_mean", "loss", "lag_max", "time/step_s")


def append_csv(step: int, metrics: dict[str, float]) -> None:
    """A few columns of each step's metrics, appended to SLUICE_HOOKS_CSV (default: sluice-metrics.csv here)."""
    path = Path(os.environ.get("SLUICE_HOOKS_CSV", "sluice-metrics.csv"))
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(COLUMNS)
        writer.writerow([metrics.get(c, "") for c in COLUMNS])


def warn_on_empty_step(step: int, info: dict[str, Any]) -> None:
    """Log when a step trained on no samples (every group filtered out or stale)."""
    if not info.get("samples"):
        log.warning("step %d (policy version %s) trained on no samples", step, info.get("policy_version"))


def mark_latest(step: int, checkpoint_dir: str) -> None:
    """Point LATEST, beside the checkpoints, at the newest commit (what a job that copies checkpoints off reads)."""
    latest = Path(checkpoint_dir).parent / "LATEST"
    tmp = latest.with_suffix(".tmp")
    tmp.write_text(f"{Path(checkpoint_dir).name}\n")
    tmp.replace(latest)
