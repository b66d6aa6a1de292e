"""Bucketed weight broadcast from the trainer to rollout engines (SGLang's ``update_weights_from_distributed``).

Both ends live here: ``init_weight_group`` + ``receive_tensors`` / ``receive_flat`` for an engine, and
``WeightPusher`` for the trainer (rank 0 of the weight group), which packs buckets with ``pipeline.sync.packing``.

The group is built directly on a ``TCPStore`` rather than through ``dist.init_process_group``: the trainer already owns
the default group (Megatron's), and the engines are separate programs that join only this one group.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from pipeline.errors import SyncError
from pipeline.sync.base import DTYPE_ITEMSIZE, EngineReply, TensorMeta, WeightUpdateEngine
from pipeline.sync.packing import FLAT_FORMAT, BucketPacker, BucketSlots, PackedBucket, unpack
from pipeline.sync.sources import Prepacked, Streamed, exhaust, is_packed

log = logging.getLogger(__name__)
MB = 1 << 20
# Every bucket costs an announcement's round trip and the hand-offs around it, about 4 ms on gloo here whatever its
# size: at 64 MB that was a seventh of a 1 GB push; at 256 MB it is a thirtieth (docs/weight-push.md).
DEFAULT_BUCKET_BYTES: dict[str, int] = {"gloo": 256 * MB, "nccl": 512 * MB}
SUPPORTED_BACKENDS = ("gloo", "nccl")
BROADCAST_WINDOW = 16
"""Broadcasts of the per-tensor wire in flight at once (``WeightGroup.broadcast_all``)."""
GLOO_THREADS = 16
"""Worker threads of a gloo weight group (torch's default is 2). A gloo op holds a worker until its bytes are through,
so two workers let two broadcasts overlap however many are in flight; each op's fixed cost (about 0.8 ms here) then
shows: 1 GB in 4 MB broadcasts moved at 0.73-0.81 of one flat broadcast with 2 workers, 0.87-0.88 with 16 on both
ends (docs/weight-push.md). Idle workers cost nothing but their stacks."""

_T = TypeVar("_T")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for an SGLang dtype string ("bfloat16", ...); SyncError for one the push does not carry."""
    if name not in DTYPE_ITEMSIZE:
        raise SyncError(f"dtype {name!r} is not one the weight push carries; use one of {sorted(DTYPE_ITEMSIZE)}")
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The SGLang dtype string for a torch dtype (``torch.bfloat16`` -> "bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise SyncError(f"dtype {dtype} is not one the weight push carries; cast to one of {sorted(DTYPE_ITEMSIZE)}")
    return name


def meta_of(name: str, tensor: torch.Tensor) -> TensorMeta:
    """The announcement for one named tensor."""
    return TensorMeta(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(int(d) for d in tensor.shape))


# --------------------------------------------------------------------------------------------------------------------
# The group
# --------------------------------------------------------------------------------------------------------------------


class WeightGroup:
    """One member of the trainer-to-engines weight group: rank 0 is the trainer, engines hold the other ranks."""

    def __init__(
        self,
        *,
        store: Store,
        backend_impl: Any,
        rank: int,
        world_size: int,
        backend: str,
        group_name: str,
    ) -> None:
        self._store = store
        self._impl = backend_impl
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.group_name = group_name
        self._broken: str | None = None
        self._closed = False
        self._issuing = threading.Lock()  # one caller issues at a time: members match broadcasts by their order
        self._in_flight_lock = threading.Lock()
        self._in_flight: collections.deque[Any] = collections.deque()  # broadcasts started, oldest first

    @property
    def device(self) -> torch.device:
        """Where tensors must live to be broadcast: CPU for gloo, the current CUDA device for NCCL."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` in place from rank ``src``; blocks until this rank's part is done."""
        self.broadcast_all([tensor], src)

    def broadcast_all(self, tensors: Sequence[torch.Tensor], src: int = 0, window: int = BROADCAST_WINDOW) -> None:
        """One broadcast per tensor, in order, with up to ``window`` of them in flight at once; blocks until this
        rank's part of every one is done. Every member must issue the same broadcasts in the same order: the backend
        matches them by their place in that order, whichever runs first.

        In flight together, they keep the wire busy: on gloo, 1 GB in 16 MB broadcasts moved at 1.5 GB/s one at a
        time and at 2.8 GB/s four at a time, the rate of one 1 GB broadcast (docs/weight-push.md)."""
        self.wait(self.issue(tensors, src, window))

    def issue(self, tensors: Sequence[torch.Tensor], src: int = 0, window: int = BROADCAST_WINDOW) -> list[Any]:
        """Start one broadcast per tensor, in order, and return their handles for ``wait`` once the last one is
        started. The window of ``window`` broadcasts in flight spans calls: the next call's first broadcast starts
        while this call's last ones are still on the wire, so two buckets sent back to back leave no gap between
        them (waiting for the oldest broadcast in flight, of whichever call, when the window is full). The tensors
        must not be written or freed until ``wait`` returned. Callers issue one at a time, in the order every member
        issues in."""
        if not tensors:
            return []
        self._check_usable()
        for tensor in tensors:
            self._check_tensor(tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        works: list[Any] = []
        try:
            with self._issuing:
                for tensor in tensors:
                    while (oldest := self._oldest(window)) is not None:
                        oldest.wait()  # not under _in_flight_lock: another thread's wait drops its works meanwhile
                    work = self._impl.broadcast([tensor], opts)
                    with self._in_flight_lock:
                        self._in_flight.append(work)
                    works.append(work)
        except RuntimeError as exc:
            self.mark_broken(f"broadcast failed: {exc}")
            raise SyncError(f"broadcast in weight group {self.group_name!r} failed: {exc}") from exc
        return works

    def wait(self, works: Sequence[Any]) -> None:
        """Block until this rank's part of every broadcast ``issue`` returned is done."""
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            self.mark_broken(f"broadcast failed: {exc}")
            raise SyncError(f"broadcast in weight group {self.group_name!r} failed: {exc}") from exc
        finally:
            # A work holds its tensor: dropped here, a finished one frees what its caller frees (a probe's buffer).
            waited = {id(w) for w in works}
            with self._in_flight_lock:
                self._in_flight = collections.deque(w for w in self._in_flight if id(w) not in waited)

    def _oldest(self, window: int) -> Any:
        """The oldest broadcast in flight if ``window`` are, after dropping the finished ones at the front."""
        with self._in_flight_lock:
            while self._in_flight and self._in_flight[0].is_completed():
                self._in_flight.popleft()
            return self._in_flight[0] if len(self._in_flight) >= window else None

    def _check_usable(self) -> None:
        if self._closed:
            raise SyncError(f"weight group {self.group_name!r} is closed; create a new one with init_weight_group")
        if self._broken is not None:
            raise SyncError(
                f"weight group {self.group_name!r} is unusable after an earlier failure ({self._broken}); "
                "every member must re-create it with init_weight_group"
            )

    def _check_tensor(self, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous():
            raise SyncError("broadcast needs a contiguous tensor; call .contiguous() first")
        if tensor.device.type != self.device.type:
            raise SyncError(
                f"a {self.backend} weight group broadcasts {self.device.type} tensors, got one on {tensor.device}"
            )

    @property
    def broken(self) -> str | None:
        """Why the group may no longer be used, or None while it is usable."""
        return self._broken

    def mark_broken(self, reason: str) -> None:
        """Refuse further broadcasts: a collective that one side abandoned leaves the peers out of step."""
        self._broken = self._broken or reason

    def close(self) -> None:
        """Tear down the communicator and drop this member's store connection."""
        if self._closed:
            return
        self._closed = True
        shutdown: Callable[[], None] | None = getattr(self._impl, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                # A peer that already left makes shutdown complain; the group is gone either way.
                pass
        self._impl = None
        self._in_flight.clear()
        del self._store


def init_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    store: TCPStore | None = None,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) the weight group; blocks until all ``world_size`` members have joined.

    ``store``: rank 0's store, already bound (``bind_weight_store``); otherwise one is made at the address and port.
    """
    if backend not in SUPPORTED_BACKENDS:
        raise SyncError(f"weight group backend {backend!r} is unknown; use one of {SUPPORTED_BACKENDS}")
    if not 0 <= rank < world_size:
        raise SyncError(f"rank {rank} is outside a weight group of world_size {world_size}")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise SyncError("backend 'nccl' needs CUDA and a torch built with NCCL; use backend='gloo' on CPU")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True
        )
    # The key prefixes reproduce what SGLang's engine side gets from its custom group helper (a PrefixStore of the
    # group name, then torch's "<group>/" and "<device>/" prefixes), so a real SGLang engine and this trainer meet on
    # the same rendezvous keys.
    device_type = "cuda" if backend == "nccl" else "cpu"
    prefixed = PrefixStore(f"{device_type}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
    impl = _make_backend(backend, prefixed, rank, world_size, timeout)
    return WeightGroup(
        store=store, backend_impl=impl, rank=rank, world_size=world_size, backend=backend, group_name=group_name
    )


def bind_weight_store(world_size: int, timeout_s: float = 300.0) -> TCPStore:
    """Rank 0's store on a port the OS picks (``.port``), listening before any member is told where to join."""
    return TCPStore("0.0.0.0", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def _make_backend(backend: str, store: Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        impl: Any = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._threads = GLOO_THREADS
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        impl = dist.ProcessGroupGloo(store, rank, world_size, options)
    # torch's group helper does this on every member; a gloo rank > 0 waits on rank 0's sequence-number key, so the
    # trainer must publish it too or a real SGLang engine would stall here.
    impl._set_sequence_number_for_group()
    return impl


# --------------------------------------------------------------------------------------------------------------------
# Receiving side (engines)
# --------------------------------------------------------------------------------------------------------------------


def check_announcement(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[TensorMeta]:
    """Validate the ``names``/``dtypes``/``shapes`` of an update request and return them as metas."""
    if not len(names) == len(dtypes) == len(shapes):
        raise SyncError(
            f"update announces {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; they must match"
        )
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if list(names).count(n) > 1})
        raise SyncError(f"update announces these tensor names more than once: {dupes}")
    return [TensorMeta(name=n, dtype=d, shape=tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)]


def validate_metas(
    metas: Iterable[TensorMeta], expected: Mapping[str, TensorMeta], *, match_dtype: bool = True
) -> None:
    """Raise SyncError listing every announced tensor that is unknown or differs in shape (or dtype) from ``expected``.

    Run this before any broadcast: gloo receiving into a tensor of the wrong size aborts the process.
    """
    problems: list[str] = []
    for meta in metas:
        want = expected.get(meta.name)
        if want is None:
            problems.append(f"{meta.name}: not a parameter of the engine's model")
        elif want.shape != meta.shape:
            problems.append(f"{meta.name}: shape {list(meta.shape)} but the model has {list(want.shape)}")
        elif match_dtype and want.dtype != meta.dtype:
            problems.append(f"{meta.name}: dtype {meta.dtype} but the model has {want.dtype}")
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise SyncError(
            f"weight update does not fit the model ({shown}). Check that trainer and engine load the same architecture "
            "and that the trainer's name mapping produces HF names"
        )


def receive_tensors(
    group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive one ``broadcast(src=0)`` per announced tensor, in the announced order (several in flight at once,
    ``WeightGroup.broadcast_all``), then yield ``(name, tensor)`` for each.

    The announcement is validated now, before anything is received; the receive runs when the iterator is first
    advanced, so the caller must advance it or the sender stays blocked in broadcasts nobody receives.
    """
    metas = check_announcement(names, dtypes, shapes)
    device = group.device

    def _receive() -> Iterator[tuple[str, torch.Tensor]]:
        tensors = [torch.empty(m.shape, dtype=torch_dtype(m.dtype), device=device) for m in metas]
        group.broadcast_all(tensors, src=0)
        yield from zip((m.name for m in metas), tensors)

    return _receive()


def receive_flat(
    group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
    buffer: torch.Tensor | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Receive one flat bucket (``load_format="flattened_bucket"``): a single uint8 broadcast of exactly the announced
    bytes, into ``buffer`` (a uint8 tensor at least that long, reused by the caller) or a new one; returned as named
    views into it."""
    metas = check_announcement(names, dtypes, shapes)
    total = sum(m.nbytes for m in metas)
    if buffer is not None and (buffer.dtype != torch.uint8 or buffer.numel() < total):
        raise SyncError(f"a receive buffer of {buffer.numel()} {buffer.dtype} cannot hold a {total}-byte bucket")
    flat = buffer[:total] if buffer is not None else torch.empty(total, dtype=torch.uint8, device=group.device)
    group.broadcast(flat, src=0)
    return unpack(metas, flat)


# --------------------------------------------------------------------------------------------------------------------
# Sending side (trainer)
# --------------------------------------------------------------------------------------------------------------------


def _item_nbytes(item: object) -> int:
    if isinstance(item, TensorMeta):
        return item.nbytes
    if isinstance(item, tuple) and len(item) == 2:
        first, second = item
        if isinstance(first, TensorMeta):
            return first.nbytes
        if isinstance(second, torch.Tensor):
            return second.numel() * second.element_size()
        if isinstance(second, TensorMeta):
            return second.nbytes
    raise SyncError(f"plan_buckets takes TensorMeta or (name, tensor) items, got {type(item).__name__}")


def plan_buckets(items: Iterable[_T], bucket_bytes: int) -> list[list[_T]]:
    """Split ``items`` (``TensorMeta`` or ``(name, tensor)``), in order, into buckets of at most ``bucket_bytes``.

    Order is kept because the engine receives tensors in the order they are announced. A tensor larger than the
    bucket gets a bucket of its own rather than being split: SGLang loads whole parameters only.
    """
    if bucket_bytes <= 0:
        raise SyncError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[_T]] = []
    current: list[_T] = []
    used = 0
    for item in items:
        size = _item_nbytes(item)
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class PushStats:
    """What one weight push moved and how long it took (begin to end, HTTP included)."""

    weight_version: str
    tensors: int
    buckets: int
    bytes: int
    """Bytes on the wire: every tensor in the dtype it was announced in."""
    seconds: float
    peak_buffer_bytes: int = 0
    """The most bucket-buffer bytes rank 0 held at once (about two buckets for a streamed push)."""
    zero_copy_bytes: int = 0
    """Bytes sent straight from the tensors' own memory, never copied into a bucket (a streamed push's large
    tensors in the wire dtype)."""

    @property
    def mb_per_s(self) -> float:
        """Throughput in MiB/s."""
        return self.bytes / MB / self.seconds if self.seconds > 0 else math.inf


_NOTHING_TO_PUSH = "a weight push needs at least one tensor; use /update_weight_version to only bump the version"

Weights = Iterable[tuple[str, torch.Tensor]] | Sequence[PackedBucket]
"""What a push sends: named tensors, packed as they arrive, or buckets packed before (``WeightPusher.pack``)."""


class WeightPusher:
    """Rank 0 of the weight group: pushes named tensors to every engine, bucket by bucket.

    Per push: ``/pause_generation`` (in place) and ``/begin_weight_update`` on all engines, together; per bucket
    ``/update_weights_from_distributed`` to all engines concurrently with the bucket's broadcast (one flat uint8
    tensor, SGLang's ``flattened_bucket`` format, or one broadcast per tensor with ``flat=False``); then
    ``/end_weight_update``, a best-effort ``/flush_cache`` and ``/continue_generation``. The next
    bucket is cast and packed in a thread while the current one is on the wire, and at most two bucket buffers exist
    at once (``pipeline.sync.packing``). A streamed push sends a large tensor already in the wire dtype straight from
    its own memory (``zero_copy_bytes``, see ``BucketPacker``), so the named tensors must not change until ``push``
    returns; ``pack`` always copies. ``weight_version`` rides only on the last bucket, so an engine never labels
    tokens with the new version while it holds a mix of old and new weights.
    """

    def __init__(
        self,
        group: WeightGroup,
        engines: Sequence[WeightUpdateEngine],
        *,
        bucket_bytes: int | None = None,
        dtype: str | None = None,
        expected: Mapping[str, TensorMeta] | None = None,
        flush_cache: bool = True,
        flat: bool = True,
        zero_copy: bool = True,
        zero_copy_bytes: int | None = None,
    ) -> None:
        if group.rank != 0:
            raise SyncError(f"the pusher must be rank 0 of the weight group, this process is rank {group.rank}")
        if not engines:
            raise SyncError("WeightPusher needs at least one engine")
        self.group = group
        self.engines = list(engines)
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES[group.backend]
        # Casting floats to the engine's dtype (e.g. "bfloat16") halves the bytes on the wire for an fp32 trainer.
        self.dtype = dtype
        if dtype is not None:
            torch_dtype(dtype)
        self.expected = expected
        self.flush_cache = flush_cache
        self.flat = flat
        self.zero_copy = zero_copy
        self.zero_copy_bytes = zero_copy_bytes
        self._buffers = BucketSlots(2, self.bucket_bytes, group.device)  # reused by every streamed push
        self._flushable: list[WeightUpdateEngine] | None = None  # asked once, at the first push's flush
        self._ordered: bool | None = None  # asked once, at the first push: may announcements run ahead of answers

    @classmethod
    async def connect(
        cls,
        engines: Sequence[WeightUpdateEngine],
        *,
        master_address: str,
        master_port: int = 0,
        group_name: str = "sluice_weights",
        backend: str = "gloo",
        ranks_per_engine: Sequence[int] | None = None,
        timeout_s: float = 300.0,
        bucket_bytes: int | None = None,
        dtype: str | None = None,
        expected: Mapping[str, TensorMeta] | None = None,
        flush_cache: bool = True,
        flat: bool = True,
        zero_copy: bool = True,
        zero_copy_bytes: int | None = None,
    ) -> WeightPusher:
        """Host the weight group and have every engine join it; ``ranks_per_engine`` is each engine's TP size.

        The remaining arguments are the pusher's (see ``__init__``).
        """
        ranks = list(ranks_per_engine) if ranks_per_engine is not None else [1] * len(engines)
        if len(ranks) != len(engines) or any(r < 1 for r in ranks):
            raise SyncError(f"ranks_per_engine needs one positive entry per engine, got {ranks} for {len(engines)}")
        world_size = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        store = None
        if master_port == 0:  # bound here and now, then announced: no port picked first and bound later
            store = bind_weight_store(world_size, timeout_s)
            master_port = int(store.port)
        hosting = _run_in_thread(
            lambda: init_weight_group(master_address, master_port, 0, world_size, group_name, backend, timeout_s,
                                      store=store)
        )
        joins = [
            engine.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            )
            for engine, offset in zip(engines, offsets)
        ]
        await _expect_success(engines, joins, "init_weights_update_group")
        group = await asyncio.wait_for(hosting, timeout_s)
        return cls(group, engines, bucket_bytes=bucket_bytes, dtype=dtype, expected=expected, flush_cache=flush_cache,
                   flat=flat, zero_copy=zero_copy, zero_copy_bytes=zero_copy_bytes)

    def packer(self) -> BucketPacker:
        """A packer for one streamed push: this pusher's bucket size, wire dtype, device, two reused buffers, and
        zero-copy for large tensors in the wire dtype."""
        self._buffers.reset()
        return BucketPacker(bucket_bytes=self.bucket_bytes, dtype=self.dtype, device=self.group.device,
                            expected=self.expected, buffers=self._buffers, zero_copy=self.zero_copy,
                            zero_copy_bytes=self.zero_copy_bytes)

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[PackedBucket]:
        """Every weight cast and packed now, for a push later (a snapshot: the model in the wire dtype, copied, never
        aliasing the parameters)."""
        packer = BucketPacker(bucket_bytes=self.bucket_bytes, dtype=self.dtype, device=self.group.device,
                              expected=self.expected, slots=None)
        return packer.pack_all(named_tensors)

    async def push(self, weights: Weights, weight_version: str | int) -> PushStats:
        """Push every weight to every engine and set their version; raises SyncError naming the engine on failure.

        Named tensors are packed as they arrive (the iterable is always exhausted, even on failure: a trainer's
        exporter is a collective); large ones in the wire dtype are sent from their own memory, so nothing may write
        them until this returns. The first bucket is packed, so every check of its tensors has passed, before any
        engine is asked anything; a later tensor that fails a check fails the push after earlier buckets went out,
        and the engines keep the old version label until a whole push lands.
        """
        version = str(weight_version)
        if self.group.broken is not None:
            exhaust(weights)
            raise SyncError(
                f"weight group {self.group.group_name!r} is unusable ({self.group.broken}); "
                "close this pusher and connect a new one"
            )
        start = time.perf_counter()
        source = Prepacked(weights) if is_packed(weights) else Streamed(self.packer(), weights)  # type: ignore[arg-type]
        buckets = tensors = sent = 0
        opened = False
        try:
            # Paused in place for the whole push: requests keep their place and their KV cache, no forward pass
            # runs, so no token is computed from half-updated weights (docs/weight-push.md, "Generation across a
            # push"). Only a whole push continues them: one that fails leaves the engines paused until the next.
            first = asyncio.ensure_future(source.next())
            if self._ordered:
                # Known from an earlier push: bucket 0's announcement pauses and opens each window itself.
                item = await first
                if item is None:
                    raise SyncError(_NOTHING_TO_PUSH)
                opened = True
                buckets, tensors, sent = await self._push_ahead(source, item, version, begin=True)
                item = None
            else:
                # The pause, the window's opening and the packing of the first bucket go on together, one round trip
                # in all: the window only admits announcements, and none is sent before every engine answered both.
                pauses = [asyncio.ensure_future(e.pause_generation("in_place")) for e in self.engines]
                begins = [asyncio.ensure_future(e.begin_weight_update()) for e in self.engines]
                opened = True  # before the answers: an engine whose window opened is closed again if another refused
                await asyncio.wait([first, *pauses, *begins])
                for task in [*pauses, *begins]:
                    task.exception()  # seen, in case the first bucket or a refused pause raises before they are checked
                item = first.result()
                if item is None:
                    raise SyncError(_NOTHING_TO_PUSH)
                await _expect_success(self.engines, pauses, "pause_generation")
                await _expect_success(self.engines, begins, "begin_weight_update")
                if self._ordered is None:
                    self._ordered = await _take_ordered_updates(self.engines)
                    self._flushable = await _with_prefix_cache(self.engines) if self.flush_cache else []
                if self._ordered:
                    buckets, tensors, sent = await self._push_ahead(source, item, version, begin=False)
                    item = None
            while item is not None:
                bucket, last = item
                # No flush with the update: SGLang refuses to flush while requests are in flight, as they are in place.
                await self._push_bucket(bucket, version if last else None, False)
                buckets, tensors, sent = buckets + 1, tensors + len(bucket.metas), sent + bucket.nbytes
                bucket.release()
                source.sent()
                item = await source.next()
        except BaseException:
            await source.abort()
            if opened:
                # Close the engines' update windows so they answer again; the original error is what matters.
                await asyncio.gather(*(e.end_weight_update() for e in self.engines), return_exceptions=True)
            raise
        await source.abort()  # nothing left to stop; waits for the packing thread to end
        if not self._ordered:  # an engine that takes announcements in order had its end with the last one
            await _expect_success(self.engines, [e.end_weight_update() for e in self.engines], "end_weight_update")
        if self.flush_cache:
            await self._flush_prefix_caches(version)
        # Every engine has every weight and the new label: generation continues (an engine held since it was adopted,
        # sync.lifecycle, serves from here on too).
        if not self._continued_at_end():
            await _expect_success(self.engines, [e.continue_generation() for e in self.engines], "continue_generation")
        return PushStats(weight_version=version, tensors=tensors, buckets=buckets, bytes=sent,
                         seconds=time.perf_counter() - start, peak_buffer_bytes=source.peak_buffer_bytes,
                         zero_copy_bytes=source.zero_copy_bytes)

    def _continued_at_end(self) -> bool:
        """Whether ``/end_weight_update`` also continues generation: with one engine, which takes announcements in
        order, and no prefix cache to flush between the two, its end means every engine has the whole push."""
        return bool(self._ordered) and len(self.engines) == 1 and not self._flushable

    async def _flush_prefix_caches(self, version: str) -> None:
        """Drop cached prefixes computed by the old weights, where the engine can: SGLang refuses while requests are
        in flight (they are, in place), and then its cache keeps them. An engine that says it keeps no prefix cache
        (the CPU engine) is not asked: a round trip per push, a twentieth of a 50 MB push on gloo."""
        if self._flushable is None:
            self._flushable = await _with_prefix_cache(self.engines)
        flushable = self._flushable
        replies = await asyncio.gather(*(e.flush_cache() for e in flushable), return_exceptions=True)  # type: ignore[attr-defined]
        for engine, reply in zip(flushable, replies):
            if isinstance(reply, BaseException) or not reply.success:
                log.debug("engine %s kept its prefix cache after push %s: %s", engine.name, version, reply)

    async def close(self) -> None:
        """Have every engine leave the group, then tear down this end; a new ``connect`` may reuse the group name."""
        calls = [e.destroy_weights_update_group(self.group.group_name) for e in self.engines]
        try:
            await _expect_success(self.engines, calls, "destroy_weights_update_group")
        finally:
            self.group.close()

    def _announce(self, bucket: PackedBucket, weight_version: str | None, flush_cache: bool,
                  **order: Any) -> dict[asyncio.Future[Any], WeightUpdateEngine]:
        """Post the bucket's ``/update_weights_from_distributed`` to every engine; the reply futures, by engine."""
        metas = bucket.metas
        # A run of zero-copy tensors goes on the per-tensor wire whatever the pusher's format: one broadcast each,
        # from their own memory.
        extra: dict[str, Any] = {"load_format": FLAT_FORMAT} if self.flat and bucket.parts is None else {}
        return {
            asyncio.ensure_future(
                engine.update_weights_from_distributed(
                    names=[m.name for m in metas],
                    dtypes=[m.dtype for m in metas],
                    shapes=[list(m.shape) for m in metas],
                    group_name=self.group.group_name,
                    flush_cache=flush_cache,
                    weight_version=weight_version,
                    abort_all_requests=False,
                    **extra,
                    **order,
                )
            ): engine
            for engine in self.engines
        }

    async def _push_ahead(self, source: Streamed | Prepacked, item: tuple[PackedBucket, bool] | None,
                          version: str, begin: bool) -> tuple[int, int, int]:
        """Send every bucket, announcing each as soon as it is packed, and starting its broadcasts as soon as the
        bucket before has started its last one (its bytes still on the wire).

        Only for engines that take a window's announcements in the order of their ``bucket_index`` whatever order
        they arrive in (``ordered_updates``): each one then waits for its turn at the engine and starts receiving the
        moment the bucket before has started its last receive, instead of a round trip and two thread hops after
        its last byte, about 3 ms a bucket here (docs/weight-push.md). Broadcasts still start in announced order, at
        most ``BROADCAST_WINDOW`` in flight across buckets, and the packing thread still holds at most two buckets:
        one is given back only once its last broadcast is through on rank 0's side. With ``begin``, bucket 0's
        announcement pauses generation and opens the window (``begin_window``). ``/end_weight_update`` goes out
        with the last announcement, naming the push and its bucket count, so each engine closes its window as soon
        as the last bucket is in (and continues, ``_continued_at_end``). Returns (buckets, tensors, bytes) sent."""
        push_id = uuid.uuid4().hex
        replies: dict[asyncio.Future[Any], WeightUpdateEngine] = {}
        sendings: list[_Sending] = []
        ends: list[asyncio.Future[EngineReply]] = []
        upcoming: asyncio.Future[Any] | None = None
        buckets = tensors = sent = 0
        landed = False  # what went out before a packing error has landed: the group is still in step
        try:
            while item is not None:
                bucket, last = item
                opening = {"begin_window": True} if begin and buckets == 0 else {}
                replies.update(self._announce(bucket, version if last else None, False, bucket_index=buckets,
                                              push_id=push_id, **opening))
                buckets, tensors, sent = buckets + 1, tensors + len(bucket.metas), sent + bucket.nbytes
                if last:
                    continued = self._continued_at_end()
                    ends = [asyncio.ensure_future(e.end_weight_update(push_id=push_id, buckets=buckets,
                                                                      continue_generation=continued))
                            for e in self.engines]
                if sendings:
                    await _watching(sendings[-1].issued, replies)  # the group matches broadcasts by their order
                sendings.append(self._send(bucket, source))
                upcoming = asyncio.ensure_future(source.next())
                try:
                    item = await _watching(upcoming, replies)
                except BaseException as exc:
                    if upcoming.done() and not upcoming.cancelled() and upcoming.exception() is exc:
                        # A tensor the packer refused (the engines have not been told of it): the buckets on the
                        # wire are whole, so let them land, as the one-at-a-time push does, and keep the group.
                        for sending in sendings:
                            await _watching(sending.done, replies)
                        await _watching(None, replies)
                        landed = True
                    raise
            for sending in sendings:
                await _watching(sending.done, replies)
            await _watching(None, replies)
        except BaseException as exc:
            for task in [*replies, *ends, *([upcoming] if upcoming is not None else [])]:
                task.cancel()
            if not landed:
                self.group.mark_broken(f"a weight push failed mid-bucket: {exc}")
            raise
        # Every bucket is in on every engine: what fails from here is a load, and the group is still in step.
        await _expect_success(self.engines, ends, "end_weight_update")
        return buckets, tensors, sent

    def _send(self, bucket: PackedBucket, source: Streamed | Prepacked) -> _Sending:
        """Broadcast one bucket from a thread; it goes back to ``source`` once its bytes are through here."""
        loop = asyncio.get_running_loop()
        issued: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if not issued.done():
                issued.set_result(None) if error is None else issued.set_exception(error)

        def send() -> None:
            try:
                works = self._issue_bucket(bucket)
            except BaseException as exc:
                _call_soon(loop, settle, exc)
                raise
            _call_soon(loop, settle, None)
            self.group.wait(works)

        def give_back(done: asyncio.Future[None]) -> None:
            # Only a bucket whose bytes are through: after a failure, a broadcast may still read it (the failed
            # push's buffers are dropped, BucketSlots.reset).
            if not done.cancelled() and done.exception() is None:
                bucket.release()
                source.sent()

        issued.add_done_callback(lambda f: f.cancelled() or f.exception())
        done = _run_in_thread(send)
        done.add_done_callback(give_back)
        return _Sending(issued, done)

    async def _push_bucket(self, bucket: PackedBucket, weight_version: str | None, flush_cache: bool) -> None:
        posts = self._announce(bucket, weight_version, flush_cache)
        sending = _run_in_thread(lambda: self._broadcast_bucket(bucket))
        pending: set[asyncio.Future[Any]] = set(posts) | {sending}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is sending:
                        task.result()
                    else:
                        _check_reply(posts[task], task, "update_weights_from_distributed")
        except BaseException as exc:
            for task in pending:
                task.cancel()
            # Whether or not our side of the broadcast finished (gloo sends small tensors eagerly, so it may have),
            # a peer that failed did not take this bucket: the members are out of step and the group must be rebuilt.
            self.group.mark_broken(f"a weight push failed mid-bucket: {exc}")
            raise

    def _broadcast_bucket(self, bucket: PackedBucket) -> None:
        self.group.wait(self._issue_bucket(bucket))

    def _issue_bucket(self, bucket: PackedBucket) -> list[Any]:
        # Every receiver allocates exactly the announced bytes; a broadcast of another size would abort it (SIGABRT
        # in gloo), so the sizes are checked here, before anything is sent.
        announced = sum(m.nbytes for m in bucket.metas)
        if bucket.nbytes != announced:
            raise SyncError(f"a bucket of {bucket.nbytes} bytes was announced as {announced}; nothing was sent")
        if self.flat and bucket.parts is None:
            return self.group.issue([bucket.flat], src=0)
        # The works hold their tensors until done, a contiguous copy included.
        return self.group.issue([tensor.contiguous() for _, tensor in bucket.tensors()], src=0)


@dataclass
class _Sending:
    """One bucket's broadcasts from rank 0: ``issued`` once the last one started, ``done`` once all are through."""

    issued: asyncio.Future[None]
    done: asyncio.Future[None]


async def engines_dtype(engines: Sequence[WeightUpdateEngine], fallback: str | None) -> str | None:
    """The dtype to send floats in: the one every engine holds its weights in (asked through ``weight_dtype`` where
    an engine has it), else ``fallback`` (the model's own). Engines that disagree get the widest, each casting on load.
    """
    asks = [e.weight_dtype() for e in engines if hasattr(e, "weight_dtype")]  # type: ignore[attr-defined]
    found = {d for d in await asyncio.gather(*asks) if d is not None}
    if len(found) > 1:
        widest = max(found, key=lambda d: DTYPE_ITEMSIZE[d])
        log.warning("the engines hold their weights in %s; the push sends %s, which each casts on load",
                    sorted(found), widest)
        return widest
    return found.pop() if found else fallback


async def engines_tp(engines: Sequence[WeightUpdateEngine]) -> list[int]:
    """Each engine's TP size (``tp_size`` where an engine has it, else 1): how many ranks it takes in the group."""

    async def tp(engine: WeightUpdateEngine) -> int:
        ask = getattr(engine, "tp_size", None)
        return int(await ask()) if ask is not None else 1

    return list(await asyncio.gather(*(tp(e) for e in engines)))


async def _with_prefix_cache(engines: Sequence[WeightUpdateEngine]) -> list[WeightUpdateEngine]:
    """The engines to flush after a push: those with ``flush_cache`` that do not say they keep no prefix cache (an
    engine that cannot be asked is flushed, as before: a flush too many costs a round trip, a stale cache more)."""
    keeps = await _engines_say(engines, "prefix_cache", True)
    return [e for e, keep in zip(engines, keeps) if keep and hasattr(e, "flush_cache")]


async def _take_ordered_updates(engines: Sequence[WeightUpdateEngine]) -> bool:
    """Whether every engine takes a window's announcements in ``bucket_index`` order (the CPU engine says
    ``ordered_updates`` in ``/model_info``; SGLang does not, and gets one announcement at a time, which is always
    correct)."""
    return all(await _engines_say(engines, "ordered_updates", False))


async def _engines_say(engines: Sequence[WeightUpdateEngine], question: str, default: bool) -> list[bool]:
    """Each engine's answer to an optional yes/no question (a method of that name), or ``default`` for an engine
    that lacks it or cannot answer."""

    async def says(engine: WeightUpdateEngine) -> bool:
        ask = getattr(engine, question, None)
        if ask is None:
            return default
        try:
            return bool(await ask())
        except Exception as exc:  # noqa: BLE001 - the default is the safe answer
            log.debug("engine %s did not answer %s (%s); taking %s", engine.name, question, exc, default)
            return default

    return list(await asyncio.gather(*(says(e) for e in engines)))


async def _watching(target: asyncio.Future[_T] | None, replies: dict[asyncio.Future[Any], WeightUpdateEngine]
                    ) -> _T | None:
    """Wait for ``target`` (with None: for every reply); every reply that comes in meanwhile is checked (a refusal
    raises at once) and dropped from ``replies``."""
    while True:
        pending: set[asyncio.Future[Any]] = set(replies)
        if target is not None:
            pending.add(target)
        if not pending:
            return None
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not target:
                _check_reply(replies.pop(task), task, "update_weights_from_distributed")
        if target is not None and target in done:
            return target.result()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` on ``loop`` from another thread; nothing if the loop is gone (its push failed and moved on)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _run_in_thread(fn: Callable[[], _T]) -> asyncio.Future[_T]:
    """Run a blocking collective off the event loop, in a daemon thread.

    Not ``asyncio.to_thread``: a broadcast whose peer vanished blocks until the backend timeout, and the default
    executor's threads would then hold up interpreter exit for that long.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def _settle(result: _T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def _target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine, not swallowed
            _call_soon(loop, _settle, None, exc)
        else:
            _call_soon(loop, _settle, result, None)

    threading.Thread(target=_target, name="sluice-weight-broadcast", daemon=True).start()
    # Nobody may be awaiting any more (the push already failed); retrieve the outcome so asyncio does not warn.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


def _check_reply(engine: WeightUpdateEngine, task: asyncio.Future[Any], endpoint: str) -> None:
    try:
        reply: EngineReply = task.result()
    except SyncError:
        raise
    except Exception as exc:
        raise SyncError(f"engine {engine.name} failed {endpoint}: {exc}") from exc
    if not reply.success:
        raise SyncError(f"engine {engine.name} refused {endpoint}: {reply.message}")


async def _expect_success(
    engines: Sequence[WeightUpdateEngine], calls: Sequence[Any], endpoint: str
) -> None:
    tasks = [asyncio.ensure_future(call) for call in calls]
    if not tasks:
        return
    await asyncio.wait(tasks)
    for task in tasks:
        # Marks each failure as seen: once the first one raises below, the others would otherwise be reported by
        # the garbage collector, at a moment of its choosing (it once broke a compile that was running then).
        task.exception()
    for engine, task in zip(engines, tasks):
        _check_reply(engine, task, endpoint)
