"""The split entry: a header in the run's stream, the payload under a shard tag of the run, on a single server and on
a 3-primary cluster (``ON_BOTH``, under the one-slot check). Old entries still read; a lost payload is dead-lettered
with its prompt handed back; a trim deletes payloads and headers (and a trim stopped between the two leaves only
payloads the next one deletes); a reclaim deletes the payloads a dead producer wrote without their headers; and the
bytes on the run's node and over the primaries meet their goals."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from pipeline.benchmarks.payload_spread import CONTROL_GOAL_BYTES, SPREAD_GOAL, control_bytes, payload_spread
from pipeline.config.producer import ProducerConfig
from pipeline.data.prompts import synthetic
from pipeline.producers.producer import Producer
from pipeline.queue import redis_streams
from pipeline.queue.archive import Archiver, ArchiveReader
from pipeline.queue.base import HeaderEntry
from pipeline.queue.codec import decode_samples, encode_samples, header_of
from pipeline.queue.connection import connect
from pipeline.queue.keys import hash_tag
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample
from tests.helpers import one_slot, redis_cluster
from tests.helpers.one_slot import ON_BOTH
from tests.helpers.redis_cluster import LocalCluster
from tests.helpers.samples import make_group

redis_kind, redis_url, redis_client = one_slot.redis_kind, one_slot.redis_url, one_slot.redis_client
redis_cluster = redis_cluster.redis_cluster

SCHEMA1_ARCHIVE = Path(__file__).parents[1] / "fixtures" / "archive_schema1"


def _pkeys(queue: SampleQueue) -> list[str]:
    return [f[b"pkey"].decode() for _, f in queue.redis.xrange(queue.keys.samples) if b"pkey" in f]


def _exists(queue: SampleQueue, keys: Sequence[str]) -> list[bool]:
    return [bool(queue.redis.exists(k)) for k in keys]


# ------------------------------------------------------------------------------------------------------ the split
@ON_BOTH
def test_an_entry_is_a_header_in_the_stream_and_its_payload_on_a_shard(queue: SampleQueue, redis_kind: str) -> None:
    rng = np.random.default_rng(0)
    queue.create_group("trainer")
    groups = [make_group(rng, 3, version=(v, v + 1)) for v in range(12)]
    ids = queue.put_many(groups[:6]) + [queue.put(g) for g in groups[6:]]
    tags = queue.shard_tags()
    if redis_kind == "single":
        assert tags == [queue.run]  # the run's own tag: the layout before payloads had keys of their own
    else:
        # Two tags per primary, every tag in a slot of its own.
        assert isinstance(queue.redis, RedisCluster) and len(tags) == 6
        owners = [queue.redis.get_node_from_key(f"{{{t}}}").name for t in tags]
        assert sorted(owners.count(o) for o in set(owners)) == [2, 2, 2]
        assert len({key_slot(t.encode()) for t in tags}) == 6
    assert SampleQueue(queue.redis, queue.run).shard_tags() == tags  # recorded once, read by every process

    rows = queue.redis.xrange(queue.keys.samples)
    assert [r[0].decode() for r in rows] == ids
    for (_, fields), group in zip(rows, groups):
        assert set(fields) == {b"v", b"n", b"vmin", b"vmax", b"seq", b"head", b"pkey", b"psize"}
        pkey = fields[b"pkey"].decode()
        assert hash_tag(pkey) in tags and pkey.endswith(f":payload:{int(fields[b'seq'])}")
        payload = queue.fetch_payloads([pkey])[pkey]
        assert payload is not None and int(fields[b"psize"]) == len(payload) > len(fields[b"head"])
        assert decode_samples(payload) == group
    if redis_kind == "cluster":  # payloads left the run's slot, and its primary
        assert {key_slot(k.encode()) for k in _pkeys(queue)} - {key_slot(queue.keys.samples.encode())}

    heads = queue.read_headers("trainer", "c", count=6)
    assert [h.id for h in heads] == ids[:6]
    assert [h.headers for h in heads] == [[header_of(s) for s in g] for g in groups[:6]]
    assert all(h.payload_key is not None and h.samples is None for h in heads)
    assert [e.samples for e in queue.materialize("trainer", "c", heads)] == groups[:6]
    assert [e.samples for e in queue.read("trainer", "c", count=10)] == groups[6:]
    assert [e.samples for e in queue.read_pending("trainer", "c")] == groups
    assert [e.samples for _, e in queue.scan()] == groups  # type: ignore[union-attr]
    assert not queue.redis.exists(queue.keys.producer_payloads("test"))  # every header took its payload off the list
    assert queue.dead_letters() == []
    checker = queue.redis.slot_checker  # type: ignore[union-attr]
    assert checker.scripts and all(len(t.slots) == 1 for t in checker.touches)


@ON_BOTH
def test_entries_of_schema_1_and_2_and_their_archives_still_read(queue: SampleQueue, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    old1, old2, new = (make_group(rng, 2) for _ in range(3))
    ids = [queue.redis.xadd(queue.keys.samples, {"v": 1, "n": 2, "vmin": 0, "vmax": 0,
                                                 "data": encode_samples(old1, routing="plain")}).decode(),
           queue.redis.xadd(queue.keys.samples, {"v": 2, "n": 2, "vmin": 0, "vmax": 0,
                                                 "data": encode_samples(old2)}).decode(),
           queue.put(new)]
    for g in ("headers", "whole", "archive"):
        queue.create_group(g, "0")
    heads = queue.read_headers("headers", "h", count=10)
    assert [h.payload_key is None for h in heads] == [True, True, False]
    assert [h.headers for h in heads] == [[header_of(s) for s in g] for g in (old1, old2, new)]
    assert [e.samples for e in queue.read("whole", "w", count=10)] == [old1, old2, new]
    Archiver(queue, tmp_path / "archive", block_ms=10).run(idle_exit_s=0.2)
    assert [sid for sid, _ in ArchiveReader(tmp_path / "archive").entries()] == [i for i in ids for _ in range(2)]
    assert list(ArchiveReader(tmp_path / "archive").samples()) == old1 + old2 + new
    shutil.copytree(SCHEMA1_ARCHIVE, tmp_path / "schema1")  # an archive written before the split
    assert len(list(ArchiveReader(tmp_path / "schema1").samples())) > 0
    assert queue.dead_letters() == []


# ---------------------------------------------------------------------------------------------- a lost payload
@ON_BOTH
def test_a_missing_or_undecodable_payload_is_dead_lettered_and_its_prompt_handed_back(queue: SampleQueue) -> None:
    rng = np.random.default_rng(2)
    k = queue.keys
    queue.create_group("trainer")
    queue.create_group("archive")
    lost, garbled, kept = (make_group(rng, 2) for _ in range(3))
    # The pacing records a producer leaves: moved to group_slots after the put, or still in its in-flight hash (it
    # died between its put and the move).
    queue.redis.hset(k.group_slots, mapping={lost[0].group_id: "7:0", kept[0].group_id: "9:0"})
    queue.redis.hset(k.producer_inflight("test"), garbled[0].group_id, "8:1")
    queue.redis.set(k.groups_started, 3)
    ids = queue.put_many([lost, garbled, kept])
    pkeys = _pkeys(queue)
    queue.redis.delete(pkeys[0])
    garbage = b"\xc1" * int(queue.redis.xrange(k.samples, count=2)[1][1][b"psize"])
    queue.redis.set(pkeys[1], garbage)

    assert [e.samples for e in queue.read("trainer", "t", count=10)] == [kept]
    dead = queue.dead_letters()
    assert [(d["entry_id"], d["group"]) for d in dead] == [(ids[0], "trainer"), (ids[1], "trainer")]
    assert dead[0]["reason"].startswith(f"payload {pkeys[0]} is missing") and "orig:payload" not in dead[0]
    assert "not valid msgpack" in dead[1]["reason"] and dead[1]["orig:payload"] == garbage  # the bytes are kept
    assert dead[0]["orig:pkey"] == pkeys[0].encode() and "orig:head" in dead[0]
    assert queue.pending_ids("trainer") == [ids[2]]  # the lost ones are acked, never read again
    # Both prompts went back as a dead producer's do, requeue counts as they were, their slots released.
    assert queue.redis.lrange(k.prompt_retry, 0, -1) == [b"7:0", b"8:1"]
    assert int(queue.redis.get(k.groups_started)) == 1
    assert queue.redis.hkeys(k.group_slots) == [kept[0].group_id.encode()]
    assert not queue.redis.exists(k.producer_inflight("test"))

    # A second group meets the same entries: it dead-letters them in its own name and hands nothing back twice.
    assert [e.samples for e in queue.read("archive", "a", count=10)] == [kept]
    assert [d["group"] for d in queue.dead_letters()] == ["trainer", "trainer", "archive", "archive"]
    assert queue.redis.llen(k.prompt_retry) == 2 and int(queue.redis.get(k.groups_started)) == 1


@ON_BOTH
def test_a_header_naming_a_key_outside_the_runs_payloads_is_dead_lettered_unread(queue: SampleQueue) -> None:
    rng = np.random.default_rng(3)
    queue.create_group("trainer")
    queue.put(make_group(rng, 2))
    fields = {k.decode(): v for k, v in queue.redis.xrange(queue.keys.samples)[0][1].items()}
    forged = queue.redis.xadd(queue.keys.samples, {**fields, "pkey": queue.keys.policy_version})
    got = queue.read("trainer", "t", count=10)
    assert len(got) == 1 and [d["entry_id"] for d in queue.dead_letters()] == [forged.decode()]
    assert "not a payload key of run" in queue.dead_letters()[0]["reason"]


# ------------------------------------------------------------------------------------------------------- trimming
@ON_BOTH
def test_trim_deletes_the_payloads_and_headers_every_group_acked(queue: SampleQueue,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_streams, "TRIM_BATCH", 3)  # several script calls in one trim
    rng = np.random.default_rng(4)
    queue.create_group("trainer")
    ids = queue.put_many([make_group(rng, 1) for _ in range(10)])
    pkeys = _pkeys(queue)
    queue.ack("trainer", [e.id for e in queue.read("trainer", "c", count=7)])
    assert queue.trim() == 7
    assert [r[0].decode() for r in queue.redis.xrange(queue.keys.samples)] == ids[7:]
    assert _exists(queue, pkeys) == [False] * 7 + [True] * 3
    assert not queue.redis.exists(queue.keys.payload_trash)
    assert len(queue.read("trainer", "c", count=10)) == 3  # what was kept still reads whole


@ON_BOTH
def test_a_trim_stopped_between_its_two_moves_leaves_only_payloads_the_next_trim_deletes(
        queue: SampleQueue, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    queue.create_group("trainer")
    ids = queue.put_many([make_group(rng, 1) for _ in range(6)])
    pkeys = _pkeys(queue)
    queue.ack("trainer", [e.id for e in queue.read("trainer", "c", count=4)])

    def killed(*args: Any) -> int:
        raise redis.ConnectionError("the trimming process died here")

    monkeypatch.setattr(queue, "_empty_trash", killed)
    with pytest.raises(redis.ConnectionError):
        queue.trim()
    # The headers went with their keys noted in the same step: no header points at nothing, no payload is unnamed.
    assert [r[0].decode() for r in queue.redis.xrange(queue.keys.samples)] == ids[4:]
    assert _exists(queue, pkeys) == [True] * 6
    assert {m.decode() for m in queue.redis.smembers(queue.keys.payload_trash)} == set(pkeys[:4])
    monkeypatch.undo()
    assert queue.trim() == 0
    assert _exists(queue, pkeys) == [False] * 4 + [True] * 2
    assert not queue.redis.exists(queue.keys.payload_trash)


# ------------------------------------------------------------------------------------------------------ reclaiming
class _NoEngine:
    async def close(self) -> None:
        pass


def _producer(queue: SampleQueue, name: str) -> Producer:
    return Producer(ProducerConfig(group_size=2), name=name, queue=queue, engine=_NoEngine(),  # type: ignore[arg-type]
                    prompts=synthetic("addition", size=8, seed=1), tokenize=lambda text: [ord(c) for c in text],
                    reward_fn=lambda prompt, response: 1.0, pacing=None, num_experts=None)


def _as(group: list[Sample], producer: str) -> list[Sample]:
    for s in group:
        s.producer = producer
    return group


@ON_BOTH
@pytest.mark.parametrize("who", ["peer", "restarted"])
def test_a_reclaim_deletes_the_payloads_a_dead_producer_wrote_without_headers(
        queue: SampleQueue, who: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(6)
    k = queue.keys
    queue.create_group("trainer")
    landed, orphan = _as(make_group(rng, 2), "dead"), _as(make_group(rng, 2), "dead")
    # What the dead producer left: both groups recorded in flight, one put whose record it never moved, and one put
    # that died after its payload landed and before its header did.
    queue.redis.sadd(k.producers, "dead")
    queue.redis.hset(k.producer_inflight("dead"), mapping={landed[0].group_id: "3:0", orphan[0].group_id: "4:0"})
    queue.redis.set(k.groups_started, 2)
    queue.put(landed)
    enqueue = queue._enqueue

    def dies_before_the_header(keys: Sequence[str], args: Sequence[Any], client: Any = None) -> Any:
        if client is not None:
            client.execute()  # a single server: the payloads go out in the header's pipeline
        raise redis.ConnectionError("the producer died here")

    monkeypatch.setattr(queue, "_enqueue", dies_before_the_header)
    with pytest.raises(redis.ConnectionError):
        queue.put(orphan)
    monkeypatch.setattr(queue, "_enqueue", enqueue)
    listed = [x.decode() for x in queue.redis.hkeys(k.producer_payloads("dead"))]
    assert len(listed) == 1 and queue.redis.exists(listed[0]) and listed[0] not in _pkeys(queue)

    producer = _producer(queue, "producer-1" if who == "peer" else "dead")
    reclaimed = producer.reclaim_dead_peers() if who == "peer" else producer.start_lease()
    assert reclaimed == 2 and sorted(queue.redis.lrange(k.prompt_retry, 0, -1)) == [b"3:0", b"4:0"]
    assert not queue.redis.exists(listed[0], k.producer_payloads("dead"))
    # The put that landed keeps its payload: its header took it off the list in the same step.
    assert [e.samples for e in queue.read("trainer", "t", count=10)] == [landed] and queue.dead_letters() == []


# ---------------------------------------------------------------------------------------------------- the figures
def test_a_group_of_48_layers_top_8_and_2304_tokens_puts_under_16_kb_on_the_runs_node(redis_url: str) -> None:
    with connect(redis_url) as client:
        c = control_bytes(client, groups=2)
    print(c)
    assert c["header_field_bytes"] <= CONTROL_GOAL_BYTES and c["stream_memory_per_group"] <= CONTROL_GOAL_BYTES
    assert c["payload_bytes"] > 300 * c["header_field_bytes"]  # the bytes that left the run's node


def test_payload_bytes_spread_within_15_percent_over_three_primaries(redis_cluster: LocalCluster) -> None:
    client = connect(redis_cluster.url)
    try:
        spread = payload_spread(client, groups=2000, shards=6)  # type: ignore[arg-type]
    finally:
        client.close()
    print(spread)
    assert sorted(spread["tags_per_primary"].values()) == [2, 2, 2]
    assert len(spread["payload_bytes_per_primary"]) == 3 and spread["max_deviation"] <= SPREAD_GOAL


def test_a_header_entry_reads_like_a_sample_for_every_decision() -> None:
    sample = make_group(np.random.default_rng(7), 1, response_len=0)[0]
    h = header_of(sample)
    for name in ("sample_id", "group_id", "prompt_id", "index", "reward", "status", "finish_reason", "producer",
                 "engine", "created_at", "version_min", "version_max", "num_response_tokens", "num_prompt_tokens"):
        assert getattr(h, name) == getattr(sample, name), name
    assert h.reward_info == {"pass": sample.reward_info["pass"]}
    entry = HeaderEntry("1-0", [h], -1, -1, None, 0)
    assert entry.group_id == sample.group_id and entry.producer == sample.producer
