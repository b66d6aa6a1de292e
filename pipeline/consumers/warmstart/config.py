"""The warm start's on-disk layout, apart from ``sft.py`` so that asking whether a warm start is finished imports no
torch. Its ``[warmstart]`` section is ``pipeline.config.warmstart.WarmStartConfig``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WARMSTART_DIR = "warmstart"
DONE_FILE = "done.json"
METRICS_FILE = "warmstart.jsonl"


def warmstart_dir(run_dir: Path) -> Path:
    """Where a run's warm start writes its checkpoint, HF model and done marker."""
    return Path(run_dir) / WARMSTART_DIR


def warmstart_model_dir(run_dir: Path) -> Path:
    """The warm-started HF model folder (with tokenizer) that engines and trainer start from."""
    return warmstart_dir(run_dir) / "model"


def warmstart_metrics_path(run_dir: Path) -> Path:
    """The warm start's metrics, one JSON line per ``log_every`` steps."""
    return Path(run_dir) / "metrics" / METRICS_FILE


def read_done(run_dir: Path) -> dict[str, Any] | None:
    """The summary a finished warm start left in its done marker, or None if it has not finished."""
    path = warmstart_dir(run_dir) / DONE_FILE
    if not path.exists():
        return None
    return dict(json.loads(path.read_text()))


def format_summary(summary: dict[str, Any]) -> str:
    """One human line for a warm start's summary."""
    line = (f"warm start: {summary['steps']} steps in {summary['seconds']:.1f} s "
            f"({summary['steps_per_s']:.1f} steps/s), final loss {summary['final_loss']:.4f}, "
            f"token accuracy {summary['final_token_accuracy']:.3f}")
    if "final_exact_match" in summary:  # absent from warm starts written before it was measured
        line += f", exact match {summary['final_exact_match']:.3f}"
    ev = summary.get("eval")
    if ev:
        line += (f"; greedy exact match {ev['exact_match']:.3f} on {ev['prompts']} {ev['split']} prompts "
                 f"(stopped with EOS: {ev['stop_rate']:.3f})")
    return line
