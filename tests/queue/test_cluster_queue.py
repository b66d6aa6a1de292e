"""The queue on a real Redis Cluster (tests/helpers/redis_cluster.py): cluster URLs, the parts of a run that the core
queue tests do not reach (producers' pacing and leases, the trainer's version, the launcher's lock) driven through
their public API under the one-slot check (tests/helpers/one_slot.py), the durability check on every primary, a
primary SIGKILLed and restarted on its AOF, and a reader across failovers."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis.cluster import RedisCluster

from pipeline.config.producer import ProducerConfig, SamplingConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.trainer.drain import Drainer
from pipeline.consumers.trainer.ledger import Ledger
from pipeline.consumers.trainer.loop import RedisClock
from pipeline.data.prompts import synthetic
from pipeline.errors import EngineError, QueueError
from pipeline.launch.control import RunLock, RunLockedError
from pipeline.producers.base import GenerateResult, VersionSpan
from pipeline.producers.producer import Pacing, Producer
from pipeline.queue.connection import (
    DEFAULT_RETRY,
    RedisClient,
    check_fsync_always,
    cluster_startup_nodes,
    connect,
    redact_url,
)
from pipeline.queue.redis_streams import SampleQueue
from tests.helpers import one_slot
from tests.helpers import redis_cluster as bed
from tests.helpers.one_slot import ON_BOTH, SlotChecker
from tests.helpers.redis_cluster import LocalCluster
from tests.helpers.samples import make_group

redis_kind, redis_url, redis_client = one_slot.redis_kind, one_slot.redis_url, one_slot.redis_client
redis_cluster, redis_cluster_replicas = bed.redis_cluster, bed.redis_cluster_replicas


@pytest.fixture
def cluster_client(redis_cluster: LocalCluster) -> Iterator[RedisClient]:
    client = connect(redis_cluster.url)
    yield client
    client.close()


# ---------------------------------------------------------------------------------------------------------- URLs
def test_cluster_urls_name_their_nodes_and_keep_secrets_out_of_messages() -> None:
    base, nodes = cluster_startup_nodes("rediss+cluster://u:p%40ss@h1:7000,[::1]:7001,h3/?ssl_ca_certs=%2Fca.pem")
    assert base == "rediss://u:p%40ss@h1:7000?ssl_ca_certs=%2Fca.pem"
    assert nodes == [("h1", 7000), ("::1", 7001), ("h3", 6379)]
    url = "redis+cluster://sluice:s3cret@h1:7000,h2:7001/0"
    assert redact_url(url) == "redis+cluster://sluice:***@h1:7000,h2:7001/0"
    assert redact_url("rediss+cluster://:s3cret@h1:7000?ssl_password=k3y") == "rediss+cluster://:***@h1:7000?ssl_password=***"
    for bad, why in [("redis+cluster://:s3cret@h1:7000/3", "database '3'"),
                     ("redis+cluster://:s3cret@h1:7000,:x", "cannot read node")]:
        with pytest.raises(QueueError, match=why) as e:
            connect(bad)
        assert "s3cret" not in str(e.value)
    with pytest.raises(QueueError, match=r"redis\+cluster://") as e:
        connect("http://u:s3cret@h/0")
    assert "s3cret" not in str(e.value)


def test_a_cluster_client_speaks_resp2_with_the_queue_retry_and_the_urls_credentials(
        redis_cluster: LocalCluster) -> None:
    for node in redis_cluster.nodes:
        with node.client() as admin:
            admin.execute_command("ACL", "SETUSER", "trainer", "on", ">pw-0", "~sluice:*", "+@all")
    hosts = redis_cluster.url.split("://", 1)[1]
    client = connect(f"redis+cluster://trainer:pw-0@{hosts}")
    try:
        assert isinstance(client, RedisCluster) and client.retry is DEFAULT_RETRY
        assert {n.name for n in client.get_primaries()} == {n.name for n in redis_cluster.primaries()}
        pool = client.get_default_node().redis_connection.connection_pool
        assert pool.connection_kwargs["protocol"] == 2 and pool.connection_kwargs["username"] == "trainer"
        assert client.set("sluice:{c}:k", 1) and client.acl_whoami() in ("trainer", b"trainer")
    finally:
        client.delete("sluice:{c}:k")
        client.close()
    with connect(redis_cluster.url, retry=None) as probe:  # the launcher's view: no retries at all
        assert probe.retry.get_retries() == 0
    with pytest.raises(QueueError, match="refused the credentials") as e:
        connect(f"redis+cluster://trainer:wrong-pw@{hosts}")
    assert "wrong-pw" not in str(e.value)


# ------------------------------------------------------------------------------------------------ one-slot check
@ON_BOTH
def test_the_one_slot_check_refuses_a_script_or_a_transaction_over_two_slots(redis_client: RedisClient) -> None:
    checker: SlotChecker = redis_client.slot_checker  # type: ignore[union-attr]
    with pytest.raises(AssertionError, match="2 hash slots"):
        redis_client.eval("return 1", 2, "sluice:{a}:x", "sluice:{b}:x")
    pipe = redis_client.pipeline(transaction=True)
    pipe.set("sluice:{a}:x", 1)
    pipe.set("sluice:{b}:x", 1)
    with pytest.raises(AssertionError, match="2 hash slots"):
        pipe.execute()
    assert not redis_client.exists("sluice:{a}:x") and not redis_client.exists("sluice:{b}:x")  # nothing was sent
    assert redis_client.eval("return 1", 2, "sluice:{a}:x", "sluice:{a}:y") == 1
    assert [t.kind for t in checker.touches] == ["script"]


# ----------------------------------------------------------------------------- pacing, leases, version, lock
class _Engine:
    """Answers like an engine of weights version 0 (four tokens a sample); fails its first call."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any],
                       **kwargs: Any) -> GenerateResult:
        return (await self.generate_many([input_ids], {**sampling_params, "n": 1}))[0]

    async def generate_many(self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, Any],
                            **kwargs: Any) -> list[GenerateResult]:
        self.calls += 1
        if self.calls == 1:
            raise EngineError("engine down for its first call")
        ids = np.array([5, 6, 7, 8], dtype=np.int32)
        return [GenerateResult(ids, "5678", np.full(4, -0.5, np.float32), "length", {"type": "length"}, len(p), 4,
                               "0", (VersionSpan("0", 0, 4),), None, None, "fake")
                for p in prompts for _ in range(int(sampling_params.get("n", 1)))]

    async def close(self) -> None:
        pass


