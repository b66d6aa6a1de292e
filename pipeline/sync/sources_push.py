"""A push from several sources: every trainer rank sends the tensors it owns over a weight group of its own, and the
engines take the new version once every source has landed (docs/weight-push.md, "Every owner sends its own share").

Rank 0 leads each push (``WeightPusher`` with ``sources``): it pauses every engine in place and opens its update
window, tells the other ranks to send, sends its own share, and hears back from each; only when every source has
landed does it close the windows, set the version label and continue generation. A source that fails leaves the
label where it was and the engines paused (some tensors may be new), until a push lands whole.

The ranks talk over ``ControlChannel``: a gloo group of the trainer ranks that only the push uses, carrying small
msgpack messages (no pickle). The other ranks answer in ``ShareSender.serve`` (``pipeline.sync.share_sender``), a
loop that runs for as long as rank 0 pushes one step's weights, retries included:

- ``connect``: join a weight group of this rank's own with the engines named (again after the engines changed);
- ``send``: send this rank's share (with ``turn``, only the rank named: engines that receive one group at a time);
- ``done``: this step's push is over.

After each, every rank reports (an error, and what it sent), gathered to rank 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from pipeline.errors import SyncError
from pipeline.sync.threads import run_in_thread

log = logging.getLogger(__name__)

SOURCE_GROUP = "sluice_weights_src{rank}"
"""The weight group of the source at trainer rank ``rank`` (rank 0 keeps the pusher's own group)."""


@dataclass(frozen=True)
class SourceReport:
    """What one source did in one step of the protocol."""

    rank: int
    error: str | None
    bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    seconds: float = 0.0


class ControlChannel:
    """The trainer ranks' control messages for a push from several sources, over a gloo group of their own."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size

    @classmethod
    def create(cls, timeout_s: float) -> ControlChannel:
        """Collective over every trainer rank (each must call it, in the same order as its other ``new_group``s)."""
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        return cls(group, dist.get_rank(), dist.get_world_size())

    def broadcast(self, message: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0's ``message`` on every rank (the others pass None)."""
        return dict(broadcast_msgpack(message, self.group))

    def gather(self, report: SourceReport) -> list[SourceReport]:
        """Every rank's report, in rank order, on every rank."""
        payload = msgpack.packb([report.rank, report.error, report.bytes, report.buckets, report.tensors,
                                 report.seconds])
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self.group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return [SourceReport(*msgpack.unpackb(p[: int(s.item())].numpy().tobytes()))
                for p, s in zip(parts, sizes, strict=True)]


class SourcesLead:
    """Rank 0's side of ``ControlChannel``: what ``WeightPusher`` calls to drive the other sources."""

    def __init__(self, control: ControlChannel) -> None:
        if control.rank != 0:
            raise SyncError("only trainer rank 0 leads a push from several sources")
        self.control = control
        self.broken: str | None = None
        """Why the control channel may be out of step (a push abandoned while a collective on it was in flight);
        every later use raises, and the trainer restarts with a fresh channel."""

    def mark_broken(self, reason: str) -> None:
        self.broken = self.broken or reason

    @property
    def others(self) -> int:
        """How many sources besides rank 0."""
        return self.control.world_size - 1

    def _check(self) -> None:
        if self.broken is not None:
            raise SyncError(f"the trainer ranks' push control is out of step ({self.broken}); the trainer must "
                            "restart (its ranks build a fresh one)")

    async def connect(self, engines: Sequence[str], tp: Sequence[int], dtype: str | None) -> None:
        """Have every other source join a weight group of its own with ``engines`` (each ``tp`` ranks), sending
        floats as ``dtype``; SyncError naming those that could not."""
        reports = await self._step({"op": "connect", "engines": list(engines), "tp": list(tp), "dtype": dtype}, None)
        _raise_failures(reports, "could not join a weight group with the engines")

    async def send(self, version: str, turn: int | None,
                   own: Callable[[], Any] | None = None) -> list[SourceReport]:
        """Tell the sources to send (``turn``: only that rank), running ``own`` (rank 0's share) meanwhile; their
        reports, rank 0's own included (its error, if ``own`` raised)."""
        return await self._step({"op": "send", "version": version, "turn": turn}, own)

    async def done(self) -> None:
        """This step's push is over (landed or given up): the sources go back to training."""
        self._check()
        await run_in_thread(lambda: self.control.broadcast({"op": "done"}))

    async def _step(self, message: dict[str, Any], own: Callable[[], Any] | None) -> list[SourceReport]:
        self._check()
        await run_in_thread(lambda: self.control.broadcast(message))
        start = time.perf_counter()
        mine = SourceReport(0, None)
        if own is not None:
            try:
                buckets, tensors, sent = await own()
                mine = SourceReport(0, None, sent, buckets, tensors, time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001 - reported with the others', and raised by the caller
                mine = SourceReport(0, f"{type(exc).__name__}: {exc}")
        reports = await run_in_thread(lambda: self.control.gather(mine))
        return reports


def _raise_failures(reports: Sequence[SourceReport], what: str) -> None:
    failed = [r for r in reports if r.error is not None]
    if failed:
        shown = "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
        raise SyncError(f"trainer source(s) {what}: {shown}")


def failures(reports: Sequence[SourceReport]) -> str | None:
    """The failed sources, named, or None when every one landed."""
    failed = [r for r in reports if r.error is not None]
    return "; ".join(f"rank {r.rank}: {r.error}" for r in failed) or None


def broadcast_msgpack(obj: Any, group: Any) -> Any:
    """Broadcast a msgpack-able object from rank 0 (pass None elsewhere)."""
    if dist.get_rank() == 0:
        data = msgpack.packb(obj, use_bin_type=True)
        size = torch.tensor([len(data)], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if dist.get_rank() == 0 else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return msgpack.unpackb(buf.numpy().tobytes(), raw=False)
