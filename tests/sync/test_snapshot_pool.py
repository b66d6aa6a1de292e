"""Snapshots reuse the last one's buffers once it was sent, and never those a held-out snapshot writer was given."""

from __future__ import annotations

import torch

from pipeline.sync.snapshot_pool import SnapshotPool


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.randn(256, 256, generator=gen)) for i in range(6)]  # 1.5 MB in 256 KB tensors


def _pointers(buckets: list) -> set[int]:
    return {b.flat.untyped_storage().data_ptr() for b in buckets}


def test_a_recycled_snapshot_takes_the_last_ones_buffers_and_holds_the_new_weights() -> None:
    pool = SnapshotPool(bucket_bytes=512 * 1024, device=torch.device("cpu"))
    first = pool.pack(_named(0), None)
    before = _pointers(first)
    assert len(first) == 3
    pool.recycle()
    second = pool.pack(_named(1), None)
    assert _pointers(second) == before  # no fresh memory, no page faults
    got = dict(t for b in second for t in b.tensors())
    for name, tensor in _named(1):
        assert torch.equal(got[name], tensor)


def test_a_snapshot_given_away_is_never_reused() -> None:
    pool = SnapshotPool(bucket_bytes=512 * 1024, device=torch.device("cpu"))
    kept = pool.pack(_named(0), None)
    pool.forget()  # a held-out snapshot is written from these, in the background
    pool.recycle()
    later = pool.pack(_named(1), None)
    assert not _pointers(later) & _pointers(kept)
    got = dict(t for b in kept for t in b.tensors())
    for name, tensor in _named(0):
        assert torch.equal(got[name], tensor)  # the writer's copy is untouched by the next snapshot
