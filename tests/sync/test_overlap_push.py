"""`trainer.overlap_push`: the weight push of step N runs while step N+1 drains and trains, and still every commit
records a version the engines confirmed.

The trainer loop, ledger, commit and version clock are the real ones; the engines are replaced by a pusher that takes
a fixed time per push (what a network transfer costs), and the megatron train step by one that takes a fixed time, so
that the overlap shows in wall-clock intervals. The checkpoint write is recorded instead of written (megatron's
dist-checkpoint needs a megatron model, which this test of the loop's ordering does not)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.consumers.trainer.drain import Batch
from pipeline.consumers.trainer.ledger import Ledger
from pipeline.consumers.trainer.loop import LocalClock, RankZero, Trainer, TrainerSettings
from pipeline.queue.sample import Sample, SamplingInfo

STEP_S = 0.15
PUSH_S = 0.25
STEPS = 5


def _group(step: int) -> list[Sample]:
    return [
        Sample(prompt_ids=np.array([5, 6], dtype=np.int32), response_ids=np.array([7, 8], dtype=np.int32),
               rollout_logprobs=np.full(2, -1.0, dtype=np.float32), token_versions=np.zeros(2, dtype=np.int32),
               reward=float(i), sampling=SamplingInfo(temperature=1.0), group_id=f"g{step}")
        for i in range(2)
    ]


class _Source:
    """One group per step; records the version each drain judged against."""

    def __init__(self) -> None:
        self.judged_at: list[int] = []
        self.acked: list[str] = []

    def recover(self) -> None:
        return None

    def next_batch(self, batch_groups: int, step: int, version: Any, should_stop: Any = None) -> Batch:
        self.judged_at.append(version())
        return Batch(groups=[_group(step)], group_entries=[f"{step}-0"], consumed=[f"{step}-0"])

    def ack(self, entry_ids: list[str]) -> None:
        self.acked.extend(entry_ids)


class _TimedStep:
    policy_version: int | None = None

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []

    def step(self, groups: list[list[Sample]]) -> dict[str, float]:
        start = time.monotonic()
        time.sleep(STEP_S)
        self.intervals.append((start, time.monotonic()))
        return {"loss": 0.0}

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class _TimedPusher:
    """Stands in for the engines: each push takes PUSH_S and is recorded with the version it carried."""

    engines: list[Any] = []
    all: list[Any] = []

    def __init__(self) -> None:
        self.pushes: list[tuple[int, float, float]] = []

    async def push(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        start = time.monotonic()
        await asyncio.sleep(PUSH_S)
        self.pushes.append((version, start, time.monotonic()))

    async def push_once(self, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], version: int) -> bool:
        await self.push(list(weights()), version)
        return True

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return [(name, tensor.detach().clone()) for name, tensor in named_tensors]

    async def adopt(self, version: int, *, fresh: bool, model_path: str | None = None) -> list[Any]:
        return []

    def counters(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        pass


def _run(tmp_path: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    import pipeline.consumers.megatron.checkpoint as checkpoint

    clock = LocalClock()
    saved: list[dict[str, Any]] = []

    def save_checkpoint(directory: Path, model: Any, optimizer: Any, meta: dict[str, Any]) -> float:
        saved.append({**meta, "clock": clock.get()})
        directory.mkdir(parents=True)
        return 0.0

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_checkpoint)
    model = torch.nn.Linear(2, 2)
    source, step_fn, pusher = _Source(), _TimedStep(), _TimedPusher()
    run_dir = tmp_path / ("overlap" if overlap else "serial")
    settings = TrainerSettings(steps=STEPS, batch_groups=1, checkpoint_every=2, keep_checkpoints=10, run_dir=run_dir,
                               overlap_push=overlap)
    trainer = Trainer(settings, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      step_fn=step_fn, export_weights=lambda: iter([("w", model.weight.detach().clone())]),
                      lead=RankZero(source=source, clock=clock, ledger=Ledger(run_dir / "ledger"), pusher=pusher))
    start = time.monotonic()
    try:
        trainer.train()
    finally:
        trainer.close()
    return {"wall": time.monotonic() - start, "steps": step_fn.intervals, "pushes": pusher.pushes, "saved": saved,
            "judged_at": source.judged_at, "acked": source.acked, "version": clock.get()}


def test_overlapped_push_runs_while_the_next_step_trains_and_commits_wait_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serial = _run(tmp_path, False, monkeypatch)
    overlap = _run(tmp_path, True, monkeypatch)
    for run in (serial, overlap):
        assert [v for v, _, _ in run["pushes"]] == list(range(1, STEPS + 1))
        assert run["version"] == STEPS
        # Every commit records the version the engines confirmed: the push in flight finished first.
        assert [(s["step"], s["policy_version"], s["clock"]) for s in run["saved"]] == [(2, 2, 2), (4, 4, 4),
                                                                                      (5, 5, 5)]
        assert run["acked"] == [f"{i}-0" for i in range(STEPS)]

    def overlapped(run: dict[str, Any]) -> list[bool]:
        # Push n (of step n) against step n + 1's training interval.
        return [push_end > run["steps"][n][0] for n, (_, _, push_end) in enumerate(run["pushes"][:-1], start=1)]

    assert not any(overlapped(serial))
    # Steps 2 and 4 commit, which waits for their pushes; the pushes of steps 1 and 3 overlap the next step.
    assert overlapped(overlap) == [True, False, True, False]
    # While its push is in flight, the next drain judges against the version being pushed, not the older one.
    assert overlap["judged_at"] == [0, 1, 2, 3, 4]
    assert overlap["wall"] < serial["wall"] - 1.5 * min(STEP_S, PUSH_S)
