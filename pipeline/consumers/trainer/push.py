"""The trainer's weight push: streamed, or packed into a snapshot and sent in the background (docs/weight-push.md).

``Trainer`` (``pipeline.consumers.trainer.loop``) takes these steps from ``PushSteps``. Every rank walks the exporter,
since that is a collective; rank 0 alone holds the pusher and the clock the push advances (``RankZero``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeline.errors import SyncError
from pipeline.sync.base import WeightPush
from pipeline.sync.packing import PackedBucket
from pipeline.sync.share_sender import ShareSender
from pipeline.sync.snapshot_pool import SnapshotPool
from pipeline.sync.sources_push import SourcesLead

if TYPE_CHECKING:
    from pipeline.consumers.trainer.loop import RankZero, TrainerSettings


@dataclass
class Owners:
    """This rank's part in a push from every owner (``sync.sources = "owners"``, docs/weight-push.md)."""

    export: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    """The tensors this rank owns (``pipeline.consumers.megatron.owners.OwnedExport``); collective."""
    lead: SourcesLead | None = None
    """Rank 0's side of the control channel (its pusher was given the same one)."""
    sender: ShareSender | None = None
    """Every other rank's source."""
    pool: SnapshotPool | None = None
    """This rank's snapshot buffers, kept from push to push."""


