"""The end-of-run summary ``sluice run`` prints: the learning curve from the trainer's metrics, in the terminal."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

BAR = 40


def learning_curve(metrics_path: Path, windows: int = 10) -> list[tuple[int, int, float]]:
    """(first step, last step, mean reward) over ``windows`` equal spans of the run's steps."""
    if not metrics_path.exists():
        return []
    rows: dict[int, float] = {}
    for line in metrics_path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            rows[int(d["step"])] = float(d["reward_mean"])  # a step redone after a restart: the last one counts
    steps = sorted(rows)
    if not steps:
        return []
    size = max(1, -(-len(steps) // windows))
    return [(chunk[0], chunk[-1], mean(rows[s] for s in chunk))
            for chunk in (steps[i : i + size] for i in range(0, len(steps), size))]


def format_curve(curve: list[tuple[int, int, float]]) -> str:
    if not curve:
        return "no trainer metrics yet"
    top = max(r for _, _, r in curve) or 1.0
    lines = ["reward (mean over the steps of each row)"]
    for first, last, r in curve:
        lines.append(f"  steps {first:4d}-{last:<4d} {r:6.3f} {'#' * round(BAR * r / top)}")
    return "\n".join(lines)
