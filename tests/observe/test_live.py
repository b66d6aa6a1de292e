"""The live view against a real Redis: the status it collects from the metrics files and the queue, the rich panel
on a terminal, the plain line otherwise, and the incremental reading of the trainer's file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

import pipeline.observe.live as live
from pipeline.observe.live import LiveView, TrainerTail, collect, plain_line
from pipeline.queue.redis_streams import SampleQueue
from tests.helpers.samples import make_group

TOTAL = 40


def _rows(n: int, t0: float = 1000.0, period: float = 2.0) -> list[dict]:
    # Steps every `period` s, 64 samples and 256 tokens each, half a second of waiting for data each.
    return [{"step": s, "policy_version": s, "time": t0 + period * s, "reward_mean": s / 100, "samples": 64,
             "num_tokens": 256, "time/drain_s": 0.5, "lag_max": s % 3, "staleness/lag_0": 2.0,
             "staleness/lag_1": 1.0, "staleness/lag_2": 1.0, "staleness/lag_3+": 0.0} for s in range(1, n + 1)]


def _run(tmp_path: Path, queue: SampleQueue, steps: int = 30) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "eval").mkdir()
    (run_dir / "metrics" / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(steps)))
    (run_dir / "eval" / "metrics.jsonl").write_text(json.dumps(
        {"kind": "heldout", "version": 20, "greedy_pass1": 0.625, "sampled_pass1": 0.5}) + "\n")
    queue.create_group("trainer", "0")
    rng = np.random.default_rng(0)
    for _ in range(3):
        queue.put(make_group(rng))
    queue.redis.set(queue.keys.policy_version, steps)
    queue.log_event("weight_push", version=steps, step=steps)
    queue.log_event("checkpoint", step=steps)
    return run_dir


def test_collect_reads_the_files_and_the_queue(tmp_path: Path, queue: SampleQueue) -> None:
    st = collect(_run(tmp_path, queue), queue, TOTAL)
    assert (st.step, st.total_steps, st.policy_version) == (30, TOTAL, 30)
    assert st.eta_s == pytest.approx(10 * 2.0)  # 10 steps left at 2 s each
    assert st.samples_per_s == pytest.approx(32.0) and st.tokens_per_s == pytest.approx(128.0)
    assert st.idle_fraction == pytest.approx(0.25)
    assert st.reward_last == pytest.approx(0.30)
    assert st.reward_mean == pytest.approx(np.mean([s / 100 for s in range(11, 31)]))  # the last 20 steps
    assert st.lag_mean == pytest.approx((0 * 2 + 1 + 2) / 4) and st.lag_max == 2
    assert (st.heldout_version, st.heldout_greedy_pass1) == (20, 0.625)
    assert (st.queue_depth, st.queue_pending, st.dead_letters) == (3, 0, 0)
    assert st.last_push_age_s is not None and st.last_push_age_s < 60


def test_terminal_gets_the_panel_and_a_log_gets_the_line(tmp_path: Path, queue: SampleQueue,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = _run(tmp_path, queue)
    out = io.StringIO()
    with LiveView(run_dir, queue, TOTAL, console=Console(file=out, force_terminal=True, width=100)) as view:
        assert view.interactive
        view.tick()
    text = out.getvalue()
    for want in ("30/40", "ETA 0:20", "32.0 samples/s", "128 tokens/s", "0.300 last", "0.625 greedy",
                 "3 waiting", "0 dead letters", "25% of the time waiting"):
        assert want in text, want

    monkeypatch.setattr(live, "PLAIN_EVERY_S", 0.0)
    view = LiveView(run_dir, queue, TOTAL, console=Console(file=io.StringIO(), force_terminal=False))
    with view:
        assert not view.interactive
        view.tick()
    line = capsys.readouterr().out.strip()
    assert line.startswith("step 30: policy version 30, reward 0.300, lag max 2 | 30/40 ETA 0:20")
    assert line == plain_line(collect(run_dir, queue, TOTAL))


def test_trainer_tail_reads_only_what_was_appended(tmp_path: Path) -> None:
    path = tmp_path / "trainer.jsonl"
    rows = _rows(30)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:25]))
    tail = TrainerTail(path, keep=5)
    assert [r["step"] for r in tail.rows()] == [21, 22, 23, 24, 25]
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[25:]) + json.dumps(rows[0])[:10])  # a line half-written
    assert [r["step"] for r in tail.rows()] == [26, 27, 28, 29, 30]
    with open(path, "a") as f:
        f.write(json.dumps(rows[0])[10:] + "\n" + json.dumps({**rows[29], "reward_mean": 9.0}) + "\n")
    got = tail.rows()
    assert [r["step"] for r in got] == [26, 27, 28, 29, 30] and got[-1]["reward_mean"] == 9.0  # a redone step


def test_a_redis_that_does_not_answer_skips_a_view_and_ends_nothing(tmp_path: Path, queue: SampleQueue,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's loop refreshes the view between its Redis watch's checks; a Redis that died meanwhile must
    not end the run from there."""
    import time

    from pipeline.net import free_port
    from pipeline.queue.connection import connect

    run_dir = _run(tmp_path, queue)
    dead = SampleQueue(connect(f"redis://127.0.0.1:{free_port()}/0", retry=None, socket_connect_timeout=1.0),
                       queue.run)
    monkeypatch.setattr(live, "PLAIN_EVERY_S", 0.0)
    for console in (Console(file=io.StringIO(), force_terminal=True, width=100),
                    Console(file=io.StringIO(), force_terminal=False)):
        start = time.monotonic()
        with LiveView(run_dir, dead, TOTAL, console=console) as view:
            view._last = -1e9  # due now
            view.tick()
        assert time.monotonic() - start < 5
    assert capsys.readouterr().out == ""  # no line from a view that could not be read
