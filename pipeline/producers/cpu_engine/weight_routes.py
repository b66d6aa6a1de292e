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
  forward passes.
- ``POST /update_weights_from_disk`` ``{model_path, weight_version, abort_all_requests (default false)}``: load a
  whole HF folder's safetensors (SGLang's protocol; the evaluator loads weight snapshots this way). The folder must
  fit the served architecture and cover every parameter; otherwise the old weights are kept. ``model_path`` in
  ``/model_info`` then names the folder.
- ``POST /update_weight_version`` ``{new_version, abort_all_requests (default true, as SGLang)}``.
- ``POST /weight_group_probe`` ``{group_name, nbytes, prepare}``: sluice's own, the bare-broadcast reference of
  ``sluice bench sync`` (``tp_group.py``).
- ``POST /pause_generation`` ``{mode: abort|retract|in_place}`` (retract behaves like in_place: requests keep their
  KV cache and resume), ``POST /continue_generation``, ``POST /flush_cache``.

Every endpoint here answers ``{"success": bool, "message": str}``.

Pausing and continuing are here because a push depends on them: whether generation is paused decides whether a bucket
is received in place, and continuing ends a ``--hold-until-update`` hold. What the weight and generation handlers
share (the pause and the hold, the update window, the loads pending, the update lock) is the ``Engine``'s and its
scheduler's, never a handler class's, so both classes see one state.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import EngineError, SluiceError
from pipeline.producers.cpu_engine.http_io import json_body, reply
from pipeline.producers.cpu_engine.tp_group import TpWeightGroup
from pipeline.sync.packing import FLAT_FORMAT

if TYPE_CHECKING:
    # server.py imports this module to wire the routes; the Engine is needed here for annotations only.
    from pipeline.producers.cpu_engine.server import Engine

log = logging.getLogger(__name__)


class InitGroupRequest(BaseModel):
    """Body of ``/init_weights_update_group``."""

    model_config = ConfigDict(extra="ignore")
    master_address: str
    """Host of the trainer's TCPStore (rank 0)."""
    master_port: int = Field(ge=1, le=65535)
    """Port of the trainer's TCPStore."""
    rank_offset: int = Field(ge=1)
    """This engine's rank in the group (the trainer is rank 0)."""
    world_size: int = Field(ge=2)
    """Trainer plus all engine ranks."""
    group_name: str = "weight_update_group"
    """Name the later updates refer to."""
    backend: str = "gloo"
    """Only gloo exists on CPU."""
    timeout_s: float = Field(default=300.0, gt=0)
    """How long to wait for the other members."""


class UpdateFromDistributedRequest(BaseModel):
    """Body of ``/update_weights_from_distributed``."""

    model_config = ConfigDict(extra="ignore")
    names: list[str]
    """HF parameter names, in the order they are broadcast."""
    dtypes: list[str]
    """SGLang dtype strings ("float32", "bfloat16", ...), one per name."""
    shapes: list[list[int]]
    """Shapes, one per name."""
    group_name: str = "weight_update_group"
    """The group the tensors arrive on."""
    flush_cache: bool = True
    """Accepted for compatibility; the CPU engine keeps no prefix cache."""
    abort_all_requests: bool = False
    """Abort running and waiting requests before loading."""
    weight_version: str | None = None
    """Version to report once these weights are loaded; None keeps the current one."""
    load_format: str | None = None
    """None: one broadcast per tensor; "flattened_bucket": one flat uint8 broadcast of all the bucket's bytes."""
    bucket_index: int | None = None
    """sluice's own: the bucket's place in the window, from a pusher that announces the next bucket before this one
    is answered (the engine says ``ordered_updates`` in ``/model_info``). Received only on its turn
    (``update_turns.py``); None: received as it comes, as SGLang does."""
    push_id: str | None = None
    """sluice's own, with ``bucket_index``: the push the bucket belongs to."""
    begin_window: bool = False
    """sluice's own, on bucket 0 of a push with ``push_id``: pause generation in place and open the window for that
    push first, as ``/pause_generation`` ``in_place`` and ``/begin_weight_update`` do: a round trip less per push.
    The push's later announcements and its end may arrive before it; they wait for the window."""


