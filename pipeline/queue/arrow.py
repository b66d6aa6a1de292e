"""The Sample's fields as an Arrow schema: the archive's Parquet columns and the columnar batch format.

Columns are plain Arrow types (lists of ints and floats, strings, a struct) so that pandas, duckdb or polars read an
archive with no sluice code. Routing, by far the largest field, is stored in two flat list columns in the ids' own
dtype (``list<uint8>``, or ``list<uint16>`` past 256 experts): ``routing_prompt`` holds the rows of the prompt
positions and ``routing_response`` the rest, each layer-major (``[layers, rows, topk]`` flattened), with the layer
count, top-k and dtype beside them, so the round trip is exact. Top-k ids keep the order the router gave them.

Why this layout (measured in docs/queue.md, "Archive"):

- The prompt rows are identical in every sample of a group. In a column of their own they sit next to each other in
  the Parquet page, where zstd finds them; inside whole samples they are a sample apart, beyond zstd's window once a
  sample's routing passes about 2 MB (a 9K-token sample of a 48-layer top-8 model).
- Layer-major puts one layer's ids together, whose expert frequencies differ from the next layer's.
- Parquet keeps uint8 and uint16 alike as INT32, so the dtype alone saves nothing on disk (it halves a uint8 table in
  memory). BYTE_STREAM_SPLIT stores the ids byte-aligned, where zstd's entropy coder sees their skew; pyarrow's
  default dictionary bit-packs them (7 bits at 128 experts) into a stream zstd finds little in. Below 16 experts
  the 4-bit packing wins, so such tables keep the dictionary.

Schema 1 (``routed_experts`` as one token-major ``list<uint16>``) still reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

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

SCHEMA_VERSION = 2
"""``sluice.schema`` in the Parquet metadata; 1 was the single ``routed_experts`` column."""

ROUTING_COLUMNS = ("routing_prompt", "routing_response")


def sample_schema(routing_type: pa.DataType | None = None) -> pa.Schema:
    """SAMPLE_SCHEMA with routing ids of ``routing_type``: uint8 by default, uint16 when any sample has more than
    256 experts."""
    routing_type = routing_type or pa.uint8()
    return pa.schema(
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
            # Large lists: a segment of long samples holds more than 2**31 routing ids.
            pa.field("routing_prompt", pa.large_list(routing_type), nullable=True),  # [layers, prompt rows, topk]
            pa.field("routing_response", pa.large_list(routing_type), nullable=True),  # [layers, other rows, topk]
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
        metadata={b"sluice.schema": str(SCHEMA_VERSION).encode()},
    )


SAMPLE_SCHEMA = sample_schema()
"""The archive's columns for routing ids up to uint8; ``sample_schema(pa.uint16())`` past 256 experts."""


def parquet_write_options(table: pa.Table, compression: str = "zstd") -> dict[str, Any]:
    """Keyword arguments for ``pq.write_table`` that store a SAMPLE_SCHEMA table compactly (see the module doc).

    Only the routing columns leave pyarrow's defaults. Their ids are stored byte-aligned (BYTE_STREAM_SPLIT) unless
    every id in the table is below 16: then the dictionary's 4-bit packing is smaller (measured: 0.98 of schema 1 at
    8 and 16 experts, against 0.83-0.72 for byte-aligned ids at 32-128 experts). They get zstd level 3, about as fast
    as level 1 on routing and 5-10% smaller, and 8 MB pages, so that a group's repeated prompt rows share a page.
    """
    routing_leaves = [f"{name}.list.element" for name in ROUTING_COLUMNS]
    others = [leaf for leaf in _leaf_paths(SAMPLE_SCHEMA) if leaf not in routing_leaves]
    options: dict[str, Any] = {"compression": compression, "data_page_size": 8 << 20}
    if _max_routing_id(table) < 16:
        options["use_dictionary"] = others + routing_leaves
    else:
        options["use_dictionary"] = others
        options["column_encoding"] = dict.fromkeys(routing_leaves, "BYTE_STREAM_SPLIT")
    if compression == "zstd":
        options["compression_level"] = {**dict.fromkeys(others, 1), **dict.fromkeys(routing_leaves, 3)}
    return options


def _max_routing_id(table: pa.Table) -> int:
    """The largest expert id in the table's routing columns (-1 when it has none)."""
    maxima = [pc.max(pc.list_flatten(table[name])).as_py() for name in ROUTING_COLUMNS]
    return max((m for m in maxima if m is not None), default=-1)


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """Parquet column paths of the schema's leaves (``prompt_ids.list.element``, ``sampling.seed``, ...)."""
    paths = []
    for f in schema:
        if pa.types.is_list(f.type) or pa.types.is_large_list(f.type):
            paths.append(f"{f.name}.list.element")
        elif pa.types.is_struct(f.type):
            paths.extend(f"{f.name}.{f.type.field(i).name}" for i in range(f.type.num_fields))
        else:
            paths.append(f.name)
    return paths


