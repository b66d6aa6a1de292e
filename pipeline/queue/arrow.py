"""The Sample's fields as an Arrow schema: the archive's Parquet columns and the columnar batch format.

Columns are plain Arrow types (lists of ints and floats, strings, a struct) so that pandas, duckdb or polars read an
archive with no sluice code. ``routed_experts`` is flattened to ``list<uint16>`` with its layer count, top-k and
original dtype beside it, so the round trip is exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.errors import SampleDecodeError, SampleError
from pipeline.queue.sample import Sample, SampleStatus, SamplingInfo

SAMPLING_TYPE = pa.struct(
    [
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int32()),
        ("max_new_tokens", pa.int32()),
        ("seed", pa.int64()),
    ]
)

SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("stream_id", pa.string(), nullable=True),  # the queue entry it came from, when archived
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("index", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("token_versions", pa.list_(pa.int32()), nullable=False),
        pa.field("version_min", pa.int32(), nullable=True),
        pa.field("version_max", pa.int32(), nullable=True),
        pa.field("routed_experts", pa.list_(pa.uint16()), nullable=True),
        pa.field("routing_layers", pa.int32(), nullable=True),
        pa.field("routing_topk", pa.int32(), nullable=True),
        pa.field("routing_dtype", pa.string(), nullable=True),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("reward_info", pa.string(), nullable=False),  # JSON
        pa.field("status", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("producer", pa.string(), nullable=False),
        pa.field("engine", pa.string(), nullable=False),
        pa.field("created_at", pa.float64(), nullable=False),  # unix seconds
        pa.field("sampling", SAMPLING_TYPE, nullable=False),
    ],
    metadata={b"sluice.schema": b"1"},
)


def _list_column(arrays: Sequence[np.ndarray | None], value_type: pa.DataType) -> pa.Array:
    """Build list<value_type> from numpy arrays in one concatenation (None becomes a null list)."""
    lengths = np.array([0 if a is None else a.size for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    np_type = value_type.to_pandas_dtype()
    parts = [a.reshape(-1).astype(np_type, copy=False) for a in arrays if a is not None]
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=np_type)
    mask = np.array([a is None for a in arrays])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type),
                                    mask=pa.array(mask) if mask.any() else None)


def samples_to_table(samples: Sequence[Sample], stream_ids: Sequence[str | None] | None = None) -> pa.Table:
    """Columnar form of samples, in the SAMPLE_SCHEMA."""
    if stream_ids is not None and len(stream_ids) != len(samples):
        raise SampleError(f"stream_ids has {len(stream_ids)} entries for {len(samples)} samples")
    re_shapes = [s.routed_experts.shape if s.routed_experts is not None else None for s in samples]
    cols: dict[str, pa.Array] = {
        "stream_id": pa.array(list(stream_ids) if stream_ids is not None else [None] * len(samples), pa.string()),
        "sample_id": pa.array([s.sample_id for s in samples], pa.string()),
        "group_id": pa.array([s.group_id for s in samples], pa.string()),
        "prompt_id": pa.array([s.prompt_id for s in samples], pa.string()),
        "index": pa.array([s.index for s in samples], pa.int32()),
        "prompt_ids": _list_column([s.prompt_ids for s in samples], pa.int32()),
        "response_ids": _list_column([s.response_ids for s in samples], pa.int32()),
        "rollout_logprobs": _list_column([s.rollout_logprobs for s in samples], pa.float32()),
        "loss_mask": _list_column([s.loss_mask for s in samples], pa.uint8()),
        "token_versions": _list_column([s.token_versions for s in samples], pa.int32()),
        "version_min": pa.array([s.version_min for s in samples], pa.int32()),
        "version_max": pa.array([s.version_max for s in samples], pa.int32()),
        "routed_experts": _list_column([s.routed_experts for s in samples], pa.uint16()),
        "routing_layers": pa.array([sh[1] if sh else None for sh in re_shapes], pa.int32()),
        "routing_topk": pa.array([sh[2] if sh else None for sh in re_shapes], pa.int32()),
        "routing_dtype": pa.array(
            [s.routed_experts.dtype.str if s.routed_experts is not None else None for s in samples], pa.string()
        ),
        "reward": pa.array([s.reward for s in samples], pa.float64()),
        "reward_info": pa.array([json.dumps(s.reward_info, separators=(",", ":")) for s in samples], pa.string()),
        "status": pa.array([s.status.value for s in samples], pa.string()),
        "finish_reason": pa.array([s.finish_reason for s in samples], pa.string()),
        "producer": pa.array([s.producer for s in samples], pa.string()),
        "engine": pa.array([s.engine for s in samples], pa.string()),
        "created_at": pa.array([s.created_at for s in samples], pa.float64()),
        "sampling": pa.array([s.sampling.to_dict() for s in samples], SAMPLING_TYPE),
    }
    return pa.Table.from_arrays([cols[f.name] for f in SAMPLE_SCHEMA], schema=SAMPLE_SCHEMA)


def _list_values(col: pa.ChunkedArray | pa.Array, np_dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    offsets = np.asarray(arr.offsets.to_numpy(), dtype=np.int64)
    values = np.asarray(arr.values.to_numpy(zero_copy_only=False), dtype=np_dtype)
    # Offsets of a sliced list array may not start at zero.
    return offsets, values, valid


def table_to_samples(table: pa.Table) -> Iterator[tuple[str | None, Sample]]:
    """Yield (stream_id, Sample) for each row; raises SampleDecodeError naming the row and field on bad data."""
    missing = [f.name for f in SAMPLE_SCHEMA if f.name not in table.column_names]
    if missing:
        raise SampleDecodeError(f"table lacks sluice columns {missing}; is it a sluice archive?")
    lists = {
        "prompt_ids": _list_values(table["prompt_ids"], "<i4"),
        "response_ids": _list_values(table["response_ids"], "<i4"),
        "rollout_logprobs": _list_values(table["rollout_logprobs"], "<f4"),
        "loss_mask": _list_values(table["loss_mask"], "u1"),
        "token_versions": _list_values(table["token_versions"], "<i4"),
        "routed_experts": _list_values(table["routed_experts"], "<u2"),
    }
    py: dict[str, list[Any]] = {
        name: table[name].to_pylist()
        for name in (
            "stream_id", "sample_id", "group_id", "prompt_id", "index", "routing_layers", "routing_topk",
            "routing_dtype", "reward", "reward_info", "status", "finish_reason", "producer", "engine", "created_at",
            "sampling",
        )
    }

    def row_list(name: str, i: int) -> np.ndarray | None:
        offsets, values, valid = lists[name]
        if not valid[i]:
            return None
        return values[offsets[i] : offsets[i + 1]]

    for i in range(table.num_rows):
        try:
            routed = row_list("routed_experts", i)
            if routed is not None:
                layers, topk, dt = py["routing_layers"][i], py["routing_topk"][i], py["routing_dtype"][i]
                if not layers or not topk or dt not in ("|u1", "<u2"):
                    raise SampleDecodeError(f"routing_layers/topk/dtype invalid: {layers}, {topk}, {dt!r}")
                if routed.size % (layers * topk):
                    raise SampleDecodeError(
                        f"routed_experts: {routed.size} ids do not divide into [*, {layers}, {topk}]")
                routed = routed.reshape(-1, layers, topk).astype(np.dtype(dt))
            sample = Sample(
                prompt_ids=row_list("prompt_ids", i),
                response_ids=row_list("response_ids", i),
                rollout_logprobs=row_list("rollout_logprobs", i),
                loss_mask=row_list("loss_mask", i),
                token_versions=row_list("token_versions", i),
                routed_experts=routed,
                reward=py["reward"][i],
                reward_info=json.loads(py["reward_info"][i]),
                status=SampleStatus(py["status"][i]),
                finish_reason=py["finish_reason"][i],
                sample_id=py["sample_id"][i],
                group_id=py["group_id"][i],
                prompt_id=py["prompt_id"][i],
                index=py["index"][i],
                producer=py["producer"][i],
                engine=py["engine"][i],
                created_at=py["created_at"][i],
                sampling=SamplingInfo.from_dict(py["sampling"][i]),
            )
        except (SampleError, ValueError, TypeError) as e:
            raise SampleDecodeError(f"row {i} (sample_id={py['sample_id'][i]!r}): {e}") from None
        yield py["stream_id"][i], sample
