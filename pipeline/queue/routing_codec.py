"""Compact, lossless routing for one queue entry (a prompt group): the block that schema 2 envelopes carry.

Routing is almost all of an MoE sample's bytes, and it is redundant in three ways this block removes:

- **Prompt rows repeat across a group.** Every sample of a GRPO group prefills the same prompt, so its rows are
  identical unless a weight push landed between the prefills. They are stored once, and each sample says whether it
  shares them; a sample whose rows differ keeps its own, so the block is exact either way.
- **Rows of the same token look alike.** Stored rows are put in the order of the token each row routed (a stable
  sort, so the decoder recomputes the permutation from the entry's token ids and nothing is stored for it), then laid
  out layer-major, so one layer's choices for one token sit side by side.
- **Ids are few and skewed.** zstd entropy-codes the result; 128 experts cost at most 7 bits an id, and less when
  expert load is uneven.

zstd runs only where it pays. At a few hundred MB/s a core it costs more than the bytes it saves unless it at least
cuts them to ``ZSTD_PAYS_BELOW``; near-uniform ids (7 of 8 bits) do not get there. A probe of one slice decides, and
a block that skips zstd stores its rows as they are, one buffer per sample, so that it costs no copy at all.

The order of ids within a row is kept as the engine returned it: megatron-core's router replay softmaxes the
replayed top-k in that order, and for top-k > 2 a reordered row gives log-probs that differ in the last bit
(measured in docs/queue.md, "Routing on the wire").
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.errors import SampleDecodeError, SampleError
from pipeline.queue.sample import ARRAY_DTYPES, Sample

#: zstd level 1: the producer and trainer pay the codec once per sample, and higher levels buy a few percent of
#: bytes for 2-3x the encode time (benchmarks/README.md, "sluice bench queue --e2e").
ZSTD_LEVEL = 1
_ZSTD = pa.Codec("zstd", compression_level=ZSTD_LEVEL)
_ROUTING_DTYPES = {d.str: d for d in ARRAY_DTYPES["routed_experts"]}
#: Compress only when a probe slice shrinks below this fraction; above it, encoding and decoding cost more than moving
#: the bytes (measured with `sluice bench queue --e2e`, benchmarks/README.md).
ZSTD_PAYS_BELOW = 0.6
#: Bytes of the probe slice; blocks smaller than twice this are compressed outright.
PROBE_BYTES = 64 << 10
_BLOCK_KEYS = frozenset({"codec", "dtype", "layers", "topk", "rows", "shared", "sharing", "size", "data"})


class _Scratch(threading.local):
    """Per-thread buffers the encoder reuses. A fresh multi-megabyte array is mapped page by page on first touch,
    which made the encoder's copies 3-4x slower than copying into memory already mapped."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def take(self, name: str, nbytes: int) -> np.ndarray:
        buf = self.buffers.get(name)
        if buf is None or buf.size < nbytes:
            buf = self.buffers[name] = np.empty(max(nbytes, 1 << 16) * 5 // 4, np.uint8)
        return buf[:nbytes]


_SCRATCH = _Scratch()


def _item_dtype(layers_dtype: np.dtype[Any], topk: int) -> np.dtype[Any]:
    width = topk * layers_dtype.itemsize
    return np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(width, (np.void, width)))


def _row_view(rows: np.ndarray) -> np.ndarray:
    """``[N, L, K]`` ids as ``[N, L]`` items of K ids each, so that gathers and transposes move whole rows of a
    layer instead of single bytes."""
    return np.ascontiguousarray(rows).view(_item_dtype(rows.dtype, rows.shape[2])).reshape(rows.shape[:2])


def _bytes_view(rows: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8))


