"""How the CPU engine receives one announced bucket of ``/update_weights_from_distributed`` and queues its load
(``WeightRoutes`` parses and checks the announcement and keeps the window; this is what happens once it is the
bucket's turn).

A bucket whose tensors fit their parameters exactly is received straight into them while generation is paused
(``WeightLoader.receive_in_place``, TP 1 only); an indexed one (``ordered_updates``) then hands its turn and the
update lock on as soon as its receives have started, so the next bucket's receives start behind them with no gap
on the wire. Every other bucket is received into a pool buffer, holding both until its bytes are in, and copied into
the model between forward passes. The label moves with the last bucket's load, and only once every bucket before it
landed.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pipeline.errors import SluiceError
from pipeline.producers.cpu_engine.tp_group import TpWeightGroup
from pipeline.sync.packing import FLAT_FORMAT

if TYPE_CHECKING:
    from pipeline.producers.cpu_engine.engine import Engine
    from pipeline.producers.cpu_engine.weight_requests import UpdateFromDistributedRequest


class BucketReceiver:
    """Receives checked buckets for one engine; the state it shares with the routes is the ``Engine``'s."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def receive(self, body: UpdateFromDistributedRequest, group: TpWeightGroup,
                              index: int | None = None) -> tuple[bool, str, int | None]:
        """Receive one checked bucket and queue its load: (success, message, HTTP status). An indexed bucket received
        in place hands its turn (and its group's ``receive_lock``) on as soon as its receives have started, so the
        next bucket's start behind them with no gap on the wire; every other receive holds both until its bytes are
        in."""
        engine = self.engine
        serial = engine.window_serial
        async with engine.receive_lock(body.group_name):
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
        if body.weight_version is not None or body.flush_cache:
            # Already in the model: the load only moves the label (and flushes the prefix cache if asked). An
            # unlabelled bucket that asks for no flush has nothing to load, and queueing nothing would put a hop to
            # the scheduler thread and back between the push's last byte and /end_weight_update's answer (about half
            # a millisecond of a 25 ms push here).
            self._queue_load([], body)
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
        # during a push (pipeline.sync.pusher), and the label moves with the last bucket's load, also when that
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

    async def quiet(self) -> None:
        """Wait for in-place receives still in flight (every ``receive_lock`` held: no new one starts)."""
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
        if body.flush_cache:
            self.engine.flush_after_update()


async def _first(wanted: asyncio.Future[Any], other: asyncio.Future[Any]) -> bool:
    """Wait until ``wanted`` or ``other`` is done; whether ``wanted`` is (and did not fail)."""
    await asyncio.wait([wanted, other], return_when=asyncio.FIRST_COMPLETED)
    return wanted.done() and not wanted.cancelled() and wanted.exception() is None


def _nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)
