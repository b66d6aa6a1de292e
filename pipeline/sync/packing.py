"""Packing named weights into flat buckets for the push, one bucket at a time.

A bucket on the wire is one uint8 tensor: its tensors' bytes back to back, in the announced order and dtype, with
no padding. That is SGLang's ``load_format="flattened_bucket"`` layout (its ``FlattenedTensorBucket``), so one
broadcast moves a whole bucket instead of one per tensor (gloo pays a fixed cost per collective; the bench measures
it), and the same layout serves the per-tensor wire too (each tensor is a view of its bucket).

``BucketPacker.stream`` consumes the exporter lazily: each tensor is cast into its bucket's buffer as it arrives (one
pass: cast and copy), so the whole model is never gathered. The first bucket of a push closes at
``first_bucket_bytes`` (the pusher asks for a sixteenth of a bucket), so the wire starts once that much is gathered
and packed rather than a whole bucket; later buckets fill to ``bucket_bytes``. At most ``slots`` bucket buffers
are alive at once: the one being sent and the one being packed (``BucketSlots``). The packer then waits for the
sender to give a buffer back, which bounds rank 0's extra memory to about two buckets plus the tensor in hand. A
tensor larger than a bucket gets a buffer of its own size, alone.

**Zero-copy.** A large tensor that already is what the wire carries (the wire dtype, contiguous, on the group's
device, at least ``zero_copy_bytes``) is not copied at all: it is broadcast from its own memory. It takes no buffer,
and ``release`` is a no-op for it. Such tensors, up to a bucket's bytes, share one announcement on the per-tensor wire
(one broadcast each: SGLang's plain ``update_weights_from_distributed``), while the tensors that are copied between
them keep filling the open flat bucket: the two kinds are gathered apart, so a model whose layers alternate small and
large tensors pays one round trip per bucket of each kind, not one per switch between them. Every announcement names
its tensors, so the order on the wire need not be the exporter's. A run of one is a normal flat bucket of one tensor.
What is sent aliases the tensors, so it is valid only while nothing writes them: the streamed push (the next
optimizer step waits for it) qualifies. An exporter that yields fresh tensors (gathered across ranks) keeps at most a
run's bytes of them alive a while longer.

``pack_all`` packs everything at once instead, and always copies: a snapshot of the weights that outlives the
parameters changing (the trainer's overlapped push), so it must not alias them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from pipeline.errors import SyncError
from pipeline.quant.fp8 import FP8, SCALE_SUFFIX
from pipeline.sync.base import DTYPE_ITEMSIZE, TensorMeta, dtype_name, torch_dtype, validate_metas

FLAT_FORMAT = "flattened_bucket"
"""SGLang's ``load_format`` for one flat uint8 broadcast per bucket."""

ZERO_COPY_MIN_BYTES = 1 << 20
"""The smallest tensor ever sent zero-copy, whatever the bucket size (see ``BucketPacker``)."""

FIRST_BUCKET_SHARE = 16
"""A streamed push's first bucket holds a sixteenth of a bucket's bytes (see ``BucketPacker``)."""


