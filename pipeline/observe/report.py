"""The end-of-run summary ``sluice run`` prints: the learning curve from the trainer's metrics, then the held-out
pass rates per evaluated version, in the terminal."""

from __future__ import annotations

from pathlib import Path
from statistics import mean
from typing import Any

from pipeline.rundir import read_heldout, trainer_rows

BAR = 40


def step_rates(rows: list[dict[str, Any]], window: int = 1) -> list[dict[str, float]]:
    """Per step (from the second line on), over the last ``window`` steps: samples/s and tokens/s trained, and the
    trainer's idle fraction.

    A step's period is the wall time since the previous line, and the rates are sums over the window divided by its
    time (not a mean of per-step rates, which one quick step would dominate). The trainer is idle while it waits for
    data (``time/drain_s``), so idle = drain / period. A restart's gap counts as one long period, so it shows.
    """
    steps = [(float(row["time"]) - float(prev["time"]), row) for prev, row in zip(rows, rows[1:])]
    steps = [(period, row) for period, row in steps if period > 0]
    out = []
    for i, (_, row) in enumerate(steps):
        span = steps[max(0, i - window + 1) : i + 1]
        period = sum(p for p, _ in span)
        out.append({"step": float(row["step"]), "time": float(row["time"]),
                    "samples_per_s": sum(float(r.get("samples", 0)) for _, r in span) / period,
                    "tokens_per_s": sum(float(r.get("num_tokens", 0)) for _, r in span) / period,
                    "idle_fraction": min(1.0, sum(float(r.get("time/drain_s", 0.0)) for _, r in span) / period)})
    return out


def learning_curve(metrics_path: Path, windows: int = 10) -> list[tuple[int, int, float]]:
    """(first step, last step, mean reward) over ``windows`` equal spans of the run's steps."""
    rows = {int(d["step"]): float(d["reward_mean"]) for d in trainer_rows(metrics_path)}
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


def format_heldout(metrics_path: Path) -> str:
    """Held-out pass rates per evaluated version (the ``"kind": "heldout"`` lines of ``eval/metrics.jsonl``)."""
    rows = read_heldout(metrics_path)
    if not rows:
        return "no held-out evaluation yet"
    ks = sorted({int(k) for d in rows.values() for k in d.get("pass_at_k", {})})
    head = f"  {'version':>8} {'greedy@1':>9} {'sampled@1':>10} " + "".join(f"{f'pass@{k}':>8} " for k in ks)
    lines = ["held-out pass rate per policy version (greedy, and sampled at the producer's temperature)",
             head + f"{'reward':>7} {'prompts':>8} {'seconds':>8}"]
    for v, d in rows.items():
        at = d.get("pass_at_k", {})
        lines.append(f"  {v:>8} {_num(d.get('greedy_pass1')):>9} {_num(d.get('sampled_pass1')):>10} "
                     + "".join(f"{_num(at.get(str(k))):>8} " for k in ks)
                     + f"{_num(d.get('reward_mean')):>7} {d.get('prompts', 0):>8} {d.get('seconds', 0):>8.1f}")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
