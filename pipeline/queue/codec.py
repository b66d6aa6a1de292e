"""The wire codec: a versioned msgpack envelope whose arrays travel as (dtype, shape, raw little-endian bytes).

Schema 2 adds a compact routing block per entry (``pipeline.queue.routing_codec``): a group's MoE routing,
losslessly, in 0.11-0.24 of the plain bytes for routing a CPU engine recorded (near-uniform ids save only their
shared prompt rows). ``routing="plain"`` keeps routing as one plain array per sample, as schema 1
did; schema 1 entries and archives still decode.

A stream entry of schema 3 no longer carries that payload: it holds a small **header** (``encode_header``: each
sample's scalars, lengths and versions, column by column) and the key of the payload, which sits on a shard of its
own (docs/queue.md, "Entries"). Entries of schema 1 and 2 carry the payload inline and still decode.

Never pickle: anything that can write to Redis could then run code in the trainer. Decoding trusts nothing: it
checks the schema version, every dtype against the field's allowed set, byte counts against shapes, and the
Sample's cross-field invariants, and raises ``SampleDecodeError`` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import msgpack
import numpy as np

from pipeline.errors import SampleDecodeError, SampleError
from pipeline.queue.base import SampleHeader
from pipeline.queue.routing_codec import can_compact, decode_routing, encode_routing
from pipeline.queue.sample import ARRAY_DTYPES, MAX_REWARD_INFO_BYTES, Sample, SampleStatus, SamplingInfo

#: Bump when the envelope changes incompatibly; decoders reject versions they do not know.
SCHEMA_VERSION = 2
KNOWN_SCHEMA_VERSIONS = frozenset({1, 2})

#: The stream entry's ``v``: 1 and 2 carry the payload inline (``data``, of the same envelope schema); 3 carries a
#: header (``head``) and the payload's key (``pkey``) and size (``psize``).
ENTRY_VERSION = 3
KNOWN_ENTRY_VERSIONS = frozenset({1, 2, 3})

#: How an entry carries its routing: "compact" (one block per entry) or "plain" (an array per sample).
RoutingCodec = Literal["compact", "plain"]
ROUTING_CODECS: tuple[RoutingCodec, ...] = ("compact", "plain")

_SCALAR_FIELDS: dict[str, type | tuple[type, ...]] = {
    "sample_id": str,
    "group_id": str,
    "prompt_id": str,
    "index": int,
    "reward": (float, int),
    "reward_info": dict,
    "status": str,
    "finish_reason": str,
    "producer": str,
    "engine": str,
    "created_at": (float, int),
    "sampling": dict,
}
_REQUIRED_ARRAYS = ("prompt_ids", "response_ids", "rollout_logprobs", "token_versions", "loss_mask")


def _pack_array(arr: np.ndarray) -> list[Any]:
    le = arr if arr.dtype.byteorder != ">" else arr.astype(arr.dtype.newbyteorder("<"))
    # A byte view packs as msgpack bin straight from the array; tobytes() would copy every array once more.
    return [le.dtype.str, list(le.shape), memoryview(np.ascontiguousarray(le).reshape(-1).view(np.uint8))]


def _sample_to_map(s: Sample, with_routing: bool) -> dict[str, Any]:
    d: dict[str, Any] = {
        "sample_id": s.sample_id,
        "group_id": s.group_id,
        "prompt_id": s.prompt_id,
        "index": s.index,
        "reward": s.reward,
        "reward_info": s.reward_info,
        "status": s.status.value,
        "finish_reason": s.finish_reason,
        "producer": s.producer,
        "engine": s.engine,
        "created_at": s.created_at,
        "sampling": s.sampling.to_dict(),
    }
    for name in ARRAY_DTYPES:
        arr = getattr(s, name)
        if arr is not None and (with_routing or name != "routed_experts"):
            d[name] = _pack_array(arr)
    return d


def encode_samples(samples: Sequence[Sample], *, routing: RoutingCodec = "compact") -> bytes:
    """Encode a group of samples (one queue entry) into one msgpack payload.

    ``routing="compact"`` stores the group's routing in one lossless block; a group whose samples mix routing
    layouts falls back to plain arrays, which decode the same.
    """
    if not samples:
        raise SampleError("cannot encode an empty group; a queue entry holds at least one sample")
    if routing not in ROUTING_CODECS:
        raise SampleError(f"routing={routing!r}; choose one of {list(ROUTING_CODECS)}")
    for s in samples:
        if not isinstance(s, Sample):
            raise SampleError(f"expected Sample, got {type(s).__name__}")
    block = encode_routing(samples) if routing == "compact" and can_compact(samples) else None
    maps = []
    for s in samples:
        m = _sample_to_map(s, with_routing=block is None)
        if s.reward_info and len(msgpack.packb(s.reward_info)) > MAX_REWARD_INFO_BYTES:
            raise SampleError(
                f"reward_info of sample {s.sample_id} exceeds {MAX_REWARD_INFO_BYTES} bytes; keep it to a few "
                "scalars (it rides in every queue entry)"
            )
        maps.append(m)
    envelope: dict[str, Any] = {"schema": SCHEMA_VERSION, "samples": maps}
    if block is not None:
        envelope["routing"] = block
    return msgpack.packb(envelope, use_bin_type=True)


# (field, dtype string) -> dtype, for the allowed pairs only: decoding runs for every sample of every consumer, and
# np.dtype() of a string costs more than the rest of an array's checks.
_ALLOWED: dict[tuple[str, str], np.dtype[Any]] = {
    (name, spelling): dtype
    for name, dtypes in ARRAY_DTYPES.items()
    for dtype in dtypes
    for spelling in {dtype.str, dtype.name, dtype.char, np.dtype(dtype.name).str}
}


def _unpack_array(name: str, value: Any) -> np.ndarray:
    if not (isinstance(value, list) and len(value) == 3):
        raise SampleDecodeError(f"{name}: expected [dtype, shape, bytes], got {type(value).__name__}")
    dtype_str, shape, raw = value
    if not isinstance(dtype_str, str):
        raise SampleDecodeError(f"{name}: dtype must be a string, got {type(dtype_str).__name__}")
    dtype = _ALLOWED.get((name, dtype_str))
    if dtype is None:
        try:
            np.dtype(dtype_str)
        except TypeError:
            raise SampleDecodeError(f"{name}: unknown dtype {dtype_str!r}") from None
        raise SampleDecodeError(
            f"{name}: dtype {dtype_str!r} is not allowed; expected one of {[d.str for d in ARRAY_DTYPES[name]]}")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise SampleDecodeError(f"{name}: shape must be a list of non-negative ints, got {shape!r}")
    if not isinstance(raw, bytes):
        raise SampleDecodeError(f"{name}: data must be raw bytes, got {type(raw).__name__}")
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise SampleDecodeError(
            f"{name}: {len(raw)} bytes do not match shape {shape} of {dtype_str} ({expected} bytes); truncated?"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _map_to_sample(m: Any) -> Sample:
    if not isinstance(m, dict):
        raise SampleDecodeError(f"expected a map per sample, got {type(m).__name__}")
    known = set(_SCALAR_FIELDS) | set(ARRAY_DTYPES)
    unknown = set(m) - known
    if unknown:
        raise SampleDecodeError(f"unknown fields {sorted(unknown)}; written by a newer sluice?")
    for name, typ in _SCALAR_FIELDS.items():
        if name not in m:
            raise SampleDecodeError(f"{name}: missing")
        v = m[name]
        if not isinstance(v, typ) or isinstance(v, bool):
            raise SampleDecodeError(f"{name}: expected {typ}, got {type(v).__name__}")
    for name in _REQUIRED_ARRAYS:
        if name not in m:
            raise SampleDecodeError(f"{name}: missing")
    arrays = {name: _unpack_array(name, m[name]) for name in ARRAY_DTYPES if name in m}
    status = m["status"]
    if status not in {s.value for s in SampleStatus}:
        raise SampleDecodeError(f"status: {status!r} is not one of {[s.value for s in SampleStatus]}")
    try:
        return Sample(
            prompt_ids=arrays["prompt_ids"],
            response_ids=arrays["response_ids"],
            rollout_logprobs=arrays["rollout_logprobs"],
            token_versions=arrays["token_versions"],
            loss_mask=arrays["loss_mask"],
            routed_experts=arrays.get("routed_experts"),
            reward=float(m["reward"]),
            reward_info=m["reward_info"],
            status=SampleStatus(status),
            finish_reason=m["finish_reason"],
            sample_id=m["sample_id"],
            group_id=m["group_id"],
            prompt_id=m["prompt_id"],
            index=m["index"],
            producer=m["producer"],
            engine=m["engine"],
            created_at=float(m["created_at"]),
            sampling=SamplingInfo.from_dict(m["sampling"]),
        )
    except SampleDecodeError:
        raise
    except SampleError as e:
        raise SampleDecodeError(str(e)) from None


def _unpack(data: bytes, what: str) -> Any:
    """msgpack of a payload or header; SampleDecodeError naming ``what`` on anything that is not."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SampleDecodeError(f"{what} must be bytes, got {type(data).__name__}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for corrupt input
        raise SampleDecodeError(f"{what} is not valid msgpack: {type(e).__name__}: {e}") from None