class EndUpdateRequest(BaseModel):
    """Body of ``/end_weight_update`` (SGLang sends none of these fields)."""

    model_config = ConfigDict(extra="ignore")
    push_id: str | None = None
    """sluice's own: the push whose buckets to wait for."""
    buckets: int | None = Field(default=None, ge=1)
    """sluice's own, with ``push_id``: how many buckets that push announced."""
    continue_generation: bool = False
    """sluice's own: continue generation once the whole push is loaded. Only a pusher with this one engine asks:
    with several, generation continues only once every engine has the whole push."""


class UpdateFromDiskRequest(BaseModel):
    """Body of ``/update_weights_from_disk``."""

    model_config = ConfigDict(extra="ignore")
    model_path: str = Field(min_length=1)
    """An HF model folder on the engine's machine, of the served architecture."""
    load_format: str | None = None
    """Accepted for compatibility; the CPU engine reads safetensors only."""
    abort_all_requests: bool = False
    """Abort running and waiting requests before loading (otherwise they continue on the new weights)."""
    weight_version: str | int | None = None
    """Version to report once these weights are loaded; None keeps the current one."""
    flush_cache: bool = True
    """Accepted for compatibility; the CPU engine keeps no prefix cache."""


class WeightRoutes:
    """Weight-update handlers; each one parses, validates and hands the work to the engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

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
            old.close()
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
        group.close()
        return reply(True, f"left weight group {name!r}")

    async def begin_update(self, request: web.Request) -> web.Response:
        """``POST /begin_weight_update``: open the window in which updates are accepted."""
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
                await self._close_window()
                return reply(False, f"{failed}; the window is closed, weight_version stays "
                                    f"{self.engine.generator.version}", 500)
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
            self.engine.scheduler.set_paused(False)
            log.info("first weight update received: generation starts")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed``: receive the announced tensors, then load them between steps.
        An announcement with a ``bucket_index`` waits for its turn in the window first (``update_turns.py``)."""
        engine = self.engine
        try:
            body = UpdateFromDistributedRequest.model_validate(await json_body(request))
        except ValidationError as exc:
            return reply(False, f"invalid /update_weights_from_distributed request: {exc}")
        if body.begin_window:
            if body.bucket_index != 0 or not body.push_id:
                return reply(False, "begin_window goes with bucket_index 0 and a push_id")
            engine.scheduler.set_paused(True)  # in place, as /pause_generation {"mode": "in_place"}
            await self._open_window(body.push_id)
        elif body.bucket_index is None and not engine.update_window_open:
            # An indexed one may come before the announcement that opens its push's window: its turn waits for it.
            return reply(
                False, "update_weights_from_distributed must come between /begin_weight_update and /end_weight_update"
            )
        # Checked before the turn, while the bucket before is still on the wire: that is time the turn would wait.
        refused, group = self._check_bucket(body)
        if body.bucket_index is None:
            return reply(False, refused) if group is None else reply(*await self._receive_bucket(body, group))
        if group is None:
            await engine.turns.fail(body.bucket_index, refused)  # its bytes would go to the next receive otherwise
            return reply(False, refused)
        refused = await engine.turns.take(body.bucket_index, body.push_id or "")
        if refused is not None:
            return reply(False, f"{refused}; nothing was received")
        success, message, status = False, "the receive was interrupted", 500
        try:
            success, message, status = await self._receive_bucket(body, group, body.bucket_index)
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

    async def _receive_bucket(self, body: UpdateFromDistributedRequest, group: TpWeightGroup,
                              index: int | None = None) -> tuple[bool, str, int | None]:
        """Receive one checked bucket and queue its load: (success, message, HTTP status). An indexed bucket received
        in place hands its turn (and ``update_lock``) on as soon as its receives have started, so the next bucket's
        start behind them with no gap on the wire; every other receive holds both until its bytes are in."""
        engine = self.engine
        serial = engine.window_serial
        async with engine.update_lock:
            if not engine.update_window_open:  # closed while this request waited for the lock
                return False, "the weight update window closed before this bucket's turn; nothing was received", None
            if not self._in_place(body, group):
                try:
                    # Received off the scheduler thread into buffers, so generation (if not paused) goes on during
                    # the transfer and a failed transfer leaves the old weights whole.
                    receive = (engine.weights.receive_flat if body.load_format == FLAT_FORMAT
                               else engine.weights.receive)
                    tensors = await asyncio.to_thread(group.receive, receive, body.names, body.dtypes, body.shapes,
                                                      engine.weights.recycle)
                except (SluiceError, RuntimeError) as exc:
                    return False, f"receiving the weights failed, old weights kept: {exc}", 500
                engine.weight_bytes_received += _nbytes(tensors)
                refused = await self._may_load(body, index, serial)
                if refused is not None:
                    engine.weights.recycle(tensors)
                    return False, refused, 500
                self._queue_load(tensors, body)
                return True, f"received {len(tensors)} tensors; they load before /end_weight_update answers", None
            receiving, issued = self._start_in_place(group, body)
            if index is None:
                await asyncio.wait([receiving])
            else:
                engine.receiving.add(receiving)
                receiving.add_done_callback(engine.receiving.discard)
                if await _first(issued, receiving):
                    await engine.turns.started(index)
        try:
            tensors = await receiving
        except (SluiceError, RuntimeError) as exc:
            shown = body.names[0] if len(body.names) == 1 else f"{len(body.names)} tensors from {body.names[0]}"
            return False, (f"receiving {shown} in place failed: {exc}. What it had not received keeps the old values "
                           "and the tensor in flight is undefined until a whole push lands; weight_version stays "
                           f"{engine.generator.version}"), 500
        engine.weight_bytes_received += _nbytes(tensors)
        refused = await self._may_load(body, index, serial)
        if refused is not None:
            return False, refused, 500
        self._queue_load([], body)  # already in the model: the load only moves the label
        return True, f"received {len(tensors)} tensors; they load before /end_weight_update answers", None

    async def _may_load(self, body: UpdateFromDistributedRequest, index: int | None, serial: int) -> str | None:
        """Why a received bucket may not be loaded, or None. An indexed bucket may have been received behind
        buckets still arriving (``started``): the label moves only once every one of them landed."""
        engine = self.engine
        if index is not None and body.weight_version is not None:
            failed = await engine.turns.settled(index, body.push_id or "")
            if failed is not None:
                return (f"{failed}; this bucket was received, but weight_version stays {engine.generator.version} "
                        "until a whole push lands")
        if engine.window_serial != serial or not engine.update_window_open:
            return ("the weight update window closed while this bucket was received; weight_version stays "
                    f"{engine.generator.version} until a whole push lands")
        return None

    def _queue_load(self, loaded: list[tuple[str, torch.Tensor]], body: UpdateFromDistributedRequest) -> None:
        engine = self.engine
        # Loaded by the scheduler between forward passes, in arrival order, while the next bucket is received: the
        # answer means "received", and /end_weight_update answers once every load is done. Generation is paused
        # during a push (pipeline.sync.weights), and the label moves with the last bucket's load, also when that
        # bucket was received in place (its load then only sets the label).
        engine.pending_loads.append(engine.scheduler.call(lambda: self._load(loaded, body)))
        # The pusher labels only its last bucket: a window that saw the label received a whole push.
        engine.updated_in_window = engine.updated_in_window or body.weight_version is not None

    def _start_in_place(self, group: TpWeightGroup, body: UpdateFromDistributedRequest
                        ) -> tuple[asyncio.Future[list[tuple[str, torch.Tensor]]], asyncio.Future[None]]:
        """The in-place receive, running in a thread, and a future done once every one of its receives started."""
        loop = asyncio.get_running_loop()
        issued: asyncio.Future[None] = loop.create_future()

        def on_issued() -> None:
            loop.call_soon_threadsafe(lambda: issued.done() or issued.set_result(None))

        receiving = asyncio.ensure_future(asyncio.to_thread(self._receive_in_place, group, body, on_issued))
        return receiving, issued

    async def _quiet(self) -> None:
        """Wait for in-place receives still in flight (``update_lock`` held: no new one starts)."""
        if self.engine.receiving:
            await asyncio.wait(list(self.engine.receiving))

    def _in_place(self, body: UpdateFromDistributedRequest, group: TpWeightGroup) -> bool:
        """Whether this bucket is received straight into its parameters: a flat bucket of one tensor, or the
        per-tensor wire's tensors (the pusher's run of large tensors sent from their own memory), each fitting its
        parameter exactly, while generation is paused (in place for the push, or held until the first update), so
        no token waits on the hold the receive puts on forward passes. TP 1 only: with more ranks, the other ranks'
        bytes are compared with rank 0's before anything is loaded, and an update whose ranks disagree is refused
        with the model untouched, which rank 0 writing into the model as it receives could no longer promise. An
        update that aborts requests first keeps the buffered path too, whose load aborts and then writes."""
        engine = self.engine
        flat = body.load_format == FLAT_FORMAT
        return (len(group.members) == 1 and not body.abort_all_requests and engine.scheduler.paused
                and engine.weights.in_place_targets(body.names, body.dtypes, body.shapes, flat=flat) is not None)

    def _receive_in_place(self, group: TpWeightGroup, body: UpdateFromDistributedRequest,
                          on_issued: Callable[[], None]) -> list[tuple[str, torch.Tensor]]:
        """Runs off the event loop. Paused or not, no forward pass may read the tensor half-written: the hold waits
        for a pass already running when the pause came (it finishes under the old weights) and keeps new ones off
        even if generation is continued meanwhile."""
        with self.engine.scheduler.hold_passes():
            flat = body.load_format == FLAT_FORMAT
            return group.receive(functools.partial(self.engine.weights.receive_in_place, flat=flat,
                                                   on_issued=on_issued), body.names, body.dtypes, body.shapes)

    def _load(self, tensors: list[tuple[str, torch.Tensor]], body: UpdateFromDistributedRequest) -> None:
        """Runs in the scheduler thread, between two forward passes."""
        if body.abort_all_requests:
            self.engine.abort(lambda s: True, "aborted by a weight update")
        try:
            self.engine.weights.apply(tensors)
        except BaseException:
            self.engine.load_failed_in_window = True
            raise
        finally:
            self.engine.weights.recycle(tensors)
        # Loads run in arrival order: the last bucket's, which carries the label, knows whether any before it failed.
        if body.weight_version is not None and not self.engine.load_failed_in_window:
            self.engine.generator.version = body.weight_version

    async def update_from_disk(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_disk``: read a whole HF folder off the scheduler thread, then load it between
        two forward passes."""
        engine = self.engine
        try:
            body = UpdateFromDiskRequest.model_validate(await json_body(request))
        except ValidationError as exc:
            return reply(False, f"invalid /update_weights_from_disk request: {exc}")
        async with engine.update_lock:
            await self._quiet()
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
        self.engine.scheduler.set_paused(True)
        if mode == "abort":
            await asyncio.wrap_future(
                self.engine.scheduler.call(lambda: self.engine.abort(lambda s: True, "aborted by pause_generation"))
            )
        return reply(True, f"generation paused ({mode})")

    async def resume(self, request: web.Request) -> web.Response:
        """``POST /continue_generation``."""
        self._continue()
        return reply(True, "generation continues")

    def _continue(self) -> None:
        self.engine.held = False  # an explicit go-ahead overrides a hold
        self.engine.scheduler.set_paused(False)

    async def weight_group_probe(self, request: web.Request) -> web.Response:
        """``POST /weight_group_probe`` ``{group_name, nbytes, prepare}`` (sluice only, for ``sluice bench sync``):
        with ``prepare``, allocate a buffer of ``nbytes``; without, receive one flat broadcast into it and drop it."""
        body = await json_body(request)
        group = self.engine.groups.get(str(body.get("group_name", "weight_update_group")))
        nbytes = body.get("nbytes")
        if group is None or not isinstance(nbytes, int) or nbytes <= 0:
            return reply(False, "weight_group_probe needs a joined group_name and nbytes > 0")
        try:
            if body.get("prepare"):
                await asyncio.to_thread(group.prepare_probe, nbytes)
            else:
                async with self.engine.update_lock:
                    await self._quiet()
                    await asyncio.to_thread(group.probe, nbytes)
        except (SluiceError, RuntimeError) as exc:
            return reply(False, f"probe failed: {exc}", status=500)
        return reply(True, f"{'prepared' if body.get('prepare') else 'received'} {nbytes} bytes")

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``POST /flush_cache``: nothing to flush (no prefix cache); kept for protocol compatibility."""
        return reply(True, "Cache flushed (the CPU engine keeps no prefix cache).")


async def _first(wanted: asyncio.Future[Any], other: asyncio.Future[Any]) -> bool:
    """Wait until ``wanted`` or ``other`` is done; whether ``wanted`` is (and did not fail)."""
    await asyncio.wait([wanted, other], return_when=asyncio.FIRST_COMPLETED)
    return wanted.done() and not wanted.cancelled() and wanted.exception() is None


def _nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)
