"""The Sample codec: exact round trips (msgpack and Arrow), and a clear SampleDecodeError for every malformed input."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import SampleDecodeError, SampleError
from pipeline.queue import Sample, SampleStatus, compact_routing, decode_samples, encode_samples, routing_dtype
from pipeline.queue.arrow import samples_to_table, table_to_samples
from tests.helpers.samples import make_sample


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    p = draw(st.integers(1, 40))
    r = draw(st.integers(0, 40))
    num_experts = draw(st.sampled_from([None, 4, 256, 257, 1000]))
    layers, topk = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    routed = None
    if num_experts:
        routed = compact_routing(rng.integers(0, num_experts, (p + r - 1, layers, topk)), num_experts)
    info = draw(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(-10, 10), st.text(max_size=5),
                                                                st.booleans(), st.none(), st.floats(allow_nan=False)),
                                max_size=3))
    return Sample(
        prompt_ids=rng.integers(-(2**31), 2**31 - 1, p, dtype=np.int64).astype(np.int32),
        response_ids=rng.integers(0, 2**31 - 1, r, dtype=np.int64).astype(np.int32),
        rollout_logprobs=-rng.random(r, dtype=np.float32) * 30,
        token_versions=np.sort(rng.integers(0, 5, r)).astype(np.int32),
        loss_mask=rng.integers(0, 2, r).astype(np.uint8),
        routed_experts=routed,
        reward=draw(st.floats(allow_nan=False, allow_infinity=False)),
        reward_info=info,
        status=draw(st.sampled_from(list(SampleStatus))),
        finish_reason=draw(st.sampled_from(["stop", "length", ""])),
        group_id=draw(st.text(max_size=8)),
        prompt_id=draw(st.text(max_size=8)),
        index=draw(st.integers(0, 64)),
        producer="p",
        engine="e",
        sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 40,
                  "seed": draw(st.one_of(st.none(), st.integers(0, 2**62)))},
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(samples(), min_size=1, max_size=4))
def test_msgpack_round_trip_is_exact(group: list[Sample]) -> None:
    out = decode_samples(encode_samples(group))
    assert out == group
    for a, b in zip(out, group):
        assert a.version_min == b.version_min and a.version_max == b.version_max
        if b.routed_experts is not None:
            assert a.routed_experts.dtype == b.routed_experts.dtype


@settings(max_examples=60, deadline=None)
@given(st.lists(samples(), min_size=1, max_size=6))
def test_arrow_round_trip_is_exact(group: list[Sample]) -> None:
    ids = [f"{i + 1}-{i}" for i in range(len(group))]
    table = samples_to_table(group, ids)
    back = list(table_to_samples(table))
    assert [sid for sid, _ in back] == ids
    assert [s for _, s in back] == group
    # A sliced table (as a filtered read produces) still maps rows to their own lists.
    sliced = list(table_to_samples(table.slice(1)))
    assert [s for _, s in sliced] == group[1:]


def test_routing_dtype_follows_expert_count() -> None:
    assert routing_dtype(8) == np.uint8
    assert routing_dtype(256) == np.uint8
    assert routing_dtype(257) == np.dtype("<u2")
    with pytest.raises(SampleError, match="65536"):
        routing_dtype(70000)
    ids = np.array([[[0, 255]]])
    assert compact_routing(ids, 256).dtype == np.uint8
    with pytest.raises(SampleError, match="outside"):
        compact_routing(ids, 200)


def _good_map(rng: np.random.Generator) -> dict:
    return msgpack.unpackb(encode_samples([make_sample(rng)], routing="plain"), raw=False)


def _encode_map(env: dict) -> bytes:
    return msgpack.packb(env, use_bin_type=True)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda env: env.update(schema=99), "schema version 99 is unknown"),
        (lambda env: env.pop("samples"), "not a sluice envelope"),
        (lambda env: env.update(samples=[]), "non-empty list"),
        (lambda env: env["samples"][0].pop("sample_id"), "sample_id: missing"),
        (lambda env: env["samples"][0].pop("rollout_logprobs"), "rollout_logprobs: missing"),
        (lambda env: env["samples"][0].update(extra=1), "unknown fields"),
        (lambda env: env["samples"][0].update(reward="high"), "reward: expected"),
        (lambda env: env["samples"][0].update(status="exploded"), "status"),
        (lambda env: env["samples"][0].update(reward_info=[1]), "reward_info: expected"),
        (lambda env: env["samples"][0]["prompt_ids"].__setitem__(0, "<f8"), "prompt_ids: dtype '<f8' is not allowed"),
        (lambda env: env["samples"][0]["prompt_ids"].__setitem__(0, "nonsense"), "prompt_ids: unknown dtype"),
        (lambda env: env["samples"][0]["routed_experts"].__setitem__(0, "<i4"), "routed_experts: dtype '<i4'"),
        (lambda env: env["samples"][0]["response_ids"].__setitem__(2, b"\x00" * 3), "response_ids: 3 bytes"),
        (lambda env: env["samples"][0]["response_ids"].__setitem__(1, [-1]), "shape must be"),
        (lambda env: env["samples"][0].update(loss_mask=["|u1", [2], b"\x01\x01"]), "loss_mask: has 2 entries"),
        (lambda env: env["samples"][0].update(token_versions=["<i4", [1], b"\x00" * 4]), "token_versions: has 1"),
        (lambda env: env["samples"][0].update(rollout_logprobs=["<f4", [0], b""]), "rollout_logprobs: has 0"),
        (lambda env: env["samples"][0].update(routed_experts=["|u1", [3, 2, 2], b"\x00" * 12]), "P\\+R-1"),
        (lambda env: env["samples"][0].update(routed_experts=["|u1", [11, 4], b"\x00" * 44]), "routed_experts: expected shape"),
        (lambda env: env["samples"][0].update(token_versions=["<i4", [7], np.full(7, -1, "<i4").tobytes()]), "negative"),
        (lambda env: env["samples"][0].update(rollout_logprobs=["<f4", [7], np.ones(7, "<f4").tobytes()]), "not a log-probability"),
        (lambda env: env["samples"][0].update(loss_mask=["|u1", [7], b"\x02" * 7]), "loss_mask: values"),
        (lambda env: env["samples"][0].update(reward=math.nan), "reward: is NaN"),
        (lambda env: env["samples"][0].update(prompt_ids=["<i4", [0], b""]), "prompt_ids: empty"),
        (lambda env: env["samples"][0].update(sampling={"temp": 1}), "sampling: unknown keys"),
    ],
)
def test_every_malformed_payload_names_its_field(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    env = _good_map(np.random.default_rng(0))
    mutate(env)
    with pytest.raises(SampleDecodeError, match=match):
        decode_samples(_encode_map(env))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"garbage", msgpack.packb([1, 2]), msgpack.packb({"schema": 1})])
def test_non_envelopes_are_rejected(data: bytes) -> None:
    with pytest.raises(SampleDecodeError):
        decode_samples(data)


def test_truncated_payload_is_rejected() -> None:
    data = encode_samples([make_sample(np.random.default_rng(1))])
    with pytest.raises(SampleDecodeError, match="msgpack"):
        decode_samples(data[: len(data) // 2])


def test_construction_validates_too() -> None:
    rng = np.random.default_rng(0)
    good = make_sample(rng)
    with pytest.raises(SampleError, match="rollout_logprobs: has 3 entries"):
        Sample(prompt_ids=[1], response_ids=[1, 2], rollout_logprobs=[-1.0, -1.0, -1.0], token_versions=[0, 0])
    with pytest.raises(SampleError, match="compact_routing"):
        Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-1.0], token_versions=[0],
               routed_experts=np.zeros((1, 1, 1), dtype=np.int32))
    with pytest.raises(SampleError, match="reward_info.x: set"):
        Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-1.0], token_versions=[0], reward_info={"x": {1}})
    with pytest.raises(SampleError, match="status"):
        Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-1.0], token_versions=[0], status="done")
    with pytest.raises(SampleError, match="empty group"):
        encode_samples([])
    assert good.version_min == 0 and good.loss_mask.dtype == np.uint8


def test_empty_response_has_no_version() -> None:
    s = Sample(prompt_ids=[1, 2], response_ids=[], rollout_logprobs=[], token_versions=[], status="aborted")
    assert s.version_min is None and s.version_max is None
    assert decode_samples(encode_samples([s])) == [s]


def test_big_endian_input_is_stored_little_endian() -> None:
    s = Sample(prompt_ids=np.array([1, 2], dtype=">i4"), response_ids=np.array([3], dtype=">i4"),
               rollout_logprobs=np.array([-0.5], dtype=">f4"), token_versions=np.array([2], dtype=">i4"))
    out = decode_samples(encode_samples([s]))[0]
    assert out.prompt_ids.dtype.str == "<i4" and out.prompt_ids.tolist() == [1, 2]
    assert out.rollout_logprobs.tolist() == [-0.5] and out.version_min == 2