class PushSteps:
    """The push steps of ``Trainer``, which has every attribute named here."""

    s: TrainerSettings
    lead: RankZero | None
    export_weights: Any
    export_full: Any
    """What held-out snapshots hold when the push carries something else: with LoRA every weight with the adapters
    merged (``export_weights`` gives the adapters alone), with FP8 engines the trained weights unquantized; None
    otherwise."""
    version: int
    step: int
    owners: Owners | None
    _stop: bool
    _distributed: bool
    _loop: asyncio.AbstractEventLoop
    _push_thread: threading.Thread | None
    _push_error: BaseException | None
    _share: Callable[[dict[str, Any]], dict[str, Any]]
    """Rank 0's dict on every rank."""

    def push_weights(self, *, background: bool | None = None) -> None:
        """Send the new weights to every engine; the policy version advances once every engine confirmed (rank 0).

        Two ways (docs/weight-push.md). **Streamed** (``overlap_push`` off): every rank walks the exporter while rank 0
        casts, packs and sends one bucket at a time, so rank 0 holds about two buckets, never the model; the next
        step waits for it. **Snapshot** (``overlap_push`` on, or a held-out snapshot is due): the weights are packed
        into wire-dtype buckets now (the model in the engines' dtype), and sent in a thread while the next batch is
        drained and trained, which the snapshot makes safe. Pushes never overlap each other, and a commit or the end
        of the run waits for the one in flight. With several ranks and ``sync.sources = "owners"`` every rank packs
        and sends the tensors it owns instead (``_push_from_owners``).
        """
        self.finish_push()
        overlap = self.s.overlap_push if background is None else background
        final = self.step >= self.s.steps or self._stop
        version = self.version + 1  # the version being pushed; the clock follows once the engines have it
        lead = self.lead
        pusher = lead.pusher if lead is not None else None
        due = lead is not None and lead.snapshots is not None and lead.snapshots.due(version, final)
        merged = None
        if self.export_full is not None:
            # The engines get adapters or FP8 bytes, a held-out snapshot every weight as trained (collective, when due).
            if self._distributed:
                due = bool(self._share({"due": due})["due"])
            if due:
                merged = [(name, tensor.detach().clone()) for name, tensor in self.export_full()]
            due = False
        if self.owners is not None:
            decided = self._share({"push": pusher is not None, "full": due,
                                   "dtype": pusher.dtype if pusher is not None else None})
            if decided["push"]:
                self._push_from_owners(self.owners, version, overlap, final, decided, merged)
                return
        streamed = not overlap and lead is not None and pusher is not None and not due
        if self._distributed:
            streamed = bool(self._share({"streamed": streamed})["streamed"])  # rank 0 decides for every rank
        if streamed:
            self._stream_push(pusher, version, final, merged)
            return
        weights = self._snapshot(pusher)  # collective: every rank iterates; only rank 0 gets tensors
        if lead is None:
            return
        self.version = version
        if overlap:
            self._push_thread = threading.Thread(target=self._send,
                                                 args=(lead, weights, version, self.step, final, merged),
                                                 name="weight-push", daemon=True)
            self._push_thread.start()
        else:
            self._send(lead, weights, version, self.step, final, merged)
            self.finish_push()

    def _push_from_owners(self, owners: Owners, version: int, overlap: bool, final: bool,
                          decided: dict[str, Any], snapshot: list[Any] | None = None) -> None:
        """Every rank packs the tensors it owns (rank 0 packs the whole model when a held-out snapshot is due, as
        that needs every weight in one place), then sends them while the next step trains (``overlap``) or before
        it. Rank 0 leads: its pusher has the others send their shares and moves the engines' label once all have
        landed (``pipeline.sync.sources_push``)."""
        named = self.export_weights() if decided["full"] else owners.export()  # collective either way
        lead = self.lead
        assert owners.pool is not None
        owners.pool.recycle()  # the push before is over (finish_push); a full one's buffers were given away
        if lead is not None:
            assert lead.pusher is not None and owners.lead is not None
            weights: list[Any] = owners.pool.pack(named, decided["dtype"])
            if decided["full"]:
                owners.pool.forget()  # the held-out snapshot is written from these buffers, in the background
            self.version = version
            step, sources = self.step, owners.lead
            target: Callable[[], None] = lambda: self._lead_sources(lead, sources, weights, version,  # noqa: E731
                                                                    step, final, snapshot)
        else:
            assert owners.sender is not None
            if decided["full"]:
                for _ in named:  # rank 0 sends it all; this rank only takes part in the gathers
                    pass
                weights = []
            else:
                weights = owners.pool.pack(named, decided["dtype"])
            target = lambda: self._serve_sources(owners.sender, weights)  # noqa: E731
        if overlap:
            self._push_thread = threading.Thread(target=target, name="weight-push", daemon=True)
            self._push_thread.start()
        else:
            target()
            self.finish_push()

    def _lead_sources(self, lead: RankZero, sources: SourcesLead, weights: list[Any], version: int, step: int,
                      final: bool, snapshot: list[Any] | None = None) -> None:
        self._send(lead, weights, version, step, final, snapshot)
        try:
            self._loop.run_until_complete(sources.done())  # the others wait for it, landed or not
        except BaseException as exc:  # noqa: BLE001 - raised by finish_push, after the push's own error
            self._push_error = self._push_error or exc

    def _serve_sources(self, sender: ShareSender | None, weights: list[Any]) -> None:
        assert sender is not None
        try:
            sender.serve(weights, self._loop)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the trainer's thread by finish_push
            self._push_error = exc

    def _push_counters(self) -> dict[str, float]:
        """Running totals of the push's trouble: engines that kept their prefix cache after a push (SGLang refuses a
        flush while requests are paused in place) and pushes abandoned as stalled."""
        pusher = self.lead.pusher if self.lead is not None else None
        return {} if pusher is None else {f"sync/{key}": value for key, value in pusher.counters().items()}

    def _snapshot(self, pusher: WeightPush | None) -> list[Any]:
        """The weights as they are now, safe from the next optimizer step: packed in the wire dtype on rank 0 (less
        memory, no second packing), else cloned."""
        if pusher is not None:
            return list(pusher.pack(self.export_weights()))
        return [(name, tensor.detach().clone()) for name, tensor in self.export_weights()]

    def _stream_push(self, pusher: WeightPush | None, version: int, final: bool,
                     snapshot: list[Any] | None = None) -> None:
        """The streamed push, collective; ``pusher`` is rank 0's, None elsewhere. An attempt that failed because an
        engine did (the rotation rebuilt its group) is made again by every rank together, since only they together
        can export the weights again."""
        start = time.perf_counter()
        error: BaseException | None = None
        for _attempt in range(3):
            again = False
            if pusher is not None:
                try:
                    again = self._loop.run_until_complete(pusher.push_once(self.export_weights, version)) is None
                except BaseException as exc:  # raised below, once the other ranks were told to stop
                    error = exc
            else:
                for _ in self.export_weights():
                    pass
            if self._distributed:
                again = bool(self._share({"again": again})["again"])
            if not again:
                break
        else:
            error = error or SyncError(f"weight push {version} failed three times on engines that failed")
        if self.lead is None:
            return
        if error is not None:
            raise error
        self.version = version
        self._confirmed(self.lead, version, self.step, final, start, None, snapshot)

    def _send(self, lead: RankZero, weights: list[Any], version: int, step: int, final: bool,
              snapshot: list[Any] | None = None) -> None:
        start = time.perf_counter()
        try:
            if lead.pusher is not None:
                self._loop.run_until_complete(lead.pusher.push(weights, version))
            self._confirmed(lead, version, step, final, start, weights, snapshot)
        except BaseException as exc:  # re-raised on the trainer's thread by finish_push
            self._push_error = exc

    def _confirmed(self, lead: RankZero, version: int, step: int, final: bool, start: float,
                   weights: list[Any] | None, snapshot: list[Any] | None = None) -> None:
        """Every engine has ``version``: only now does the clock advance. A replay clock may have jumped ahead to a
        version seen in the data; the trainer follows it."""
        version = lead.clock.advance(at_least=version)
        self.version = max(self.version, version)
        weights = weights if snapshot is None else snapshot
        if lead.snapshots is not None and weights is not None and (self.export_full is None or snapshot is not None):
            named = [t for b in weights for t in b.tensors()] if weights and isinstance(weights[0], PackedBucket) \
                else weights
            lead.snapshots.maybe_write(version, named, final=final)
        lead.clock.event("weight_push", version=version, step=step, seconds=round(time.perf_counter() - start, 4),
                         engines=0 if lead.pusher is None else len(lead.pusher.engines))

    def finish_push(self) -> float:
        """Wait for the push in flight (re-raising its error); returns the seconds waited."""
        start = time.perf_counter()
        if self._push_thread is not None:
            self._push_thread.join()
            self._push_thread = None
        error, self._push_error = self._push_error, None
        if error is not None:
            raise error
        return time.perf_counter() - start


async def close_pusher(pusher: WeightPush) -> None:
    """Have the engines leave the weight group, then close every engine client the pusher was given."""
    try:
        await pusher.close()
    finally:
        # A rotation's engines are those in its group now; its clients include the ones that left it.
        for engine in pusher.all:
            await engine.close()