def _producer(queue: SampleQueue, name: str) -> Producer:
    return Producer(ProducerConfig(group_size=2, sampling=SamplingConfig(max_new_tokens=4), admission_poll_s=0.01,
                                   engine_retry_s=0.0), name=name, queue=queue, engine=_Engine(),
                    prompts=synthetic("addition", size=16, seed=1), tokenize=lambda text: [ord(c) for c in text],
                    reward_fn=lambda prompt, response: 1.0, pacing=Pacing(max_lag=0, batch_groups=2),
                    num_experts=None)  # fmt: skip


def test_pacing_leases_the_trainers_version_and_the_run_lock_on_a_cluster(redis_cluster: LocalCluster,
                                                                         tmp_path: Path) -> None:
    client = connect(redis_cluster.url)
    checker = SlotChecker(client)
    queue = SampleQueue(client, "paced", capacity=16)
    keys = queue.keys
    try:
        queue.create_group("trainer")
        # What a producer killed while generating leaves: a slot held, its prompt recorded in flight, no lease.
        client.sadd(keys.producers, "producer-dead")
        client.hset(keys.producer_inflight("producer-dead"), "g-dead", "9:0")
        client.incr(keys.groups_started)

        producer = _producer(queue, "producer-0")
        stats = asyncio.run(producer.run(max_groups=2))
        # The dead peer's prompt came back and was taken first; the engine's failure handed one prompt back too.
        assert stats.prompts_reclaimed == 1 and stats.engine_errors == 1 and stats.groups_put == 2
        assert int(client.get(keys.groups_started)) == 2 and client.hlen(keys.group_slots) == 2
        assert not client.exists(keys.producer_inflight("producer-dead"), producer.lease_key)
        assert {s.prompt_id for e in queue.read("trainer", "peek", count=10) for s in e.samples}  # both queued

        # The trainer moves to version 2: both groups (version 0) are stale at max_lag 0, so their slots come back.
        clock = RedisClock(queue)
        assert clock.advance() == 1 and clock.advance(at_least=2) == 2
        ledger = Ledger(tmp_path / "ledger")
        drainer = Drainer(queue, ledger, StalenessConfig(max_lag=0, action="drop"), consumer="peek", block_ms=10)
        drainer.recover()
        batch = drainer.next_batch(2, step=1, version=lambda: 2,
                                   should_stop=lambda: not client.hlen(keys.group_slots))
        assert batch.groups == [] and batch.slots.released == 2 and int(client.get(keys.groups_started)) == 0
        drainer.ack(batch.consumed)
        assert queue.pending_ids("trainer") == []

        lock = RunLock.acquire(client, keys.launcher, "run 'paced'", ttl_s=3.0)
        try:
            with connect(redis_cluster.url) as other, pytest.raises(RunLockedError, match="is live"):
                RunLock.acquire(other, keys.launcher, "run 'paced'")
            time.sleep(1.2)  # one renewal (a third of the TTL)
            assert 0 < client.pttl(keys.launcher) <= 3000
        finally:
            lock.release()
        assert not client.exists(keys.launcher)
    finally:
        client.delete(*client.scan_iter(match=f"{keys.prefix}:*"))
        client.close()
    # Not vacuous: the put's reservation, the producer's four scripts, the drainer's release, the version's advance
    # and the lock's renewal and release ran, and so did the lease's transactions (taken, given up) and the ack's.
    assert len(checker.scripts) >= 9
    assert {"SADD", "SREM", "XACK"} <= {word for t in checker.transactions for word in t.what.split()}
    assert len({s for t in checker.touches for s in t.slots}) == 1


