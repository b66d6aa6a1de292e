"""The buffers of one source's snapshots, kept from push to push.

A snapshot (each source's share, packed in the wire dtype and sent while the next step trains) is written into
fresh memory unless something keeps it: page faults on a fresh buffer cost more than the copy into it (a 100 MB
share took 0.18 to 1.8 s to pack here, against about 0.05 s into buffers already touched). Pushes never overlap,
so once a push is over its snapshot's buffers take the next one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pipeline.sync.packing import BucketPacker, BucketSlots, PackedBucket


class SnapshotPool:
    """Packs snapshots of at most ``bucket_bytes`` per bucket on ``device``, reusing the last one's buffers."""

    def __init__(self, bucket_bytes: int, device: torch.device) -> None:
        self.bucket_bytes = bucket_bytes
        self.device = device
        # In host memory beside a GPU: page-locked, so that each bucket goes up at full speed when it is sent.
        pin = device.type == "cpu" and torch.cuda.is_available()
        self._slots = BucketSlots(None, bucket_bytes, device, pin_memory=pin)
        self._last: list[PackedBucket] = []

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: str | None) -> list[PackedBucket]:
        """The tensors cast to ``dtype`` and copied now into buckets (the last snapshot's buffers first)."""
        self._slots.reset()
        packer = BucketPacker(bucket_bytes=self.bucket_bytes, dtype=dtype, device=self.device, buffers=self._slots)
        self._last = packer.pack_all(named_tensors, releasable=True)
        return self._last

    def recycle(self) -> None:
        """The last snapshot was sent and nothing else holds it (no held-out snapshot is being written from it):
        its buffers take the next one."""
        for bucket in self._last:
            bucket.release()
        self._last = []

    def forget(self) -> None:
        """The last snapshot is someone else's now (a held-out snapshot writer's): never reuse its buffers."""
        for bucket in self._last:
            bucket.keep()
        self._last = []
