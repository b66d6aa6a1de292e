"""The CPU engine's weight-update endpoints, SGLang 0.5.23's on aiohttp; ``server.py`` serves generation and wires
both into one application.

Endpoints (bodies and answers in SGLang's field names):

- ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size, group_name, backend}``
  joins the weight group (gloo only here) as ranks ``rank_offset .. rank_offset + tp - 1`` (``--tp``, see
  ``tp_group.py``) and answers once joined; ``POST /destroy_weights_update_group``.
- ``POST /begin_weight_update``, ``POST /update_weights_from_distributed``, ``POST /end_weight_update``; the middle
  one answers 400 outside a begin/end window, as SGLang does. While generation is paused (the pusher pauses in
  place for the push; ``--hold-until-update`` holds until the first one), a flat bucket of one tensor, or a
  per-tensor announcement, whose tensors fit their parameters exactly is received straight into them
  (``WeightLoader.receive_in_place``, TP 1 only); other buckets are received into a buffer and copied in between
  forward passes (``bucket_receiver.py``). sluice's own, for a pusher that knows the engine says
  ``ordered_updates``: ``bucket_index`` and ``push_id`` on each announcement (received in that order,
  ``update_turns.py``), ``begin_window`` on bucket 0 (pause in place and open the window for that push), and
  ``push_id``, ``buckets`` and ``continue_generation`` on the end (wait for that many buckets of the push, then
  close, then continue).
- ``POST /update_weights_from_disk`` ``{model_path, weight_version, abort_all_requests (default false)}``: load a
  whole HF folder's safetensors (SGLang's protocol; the evaluator loads weight snapshots this way). The folder must
  fit the served architecture and cover every parameter; otherwise the old weights are kept. ``model_path`` in
  ``/model_info`` then names the folder.
- ``POST /update_weight_version`` ``{new_version, abort_all_requests (default true, as SGLang)}``.
- ``POST /weight_group_probe`` ``{group_name, nbytes, prepare}``: sluice's own, the bare-broadcast reference of
  ``sluice bench sync`` (``tp_group.py``).
- ``POST /pause_generation`` ``{mode: abort|retract|in_place}`` (retract behaves like in_place: requests keep their
  KV cache and resume), ``POST /continue_generation``.
- ``POST /flush_cache`` (or GET): empties the prefix cache, only on a fully idle engine (nothing waiting, running or
  paused in place); otherwise a 400 naming the pending requests, as SGLang answers.

Every endpoint here answers ``{"success": bool, "message": str}``.

SGLang's model-update lock (``update_lock.py``): ``/begin_weight_update``, ``/update_weights_from_distributed``,
``/end_weight_update`` and ``/update_weights_from_disk`` run without it while generation is paused, and otherwise
first take it as a writer, waiting for every generation in flight. An announcement with a ``bucket_index``, and an end
with ``buckets``, may arrive before the window they belong to opens (``begin_window`` pauses and opens it): they look
at the pause once their turn comes, not as they arrive, or they would wait for generations the pause then freezes.

Pausing and continuing are here because a push depends on them: whether generation is paused decides whether a bucket
is received in place, and continuing ends a ``--hold-until-update`` hold. What the weight and generation handlers
share (the pause and the hold, the update window, the loads pending, the update lock) is the ``Engine``'s and its
scheduler's, never a handler class's, so both classes see one state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from aiohttp import web
from pydantic import ValidationError

from pipeline.errors import EngineError, SluiceError
from pipeline.producers.cpu_engine.bucket_receiver import BucketReceiver
from pipeline.producers.cpu_engine.http_io import json_body, reply
from pipeline.producers.cpu_engine.prefix_cache import flush_refused
from pipeline.producers.cpu_engine.tp_group import TpWeightGroup
from pipeline.producers.cpu_engine.weight_requests import (
    EndUpdateRequest,
    InitGroupRequest,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
)
from pipeline.sync.packing import FLAT_FORMAT

if TYPE_CHECKING:
    # server.py imports this module to wire the routes; the Engine is needed here for annotations only.
    from pipeline.producers.cpu_engine.engine import Engine

log = logging.getLogger(__name__)


class WeightRoutes:
    """Weight-update handlers; each one parses, validates and hands the work to the engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.receiver = BucketReceiver(engine)

    async def init_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group``: join the trainer's weight group; answers once joined."""
        try:
            body = InitGroupRequest.model_validate(await json_body(request))
        except ValidationError as exc:
            return reply(False, f"invalid /init_weights_update_group request: {exc}")
        if body.backend != "gloo":
            return reply(False, f"backend {body.backend!r} is not available in the CPU engine; use backend 'gloo'")
        old = self.engine.groups.pop(body.group_name, None)
        if old is not None:
            await _leave(old)
        tp = self.engine.cfg.tp
        try:
            group = await TpWeightGroup.join(tp, master_address=body.master_address, master_port=body.master_port,
                                             rank_offset=body.rank_offset, world_size=body.world_size,
                                             group_name=body.group_name, timeout_s=body.timeout_s,
                                             bytes_received=self.engine.rank_bytes_received)
        except (SluiceError, RuntimeError) as exc:
            return reply(False, f"could not join weight group {body.group_name!r}: {exc}")
        self.engine.groups[body.group_name] = group
        ranks = f"ranks {body.rank_offset}..{body.rank_offset + tp - 1}" if tp > 1 else f"rank {body.rank_offset}"
        return reply(True, f"joined weight group {body.group_name!r} as {ranks} of {body.world_size}")

    async def destroy_group(self, request: web.Request) -> web.Response:
        """``POST /destroy_weights_update_group``."""
        body = await json_body(request)
        name = body.get("group_name", "weight_update_group")
        group = self.engine.groups.pop(name, None)
        if group is None:
            return reply(False, f"no weight group named {name!r}")
        await _leave(group)
        return reply(True, f"left weight group {name!r}")

    @asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """SGLang's rule for a weight update: paused, it runs as it is (the generations in flight are frozen, and
        new ones wait at the gate); not paused, it first takes the model-update lock as a writer, which waits until
        every generation in flight has finished and lets no new one start."""
        if self.engine.paused:
            yield
            return
        async with self.engine.model_update_lock.writing():
            yield

    async def begin_update(self, request: web.Request) -> web.Response:
        """``POST /begin_weight_update``: open the window in which updates are accepted (under ``_exclusive``)."""
        async with self._exclusive():
            await self._open_window(None)
        return reply(True, "weight update window opened")

    async def _open_window(self, push_id: str | None) -> None:
        """Nothing of an earlier window counts in the new one (a receive of a failed push that finished after that
        window closed, say)."""
        engine = self.engine
        engine.update_window_open = True
        engine.window_serial += 1
        engine.updated_in_window = engine.load_failed_in_window = False
        await engine.turns.open(push_id)

    async def end_update(self, request: web.Request) -> web.Response:
        """``POST /end_weight_update``: answers once every bucket received is loaded. With ``push_id`` and
        ``buckets`` (sluice's own, from a pusher that announces ahead), it may arrive before the push's last
        announcements: it first waits until that push's buckets ``0 .. buckets - 1`` are received (or one failed),
        so the pusher posts it with the last announcement, not a round trip after its answer. With
        ``continue_generation`` too, a whole push also continues generation, as ``/continue_generation`` does."""
        try:
            body = EndUpdateRequest.model_validate(await json_body(request))
        except ValidationError as exc:
            return reply(False, f"invalid /end_weight_update request: {exc}")
        if body.buckets is not None:
            push = body.push_id or ""
            failed = await self.engine.turns.settled(body.buckets, push)
            if failed is not None:
                if not self.engine.turns.holds(push):  # another push's window: not this request's to close
                    return reply(False, f"{failed}; weight_version stays {self.engine.generator.version}")
                async with self._exclusive():
                    await self._close_window()
                return reply(False, f"{failed}; the window is closed, weight_version stays "
                                    f"{self.engine.generator.version}", 500)
        async with self._exclusive():
            success, message, status = await self._close_window()
        if success and body.continue_generation:
            self._continue()
            message = f"{message}; generation continues"
        return reply(success, message, status)

    async def _close_window(self) -> tuple[bool, str, int | None]:
        engine = self.engine
        engine.update_window_open = False
        await engine.turns.close()
        pending, engine.pending_loads = engine.pending_loads, []
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in pending), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            engine.updated_in_window = False
            return False, f"loading a received bucket failed: {failed[0]!r}", 500
        if engine.updated_in_window:
            self._release()  # a whole push has landed: the weights are the trainer's now
        engine.updated_in_window = False
        return True, "weight update window closed", None

    def _release(self) -> None:
        if self.engine.held:
            self.engine.held = False
            self.engine.set_paused(False)
            log.info("first weight update received: generation starts")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed``: receive the announced tensors, then load them between steps.
        An announcement with a ``bucket_index`` waits for its turn in the window first (``update_turns.py``). The
        receive runs under ``_exclusive``, decided as the announcement arrives, or at its turn if it has an index."""
        engine = self.engine
        try:
            body = UpdateFromDistributedRequest.model_validate(await json_body(request))
        except ValidationError as exc:
            return reply(False, f"invalid /update_weights_from_distributed request: {exc}")
        if body.begin_window and (body.bucket_index != 0 or not body.push_id):
            return reply(False, "begin_window goes with bucket_index 0 and a push_id")
        if body.abort_all_requests:
            # Before the writer lock, as SGLang does: the generations it would wait for end now.
            await self._abort_all("aborted by a weight update")
        if body.begin_window:
            engine.set_paused(True)  # in place, as /pause_generation {"mode": "in_place"}: no writer lock needed
            await self._open_window(body.push_id)
        elif body.bucket_index is None and not engine.update_window_open:
            # An indexed one may come before the announcement that opens its push's window: its turn waits for it.
            return reply(
                False, "update_weights_from_distributed must come between /begin_weight_update and /end_weight_update"
            )
        # Checked before the turn, while the bucket before is still on the wire: that is time the turn would wait.
        refused, group = self._check_bucket(body)
        if body.bucket_index is None:
            if group is None:
                return reply(False, refused)
            async with self._exclusive():
                return reply(*await self.receiver.receive(body, group))
        if group is None:
            await engine.turns.fail(body.bucket_index, refused)  # its bytes would go to the next receive otherwise
            return reply(False, refused)
        refused = await engine.turns.take(body.bucket_index, body.push_id or "")
        if refused is not None:
            return reply(False, f"{refused}; nothing was received")
        success, message, status = False, "the receive was interrupted", 500
        try:
            async with self._exclusive():
                success, message, status = await self.receiver.receive(body, group, body.bucket_index)
        finally:
            await engine.turns.done(body.bucket_index, None if success else message)
        return reply(success, message, status)

    def _check_bucket(self, body: UpdateFromDistributedRequest) -> tuple[str, TpWeightGroup | None]:
        """The group to receive an announcement on, or (why it is refused, None); nothing is received."""
        engine = self.engine
        if body.load_format not in (None, FLAT_FORMAT):
            return f"load_format {body.load_format!r} is unknown; use none or {FLAT_FORMAT!r}", None
        try:
            engine.weights.check(body.names, body.dtypes, body.shapes)
        except EngineError as exc:
            return f"{exc}; nothing was received and the old weights are kept", None
        group = engine.groups.get(body.group_name)
        if group is None:
            return f"no weight group named {body.group_name!r}; call /init_weights_update_group first", None
        return "", group

    async def update_from_disk(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_disk``: read a whole HF folder off the scheduler thread, then load it between
        two forward passes (under ``_exclusive``), and flush the prefix cache if asked and idle."""
        engine = self.engine
        try:
            body = UpdateFromDiskRequest.model_validate(await json_body(request))
        except ValidationError as exc:
            return reply(False, f"invalid /update_weights_from_disk request: {exc}")
        if body.abort_all_requests:
            await self._abort_all("aborted by a weight update")  # before the writer lock, as SGLang does
        async with self._exclusive(), engine.update_lock, _all_held(engine.all_receive_locks()):
            await self.receiver.quiet()
            try:
                tensors = await asyncio.to_thread(engine.weights.read_folder, body.model_path)
            except EngineError as exc:
                return reply(False, f"{exc}; the old weights are kept")
            version = None if body.weight_version is None else str(body.weight_version)

            def load() -> None:
                if body.abort_all_requests:
                    engine.abort(lambda s: True, "aborted by a weight update")
                engine.weights.apply(tensors)
                engine.model_path = body.model_path
                if version is not None:
                    engine.generator.version = version
                if body.flush_cache:
                    engine.flush_after_update()

            await asyncio.wrap_future(engine.scheduler.call(load))
        self._release()
        return reply(True, f"loaded {len(tensors)} tensors from {body.model_path}; weight_version "
                           f"{engine.generator.version}")

    async def update_version(self, request: web.Request) -> web.Response:
        """``POST /update_weight_version``."""
        body = await json_body(request)
        if "new_version" not in body:
            return reply(False, "update_weight_version needs new_version")
        version, abort_all = str(body["new_version"]), bool(body.get("abort_all_requests", True))

        def action() -> None:
            if abort_all:
                self.engine.abort(lambda s: True, "aborted by a weight version update")
            self.engine.generator.version = version

        await asyncio.wrap_future(self.engine.scheduler.call(action))
        return reply(True, f"weight_version is now {version}")

    async def pause(self, request: web.Request) -> web.Response:
        """``POST /pause_generation``."""
        body = await json_body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return reply(False, f"pause mode {mode!r} is unknown; use abort, retract or in_place")
        self.engine.set_paused(True)
        if mode == "abort":
            await self._abort_all("aborted by pause_generation")
        return reply(True, f"generation paused ({mode})")

    async def _abort_all(self, message: str) -> None:
        engine = self.engine
        await asyncio.wrap_future(engine.scheduler.call(lambda: engine.abort(lambda s: True, message)))

    async def resume(self, request: web.Request) -> web.Response:
        """``POST /continue_generation``."""
        self._continue()
        return reply(True, "generation continues")

    def _continue(self) -> None:
        self.engine.held = False  # an explicit go-ahead overrides a hold
        self.engine.set_paused(False)

    async def weight_group_probe(self, request: web.Request) -> web.Response:
        """``POST /weight_group_probe`` ``{group_name, nbytes, prepare}`` (sluice only, for ``sluice bench sync``):
        with ``prepare``, allocate a buffer of ``nbytes``; without, receive one flat broadcast into it and drop it."""
        body = await json_body(request)
        name = str(body.get("group_name", "weight_update_group"))
        group = self.engine.groups.get(name)
        nbytes = body.get("nbytes")
        if group is None or not isinstance(nbytes, int) or nbytes <= 0:
            return reply(False, "weight_group_probe needs a joined group_name and nbytes > 0")
        try:
            if body.get("prepare"):
                await asyncio.to_thread(group.prepare_probe, nbytes)
            else:
                async with self.engine.receive_lock(name):
                    await self.receiver.quiet()
                    await asyncio.to_thread(group.probe, nbytes)
        except (SluiceError, RuntimeError) as exc:
            return reply(False, f"probe failed: {exc}", status=500)
        return reply(True, f"{'prepared' if body.get('prepare') else 'received'} {nbytes} bytes")

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``POST /flush_cache``: empty the prefix cache if the engine is fully idle, else a 400 (SGLang's rule);
        decided between two forward passes, where nothing can be admitted meanwhile."""
        engine = self.engine
        load = engine.scheduler.load()
        if load.num_running_reqs or load.num_waiting_reqs:
            # Plainly busy (a push's requests paused in place): refused here, without a hop to the scheduler thread.
            return reply(False, flush_refused(load.num_waiting_reqs, load.num_running_reqs))
        return reply(*await asyncio.wrap_future(engine.scheduler.call(engine.flush_prefix_cache)))



@asynccontextmanager
async def _all_held(locks: list[asyncio.Lock]) -> AsyncIterator[None]:
    """Every lock, taken in the order given (always the same order, so two holders cannot wait on each other)."""
    taken: list[asyncio.Lock] = []
    try:
        for lock in locks:
            await lock.acquire()
            taken.append(lock)
        yield
    finally:
        for lock in reversed(taken):
            lock.release()


async def _leave(group: TpWeightGroup) -> None:
    """Tear down this engine's members of a weight group off the event loop: a member's shutdown waits for its
    receives in flight, and one left waiting by a push that broke (another engine died inside it) ends only when the
    trainer's end closes or the group times out. Generation and every other route go on meanwhile."""
    await asyncio.to_thread(group.close)
