"""Checkpoint folders of a run: ``checkpoints/step-<N>``, written as ``step-<N>.tmp`` and renamed when complete."""

from __future__ import annotations

import shutil
from pathlib import Path


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint (``.tmp`` folders are unfinished saves and are ignored)."""
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    return done[-1] if done else None


def prune_checkpoints(root: Path, keep: int) -> None:
    for p in sorted(p for p in root.glob("step-*") if not p.name.endswith(".tmp"))[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step-*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