def _shared_prefix(routed: Sequence[Sample]) -> tuple[int, list[bool]]:
    """Rows stored once for the group, and which samples take them: the first routed sample's prompt rows, shared
    by every sample whose own rows there are bit-identical."""
    first = routed[0].routed_experts
    assert first is not None
    shared = min(routed[0].num_prompt_tokens, first.shape[0])
    head = first[:shared]
    sharing = [
        s.routed_experts.shape[0] >= shared and np.array_equal(s.routed_experts[:shared], head)
        for s in routed
    ]
    if sum(sharing) < 2:
        return 0, [False] * len(routed)
    return shared, sharing


#: What the row order is computed from: a sample's prompt ids, response ids and routed row count.
_Tokens = tuple[np.ndarray, np.ndarray, int]


def _token_keys(tokens: Sequence[_Tokens], shared: int, sharing: Sequence[bool]) -> np.ndarray:
    """The token id each stored row routed, in stored order: the shared rows (first sample's prompt), then each
    sample's own rows."""
    keys = [tokens[0][0][:shared]] if shared else []
    for (prompt, response, rows), takes in zip(tokens, sharing):
        start = shared if takes else 0
        if start < prompt.size:
            keys.append(prompt[start:min(rows, prompt.size)])
        keys.append(response[max(0, start - prompt.size): max(0, rows - prompt.size)])
    return np.concatenate(keys) if keys else np.zeros(0, np.int32)


def _token_order(keys: np.ndarray) -> np.ndarray:
    """The stable order of rows by token id. A stable order is unique, so the encoder and the decoder agree whatever
    algorithm sorts; 16-bit keys take numpy's radix sort, 7-9x faster than the merge sort of 32-bit ones."""
    if keys.size and 0 <= int(keys.min()) and int(keys.max()) < 1 << 16:
        keys = keys.astype(np.uint16)
    return np.argsort(keys, kind="stable")


def can_compact(samples: Sequence[Sample]) -> bool:
    """Whether the group's routing fits one block: some sample has routing, and all that do agree on layers, top-k
    and dtype (a group mixing layouts is written per sample instead)."""
    layouts = {(s.routed_experts.shape[1:], s.routed_experts.dtype.str)
               for s in samples if s.routed_experts is not None}
    return len(layouts) == 1


