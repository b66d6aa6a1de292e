"""Compact routing on the wire: exact for every shape, smaller than plain arrays, old entries still read, and the
trainer's replay gives bit-identical log-probs from compact and plain entries."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import SampleDecodeError
from pipeline.queue import Sample, decode_samples, encode_samples
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.routing_codec import plain_routing_bytes

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _sample(rng: np.random.Generator, prompt: np.ndarray, prompt_rows: np.ndarray | None, response: int,
            num_experts: int, layers: int, topk: int, index: int) -> Sample:
    routed = None
    if prompt_rows is not None:
        rows = prompt.size + response - 1
        extra = max(0, rows - prompt_rows.shape[0]) * layers
        dtype = np.uint8 if num_experts <= 256 else np.dtype("<u2")
        own = np.array([rng.permutation(num_experts)[:topk] for _ in range(extra)], dtype=dtype).reshape(
            -1, layers, topk)
        routed = np.concatenate([prompt_rows[:rows].astype(dtype), own])[:rows]
    return Sample(
        prompt_ids=prompt, response_ids=rng.integers(0, 50, response).astype(np.int32),
        rollout_logprobs=-rng.random(response, dtype=np.float32), token_versions=np.zeros(response, np.int32),
        routed_experts=routed, group_id="g", index=index,
    )


@st.composite
def groups(draw: st.DrawFn) -> list[Sample]:
    """A GRPO group as engines produce it: one prompt, its routing rows shared unless a push landed between the
    prefills (``diverged``), a response of its own per sample, and now and then a sample without routing."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_experts = draw(st.sampled_from([2, 8, 64, 128, 256, 300]))
    topk = draw(st.integers(1, min(8, num_experts)))
    layers = draw(st.integers(1, 4))
    size = draw(st.integers(1, 9))
    prompt = rng.integers(0, 50, draw(st.integers(1, 30))).astype(np.int32)
    shared = np.stack([rng.permutation(num_experts)[:topk] for _ in range(prompt.size * layers)]).reshape(
        prompt.size, layers, topk)
    out = []
    for i in range(size):
        rows = shared
        if draw(st.integers(0, 4)) == 0:  # diverged: its prefill saw other weights
            rows = shared.copy()
            rows[draw(st.integers(0, prompt.size - 1))] = rng.permutation(num_experts)[:topk]
        routed = None if draw(st.integers(0, 6)) == 0 else rows
        out.append(_sample(rng, prompt, routed, draw(st.integers(1, 40)), num_experts, layers, topk, i))
    return out


@settings(max_examples=200, deadline=None)
@given(groups())
def test_compact_routing_round_trip_is_exact(group: list[Sample]) -> None:
    compact = decode_samples(encode_samples(group, routing="compact"))
    plain = decode_samples(encode_samples(group, routing="plain"))
    for a, b, c in zip(group, compact, plain, strict=True):
        if a.routed_experts is None:
            assert b.routed_experts is None and c.routed_experts is None
            continue
        # Same ids in the same order within every row: what the trainer replays is what the engine returned.
        assert b.routed_experts.dtype == a.routed_experts.dtype
        assert np.array_equal(b.routed_experts, a.routed_experts)
        assert np.array_equal(c.routed_experts, a.routed_experts)
    assert compact == group


def _group(rng: np.random.Generator, *, size: int = 8, prompt_len: int = 64, response: int = 64,
           num_experts: int = 8, topk: int = 2, layers: int = 2) -> list[Sample]:
    prompt = rng.integers(0, 50, prompt_len).astype(np.int32)
    shared = np.stack([rng.permutation(num_experts)[:topk] for _ in range(prompt_len * layers)]).reshape(
        prompt_len, layers, topk)
    return [_sample(rng, prompt, shared, response, num_experts, layers, topk, i) for i in range(size)]


def _routing_bytes(payload: bytes) -> int:
    env = msgpack.unpackb(payload, raw=False)
    if "routing" in env:
        return len(env["routing"]["data"])
    return sum(len(m["routed_experts"][2]) for m in env["samples"] if "routed_experts" in m)