def _list_column(arrays: Sequence[np.ndarray | None], value_type: pa.DataType, large: bool = False) -> pa.Array:
    """Build list<value_type> (large_list with ``large``) from numpy arrays in one concatenation (None becomes a
    null list). Arrays are flattened in C order."""
    lengths = np.array([0 if a is None else a.size for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not large and offsets[-1] > np.iinfo(np.int32).max:
        raise SampleError(f"{offsets[-1]} values do not fit one list<{value_type}> column (at most 2**31 - 1); "
                          "write fewer samples per table (queue.archive.segment_samples)")
    np_type = value_type.to_pandas_dtype()
    parts = [a.reshape(-1).astype(np_type, copy=False) for a in arrays if a is not None]
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=np_type)
    mask = np.array([a is None for a in arrays])
    list_type = pa.LargeListArray if large else pa.ListArray
    return list_type.from_arrays(pa.array(offsets if large else offsets.astype(np.int32)),
                                 pa.array(values, type=value_type), mask=pa.array(mask) if mask.any() else None)


def _split_routing(sample: Sample) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The routing of the prompt positions and of the rest, each ``[layers, rows, topk]`` (views)."""
    routed = sample.routed_experts
    if routed is None:
        return None, None
    # An empty response has P - 1 rows, all of prompt positions.
    cut = min(sample.num_prompt_tokens, routed.shape[0])
    return routed[:cut].transpose(1, 0, 2), routed[cut:].transpose(1, 0, 2)


def samples_to_table(samples: Sequence[Sample], stream_ids: Sequence[str | None] | None = None) -> pa.Table:
    """Columnar form of samples, in ``sample_schema`` of their widest routing dtype (uint8 when none has any)."""
    if stream_ids is not None and len(stream_ids) != len(samples):
        raise SampleError(f"stream_ids has {len(stream_ids)} entries for {len(samples)} samples")
    re_shapes = [s.routed_experts.shape if s.routed_experts is not None else None for s in samples]
    wide = any(s.routed_experts is not None and s.routed_experts.dtype.itemsize > 1 for s in samples)
    schema = sample_schema(pa.uint16() if wide else pa.uint8())
    routing_type = schema.field("routing_prompt").type.value_type
    prompt_rows, other_rows = zip(*(_split_routing(s) for s in samples)) if samples else ((), ())
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
        "routing_prompt": _list_column(prompt_rows, routing_type, large=True),
        "routing_response": _list_column(other_rows, routing_type, large=True),
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
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def _list_values(col: pa.ChunkedArray | pa.Array, np_dtype: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Offsets, values (in ``np_dtype``, or their own dtype for None) and validity of a list column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    offsets = np.asarray(arr.offsets.to_numpy(), dtype=np.int64)
    values = np.asarray(arr.values.to_numpy(zero_copy_only=False), dtype=np_dtype)
    # Offsets of a sliced list array may not start at zero.
    return offsets, values, valid


_V1_ROUTING = ("routed_experts",)


def _schema_version(table: pa.Table) -> int:
    """1 or 2, from the routing columns; raises for a table from a newer sluice or with no sluice columns."""
    declared = (table.schema.metadata or {}).get(b"sluice.schema")
    if declared is not None and declared.isdigit() and int(declared) > SCHEMA_VERSION:
        raise SampleDecodeError(f"table has sluice schema {int(declared)}, newer than this sluice reads "
                                f"({SCHEMA_VERSION}); upgrade sluice to read it")
    version = 1 if "routed_experts" in table.column_names else SCHEMA_VERSION
    if version == 1 and any(name in table.column_names for name in ROUTING_COLUMNS):
        raise SampleDecodeError("table mixes schema-1 and schema-2 routing columns (segments of both concatenated); "
                                "decode each segment on its own, as ArchiveReader.entries does")
    routing = _V1_ROUTING if version == 1 else ROUTING_COLUMNS
    common = [f.name for f in SAMPLE_SCHEMA if f.name not in ROUTING_COLUMNS]
    missing = [name for name in (*common, *routing) if name not in table.column_names]
    if missing:
        raise SampleDecodeError(f"table lacks sluice columns {missing}; is it a sluice archive?")
    return version


def _routing(parts: list[np.ndarray], layers: Any, topk: Any, dt: Any, layer_major: bool) -> np.ndarray:
    """``[rows, layers, topk]`` in dtype ``dt`` from the stored parts (row-major in schema 1, layer-major after)."""
    if not layers or not topk or dt not in ("|u1", "<u2"):
        raise SampleDecodeError(f"routing_layers/topk/dtype invalid: {layers}, {topk}, {dt!r}")
    for part in parts:
        if part.size % (layers * topk):
            raise SampleDecodeError(f"routing: {part.size} ids do not divide into [*, {layers}, {topk}]")
    dtype = np.dtype(dt)
    for part in parts:
        if part.dtype.itemsize > dtype.itemsize and part.size and int(part.max()) > np.iinfo(dtype).max:
            raise SampleDecodeError(f"routing: id {int(part.max())} does not fit routing_dtype {dt!r}")
    if not layer_major:
        return parts[0].reshape(-1, layers, topk).astype(dtype)
    blocks = [part.reshape(layers, -1, topk) for part in parts]
    return np.ascontiguousarray(np.concatenate(blocks, axis=1).transpose(1, 0, 2), dtype=dtype)


def table_to_samples(table: pa.Table) -> Iterator[tuple[str | None, Sample]]:
    """Yield (stream_id, Sample) for each row of a schema-2 or schema-1 table; raises SampleDecodeError naming the
    row and field on bad data."""
    version = _schema_version(table)
    routing_columns = _V1_ROUTING if version == 1 else ROUTING_COLUMNS
    lists = {
        "prompt_ids": _list_values(table["prompt_ids"], "<i4"),
        "response_ids": _list_values(table["response_ids"], "<i4"),
        "rollout_logprobs": _list_values(table["rollout_logprobs"], "<f4"),
        "loss_mask": _list_values(table["loss_mask"], "u1"),
        "token_versions": _list_values(table["token_versions"], "<i4"),
        **{name: _list_values(table[name], None) for name in routing_columns},
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
            stored = [row_list(name, i) for name in routing_columns]
            parts = [part for part in stored if part is not None]
            routed = None
            if parts:
                if len(parts) != len(stored):
                    raise SampleDecodeError("routing_prompt and routing_response: one is null, the other is not")
                routed = _routing(parts, py["routing_layers"][i], py["routing_topk"][i], py["routing_dtype"][i],
                                  layer_major=version > 1)
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