def _worth_compressing(parts: Sequence[np.ndarray], size: int) -> bool:
    if size < 2 * PROBE_BYTES:
        return True
    largest = max(parts, key=lambda p: p.nbytes)
    rows = max(1, PROBE_BYTES // max(1, largest[0].nbytes))
    probe = np.ascontiguousarray(largest[:rows])
    return _ZSTD.compress(pa.py_buffer(probe)).size < ZSTD_PAYS_BELOW * probe.nbytes


def encode_routing(samples: Sequence[Sample]) -> dict[str, Any]:
    """The routing block of one entry; ``can_compact(samples)`` must hold.

    Its ``data`` may view per-thread scratch memory, valid until this thread's next call: pack it at once.
    """
    routed = [s for s in samples if s.routed_experts is not None]
    if not routed or not can_compact(samples):
        raise SampleError("encode_routing needs samples whose routing shares one [*, layers, topk] layout and dtype")
    first = routed[0].routed_experts
    assert first is not None
    layers, topk = first.shape[1:]
    shared, sharing = _shared_prefix(routed)
    parts = [first[:shared]] if shared else []
    parts += [s.routed_experts[shared if takes else 0:] for s, takes in zip(routed, sharing)]  # type: ignore[index]
    stored = sum(p.shape[0] for p in parts)
    size = stored * layers * topk * first.dtype.itemsize
    it = iter(sharing)
    block = {
        "dtype": first.dtype.str,
        "layers": int(layers),
        "topk": int(topk),
        "rows": [-1 if s.routed_experts is None else int(s.routed_experts.shape[0]) for s in samples],
        "shared": shared,
        "sharing": [s.routed_experts is not None and next(it) for s in samples],
        "size": size,
    }
    if not _worth_compressing(parts, size):
        # msgpack copies each view into the payload: the rows reach it without an intermediate copy.
        return {**block, "codec": "none", "data": [_bytes_view(p) for p in parts]}
    item = _item_dtype(first.dtype, topk)
    stacked = _SCRATCH.take("stacked", size).view(item).reshape(stored, layers)
    np.concatenate([_row_view(p) for p in parts], out=stacked)
    tokens = [(s.prompt_ids, s.response_ids, s.routed_experts.shape[0]) for s in routed]  # type: ignore[union-attr]
    order = _token_order(_token_keys(tokens, shared, sharing))
    # Gather in token order and go layer-major in one pass: [N, L] row items -> [L, N].
    laid_out = _SCRATCH.take("laid_out", size).view(item).reshape(layers, stored)
    np.take(stacked.T, order, axis=1, out=laid_out)
    packed = _ZSTD.compress(pa.py_buffer(laid_out))
    if packed.size >= size:  # the probe was wrong; keep the plain rows
        return {**block, "codec": "none", "data": [_bytes_view(p) for p in parts]}
    # A memoryview of Arrow's buffer packs as msgpack bin without a copy.
    return {**block, "codec": "zstd", "data": memoryview(packed)}


def _check_block(block: Any, count: int) -> tuple[np.dtype[Any], int, int, list[int], int, list[bool]]:
    if not isinstance(block, dict):
        raise SampleDecodeError(f"routing: expected a map, got {type(block).__name__}")
    missing = _BLOCK_KEYS - set(block)
    extra = set(block) - _BLOCK_KEYS
    if missing or extra:
        raise SampleDecodeError(f"routing: missing keys {sorted(missing)}, unknown keys {sorted(extra)}")
    dtype = _ROUTING_DTYPES.get(block["dtype"]) if isinstance(block["dtype"], str) else None
    if dtype is None:
        raise SampleDecodeError(f"routing: dtype {block['dtype']!r} is not one of {sorted(_ROUTING_DTYPES)}")
    layers, topk, shared = block["layers"], block["topk"], block["shared"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (layers, topk, shared)) or min(
            layers, topk) < 1 or shared < 0:
        raise SampleDecodeError(f"routing: layers={layers!r}, topk={topk!r} must be >= 1 and shared={shared!r} >= 0")
    rows, sharing = block["rows"], block["sharing"]
    if not (isinstance(rows, list) and isinstance(sharing, list) and len(rows) == len(sharing) == count):
        raise SampleDecodeError(f"routing: rows and sharing must list all {count} samples")
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= -1 for r in rows):
        raise SampleDecodeError(f"routing: rows must be ints >= -1 (-1: no routing), got {rows!r}")
    if not all(isinstance(f, bool) for f in sharing):
        raise SampleDecodeError("routing: sharing must be booleans")
    for i, (r, takes) in enumerate(zip(rows, sharing)):
        if takes and (r < shared or r == -1):
            raise SampleDecodeError(f"routing: sample {i} shares {shared} rows but has {r}")
    codec, data = block["codec"], block["data"]
    if not ((codec == "zstd" and isinstance(data, bytes))
            or (codec == "none" and isinstance(data, list) and all(isinstance(d, bytes) for d in data))):
        raise SampleDecodeError(f"routing: codec {codec!r} unknown, or its data is not bytes (zstd) or a list of "
                                "bytes (none)")
    return dtype, layers, topk, rows, shared, sharing