def test_shared_prompt_rows_are_stored_once_and_a_diverged_sample_keeps_its_own() -> None:
    rng = np.random.default_rng(0)
    group = _group(rng, num_experts=128, topk=8, prompt_len=200, response=20)
    payload = encode_samples(group)
    block = msgpack.unpackb(payload, raw=False)["routing"]
    assert block["shared"] == 200 and all(block["sharing"])
    # The same group with prompt rows that differ per sample stores 8 x 219 rows instead of 200 + 8 x 19.
    unshared = [Sample(**{**s.__dict__, "routed_experts": np.concatenate(
        [np.stack([rng.permutation(128)[:8] for _ in range(400)]).reshape(200, 2, 8).astype(np.uint8),
         s.routed_experts[200:]])}) for s in group]
    assert _routing_bytes(encode_samples(unshared)) > 4 * _routing_bytes(payload)
    # One sample's prefill saw other weights: it keeps its own rows, the others still share.
    diverged = group[3].routed_experts.copy()
    diverged[17, 1] = diverged[17, 1][::-1]
    group[3] = Sample(**{**group[3].__dict__, "routed_experts": diverged})
    payload = encode_samples(group)
    block = msgpack.unpackb(payload, raw=False)["routing"]
    assert block["sharing"] == [True, True, True, False, True, True, True, True]
    assert np.array_equal(decode_samples(payload)[3].routed_experts, diverged)


def test_compact_routing_is_at_most_half_the_plain_bytes_for_engine_shaped_routing() -> None:
    # The recipe's shape (8 experts, top-2): ids need 3 of their 8 bits, and a group shares its prompt rows.
    rng = np.random.default_rng(1)
    group = _group(rng, prompt_len=40, response=60)
    compact = _routing_bytes(encode_samples(group))
    plain = plain_routing_bytes(group)
    assert plain == _routing_bytes(encode_samples(group, routing="plain"))
    print(f"routing bytes compact/plain: {compact / plain:.3f}")
    assert compact / plain <= 0.5


def test_zstd_runs_only_where_it_pays() -> None:
    # Uniform ids over 256 experts carry 8 bits each: the probe sees zstd cannot pay and the rows go as they are.
    rng = np.random.default_rng(2)
    uniform = _group(rng, size=3, prompt_len=50, response=4000, num_experts=256, topk=8, layers=2)
    env = msgpack.unpackb(encode_samples(uniform), raw=False)
    assert env["routing"]["codec"] == "none" and env["routing"]["shared"] == 50
    assert [len(b) for b in env["routing"]["data"]] == [50 * 16] + [3999 * 16] * 3
    env["routing"]["data"][2] = env["routing"]["data"][2][:-16]
    with pytest.raises(SampleDecodeError, match="row buffer 2 holds"):
        decode_samples(msgpack.packb(env, use_bin_type=True))
    # Eight experts need 3 bits of each byte: zstd pays, and it runs.
    skewed = _group(rng, size=3, prompt_len=50, response=12000, num_experts=8, topk=2, layers=2)
    env = msgpack.unpackb(encode_samples(skewed), raw=False)
    assert env["routing"]["codec"] == "zstd" and len(env["routing"]["data"]) < 0.5 * plain_routing_bytes(skewed)
    for group in (uniform, skewed):
        back = decode_samples(encode_samples(group))
        assert all(np.array_equal(a.routed_experts, b.routed_experts) for a, b in zip(group, back, strict=True))


def test_a_group_mixing_routing_layouts_falls_back_to_plain_arrays() -> None:
    rng = np.random.default_rng(3)
    group = _group(rng, size=2) + _group(rng, size=1, layers=3)
    env = msgpack.unpackb(encode_samples(group), raw=False)
    assert "routing" not in env and all("routed_experts" in m for m in env["samples"])
    assert decode_samples(encode_samples(group)) == group


def test_a_schema_1_entry_still_decodes() -> None:
    # Written by sluice before compact routing (schema 1): routing per sample as plain uint8 arrays.
    payload = (FIXTURES / "entry_schema1.msgpack").read_bytes()
    assert msgpack.unpackb(payload, raw=False)["schema"] == 1
    samples = decode_samples(payload)
    assert [s.index for s in samples] == [0, 1, 2] and {s.group_id for s in samples} == {"g-schema1"}
    assert [None if s.routed_experts is None else s.routed_experts.shape for s in samples] == [
        (8, 2, 2), (7, 2, 2), None]
    assert samples[0].sampling.seed == 11 and samples[2].reward == 1.0
    assert decode_samples(encode_samples(samples)) == samples


