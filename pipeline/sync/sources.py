"""Where a push's buckets come from: packed before it (``Prepacked``, a snapshot) or as it goes (``Streamed``, a
packing thread one bucket ahead of the send). ``WeightPusher.push`` takes buckets with ``next`` and says ``sent`` for
each once it is through on rank 0's side."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from pipeline.sync.packing import BucketPacker, PackedBucket


def exhaust(weights: Iterable[Any]) -> None:
    """Walk a one-shot exporter that a push will not send: a trainer's is a collective every rank must finish, and
    the other ranks would otherwise wait in it until the group's timeout."""
    if not isinstance(weights, Sequence):
        for _ in weights:
            pass


def is_packed(weights: object) -> bool:
    """Whether a push's weights are buckets packed before it (a snapshot) rather than named tensors."""
    return isinstance(weights, Sequence) and len(weights) > 0 and isinstance(weights[0], PackedBucket)


class Prepacked:
    """Buckets packed before the push (a snapshot), handed out in order."""

    def __init__(self, buckets: Sequence[PackedBucket]) -> None:
        self._buckets = list(buckets)
        self._next = 0
        self.peak_buffer_bytes = sum(b.nbytes for b in self._buckets)
        self.zero_copy_bytes = sum(b.nbytes for b in self._buckets if b.zero_copy)

    async def next(self) -> tuple[PackedBucket, bool] | None:
        if self._next >= len(self._buckets):
            return None
        self._next += 1
        return self._buckets[self._next - 1], self._next == len(self._buckets)

    def sent(self) -> None:
        pass

    async def abort(self) -> None:
        pass


class Streamed:
    """``BucketPacker.stream`` run in a thread: the next bucket is packed while the current one is sent.

    The thread hands a bucket over as soon as it is packed, and packs the next only once the consumer is done with
    the one before (it asks for the next), so at most two buckets are alive: the one being sent and the one packed
    ahead, plus the tensor in hand. Bucket buffers
    alone would bound copied buckets, but a zero-copy bucket takes none: without this, the thread would run through
    the exporter ahead of the sends, holding every tensor it gathered (a TP/EP gather makes a new one) until sent.
    Holding a zero-copy bucket until it was sent is what keeps it valid: its view keeps the tensor's memory alive,
    and nothing writes a parameter during a streamed push (the next optimizer step waits for it).
    """

    def __init__(self, packer: BucketPacker, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._packer = packer
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._stop = threading.Event()
        self._done = self._loop.create_future()
        self._room = threading.Condition()
        self._unsent = 0  # buckets handed over that the consumer has not called sent() for
        thread = threading.Thread(target=self._run, args=(named,), name="sluice-weight-pack", daemon=True)
        thread.start()

    @property
    def peak_buffer_bytes(self) -> int:
        return self._packer.stats.peak_buffer_bytes

    @property
    def zero_copy_bytes(self) -> int:
        return self._packer.stats.zero_copy_bytes

    def _hand_over(self, kind: str, value: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, (kind, value))
        except RuntimeError:
            pass  # the loop is gone: the push already failed and its caller moved on

    def _wait_for_room(self) -> None:
        # Two buckets handed over and unfinished (one being sent, one waiting for it): pack no third until the
        # first is done.
        with self._room:
            while self._unsent >= 2 and not self._stop.is_set():
                self._room.wait()

    def _run(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        try:
            for item in self._packer.stream(named, self._stop):
                # Handed over as soon as it is packed, so the send of the bucket before finds it waiting (no thread
                # hop between two buckets); the wait that bounds memory comes after, before the next is packed.
                with self._room:
                    self._unsent += 1
                self._hand_over("bucket", item)
                self._wait_for_room()
            self._hand_over("end", None)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting push, not swallowed
            self._hand_over("error", exc)
        finally:
            try:
                self._loop.call_soon_threadsafe(lambda: self._done.done() or self._done.set_result(None))
            except RuntimeError:
                pass

    async def next(self) -> tuple[PackedBucket, bool] | None:
        """The next bucket (None after the last); the consumer calls ``sent`` once it is done with it."""
        kind, value = await self._items.get()
        if kind == "error":
            raise value
        return value if kind == "bucket" else None

    def sent(self) -> None:
        """The consumer has sent (and released) the oldest bucket it got: the thread may pack another. Two got and
        not sent hold the thread back, so a consumer that announces the next bucket while one is on the wire keeps
        the bound of two."""
        with self._room:
            self._unsent -= 1
            self._room.notify_all()

    async def abort(self) -> None:
        """Stop packing (the source is still drained) and wait for the thread; buckets not sent are given back."""
        self._stop.set()
        self._packer.slots.abort()
        with self._room:
            self._room.notify_all()
        await self._done
        while not self._items.empty():
            kind, value = self._items.get_nowait()
            if kind == "bucket":
                value[0].release()
