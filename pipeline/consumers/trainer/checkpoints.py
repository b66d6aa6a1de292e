"""Pruning a run's checkpoint folders (``pipeline.rundir``: ``checkpoints/step-<N>``, written as ``step-<N>.tmp``
and renamed when complete)."""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.rundir import CHECKPOINT_PREFIX, TMP_SUFFIX


def prune_checkpoints(root: Path, keep: int) -> None:
    for p in sorted(p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if not p.name.endswith(TMP_SUFFIX))[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(f"{CHECKPOINT_PREFIX}*{TMP_SUFFIX}"):
        shutil.rmtree(p, ignore_errors=True)