def test_a_schema_1_queue_entry_is_read_like_a_new_one(queue: SampleQueue) -> None:
    queue.create_group("trainer")
    payload = (FIXTURES / "entry_schema1.msgpack").read_bytes()
    old = queue.redis.xadd(queue.keys.samples, {"v": 1, "n": 3, "vmin": 3, "vmax": 3, "data": payload})
    new = queue.put(_group(np.random.default_rng(4), size=3))
    got = queue.read("trainer", "c", count=10)
    assert [e.id for e in got] == [old.decode(), new]
    assert [len(e.samples) for e in got] == [3, 3] and queue.dead_letters() == []


def _mutations() -> list[tuple[object, str]]:
    return [
        (lambda b: b.update(codec="lzma"), "codec 'lzma' unknown"),
        (lambda b: b.update(size=b["size"] + 1), "declares"),
        (lambda b: b.update(data=b["data"][:-5]), "routing"),
        (lambda b: b.update(dtype="<i4"), "dtype '<i4'"),
        (lambda b: b.update(rows=b["rows"][:-1]), "rows and sharing"),
        (lambda b: b.update(rows=[r + 1 for r in b["rows"]]), "P\\+R-1|declares"),
        (lambda b: b.update(sharing=[False] + b["sharing"][1:]), "shared rows must be|declares"),
        (lambda b: b.pop("layers"), "missing keys \\['layers'\\]"),
        (lambda b: b.update(extra=1), "unknown keys \\['extra'\\]"),
    ]


@pytest.mark.parametrize(("mutate", "match"), _mutations())
def test_a_corrupt_routing_block_is_a_decode_error(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    env = msgpack.unpackb(encode_samples(_group(np.random.default_rng(5), size=3)), raw=False)
    mutate(env["routing"])
    with pytest.raises(SampleDecodeError, match=match):
        decode_samples(msgpack.packb(env, use_bin_type=True))


def test_a_corrupt_routing_block_goes_to_the_dead_letter_stream(queue: SampleQueue) -> None:
    queue.create_group("trainer")
    env = msgpack.unpackb(encode_samples(_group(np.random.default_rng(6), size=2)), raw=False)
    env["routing"]["data"] = env["routing"]["data"][: len(env["routing"]["data"]) // 2]
    bad = queue.redis.xadd(queue.keys.samples, {"v": 2, "n": 2, "vmin": 0, "vmax": 0,
                                                "data": msgpack.packb(env, use_bin_type=True)})
    good = queue.put(_group(np.random.default_rng(7), size=2))
    assert [e.id for e in queue.read("trainer", "c", count=10)] == [good]
    dead = queue.dead_letters()
    assert [d["entry_id"] for d in dead] == [bad.decode()] and "routing" in dead[0]["reason"]


def test_the_queue_writes_the_routing_codec_it_was_given(queue: SampleQueue) -> None:
    queue.create_group("trainer")
    plain = SampleQueue(queue.redis, queue.run, capacity=1000, routing_codec="plain")
    rng = np.random.default_rng(8)
    group = _group(rng, prompt_len=100, response=100)
    queue.put(group)
    plain.put(group)
    rows = queue.redis.xrange(queue.keys.samples)
    payloads = queue.fetch_payloads([fields[b"pkey"].decode() for _, fields in rows])
    compact, plain_bytes = (_routing_bytes(data) for data in payloads.values())
    assert compact < 0.5 * plain_bytes == 0.5 * plain_routing_bytes(group)
    got = queue.read("trainer", "c", count=10)
    for entry in got:
        assert [np.array_equal(a.routed_experts, b.routed_experts) for a, b in zip(entry.samples, group)] == [True] * 8


def test_an_envelope_with_unknown_keys_or_a_schema_1_routing_block_is_refused() -> None:
    env = msgpack.unpackb(encode_samples(_group(np.random.default_rng(10), size=2)), raw=False)
    with pytest.raises(SampleDecodeError, match=r"unknown keys \['extra'\]"):
        decode_samples(msgpack.packb({**env, "extra": 1}, use_bin_type=True))
    with pytest.raises(SampleDecodeError, match="schema 1 envelope cannot carry a routing block"):
        decode_samples(msgpack.packb({**env, "schema": 1}, use_bin_type=True))