def decode_samples(data: bytes) -> list[Sample]:
    """Decode one queue entry's payload; raises SampleDecodeError on anything malformed."""
    env = _unpack(data, "payload")
    if not isinstance(env, dict) or "schema" not in env or "samples" not in env:
        raise SampleDecodeError("payload is not a sluice envelope (needs 'schema' and 'samples')")
    if env["schema"] not in KNOWN_SCHEMA_VERSIONS:
        raise SampleDecodeError(
            f"schema version {env['schema']!r} is unknown (this sluice reads {sorted(KNOWN_SCHEMA_VERSIONS)}); "
            "upgrade sluice to read it"
        )
    unknown = set(env) - {"schema", "samples", "routing"}
    if unknown:
        raise SampleDecodeError(f"envelope has unknown keys {sorted(unknown)}")
    if env["schema"] == 1 and "routing" in env:
        raise SampleDecodeError("a schema 1 envelope cannot carry a routing block (schema 2 introduced it)")
    samples = env["samples"]
    if not isinstance(samples, list) or not samples:
        raise SampleDecodeError("samples: expected a non-empty list")
    out = []
    for i, m in enumerate(samples):
        if "routing" in env and isinstance(m, dict) and "routed_experts" in m:
            raise SampleDecodeError(f"sample[{i}] routed_experts: given both per sample and in the entry's block")
        try:
            out.append(_map_to_sample(m))
        except SampleDecodeError as e:
            raise SampleDecodeError(f"sample[{i}] {e}") from None
    if "routing" in env:
        # decode_routing checked each array against its sample's token counts, all the rest validate() would.
        for s, routed in zip(out, decode_routing(env["routing"], out)):
            s.routed_experts = routed
    return out


