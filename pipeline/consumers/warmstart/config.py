"""The warm start's done marker, apart from ``sft.py`` so that asking whether a warm start is finished imports no
torch. Its folders are ``pipeline.rundir``'s (``warmstart_dir``, ``warmstart_model_dir``); its ``[warmstart]`` section
is ``pipeline.config.warmstart.WarmStartConfig``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.rundir import warmstart_done_path


def read_done(run_dir: Path) -> dict[str, Any] | None:
    """The summary a finished warm start left in its done marker, or None if it has not finished."""
    path = warmstart_done_path(run_dir)
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
