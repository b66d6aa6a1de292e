"""The run's live view: one panel, refreshed about every second, from the metrics files and the run's Redis.

``sluice run`` shows it while the trainer trains (a rich ``Live`` panel on a terminal; one plain line every 10 s
when stdout is not a terminal, as in CI and logs), and ``sluice status --run-dir DIR`` shows the same panel for a
run started elsewhere. Everything comes from what any process can read: ``metrics/trainer.jsonl`` (step, reward,
lag, throughput, idle time), ``eval/metrics.jsonl`` (held-out pass@1), and Redis (policy version, queue depth, dead
letters, the time of the last weight push from the run's events stream).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from pipeline.observe.report import step_rates
from pipeline.queue.redis_streams import SampleQueue
from pipeline.rundir import eval_metrics_path, read_heldout, trainer_metrics_path, trainer_rows

log = logging.getLogger(__name__)

WINDOW = 20  # steps in the window means (reward, lag, rates)
PLAIN_EVERY_S = 10.0
_LAG = re.compile(r"^staleness/lag_(\d+)(\+?)$")


@dataclass
class RunStatus:
    """What the panel shows; None where not known yet."""

    run: str
    step: int | None
    total_steps: int
    eta_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    reward_last: float | None
    reward_mean: float | None
    heldout_version: int | None
    heldout_greedy_pass1: float | None
    heldout_sampled_pass1: float | None
    lag_mean: float | None
    lag_max: int | None
    queue_depth: int | None
    queue_pending: int | None
    dead_letters: int | None
    policy_version: int | None
    last_push_age_s: float | None
    idle_fraction: float | None
    window: int
    mismatch_k3: float | None = None
    """Mean over the window: k3 between the trainer's log-probs and the behaviour ones (precision gap + staleness)."""
    capped_fraction: float | None = None
    """Mean over the window: the share of tokens whose TIS weight was capped."""
    agreement_no_replay: float | None = None
    """Mean over the window: routing top-k agreement without replay (``trainer.measure_r3``)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _lag_mean(rows: list[dict[str, Any]]) -> float | None:
    """Mean lag of the trained groups from the per-step histograms (the overflow bucket ``k+`` counts as k)."""
    total = count = 0.0
    for row in rows:
        for key, n in row.items():
            m = _LAG.match(key)
            if m and n:
                total += int(m.group(1)) * float(n)
                count += float(n)
    return total / count if count else None


def _last_push(queue: SampleQueue, now: float) -> float | None:
    # The events stream's ids are Redis's clock in ms; the newest weight_push is among the last few events.
    for entry_id, fields in queue.redis.xrevrange(queue.keys.events, count=50):
        kind = fields.get(b"kind", fields.get("kind"))
        if kind in (b"weight_push", "weight_push"):
            ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
            return max(0.0, now - ms / 1000)
    return None


class TrainerTail:
    """The trainer's last ``keep`` lines by step, reading only what was appended since the last call (the live
    view reads it every second, and a long run's file is megabytes)."""

    def __init__(self, path: Path, keep: int = WINDOW + 1) -> None:
        self.path, self.keep = path, keep
        self._offset = 0
        self._rows: dict[int, dict[str, Any]] = {}

    def rows(self) -> list[dict[str, Any]]:
        if self.path.is_file():
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
            self._offset += end
            for line in data[:end].splitlines():
                if line.strip():
                    row = json.loads(line)
                    self._rows.pop(int(row["step"]), None)
                    self._rows[int(row["step"])] = row  # a step redone after a restart: the last line counts
            for step in sorted(self._rows)[:-self.keep]:
                del self._rows[step]
        return [self._rows[s] for s in sorted(self._rows)]