# ------------------------------------------------------------------------------------------------------- headers
# Column name -> what one value may be. A header lists each column once with one value per sample: the names would
# otherwise be repeated per sample, and they are most of a small map's bytes.
_HEADER_COLUMNS: dict[str, tuple[type, ...]] = {
    "sample_id": (str,),
    "group_id": (str,),
    "prompt_id": (str,),
    "index": (int,),
    "reward": (float, int),
    "status": (str,),
    "finish_reason": (str,),
    "producer": (str,),
    "engine": (str,),
    "created_at": (float, int),
    "prompt_len": (int,),
    "response_len": (int,),
    "version_min": (int, type(None)),
    "version_max": (int, type(None)),
    "pass": (bool, int, float, type(None)),
}
_STATUSES = {s.value: s for s in SampleStatus}


def _verdict(info: Any) -> bool | int | float | None:
    """The reward's ``pass`` verdict as the stream evaluator reads it (a bool or a number), else None."""
    v = info.get("pass") if isinstance(info, dict) else None
    return v if isinstance(v, (bool, int, float)) else None


def header_of(sample: Sample) -> SampleHeader:
    """The header a sample gets on the wire (also what an entry of schema 1 or 2 reads as)."""
    verdict = _verdict(sample.reward_info)
    return SampleHeader(
        sample_id=sample.sample_id, group_id=sample.group_id, prompt_id=sample.prompt_id, index=sample.index,
        reward=sample.reward, status=sample.status, finish_reason=sample.finish_reason, producer=sample.producer,
        engine=sample.engine, created_at=sample.created_at, prompt_len=sample.num_prompt_tokens,
        response_len=sample.num_response_tokens, version_min=sample.version_min, version_max=sample.version_max,
        reward_info={} if verdict is None else {"pass": verdict},
    )


