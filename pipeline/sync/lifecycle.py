"""Engines that outlive a run: bring each one to the run's weights and version before anything samples from it.

An SGLang server is the user's: it may have been started a minute ago with its default ``--weight-version`` (the
string ``"default"``), or have served an earlier run that left trained weights at that run's version. A producer that
samples from either labels tokens with a version the run never pushed, and the trainer then refuses them (a token
newer than the trainer) or the producer cannot parse them (``"default"``). ``adopt_engines`` runs before producers
start (the launcher) and again when the trainer starts, and decides per engine:

- **kept**: it reports the run's version. Nothing to do, except undoing a pause an earlier push left behind.
- **labelled**: a fresh run (version 0, no checkpoint) and an engine at ``"default"``: it serves the weights it
  loaded from its model path, which are the run's starting weights, so it only needs the run's label
  (``/update_weight_version`` with ``abort_all_requests`` false).
- **loaded**: a fresh run and an engine at any other version (another run's trained weights): it reloads the run's
  starting weights from disk (``/update_weights_from_disk`` with the run's model folder and version).
- **held**: a resumed run, or a load that the engine refused. The run's current weights are the trainer's, which
  exist nowhere on disk, so the engine is paused in place (``/pause_generation`` ``in_place``): requests wait, nothing
  is sampled, until the trainer's next push, which ends with ``/continue_generation``. The trainer pushes as it
  starts whenever an engine is held.

Every engine of a resumed run is held, even one reporting the run's version: a trainer that died in the middle of a
push leaves engines with some buckets of new weights under the old label, and only a whole push makes them right.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal, Protocol

from pipeline.errors import SyncError
from pipeline.sync.base import EngineReply

log = logging.getLogger(__name__)

DEFAULT_VERSION = "default"
"""What SGLang reports before any update when it was started without ``--weight-version``."""

Action = Literal["kept", "labelled", "loaded", "held"]


class ManagedEngine(Protocol):
    """The endpoints adoption needs (``SGLangClient`` has them, as does the CPU engine it talks to)."""

    @property
    def name(self) -> str: ...

    async def weight_version(self) -> str: ...

    async def update_weight_version(self, new_version: str | int, *, abort_all_requests: bool = False) -> EngineReply:
        ...

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | int | None = None,
                                       abort_all_requests: bool = False) -> EngineReply: ...

    async def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> EngineReply: ...

    async def continue_generation(self) -> EngineReply: ...


@dataclass(frozen=True)
class Adoption:
    """What ``adopt_engines`` found on one engine and did about it."""

    engine: str
    found: str
    action: Action
    detail: str = ""


async def adopt_engines(engines: list[ManagedEngine], *, version: int, fresh: bool,
                        model_path: str | None) -> list[Adoption]:
    """Bring every engine to the run's ``version`` (see the module docstring); one ``Adoption`` per engine, in order.

    ``fresh``: the run starts from its model folder (version 0, no checkpoint), so ``model_path`` holds its current
    weights; it must be a path the engine can read (on the engine's machine). Raises SyncError naming the engine if
    one does not answer or refuses to be labelled or paused.
    """
    return list(await asyncio.gather(*(_adopt(e, version, fresh, model_path) for e in engines)))


async def _adopt(engine: ManagedEngine, version: int, fresh: bool, model_path: str | None) -> Adoption:
    try:
        found = str(await engine.weight_version())
    except Exception as exc:
        raise SyncError(f"engine {engine.name} did not report its weight version: {exc}") from exc
    want = str(version)
    if not fresh:
        return await _hold(engine, found, "the run resumes: only the trainer's next push holds its weights")
    if found == want:
        await _expect(engine, "continue_generation", await engine.continue_generation())
        return Adoption(engine.name, found, "kept")
    if found == DEFAULT_VERSION:
        reply = await engine.update_weight_version(want, abort_all_requests=False)
        await _expect(engine, "update_weight_version", reply)
        await _expect(engine, "continue_generation", await engine.continue_generation())
        log.info("engine %s reported weight version %r (never updated): labelled %s", engine.name, found, want)
        return Adoption(engine.name, found, "labelled")
    if model_path is not None:
        reply = await engine.update_weights_from_disk(model_path, weight_version=want, abort_all_requests=False)
        if reply.success:
            await _expect(engine, "continue_generation", await engine.continue_generation())
            log.warning("engine %s held weights of version %r, not this run's: reloaded %s as version %s",
                        engine.name, found, model_path, want)
            return Adoption(engine.name, found, "loaded")
        return await _hold(engine, found, f"it refused to load {model_path}: {reply.message}")
    return await _hold(engine, found, "no model folder to load from")


async def _hold(engine: ManagedEngine, found: str, why: str) -> Adoption:
    await _expect(engine, "pause_generation", await engine.pause_generation("in_place"))
    log.warning("engine %s (weight version %r) holds generation until the trainer's first push: %s", engine.name,
                found, why)
    return Adoption(engine.name, found, "held", why)


async def _expect(engine: ManagedEngine, endpoint: str, reply: EngineReply) -> None:
    if not reply.success:
        raise SyncError(f"engine {engine.name} refused {endpoint}: {reply.message}")