def collect(run_dir: Path, queue: SampleQueue | None, total_steps: int, window: int = WINDOW,
            rows: list[dict[str, Any]] | None = None) -> RunStatus:
    """The run's status now, from its files and (when given) its Redis; ``rows``: the trainer's last lines, when
    the caller keeps them (``TrainerTail``)."""
    now = time.time()
    if rows is None:
        rows = trainer_rows(trainer_metrics_path(run_dir))
    recent = rows[-window:]
    rates = step_rates(rows[-(window + 1):], window)
    rate = rates[-1] if rates else None
    step = int(rows[-1]["step"]) if rows else None
    eta = None
    if rate and step is not None:
        k = min(window, len(rows) - 1)
        eta = max(0, total_steps - step) * (float(rows[-1]["time"]) - float(rows[-k - 1]["time"])) / k
    heldout = read_heldout(eval_metrics_path(run_dir))
    newest = heldout[max(heldout)] if heldout else {}
    depth = pending = dead = version = None
    push_age = None
    if queue is not None:
        st = queue.stats()
        trainer = next((g for g in st.groups if g.name == "trainer"), None)
        depth = trainer.lag if trainer is not None else st.length
        pending = trainer.pending if trainer is not None else None
        dead, version = st.deadletter, st.policy_version
        push_age = _last_push(queue, now)
    rewards = [float(r["reward_mean"]) for r in recent if "reward_mean" in r]
    return RunStatus(
        run=queue.run if queue is not None else run_dir.name, step=step, total_steps=total_steps, eta_s=eta,
        samples_per_s=rate["samples_per_s"] if rate else None, tokens_per_s=rate["tokens_per_s"] if rate else None,
        reward_last=rewards[-1] if rewards else None, reward_mean=sum(rewards) / len(rewards) if rewards else None,
        heldout_version=int(newest["version"]) if newest else None,
        heldout_greedy_pass1=newest.get("greedy_pass1"), heldout_sampled_pass1=newest.get("sampled_pass1"),
        lag_mean=_lag_mean(recent), lag_max=max((int(r.get("lag_max", 0)) for r in recent), default=None),
        queue_depth=depth, queue_pending=pending, dead_letters=dead, policy_version=version,
        last_push_age_s=push_age, idle_fraction=rate["idle_fraction"] if rate else None, window=len(recent) or window,
        mismatch_k3=_mean(recent, "mismatch_k3"), capped_fraction=_mean(recent, "is_capped_fraction"),
        agreement_no_replay=_mean(recent, "r3/agreement_no_replay"))


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _f(x: float | None, fmt: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def plain_line(st: RunStatus) -> str:
    """One line for logs and CI; it starts as the launcher's line always did (``step N: policy version V, ...``)."""
    if st.step is None:
        return f"waiting for the first trainer step (policy version {_f(st.policy_version, 'd')})"
    return (f"step {st.step}: policy version {_f(st.policy_version, 'd')}, reward {_f(st.reward_last)}, lag max "
            f"{_f(st.lag_max, 'd')} | {st.step}/{st.total_steps} ETA {_duration(st.eta_s)}, "
            f"{_f(st.samples_per_s, '.1f')} samples/s, {_f(st.tokens_per_s, '.0f')} tokens/s, reward mean "
            f"{_f(st.reward_mean)}, held-out pass@1 {_f(st.heldout_greedy_pass1)}, lag mean {_f(st.lag_mean, '.2f')}, "
            f"queue {_f(st.queue_depth, 'd')}, dead letters {_f(st.dead_letters, 'd')}, last push "
            f"{_duration(st.last_push_age_s)} ago, trainer idle {_f(st.idle_fraction, '.0%')}, mismatch k3 "
            f"{_f(st.mismatch_k3, '.2e')}")


def panel(st: RunStatus) -> Any:
    """The rich panel of a status."""
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column(no_wrap=True)
    step = st.step or 0
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=max(st.total_steps, 1), completed=step, width=30),
                f"{step}/{st.total_steps}  ETA {_duration(st.eta_s)}")
    w = f"(last {st.window} steps)"
    held = ("not evaluated yet" if st.heldout_version is None else
            f"{_f(st.heldout_greedy_pass1)} greedy, {_f(st.heldout_sampled_pass1)} sampled (policy version "
            f"{st.heldout_version})")
    push = "none yet" if st.last_push_age_s is None else f"{_duration(st.last_push_age_s)} ago"
    grid.add_row("step", bar)
    grid.add_row("throughput", f"{_f(st.samples_per_s, '.1f')} samples/s, {_f(st.tokens_per_s, '.0f')} tokens/s {w}")
    grid.add_row("reward", f"{_f(st.reward_last)} last, {_f(st.reward_mean)} mean {w}")
    grid.add_row("held-out pass@1", held)
    grid.add_row("lag", f"{_f(st.lag_mean, '.2f')} mean, {_f(st.lag_max, 'd')} max {w}")
    grid.add_row("queue", f"{_f(st.queue_depth, 'd')} waiting, {_f(st.queue_pending, 'd')} pending commit, "
                 f"{_f(st.dead_letters, 'd')} dead letters")
    grid.add_row("policy version", f"{_f(st.policy_version, 'd')}, last push {push}")
    mismatch = f"k3 {_f(st.mismatch_k3, '.2e')}, TIS-capped tokens {_f(st.capped_fraction, '.2%')}"
    if st.agreement_no_replay is not None:
        mismatch += f", routing agreement without replay {_f(st.agreement_no_replay, '.3f')}"
    grid.add_row("mismatch", f"{mismatch} {w}")
    grid.add_row("trainer idle", f"{_f(st.idle_fraction, '.0%')} of the time waiting for data {w}")
    title = f"sluice · {st.run}" + ("" if st.step is not None else " · waiting for the first trainer step")
    return Panel(grid, title=title, title_align="left", border_style="blue", expand=False)


class LiveView:
    """The launcher's progress: a rich Live panel on a terminal, a plain line every 10 s otherwise.

    ``tick`` is cheap to call often (the launcher's loop runs twice a second): it redraws at most once a second.
    """

    def __init__(self, run_dir: Path, queue: SampleQueue, total_steps: int, *, console: Any = None) -> None:
        from rich.console import Console

        self.run_dir, self.queue, self.total_steps = Path(run_dir), queue, total_steps
        self.console = console or Console()
        self.interactive = self.console.is_terminal
        self._live: Any = None
        self._tail = TrainerTail(trainer_metrics_path(self.run_dir))
        self._last = 0.0 if self.interactive else time.monotonic()  # the plain line waits its first 10 s

    def __enter__(self) -> LiveView:
        if self.interactive:
            from rich.live import Live
            from rich.text import Text

            st = self._status()
            first = panel(st) if st is not None else Text("waiting for Redis to answer")
            self._live = Live(first, console=self.console, auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            st = self._status()
            if st is not None:
                self._live.update(panel(st), refresh=True)
            self._live.__exit__(None, None, None)
            self._live = None

    def status(self) -> RunStatus:
        return collect(self.run_dir, self.queue, self.total_steps, rows=self._tail.rows())

    def _status(self) -> RunStatus | None:
        """The status, or None while Redis does not answer (the launcher's watch restarts an embedded one): a view
        is skipped, never the end of the run."""
        try:
            return self.status()
        except redis.RedisError as e:
            log.debug("live view skipped: Redis did not answer (%s)", e)
            return None

    def tick(self) -> None:
        now = time.monotonic()
        if self._live is not None and now - self._last >= 1.0:
            st = self._status()
            if st is not None:
                self._live.update(panel(st), refresh=True)
            self._last = now
        elif self._live is None and now - self._last >= PLAIN_EVERY_S:
            st = self._status()
            if st is not None and st.step is not None:
                print(plain_line(st), flush=True)
            self._last = now