def decode_routing(block: Any, samples: Sequence[Sample]) -> list[np.ndarray | None]:
    """Each sample's ``[rows, layers, topk]`` routing (None where it had none), exactly as encoded.

    ``samples`` are the entry's samples decoded without routing: their token ids give the row order back.
    """
    dtype, layers, topk, rows, shared, sharing = _check_block(block, len(samples))
    routed = [i for i, r in enumerate(rows) if r >= 0]
    if not routed:
        raise SampleDecodeError("routing: the block covers no sample")
    if not any(sharing):
        shared = 0
    elif not sharing[routed[0]] or shared > samples[routed[0]].num_prompt_tokens:
        raise SampleDecodeError(f"routing: {shared} shared rows must be the first routed sample's prompt rows")
    own = [rows[i] - (shared if sharing[i] else 0) for i in routed]
    stored = shared + sum(own)
    size = stored * layers * topk * dtype.itemsize
    if block["size"] != size:
        raise SampleDecodeError(f"routing: declares {block['size']} bytes but its rows need {size}")
    tokens = []
    for i in routed:
        s = samples[i]
        if rows[i] != s.num_prompt_tokens + s.num_response_tokens - 1:
            raise SampleDecodeError(
                f"routing: sample {i} has {rows[i]} rows but P+R-1 = {s.num_prompt_tokens + s.num_response_tokens - 1}")
        tokens.append((s.prompt_ids, s.response_ids, rows[i]))
    if block["codec"] == "none":
        return _decode_rows(block["data"], samples, routed, own, dtype, layers, topk, shared, sharing)
    try:
        raw = memoryview(_ZSTD.decompress(block["data"], decompressed_size=size))
    except (OSError, ValueError, pa.ArrowException) as e:
        raise SampleDecodeError(f"routing: corrupt zstd data ({e})") from None
    if len(raw) != size:
        raise SampleDecodeError(f"routing: {len(raw)} bytes where {size} were declared; truncated?")
    keys = _token_keys(tokens, shared, [sharing[i] for i in routed])
    if keys.size != stored:
        raise SampleDecodeError(f"routing: {stored} stored rows but the samples' tokens name {keys.size}")
    order = _token_order(keys)
    item = _item_dtype(dtype, topk)
    laid_out = np.frombuffer(raw, dtype=item).reshape(layers, stored)
    # Stored row j sits at column rank[j] of the layer-major layout; every output row names its stored row.
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    sources = []
    cursor = shared
    for i, n in zip(routed, own):
        head = np.arange(shared) if sharing[i] else np.zeros(0, np.int64)
        sources += [head, np.arange(cursor, cursor + n)]
        cursor += n
    flat = laid_out.T[rank[np.concatenate(sources)]]  # [total rows, L] items, row-major
    out: list[np.ndarray | None] = [None] * len(samples)
    start = 0
    whole = flat.view(dtype).reshape(-1, layers, topk)
    whole.flags.writeable = False  # like every decoded array: a caller that writes must copy
    for i in routed:
        out[i] = whole[start:start + rows[i]]
        start += rows[i]
    return out


def plain_routing_bytes(samples: Sequence[Sample]) -> int:
    """Bytes the group's routing takes as plain arrays (the reference compact routing is measured against)."""
    return sum(math.prod(s.routed_experts.shape) * s.routed_experts.dtype.itemsize
               for s in samples if s.routed_experts is not None)


def _decode_rows(data: list[bytes], samples: Sequence[Sample], routed: list[int], own: list[int], dtype: np.dtype[Any],
                 layers: int, topk: int, shared: int, sharing: list[bool]) -> list[np.ndarray | None]:
    """A block stored without zstd: the shared rows (if any) and each routed sample's own rows, as they were."""
    counts = ([shared] if shared else []) + own
    if len(data) != len(counts):
        raise SampleDecodeError(f"routing: {len(data)} row buffers where {len(counts)} were expected")
    row_bytes = layers * topk * dtype.itemsize
    arrays = []
    for i, (buf, n) in enumerate(zip(data, counts)):
        if len(buf) != n * row_bytes:
            raise SampleDecodeError(f"routing: row buffer {i} holds {len(buf)} bytes where {n * row_bytes} are due")
        arrays.append(np.frombuffer(buf, dtype=dtype).reshape(n, layers, topk))
    head = arrays.pop(0) if shared else None
    out: list[np.ndarray | None] = [None] * len(samples)
    for i, rows in zip(routed, arrays):
        if sharing[i]:
            whole = np.concatenate([head, rows])  # type: ignore[list-item]
            whole.flags.writeable = False
            out[i] = whole
        else:
            out[i] = rows
    return out