# ----------------------------------------------------------------------------------------------- durability
def test_the_safe_durability_check_looks_at_every_primary(redis_cluster: LocalCluster,
                                                          cluster_client: RedisClient) -> None:
    assert check_fsync_always(cluster_client, redis_cluster.url)
    primaries = redis_cluster.primaries()
    lax = primaries[-1]
    with lax.client() as c:
        c.config_set("appendfsync", "everysec")
    try:
        with pytest.raises(QueueError, match=f"primary {lax.name} of the cluster.*appendfsync 'everysec'"):
            check_fsync_always(cluster_client, redis_cluster.url)
    finally:
        with lax.client() as c:
            c.config_set("appendfsync", "always")


def test_a_primary_sigkilled_and_restarted_on_its_aof_keeps_every_acknowledged_put(
        redis_cluster: LocalCluster, cluster_client: RedisClient) -> None:
    queue = SampleQueue(cluster_client, "durable", capacity=10_000)
    queue.create_group("trainer")
    rng = np.random.default_rng(0)
    acked: list[str] = []
    stop = threading.Event()

    def write() -> None:
        # Every put that returned is acknowledged; the ones during the outage ride on the client's retry.
        while not stop.is_set():
            acked.extend(queue.put_many([make_group(rng, 1, num_experts=None)]))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        while len(acked) < 20:
            time.sleep(0.01)
        victim = redis_cluster.primary_for(queue.keys.samples)
        redis_cluster.kill(victim)
        time.sleep(0.5)
        redis_cluster.restart(victim)
        before = len(acked)
        deadline = time.monotonic() + 30
        while len(acked) < before + 20:
            assert time.monotonic() < deadline, "no put went through after the primary came back"
            time.sleep(0.05)
    finally:
        stop.set()
        writer.join()
    kept = [i for i, _ in queue.scan()]
    assert set(acked) <= set(kept)
    # A put whose answer the kill cut off may have been applied and then sent again: at most one extra entry.
    assert len(kept) - len(acked) <= 1
    assert [e.id for e in queue.read("trainer", "t", count=len(kept) + 1)] == kept
    cluster_client.delete(*cluster_client.scan_iter(match=f"{queue.keys.prefix}:*"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["failover", "sigkill"])
def test_a_reader_rides_out_a_failover_of_its_primary(redis_cluster_replicas: LocalCluster, how: str) -> None:
    cluster = redis_cluster_replicas
    writer_client, reader_client = connect(cluster.url), connect(cluster.url)
    run = f"failover-{how}"
    writer, reader = SampleQueue(writer_client, run), SampleQueue(reader_client, run)
    reader.create_group("trainer")
    rng = np.random.default_rng(1)
    first = writer.put_many([make_group(rng, 1, num_experts=None) for _ in range(5)])
    old = cluster.primary_for(reader.keys.samples)
    replica = cluster.replicas_of(old)[0]
    cluster.wait_ok()  # the replica has the entries
    read: list[str] = []
    failed: list[BaseException] = []

    def consume() -> None:
        try:
            while len(read) < 10:
                got = reader.read("trainer", "t", count=2, block_ms=200)
                reader.ack("trainer", [e.id for e in got])
                read.extend(e.id for e in got)
        except BaseException as e:  # the assertion below names it
            failed.append(e)

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        while len(read) < 5 and thread.is_alive():
            time.sleep(0.01)
        if how == "failover":
            cluster.failover(replica)
        else:
            # No restart: the replica is promoted once the others mark the primary failed (node timeout, 2 s).
            cluster.kill(old)
            deadline = time.monotonic() + 60
            while cluster.primary_for(reader.keys.samples) != replica:
                assert time.monotonic() < deadline, "the replica was not promoted"
                time.sleep(0.1)
        second = writer.put_many([make_group(rng, 1, num_experts=None) for _ in range(5)])
        thread.join(timeout=60)
    finally:
        if how == "sigkill" and old.proc is None:
            cluster.restart(old)  # it comes back as a replica of its successor
        else:
            cluster.wait_ok()
    assert not failed, f"the reader failed across the {how}: {type(failed[0]).__name__}: {failed[0]}"
    assert read == first + second and reader.pending_ids("trainer") == []
    assert cluster.primary_for(reader.keys.samples) == replica
    writer_client.delete(*writer_client.scan_iter(match=f"{writer.keys.prefix}:*"))
    writer_client.close()
    reader_client.close()


def test_a_stream_read_asks_nothing_of_a_dead_default_node(redis_cluster: LocalCluster,
                                                           cluster_client: RedisClient) -> None:
    """redis-py resolved XREADGROUP's keys with COMMAND GETKEYS on its default node, before its retry loop: with that
    primary dead, a read of a stream on a live primary failed with a ConnectionError (a trainer crash in the cluster
    fault trials)."""
    assert isinstance(cluster_client, RedisCluster)
    key = "default-node-stream"
    home = redis_cluster.primary_for(key)
    other = next(p for p in redis_cluster.primaries() if p != home)
    cluster_client.xgroup_create(key, "trainer", id="0", mkstream=True)
    entry = cluster_client.xadd(key, {"f": "v"})
    cluster_client.replace_default_node(cluster_client.get_node(host="127.0.0.1", port=other.port))
    redis_cluster.kill(other)
    try:
        # Within the node timeout (2 s) the cluster still serves the slots of its live primaries.
        got = cluster_client.xreadgroup("trainer", "t", {key: ">"}, count=5)
        plain = cluster_client.xread({key: "0"}, count=5)
    finally:
        redis_cluster.restart(other)
        cluster_client.delete(key)
    assert [i for i, _ in got[0][1]] == [entry]
    assert [i for i, _ in plain[0][1]] == [entry]
