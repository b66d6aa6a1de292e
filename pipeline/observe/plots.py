"""PNG plots of a run, from its metrics files: ``RUN_DIR/plots/*.png`` at the end of ``sluice run``, and
``sluice plot --run-dir DIR`` for any run, live or finished.

- ``reward.png``: the sampled reward per step (and its moving mean), with held-out pass@1 (greedy and sampled) at
  the step each evaluated policy version was pushed;
- ``lag.png``: the lag histogram over time: per step, the share of trained groups at each lag (versions behind);
- ``mismatch.png``: the rollout/train log-prob mismatch (k3) with R3 (the routing replayed) and without it, where
  the trainer measured it (``trainer.measure_r3``); a missing series is named in the plot, not drawn as zeros. Below
  it, what the mismatch does: the share of tokens whose TIS weight was capped, and the routing disagreement without
  replay (1 - top-k agreement);
- ``throughput.png``: samples/s trained and generated, and the trainer's idle fraction (waiting for data).

Only what the files hold is drawn, so a plot of a live run is a plot of the run so far. matplotlib's object API
(``Figure``) renders without pyplot or a display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.observe.report import step_rates
from pipeline.rundir import (
    eval_metrics_path,
    plots_dir,
    producer_metrics_paths,
    read_heldout,
    read_jsonl,
    trainer_metrics_path,
    trainer_rows,
)

_LAG_KEYS = ("staleness/lag_neg", "staleness/lag_0", "staleness/lag_1", "staleness/lag_2", "staleness/lag_3+")


def moving_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _window(n: int) -> int:
    return max(1, min(50, n // 10))


def _figure(title: str, rows: int = 1) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6 * rows), layout="constrained")
    fig.suptitle(title)
    return fig


def _note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=10, color="0.35", wrap=True)


def plot_reward(rows: list[dict[str, Any]], heldout: list[dict[str, Any]], out: Path) -> None:
    fig = _figure("reward and held-out pass@1")
    ax = fig.add_subplot()
    steps = [r["step"] for r in rows]
    reward = [float(r["reward_mean"]) for r in rows]
    if rows:
        ax.plot(steps, reward, color="tab:blue", alpha=0.3, lw=0.8, label="reward per step (sampled, training prompts)")
        w = _window(len(rows))
        ax.plot(steps, moving_mean(reward, w), color="tab:blue", lw=2, label=f"reward, mean of {w} steps")
    # A held-out line names a policy version; the step is the one that pushed that version.
    step_of = {}
    for r in rows:
        step_of.setdefault(int(r["policy_version"]), int(r["step"]))
    for key, color, label in (("greedy_pass1", "tab:green", "held-out greedy pass@1"),
                              ("sampled_pass1", "tab:orange", "held-out sampled pass@1")):
        pts = sorted((step_of.get(int(h["version"]), int(h["version"])), float(h[key]))
                     for h in heldout if h.get(key) is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", color=color, label=label)
    if not rows and not heldout:
        _note(ax, "no trainer metrics yet")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward / pass rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    fig.savefig(out, dpi=100)


def plot_lag(rows: list[dict[str, Any]], out: Path) -> None:
    fig = _figure("lag of the trained groups over time (versions behind the trainer)")
    ax = fig.add_subplot()
    present = [k for k in _LAG_KEYS if any(r.get(k) for r in rows)]
    if not present:
        _note(ax, "no lag histogram in the trainer's metrics yet")
    else:
        steps = [r["step"] for r in rows]
        w = _window(len(rows))
        totals = [sum(float(r.get(k, 0.0)) for k in present) or 1.0 for r in rows]
        shares = [moving_mean([float(r.get(k, 0.0)) / t for r, t in zip(rows, totals)], w) for k in present]
        labels = [k.removeprefix("staleness/lag_").replace("neg", "negative (newer than the trainer)") for k in present]
        ax.stackplot(steps, shares, labels=[f"lag {x}" for x in labels], alpha=0.85)
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"share of groups (mean of {w} steps)")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xlabel("trainer step")
    fig.savefig(out, dpi=100)


def plot_mismatch(rows: list[dict[str, Any]], out: Path) -> list[str]:
    """Draws what was measured; returns the notes about what was not."""
    fig = _figure("rollout/train log-prob mismatch (k3 estimator of KL(rollout || train))", rows=2)
    ax = fig.add_subplot(2, 1, 1)
    series = (("r3/mismatch_k3_replay", "tab:green", "with R3 (routing replayed)"),
              ("r3/mismatch_k3_no_replay", "tab:red", "without R3 (the trainer's own routing)"))
    notes = []
    drawn = False
    for key, color, label in series:
        pts = [(r["step"], float(r[key])) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), color=color, alpha=0.8, label=label)
            drawn = True
        else:
            notes.append(f"{label}: not measured" + (" (trainer.measure_r3 = false)" if "no_replay" in key else ""))
    if not drawn and rows:
        pts = [(r["step"], float(r["mismatch_k3"])) for r in rows if r.get("mismatch_k3") is not None]
        if pts:
            ax.plot(*zip(*pts), color="tab:blue", label="mismatch of the trained tokens")
            drawn = True
    if notes:
        ax.text(0.99, 0.97, "\n".join(notes), transform=ax.transAxes, ha="right", va="top", fontsize=8, color="0.35")
    if not drawn:
        _note(ax, "no mismatch measured yet")
    else:
        ax.set_yscale("symlog", linthresh=1e-6)  # linear near 0 (R3 often gives exactly 0), log above
        ax.set_ylim(bottom=0)  # k3 is never negative
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mismatch k3 (per token)")
    ax.grid(alpha=0.3)
    _plot_mismatch_effects(fig.add_subplot(2, 1, 2), rows)
    fig.savefig(out, dpi=100)
    return notes


def _plot_mismatch_effects(ax: Any, rows: list[dict[str, Any]]) -> None:
    series = (("is_capped_fraction", "tab:purple", "tokens whose TIS weight was capped", False),
              ("r3/agreement_no_replay", "tab:red", "routing disagreement without replay (1 - top-k agreement)", True))
    drawn = False
    for key, color, label, flip in series:
        pts = [(r["step"], 1.0 - float(r[key]) if flip else float(r[key])) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), color=color, alpha=0.8, label=label)
            drawn = True
    if not drawn:
        _note(ax, "no capped-weight share or routing agreement measured yet")
        return
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("share of tokens")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)


def plot_throughput(rows: list[dict[str, Any]], producers: dict[str, list[dict[str, Any]]], out: Path) -> None:
    fig = _figure("throughput and trainer idle time", rows=2)
    top, bottom = fig.subplots(2, 1, sharex=True)
    w = _window(len(rows))
    rates, each = step_rates(rows, w), step_rates(rows)
    if rates:
        t0 = min([rates[0]["time"]] + [p[0]["time"] for p in producers.values() if p])
        x = [(r["time"] - t0) for r in rates]
        top.plot(x, [r["samples_per_s"] for r in rates], color="tab:blue", lw=2, label=f"trained (over {w} steps)")
        for name, lines in sorted(producers.items()):
            pts = [(p["time"] - t0, float(p["samples_per_s"])) for p in lines if "samples_per_s" in p]
            if pts:
                top.plot(*zip(*pts), marker=".", alpha=0.8, label=f"generated by {name}")
        bottom.plot(x, [r["idle_fraction"] for r in each], color="tab:gray", alpha=0.4, lw=0.8, label="per step")
        bottom.plot(x, [r["idle_fraction"] for r in rates], color="tab:red", lw=2, label=f"over {w} steps")
        top.legend(loc="upper left", fontsize=8)
        bottom.legend(loc="upper left", fontsize=8)
    else:
        _note(top, "fewer than two trainer steps yet")
    top.set_ylabel("samples/s")
    top.grid(alpha=0.3)
    bottom.set_ylabel("trainer idle fraction\n(waiting for data)")
    bottom.set_ylim(-0.02, 1.02)
    bottom.set_xlabel("seconds since the first step (or the first producer line)")
    bottom.grid(alpha=0.3)
    fig.savefig(out, dpi=100)


def write_plots(run_dir: Path) -> dict[str, Path]:
    """Every plot of the run into ``RUN_DIR/plots``; returns them by name. Notes on missing series are logged into
    ``plots/README.txt`` (what a plot could not show, and why)."""
    run_dir = Path(run_dir)
    folder = plots_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    rows = trainer_rows(trainer_metrics_path(run_dir))
    heldout = list(read_heldout(eval_metrics_path(run_dir)).values())
    producers = {p.stem: read_jsonl(p) for p in producer_metrics_paths(run_dir)}
    out = {name: folder / f"{name}.png" for name in ("reward", "lag", "mismatch", "throughput")}
    plot_reward(rows, heldout, out["reward"])
    plot_lag(rows, out["lag"])
    notes = plot_mismatch(rows, out["mismatch"])
    plot_throughput(rows, producers, out["throughput"])
    (folder / "README.txt").write_text(
        f"plots of {run_dir} at step {rows[-1]['step'] if rows else 0} (sluice plot --run-dir DIR redraws them)\n"
        + "".join(f"mismatch.png: {n}\n" for n in notes))
    return out
