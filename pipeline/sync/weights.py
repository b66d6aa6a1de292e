"""Bucketed weight broadcast from the trainer to rollout engines (SGLang's ``update_weights_from_distributed``).

The group and both ends' helpers live here: ``init_weight_group`` + ``receive_tensors`` / ``receive_flat`` for an
engine; the trainer's side, ``WeightPusher`` (rank 0 of the weight group), is ``pipeline.sync.pusher``, which packs
buckets with ``pipeline.sync.packing``.

The group is built directly on a ``TCPStore`` rather than through ``dist.init_process_group``: the trainer already owns
the default group (Megatron's), and the engines are separate programs that join only this one group.
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from pipeline.errors import SyncError
from pipeline.sync.base import TensorMeta, check_announcement, torch_dtype
from pipeline.sync.packing import unpack

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
        if self._broken is not None:
            # gloo closes its connections only when the communicator is freed (shutdown and abort leave them open),
            # and the broadcasts of a failed push keep it alive from the tracebacks that hold them, which are
            # reference cycles. Collected now, a peer still waiting in a broadcast of the broken group fails at once
            # instead of at the group's timeout (300 s).
            gc.collect()


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