def unpack(metas: list[TensorMeta], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named tensors a flat bucket holds, as views into it (copies where a tensor's offset is not aligned to its
    element size, which a view cannot express)."""
    total = sum(m.nbytes for m in metas)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != total:
        raise SyncError(f"a flat bucket must be {total} uint8 bytes for its {len(metas)} tensors, got "
                        f"{flat.dtype} {list(flat.shape)}")
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for meta in metas:
        chunk = flat[offset : offset + meta.nbytes]
        if offset % DTYPE_ITEMSIZE[meta.dtype]:
            chunk = chunk.clone()
        out.append((meta.name, chunk.view(torch_dtype(meta.dtype)).reshape(meta.shape)))
        offset += meta.nbytes
    return out


class BucketSlots:
    """At most ``count`` bucket buffers alive at once; standard-size ones are reused (no page faults per push)."""

    def __init__(self, count: int | None, bucket_bytes: int, device: torch.device, pin_memory: bool = False) -> None:
        self.count = count
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.pin_memory = pin_memory
        """Page-locked host buffers, which a GPU copies from at full speed and without staging."""
        self._free: list[torch.Tensor] = []
        self._taken = 0
        self._cond = threading.Condition()
        self._aborted = False
        self.live_bytes = 0
        self.peak_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of at least ``nbytes``; blocks while ``count`` are taken. None once aborted."""
        with self._cond:
            while self.count is not None and self._taken >= self.count and not self._aborted:
                self._cond.wait()
            if self._aborted:
                return None
            self._taken += 1
            if nbytes <= self.bucket_bytes and self._free:
                buf = self._free.pop()
            else:
                buf = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=self.device,
                                  pin_memory=self.pin_memory)
            self.live_bytes += buf.numel()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes + sum(b.numel() for b in self._free))
            return buf

    def give_back(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._taken -= 1
            self.live_bytes -= buf.numel()
            if buf.numel() == self.bucket_bytes and (self.count is None or len(self._free) < self.count):
                self._free.append(buf)
            self._cond.notify_all()

    def abort(self) -> None:
        """Wake a packer waiting for a buffer: the push failed, nobody will give one back."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def reset(self) -> None:
        """Ready for the next push: nothing taken (what a failed push left out is dropped), not aborted; the free
        buffers stay."""
        with self._cond:
            self._taken = 0
            self._aborted = False
            self.live_bytes = 0
            self.peak_bytes = sum(b.numel() for b in self._free)


@dataclass
class PackedBucket:
    """One bucket ready for the wire: what is announced, and the bytes that follow the announcement (one flat uint8
    tensor, or with ``parts`` one tensor per announced name)."""

    metas: list[TensorMeta]
    flat: torch.Tensor
    _release: Callable[[], None] | None = field(default=None, repr=False)
    zero_copy: bool = False
    """The bytes are the tensors' own memory (nothing copied), not a bucket buffer."""
    parts: list[torch.Tensor] | None = None
    """A run of zero-copy tensors sent under one announcement on the per-tensor wire, one broadcast each (``flat``
    is then empty): several large tensors cannot share one flat broadcast without a copy, but need not each pay an
    announcement's round trip either."""

    @property
    def nbytes(self) -> int:
        if self.parts is not None:
            return sum(int(t.numel()) * t.element_size() for t in self.parts)
        return int(self.flat.numel())

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The named tensors, as views of the flat bytes (or the parts themselves)."""
        if self.parts is not None:
            return [(m.name, t) for m, t in zip(self.metas, self.parts, strict=True)]
        return unpack(self.metas, self.flat)

    def keep(self) -> None:
        """The buffer stays with this bucket for good: ``release`` does nothing from now on."""
        self._release = None

    def release(self) -> None:
        """Give the buffer back to its packer (streamed buckets); a no-op for a snapshot's and a zero-copy one's."""
        if self._release is not None:
            self._release()
            self._release = None


class _OpenBucket:
    def __init__(self, buf: torch.Tensor, limit: int) -> None:
        self.buf = buf
        self.limit = min(limit, buf.numel())
        self.used = 0
        self.metas: list[TensorMeta] = []

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.limit

    def add(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        n = meta.nbytes
        if n:
            dst = self.buf[self.used : self.used + n]
            wire = torch_dtype(meta.dtype)
            src = tensor.detach()
            if self.used % DTYPE_ITEMSIZE[meta.dtype] == 0:
                dst.view(wire).copy_(src.reshape(-1))  # cast, move and copy in one pass
            else:
                dst.copy_(src.to(device=dst.device, dtype=wire).contiguous().reshape(-1).view(torch.uint8))
        self.metas.append(meta)
        self.used += n


@dataclass
class PackStats:
    """What a packer did: tensors and bytes packed, and the most buffer bytes alive at once."""

    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    peak_buffer_bytes: int = 0
    zero_copy_tensors: int = 0
    """Tensors sent from their own memory (each its own bucket, no buffer, no copy)."""
    zero_copy_bytes: int = 0


class BucketPacker:
    """Casts named tensors to the wire dtype and packs them, in order, into flat buckets of ``bucket_bytes``; a large
    tensor already in the wire dtype goes out of its own memory instead (``zero_copy_bytes``).

    ``zero_copy_bytes``: the smallest tensor sent zero-copy; None picks 1 MiB on CPU and a quarter of a bucket on
    GPU; ``zero_copy=False`` copies every tensor. The default weighs what a zero-copy tensor saves against what it
    costs. It saves both copies of its bytes: rank 0's cast into a bucket and, for an engine that receives in place,
    the engine's copy into its model, together about 0.27 ms per MB on the 2-core CPU machine. Since runs and flat
    buckets are gathered apart, it costs only its own broadcast and a share of its run's announcement. On gloo that
    pays from 1 MiB: with 1 MiB instead of a sixteenth of a 64 MB bucket (4 MB), the 50 MB bench model's push took
    46.6 ms instead of 55.7 (medians of 21 rounds, alternately in one process; benchmarks/README.md). A GPU copies
    at hundreds of GB/s, so there a tensor pays for its own NCCL call only when large: a quarter of the default 512 MB
    bucket. One below 1 MiB never pays.
    """

    def __init__(self, *, bucket_bytes: int, dtype: str | None, device: torch.device,
                 expected: Mapping[str, TensorMeta] | None = None, slots: int | None = 2,
                 buffers: BucketSlots | None = None, zero_copy: bool = True,
                 zero_copy_bytes: int | None = None, first_bucket_bytes: int | None = None) -> None:
        if bucket_bytes <= 0:
            raise SyncError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if dtype is not None and dtype not in DTYPE_ITEMSIZE:
            raise SyncError(f"dtype {dtype!r} is not one the weight push carries; use one of {sorted(DTYPE_ITEMSIZE)}")
        if zero_copy_bytes is not None and zero_copy_bytes <= 0:
            raise SyncError(f"zero_copy_bytes must be positive, got {zero_copy_bytes}; pass zero_copy=False to copy "
                            "every tensor")
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.expected = expected
        self.device = device
        self.first_bucket_bytes = min(first_bucket_bytes or bucket_bytes, bucket_bytes)
        """The first bucket (flat or run) closes at this many bytes, later ones at ``bucket_bytes``."""
        self.zero_copy_bytes: int | None = None
        """Tensors of at least this many bytes go out zero-copy when they qualify; None: every tensor is copied."""
        if zero_copy:
            floor = ZERO_COPY_MIN_BYTES if device.type == "cpu" else max(bucket_bytes // 4, ZERO_COPY_MIN_BYTES)
            self.zero_copy_bytes = zero_copy_bytes or floor
        # A pusher passes its own slots, so that the two buffers outlive one push: a fresh 64 MB buffer costs
        # more in page faults (measured: 0.11 s) than the copy into it (0.01 s).
        self.slots = buffers if buffers is not None else BucketSlots(slots, bucket_bytes, device)
        self.stats = PackStats()
        self._seen: set[str] = set()

    def meta(self, name: str, tensor: torch.Tensor) -> TensorMeta:
        """What is announced for one tensor; SyncError for a duplicate, a non-tensor, or one the engine lacks."""
        if not isinstance(tensor, torch.Tensor):
            raise SyncError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in self._seen:
            raise SyncError(f"weight {name!r} appears twice in one push; the exporter must yield each name once")
        self._seen.add(name)
        # FP8 weights and their scales travel as they are: a cast would change what the engine serves.
        exact = tensor.dtype == FP8 or name.endswith(SCALE_SUFFIX)
        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() and not exact \
            else dtype_name(tensor.dtype)
        meta = TensorMeta(name=name, dtype=dtype, shape=tuple(int(d) for d in tensor.shape))
        if self.expected is not None:
            validate_metas([meta], self.expected)
        return meta

    def stream(self, named: Iterable[tuple[str, torch.Tensor]],
               stop: threading.Event | None = None) -> Iterator[tuple[PackedBucket, bool]]:
        """``(bucket, is_last)`` one at a time, packed as the tensors arrive (copied ones in the exporter's order,
        zero-copy ones gathered apart). Each bucket must be ``release``d once sent; the next one waits for a free
        buffer. A zero-copy bucket aliases its tensors until it was sent. The source is always exhausted, even when
        the consumer stops early or ``stop`` is set (a trainer's exporter is a collective every rank must finish)."""
        source = iter(named)
        current: _OpenBucket | None = None
        # Zero-copy tensors, up to a bucket's bytes, go under one announcement, and the copied ones fill the open flat
        # bucket; neither closes the other. A run aliases memory the exporter already holds, so keeping it open across
        # small tensors costs no buffer, and every announcement saved is a round trip with the wire idle. Each is
        # sent when full; at the end, whichever goes last carries the version label.
        run: list[tuple[TensorMeta, torch.Tensor]] = []
        run_bytes = 0
        # Until the first bucket goes, buckets close at first_bucket_bytes: the wire starts after a sixteenth of a
        # bucket is gathered and packed, not a whole one (a bucket of casts takes as long as its transfer on CPU).
        limit = self.first_bucket_bytes
        try:
            for name, tensor in source:
                if stop is not None and stop.is_set():
                    break
                meta = self.meta(name, tensor)
                own = self._zero_copy(meta, tensor)
                if own is not None:
                    if run and run_bytes + meta.nbytes > limit:
                        sent, run, run_bytes = self._close_run(run), [], 0
                        limit = self._full_size(current)
                        yield sent, False
                    run.append((meta, own))
                    run_bytes += meta.nbytes
                    self.stats.tensors += 1
                    continue
                if current is not None and not current.fits(meta.nbytes):
                    # Dropped before the yield: from here the bucket's buffer is the consumer's to give back.
                    closed, current = self._close(current), None
                    limit = self.bucket_bytes
                    yield closed, False
                if current is None:
                    buf = self.slots.take(meta.nbytes)
                    if buf is None:
                        break
                    current = _OpenBucket(buf, limit)
                current.add(meta, tensor)
                self.stats.tensors += 1
            else:
                # The run before the flat bucket: an engine that receives a run in place can start the next
                # bucket's receive behind it (``ordered_updates``), while a flat bucket's receive into a buffer ends
                # before the next one starts.
                tail = [self._close_run(run)] if run else []
                run = []
                if current is not None:
                    tail.append(self._close(current))
                    current = None
                for i, bucket in enumerate(tail):
                    yield bucket, i == len(tail) - 1
        finally:
            if current is not None:
                self.slots.give_back(current.buf)
            for _ in source:  # keep the other trainer ranks' collectives in step
                pass
            self.stats.peak_buffer_bytes = self.slots.peak_bytes

    def pack_all(self, named: Iterable[tuple[str, torch.Tensor]], *, releasable: bool = False) -> list[PackedBucket]:
        """Every weight packed at once (no buffer limit): a snapshot that stays valid while the parameters change.
        With ``releasable``, each bucket's ``release`` gives its buffer back to this packer's slots for the next
        snapshot (``SnapshotPool``); otherwise the buffers live as long as the snapshot does."""
        self.slots.count = None
        self.zero_copy_bytes = None  # a snapshot is copies by definition: the parameters keep training under it
        buckets = [bucket for bucket, _ in self.stream(named)]
        if not releasable:
            for bucket in buckets:
                bucket._release = None
        return buckets

    def _full_size(self, current: _OpenBucket | None) -> int:
        """A bucket went: from now on buckets fill to ``bucket_bytes``, the open flat one too."""
        if current is not None:
            current.limit = current.buf.numel()
        return self.bucket_bytes

    def _zero_copy(self, meta: TensorMeta, tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor itself, to be sent from its own memory, or None where it must be copied: too small to pay for
        its own broadcast, another dtype than the wire's (it must be cast), not contiguous, or not where the group
        sends from."""
        if self.zero_copy_bytes is None or meta.nbytes < self.zero_copy_bytes:
            return None
        if tensor.dtype == FP8:
            return None  # a run of several goes out as tensors of their own dtype, which gloo cannot broadcast
        if str(tensor.dtype).removeprefix("torch.") != meta.dtype or not tensor.is_contiguous():
            return None
        if tensor.device != self.device:
            return None
        return tensor.detach()

    def _close_run(self, run: list[tuple[TensorMeta, torch.Tensor]]) -> PackedBucket:
        """A run of zero-copy tensors as one bucket: alone, a normal flat bucket of its own bytes (the wire format
        every engine knows); several, the per-tensor wire under one announcement."""
        nbytes = sum(m.nbytes for m, _ in run)
        # Counted when the bucket is made, as a packed bucket is: a run a stopped stream never sent is not counted.
        self.stats.buckets += 1
        self.stats.bytes += nbytes
        self.stats.zero_copy_tensors += len(run)
        self.stats.zero_copy_bytes += nbytes
        if len(run) == 1:
            meta, tensor = run[0]
            return PackedBucket([meta], tensor.reshape(-1).view(torch.uint8), None, zero_copy=True)
        empty = torch.empty(0, dtype=torch.uint8, device=self.device)
        return PackedBucket([m for m, _ in run], empty, None, zero_copy=True, parts=[t for _, t in run])

    def _close(self, bucket: _OpenBucket) -> PackedBucket:
        buf = bucket.buf
        flat = buf[: bucket.used]
        self.stats.buckets += 1
        self.stats.bytes += bucket.used
        return PackedBucket(bucket.metas, flat, lambda: self.slots.give_back(buf))