def encode_header(samples: Sequence[Sample]) -> bytes:
    """A group's header: every column of ``_HEADER_COLUMNS`` as a list with one value per sample."""
    if not samples:
        raise SampleError("cannot encode an empty group; a queue entry holds at least one sample")
    heads = [header_of(s) for s in samples]
    cols: dict[str, list[Any]] = {name: [] for name in _HEADER_COLUMNS}
    for h in heads:
        for name in _HEADER_COLUMNS:
            if name == "pass":
                cols[name].append(h.reward_info.get("pass"))
            elif name == "status":
                cols[name].append(h.status.value)
            else:
                cols[name].append(getattr(h, name))
    return msgpack.packb({"schema": ENTRY_VERSION, **cols}, use_bin_type=True)


def decode_header(data: bytes) -> list[SampleHeader]:
    """Decode a header; raises SampleDecodeError naming the column that is malformed."""
    head = _unpack(data, "header")
    if not isinstance(head, dict) or head.get("schema") != ENTRY_VERSION:
        raise SampleDecodeError(f"header is not a sluice header of schema {ENTRY_VERSION}")
    unknown, missing = set(head) - set(_HEADER_COLUMNS) - {"schema"}, set(_HEADER_COLUMNS) - set(head)
    if unknown or missing:
        raise SampleDecodeError(f"header columns: unknown {sorted(unknown)}, missing {sorted(missing)}")
    n = len(head["sample_id"]) if isinstance(head["sample_id"], list) else 0
    if n == 0:
        raise SampleDecodeError("header sample_id: expected a non-empty list")
    for name, types in _HEADER_COLUMNS.items():
        col = head[name]
        if not isinstance(col, list) or len(col) != n:
            raise SampleDecodeError(f"header {name}: expected a list of {n} values")
        for v in col:
            if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
                raise SampleDecodeError(f"header {name}: {type(v).__name__} {v!r} is not one of {types}")
    out = []
    for i in range(n):
        row = {name: head[name][i] for name in _HEADER_COLUMNS}
        lo, hi = row["version_min"], row["version_max"]
        if (lo is None) != (hi is None) or (lo is not None and not 0 <= lo <= hi):
            raise SampleDecodeError(f"header sample[{i}]: versions [{lo}, {hi}] are not 0 <= min <= max")
        if (lo is None) != (row["response_len"] == 0):
            raise SampleDecodeError(f"header sample[{i}]: versions [{lo}, {hi}] for {row['response_len']} "
                                    "response tokens; only an empty response has none")
        if row["status"] not in _STATUSES:
            raise SampleDecodeError(f"header sample[{i}] status: {row['status']!r} is not one of {list(_STATUSES)}")
        if row["index"] < 0 or row["prompt_len"] < 1 or row["response_len"] < 0 or math.isnan(row["reward"]):
            raise SampleDecodeError(f"header sample[{i}]: index {row['index']}, prompt_len {row['prompt_len']}, "
                                    f"response_len {row['response_len']} or reward {row['reward']} is impossible")
        verdict = row.pop("pass")
        out.append(SampleHeader(**{**row, "status": _STATUSES[row["status"]], "reward": float(row["reward"]),
                                   "created_at": float(row["created_at"])},
                                reward_info={} if verdict is None else {"pass": verdict}))
    return out
