"""The trainer's weight push over engines that fail and come back.

A weight group is one collective: an engine that dies during a push breaks it for every member. ``EngineRotation``
keeps the push going without that engine: it finds which engines still answer, rebuilds the group over those, and
sends the step's weights again, so the trainer neither crashes nor rolls back to its last checkpoint. Before each
push it looks for engines that are out of the group or were restarted behind its back (a restarted engine answers
with the weight version it started with, not the last one pushed) and rebuilds the group with them, so the push that
follows re-syncs them with every weight. Between its restart and that push an engine serves its old weights; the
samples it makes meanwhile carry their real weight version, so the staleness policy sees them for what they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import torch

from pipeline.errors import SyncError
from pipeline.sync.base import WeightSource, WeightUpdateEngine
from pipeline.sync.lifecycle import Adoption, ManagedEngine, adopt_engines
from pipeline.sync.packing import PackedBucket
from pipeline.sync.pusher import PushStalledError, PushStats, WeightPusher
from pipeline.sync.sources import exhaust

log = logging.getLogger(__name__)

Connect = Callable[[list[WeightUpdateEngine]], Awaitable[WeightPusher]]
Discover = Callable[[list[WeightUpdateEngine]], list[WeightUpdateEngine]]


async def _healthy(engine: WeightUpdateEngine) -> bool:
    probe = getattr(engine, "health", None)
    if probe is None:
        return True  # an engine that cannot be probed is taken at its word
    try:
        return bool(await probe())
    except Exception:
        return False


async def _version(engine: WeightUpdateEngine) -> str | None:
    probe = getattr(engine, "weight_version", None)
    if probe is None:
        return None
    try:
        return str(await probe())
    except Exception:
        return None


class EngineRotation:
    """A ``WeightPusher`` over the engines that answer, rebuilt when one fails or one comes back."""

    def __init__(self, engines: Sequence[WeightUpdateEngine], connect: Connect,
                 discover: Discover | None = None, wait_s: float = 120.0) -> None:
        if not engines:
            raise SyncError("the weight push needs at least one engine")
        self.all = list(engines)
        self._connect = connect
        # The engines as they are now (one restarted on another node has another address), given those known.
        self._discover = discover
        # With no engine answering, how long to wait for one (the launcher restarts a dead engine in seconds; the
        # trainer failing instead would roll back to its checkpoint).
        self.wait_s = wait_s
        self.pusher: WeightPusher | None = None
        self.members: list[WeightUpdateEngine] = []
        self.pushed: str | None = None
        self.rebuilds = 0
        self.stalls = 0
        """Pushes abandoned because they stalled (each one retried on a rebuilt group)."""
        self._flush_refused_before = 0  # refused by the pushers of earlier groups

    @classmethod
    async def start(cls, engines: Sequence[WeightUpdateEngine], connect: Connect,
                    discover: Discover | None = None, wait_s: float = 120.0) -> EngineRotation:
        rotation = cls(engines, connect, discover, wait_s)
        await rotation._rebuild(await rotation._answering(rotation.all))
        return rotation

    @property
    def engines(self) -> list[WeightUpdateEngine]:
        return list(self.members)

    async def push(self, weights: WeightSource, weight_version: str | int) -> PushStats:
        """Push to the engines that answer; after a failure that an engine caused, once more to those left.

        ``weights`` must be sendable twice: packed buckets, a list of named tensors, or a callable that exports them
        afresh (a one-shot iterator would be empty the second time).
        """
        stats = await self.push_once(weights, weight_version)
        if stats is None:
            stats = await self.push_once(weights, weight_version)
        if stats is None:
            raise SyncError(f"weight push {weight_version} failed twice on engines that failed; see the log")
        return stats

    async def push_once(self, weights: WeightSource, weight_version: str | int) -> PushStats | None:
        """One attempt. None: it failed because an engine failed or restarted, or it stalled (``PushStalledError``),
        and the group was rebuilt over the engines that answer, so the caller should send the weights again. Raises
        when no engine is to blame."""
        source = weights() if callable(weights) else weights
        try:
            await self._admit_returned()
        except BaseException:
            exhaust(source)  # the other trainer ranks are walking the exporter too
            raise
        assert self.pusher is not None
        try:
            stats = await self.pusher.push(source, weight_version)
        except SyncError as exc:
            failure = str(exc)
            alive = await self._answering(self.members)  # waits for one to come back if none answers
            restarted = await self._restarted(alive)
            stalled = isinstance(exc, PushStalledError)
            if len(alive) == len(self.members) and not restarted and not stalled:
                raise  # every engine answers as it did: not an engine fault, and nothing to route around
            # A stall left the group out of step (a broadcast may be half-way); the push is dropped and made again
            # on a new group, once: a second stall is raised by ``push``.
            self.stalls += stalled
        else:
            self.pushed = str(weight_version)
            return stats
        # Rebuilt only once the error is dropped: it holds the failed push's broadcasts, and with them the old
        # group's connections, which an engine still waiting in one of them needs closed to give up
        # (WeightPusher.close).
        gone = [e.name for e in self.members if e not in alive]
        log.warning("weight push %s failed (%s); out of the rotation: %s; restarted: %s; the push goes to the %d "
                    "answering", weight_version, failure, ", ".join(gone) or "none",
                    ", ".join(e.name for e in restarted) or "none", len(alive))
        await self._rebuild(alive)
        return None

    @property
    def flush_refused(self) -> int:
        """Engine prefix-cache flushes refused over every push of this run's trainer process."""
        current = self.pusher.flush_refused if self.pusher is not None else 0
        return self._flush_refused_before + current

    def counters(self) -> dict[str, float]:
        """Refused prefix-cache flushes and pushes abandoned as stalled, over this process's run."""
        sources = self.pusher.source_counters() if self.pusher is not None else {}
        return {"flush_refused": float(self.flush_refused), "stalls": float(self.stalls), **sources}

    @property
    def dtype(self) -> str | None:
        """The current group's wire dtype (None: each tensor's own)."""
        return self.pusher.dtype if self.pusher is not None else None

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[PackedBucket]:
        """The weights packed for the current group's wire dtype, to push later (``WeightPusher.pack``)."""
        assert self.pusher is not None
        return self.pusher.pack(named_tensors)

    async def adopt(self, version: int, *, fresh: bool, model_path: str | None = None) -> list[Adoption]:
        """``adopt_engines`` over every engine that has the endpoints (all of them outside tests); any ``held`` one
        needs a push before it serves again."""
        managed: list[ManagedEngine] = [e for e in self.all if hasattr(e, "update_weight_version")]  # type: ignore[misc]
        return await adopt_engines(managed, version=version, fresh=fresh, model_path=model_path)

    async def close(self) -> None:
        if self.pusher is not None:
            self._flush_refused_before += self.pusher.flush_refused
            try:
                await self.pusher.close()
            except SyncError as exc:
                log.warning("leaving the weight group: %s", exc)
            self.pusher = None

    async def _answering(self, engines: Sequence[WeightUpdateEngine]) -> list[WeightUpdateEngine]:
        start = time.monotonic()
        pause, told = 0.5, start
        while True:
            ok = await asyncio.gather(*(_healthy(e) for e in engines))
            alive = [e for e, good in zip(engines, ok) if good]
            if alive:
                return alive
            waited = time.monotonic() - start
            if waited >= self.wait_s:
                raise SyncError(f"no engine answers ({', '.join(e.name for e in engines)}) after {self.wait_s:.0f}s; "
                                "the weight push has nowhere to go")
            if time.monotonic() - told >= 10.0:
                told = time.monotonic()
                log.warning("no engine answers /health (%s) for %.0fs; the push waits up to %.0fs. A server sluice "
                            "started is restarted by the launcher; one given in engine.urls must be restarted by "
                            "whoever runs it (an SGLang scheduler paused past --watchdog-timeout kills itself).",
                            ", ".join(e.name for e in engines), waited, self.wait_s)
            await asyncio.sleep(pause)
            pause = min(2 * pause, 5.0)

    async def _admit_returned(self) -> None:
        if self._discover is not None:
            self.all = self._discover(self.all)
            moved = [e for e in self.members if e not in self.all]
            if moved:
                log.warning("%s moved away; rebuilding the weight group without them", ", ".join(e.name for e in moved))
                await self._rebuild(await self._answering([e for e in self.members if e in self.all]))
        outside = [e for e in self.all if e not in self.members]
        back = [e for e, ok in zip(outside, await asyncio.gather(*(_healthy(e) for e in outside))) if ok]
        restarted = await self._restarted(self.members)
        if back or restarted:
            log.warning("%s answer again or restarted; rebuilding the weight group so that the next push re-syncs "
                        "them", ", ".join(e.name for e in [*back, *restarted]))
            members = [e for e in self.all if e in self.members or e in back]
            await self._rebuild(await self._answering(members))

    async def _restarted(self, engines: Sequence[WeightUpdateEngine]) -> list[WeightUpdateEngine]:
        """The engines that report another weight version than the last one pushed: restarted since."""
        if self.pushed is None:
            return []
        versions = await asyncio.gather(*(_version(e) for e in engines))
        return [e for e, v in zip(engines, versions) if v is not None and v != self.pushed]

    async def _rebuild(self, members: list[WeightUpdateEngine]) -> None:
        await self.close()
        self.pusher = await self._connect(members)
        self.members = members
        self.rebuilds += 1
