"""``sluice bench data-plane``: the data plane's three speed goals, each a ratio against a reference measured in the
same run, on the same machine (docs/queue.md, "Entries"; docs/trainer.md, "One rank decides, every replica reads its
own share").

- **e2e** (goal: >= 0.9). Samples per second from a producer to a trainer of ``readers`` data-parallel ranks, through
  a local Redis Cluster of ``masters`` primaries with every rank reading its own share, against the single-node path
  as it was before: one redis-server (the same binary and AOF settings) and ``trainer.fetch = "rank0"``, rank 0
  fetching and decoding every payload and broadcasting the batch. A producer process calls ``SampleQueue.put(group)``
  once per group; the trainer's ranks are gloo processes that drain as ``Trainer.drain`` does: rank 0
  ``Drainer.next_batch`` (headers, the staleness policy), ``SharePlanner.plan`` and ``broadcast_msgpack_sized``;
  every rank ``ShareReader.read`` of its share (its own fetch and decode, or the inline groups under ``rank0``) and
  the ``all_gather_msgpack`` of lost payloads; rank 0 acks. The clock runs from the producer's first put to rank 0's
  last ack, after every rank holds its decoded share. Four variants run per round, in a rotating order (single node
  or cluster, each with ``rank0`` and ``readers``), so the cluster's own cost (same trainer code, one node against
  three) and what readers change (same server) are reported beside the goal's ratio.
- **drain** (goal: <= 0.2). Rank 0's drain critical path for one batch of ``samples`` samples already in the
  cluster's stream: from before ``Drainer.next_batch`` to rank 0's ``broadcast_msgpack_sized`` returning, i.e. every
  rank has been sent what it needs. ``rank0`` (the path before readers): headers, judge, fetch every payload, decode
  and check it, re-encode it plain, pack the batch and broadcast it; ``readers``: headers, judge, plan, pack the
  keys and broadcast them. Both drain the same entries, through a consumer group each, in alternating order. Also
  reported: until every rank holds its decoded share (where the readers' fetch now sits), and the bytes broadcast.
- **eval** (goal: <= 0.1). The stream evaluator's CPU time per sample, ``time.process_time`` in its own process,
  over the same entries: ``Evaluator`` as it is (headers only) against the same class reading whole entries with
  ``SampleQueue.read`` (every payload fetched, decoded and checked), which is what it did before headers existed.
  Its aggregation and its ack-and-count script are the real ones in both.

A module of its own rather than more options of ``sluice bench queue --e2e``: that benchmark compares codecs, one
producer against one consumer of whole entries on one server, with raw redis-py as its reference; this one needs two
servers at once, a trainer of gloo ranks, an evaluator process, and three references of different kinds. It takes
that benchmark's synthetic groups (``queue_e2e.build_groups``), so both measure the same bytes.

``python -m pipeline.benchmarks.data_plane producer|evaluator|rank RANK WORLD PORT`` is one worker of the harness;
it speaks JSON lines on its stdin and stdout (rank 0 only, for the ranks; its peers follow rank 0's broadcasts).
Each worker builds what it needs from small parameters: no sample crosses a process boundary except through Redis
and the trainer's own broadcasts, and nothing is pickled.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GOALS = {"e2e": (">=", 0.9), "drain": ("<=", 0.2), "eval": ("<=", 0.1)}
SERVERS = ("single", "cluster")
MODES = ("rank0", "readers")
E2E_VARIANTS = tuple(f"{s}_{m}" for s in SERVERS for m in MODES)
#: The trainer drain's blocking read (``trainer.drain_block_ms``'s default).
BLOCK_MS = 1000
# A run that sees no progress for this long has lost a worker; fail rather than hang.
_STALL_S = 120.0


@dataclass
class DataPlaneParams:
    """What ``sluice bench data-plane`` moves and how often."""

    samples: int = 256
    """Samples in the drain's batch (goal b) and under the evaluator (goal c)."""
    e2e_samples: int = 512
    """Samples each end-to-end run moves (goal a)."""
    group_size: int = 16
    prompt_tokens: int = 256
    response_tokens: int = 2048
    layers: int = 48
    topk: int = 8
    num_experts: int = 128
    batch_groups: int = 4
    """Groups per trainer step in the end-to-end runs (the drain's batch is all of ``samples``)."""
    readers: int = 2
    """Data-parallel ranks of the trainer: gloo processes, rank 0 among them."""
    masters: int = 3
    """Primaries of the local Redis Cluster."""
    appendfsync: str = "everysec"
    """Of every server, the single node's and each primary's (AOF is always on)."""
    rounds: int = 3
    eval_repeats: int = 3
    """Evaluator passes over the entries per mode and round (a pass over headers alone takes milliseconds)."""
    out: str = "runs/bench-data-plane"
    """Output folder: ``data-plane.json``, the servers' folders while they run, and the workers' logs."""


# ----------------------------------------------------------------------------------------------- the protocol
class _Channel:
    """A worker's side: JSON lines from its stdin, to its stdout, which nothing else may write to."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # whatever else prints goes to stderr (the worker's log), never into the protocol

    def send(self, kind: str, **body: Any) -> None:
        self._out.write(json.dumps({"kind": kind, **body}) + "\n")

    @staticmethod
    def recv() -> dict[str, Any]:
        line = sys.stdin.readline()
        msg: dict[str, Any] = json.loads(line) if line else {"cmd": "stop"}
        return msg


class _Worker:
    """The driver's side of one worker process (``protocol=False``: a rank that only follows rank 0)."""

    def __init__(self, name: str, args: list[str], logs: Path, protocol: bool = True) -> None:
        self.name, self.log = name, logs / f"{name}.log"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.benchmarks.data_plane", *args],
                stdin=subprocess.PIPE if protocol else subprocess.DEVNULL,
                stdout=subprocess.PIPE if protocol else subprocess.DEVNULL, stderr=log, bufsize=0,
                env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})

    def send(self, **msg: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())

    def recv(self, kind: str, timeout_s: float = _STALL_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        # Unbuffered, and a worker has at most one line outstanding, so select sees all of it.
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"the benchmark's {self.name} sent nothing in {timeout_s:.0f} s (exit code "
                               f"{self.proc.poll()}); see {self.log}: {self._tail()}")
        msg: dict[str, Any] = json.loads(line)
        if msg["kind"] == "error":
            raise RuntimeError(f"the benchmark's {self.name} failed:\n{msg['text']}")
        if msg["kind"] != kind:
            raise RuntimeError(f"the benchmark's {self.name} answered {msg['kind']!r} where {kind!r} was due")
        return msg

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.send(cmd="stop")
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _serving(main: Callable[[_Channel], None], channel: _Channel | None = None) -> None:
    """Run a worker's main; a crash is sent to the driver with its traceback, the one handler of the process."""
    chan = channel or _Channel()
    try:
        main(chan)
    except BaseException:
        chan.send("error", text=traceback.format_exc())
        sys.exit(1)


# ------------------------------------------------------------------------------------------------ the producer
def _shape(p: DataPlaneParams, groups: int) -> dict[str, Any]:
    return {"source": "synthetic", "groups": groups, "group_size": p.group_size, "prompt_tokens": p.prompt_tokens,
            "response_tokens": p.response_tokens, "layers": p.layers, "topk": p.topk, "num_experts": p.num_experts}


def _producer_main(chan: _Channel) -> None:
    """Builds the groups once, then per run puts the first ``count`` of them, one ``put`` a group."""
    from pipeline.benchmarks.queue_e2e import _Shape, build_groups
    from pipeline.queue.connection import connect
    from pipeline.queue.redis_streams import SampleQueue, encode_entry

    cfg = chan.recv()
    groups = build_groups(_Shape(**cfg["shape"]))
    fields, payload = encode_entry(groups[0])
    chan.send("ready", payload_bytes=len(payload), header_bytes=len(fields["head"]))
    clients: dict[str, Any] = {}
    while (msg := chan.recv())["cmd"] != "stop":
        client = clients.get(msg["url"]) or clients.setdefault(msg["url"], connect(msg["url"]))
        queue = SampleQueue(client, msg["run"], capacity=max(1024, len(groups) + 1))
        queue.shard_tags()  # chosen once per run, before the clock: every later put of a run reads it
        todo = groups[:int(msg["count"])]
        gc.collect()
        chan.send("armed")
        chan.recv()  # go
        start = time.perf_counter()
        for g in todo:
            queue.put(g)
        chan.send("done", start=start, put_s=time.perf_counter() - start, put=len(todo))


# ----------------------------------------------------------------------------------------------- the evaluator
def _evaluator_main(chan: _Channel) -> None:
    """Per request, ``repeats`` passes of one evaluator over a run's entries, each from a fresh group; the CPU time
    and wall time of each pass."""
    from pipeline.config.eval import EvaluatorConfig
    from pipeline.consumers.evaluator import Evaluator
    from pipeline.queue.base import QueueEntry
    from pipeline.queue.connection import connect
    from pipeline.queue.redis_streams import SampleQueue

    class WholeEntryEvaluator(Evaluator):
        """The evaluator as it read before entries had headers: every entry whole (its payload fetched, decoded
        and checked against its header), then the same aggregation and the same ack-and-count."""

        def read(self, block_ms: int | None = None) -> list[QueueEntry]:  # type: ignore[override]
            wait = self.cfg.block_ms if block_ms is None else block_ms
            return self.queue.read(self.cfg.group, self.cfg.consumer, count=self.cfg.batch_entries,
                                   block_ms=wait or None)

    chan.send("ready")
    clients: dict[str, Any] = {}
    while (msg := chan.recv())["cmd"] != "stop":
        client = clients.get(msg["url"]) or clients.setdefault(msg["url"], connect(msg["url"]))
        queue = SampleQueue(client, msg["run"])
        kind = Evaluator if msg["mode"] == "headers" else WholeEntryEvaluator
        cpu, wall, counted = [], [], []
        for _ in range(int(msg["repeats"])):
            evaluator = kind(queue, EvaluatorConfig(group=f"eval-{msg['mode']}"))
            evaluator.attach(reset=True)  # a fresh group at the stream's start, its counters dropped
            gc.collect()
            c0, w0 = time.process_time(), time.perf_counter()
            while evaluator.counted_entries < int(msg["entries"]):
                if not evaluator.step(block_ms=0):  # everything is in the stream already: never wait
                    raise RuntimeError(f"the evaluator found {evaluator.counted_entries} of {msg['entries']} entries")
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            counted.append(evaluator.aggregate.total.samples)
        chan.send("done", cpu_s=cpu, wall_s=wall, samples_counted=counted)


# --------------------------------------------------------------------------------------------------- the ranks
@dataclass
class _Rank:
    """One trainer rank's part: the gloo group it talks over, and its clients (kept, as a trainer keeps them)."""

    rank: int
    world: int
    group: Any
    clients: dict[str, Any]

    def client(self, url: str) -> Any:
        from pipeline.queue.connection import connect

        if url not in self.clients:
            client = connect(url)
            # A trainer's connections to every primary are open by its second step; so are the benchmark's before
            # the clock starts.
            primaries = getattr(client, "get_primaries", None)
            if primaries is None:
                client.ping()
            for node in primaries() if primaries is not None else []:
                client.ping(target_nodes=node)
            self.clients[url] = client
        return self.clients[url]


def _set_up(me: _Rank, cmd: dict[str, Any]) -> tuple[Any, Any]:
    """(rank 0's drainer and planner or None, this rank's reader), as the trainer's ``main`` wires them."""
    from pipeline.config.staleness import StalenessConfig
    from pipeline.consumers.trainer.drain import Drainer
    from pipeline.consumers.trainer.ledger import Ledger
    from pipeline.consumers.trainer.readers import SharePlanner, ShareReader
    from pipeline.queue.redis_streams import SampleQueue

    reads = cmd["mode"] == "readers"
    # Under rank0 the other ranks never talk to Redis: they take what rank 0 broadcasts.
    queue = SampleQueue(me.client(cmd["url"]), cmd["run"]) if reads or me.rank == 0 else None
    reader = ShareReader(queue if reads else None)
    if me.rank != 0:
        return None, reader
    assert queue is not None
    drainer = Drainer(queue, Ledger(cmd["ledger"]), StalenessConfig(), group=cmd["group"], block_ms=BLOCK_MS)
    return (drainer, SharePlanner(me.world, cmd["mode"], queue)), reader


def _drain_step(me: _Rank, lead: tuple[Any, Any] | None, reader: Any, want: int, step: int,
                should_stop: Callable[[], bool]) -> dict[str, Any]:
    """One step's drain on every rank, as ``Trainer.drain`` does it (lost payloads are an error here: none is lost).

    Times are seconds from rank 0's start of the step; every rank's are gathered to rank 0 (``perf_counter`` is the
    machine's monotonic clock, the same in every process)."""
    from pipeline.consumers.trainer.readers import GroupRef, all_gather_msgpack, broadcast_msgpack_sized

    t0 = time.perf_counter()
    shares: list[list[Any]] | None = None
    lost_here: list[tuple[int, str]] = []
    consumed: list[str] = []
    judged = planned = t0
    planner_fetched = 0
    if lead is not None:
        drainer, planner = lead
        batch = drainer.next_batch(want, step, lambda: 0, should_stop=should_stop)
        judged = time.perf_counter()
        if len(batch.groups) < want:
            raise RuntimeError(f"step {step}: drained {len(batch.groups)} of {want} groups before giving up")
        planned_shares, lost_here = planner.plan(batch, list(range(len(batch.groups))), [0] * me.world)
        shares = [[r.pack() for r in share] for share in planned_shares]
        consumed = batch.consumed
        planned = time.perf_counter()
        if planner.mode == "rank0":  # rank 0's planner fetched every payload of the batch itself
            planner_fetched = sum(e.payload_size for e in batch.sources if e is not None)
    shared, sent = broadcast_msgpack_sized({"shares": shares} if me.rank == 0 else None, 0, me.group)
    have_plan = time.perf_counter()
    got, lost = reader.read([GroupRef.unpack(r) for r in shared["shares"][me.rank]])
    ready = time.perf_counter()
    stats = reader.take_stats()
    mine = [have_plan, ready, stats.fetched_bytes + planner_fetched, len(got), sum(len(g) for _, g in got),
            [[i, why] for i, why in [*lost, *lost_here]]]
    every = all_gather_msgpack(mine, me.group)
    lost_all = [why for r in every for _, why in r[5]]
    if lost_all:
        raise RuntimeError(f"step {step}: payloads lost: {lost_all[:3]}")
    if lead is not None:
        lead[0].ack(consumed)
    return {"groups": sum(len(s) for s in shared["shares"]), "judge_s": judged - t0, "plan_s": planned - judged,
            "send_s": have_plan - planned, "critical_s": have_plan - t0, "acked_s": time.perf_counter() - t0,
            "broadcast_bytes": sent, "plan_in_hand_s": [r[0] - t0 for r in every],
            "share_ready_s": [r[1] - t0 for r in every],
            "fetched_bytes": [r[2] for r in every], "groups_per_rank": [r[3] for r in every],
            "samples_per_rank": [r[4] for r in every]}


def _e2e(me: _Rank, cmd: dict[str, Any], chan: _Channel | None) -> dict[str, Any]:
    """Drain ``groups`` groups as the producer puts them, ``batch_groups`` a step."""
    from pipeline.consumers.trainer.readers import all_gather_msgpack

    lead, reader = _set_up(me, cmd)
    all_gather_msgpack(None, me.group)  # every rank is set up
    if chan is not None:
        chan.send("armed")
        chan.recv()  # go
    groups, trained, step = int(cmd["groups"]), 0, 0
    samples = [0] * me.world
    fetched = [0] * me.world
    progress = [time.monotonic()]  # when the last step ended: a producer silent for long has died
    plan_bytes = 0
    while trained < groups:
        step += 1
        s = _drain_step(me, lead, reader, min(int(cmd["batch_groups"]), groups - trained), step,
                        lambda: time.monotonic() - progress[0] > _STALL_S)
        trained += s["groups"]
        samples = [a + b for a, b in zip(samples, s["samples_per_rank"])]
        fetched = [a + b for a, b in zip(fetched, s["fetched_bytes"])]
        plan_bytes += s["broadcast_bytes"]
        progress[0] = time.monotonic()
    return {"end": time.perf_counter(), "steps": step, "groups": trained, "samples_per_rank": samples,
            "fetched_bytes": fetched, "broadcast_bytes": plan_bytes}


def _drain(me: _Rank, cmd: dict[str, Any], chan: _Channel | None) -> dict[str, Any]:
    """One timed step over a batch already in the stream."""
    from pipeline.consumers.trainer.readers import all_gather_msgpack

    lead, reader = _set_up(me, cmd)
    all_gather_msgpack(None, me.group)
    gc.collect()
    start = time.monotonic()
    return _drain_step(me, lead, reader, int(cmd["groups"]), 1, lambda: time.monotonic() - start > _STALL_S)


_RANK_COMMANDS: dict[str, Callable[[_Rank, dict[str, Any], _Channel | None], dict[str, Any]]] = {
    "e2e": _e2e, "drain": _drain}


def _rank_main(rank: int, world: int, port: int) -> None:
    """One trainer rank; rank 0 takes the driver's commands and broadcasts each to its peers."""
    from datetime import timedelta

    import torch.distributed as dist

    from pipeline.consumers.trainer.readers import broadcast_msgpack_from

    def main(chan: _Channel | None) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=_STALL_S * 3))
        me = _Rank(rank, world, dist.new_group(backend="gloo"), {})  # the trainer's own gloo group for bytes
        if chan is not None:
            chan.send("ready")
        while True:
            cmd = broadcast_msgpack_from(chan.recv() if chan is not None else None, 0, me.group)
            if cmd["cmd"] == "stop":
                break
            result = _RANK_COMMANDS[cmd["cmd"]](me, cmd, chan)
            if chan is not None:
                chan.send("done", **result)
        dist.destroy_process_group()

    if rank == 0:
        _serving(main)
    else:
        main(None)  # a peer's crash shows in its log, and in rank 0's collectives failing


# -------------------------------------------------------------------------------------------------- the servers
@dataclass
class _Server:
    """A server the benchmark started: its URL, and a plain client of each of its nodes (to clean up between runs)."""

    name: str
    url: str
    nodes: list[Any]
    version: str


def _single_node(binary: str, folder: Path, appendfsync: str) -> tuple[subprocess.Popen[bytes], int]:
    """A plain redis-server from the cluster's binary, with the cluster nodes' AOF settings."""
    import redis

    from pipeline.net import free_port

    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                             "--appendonly", "yes", "--appendfsync", appendfsync, "--save", "", "--daemonize", "no",
                             "--logfile", str(folder / "redis.log")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            with redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5) as c:
                c.ping()
            return proc, port
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"redis-server did not start: {(folder / 'redis.log').read_text()[-1500:]}") \
                    from None
            time.sleep(0.05)


@contextlib.contextmanager
def _servers(p: DataPlaneParams, folder: Path) -> Iterator[dict[str, _Server]]:
    """The single node and the cluster, both from one redis-server binary, stopped (by PID) on the way out."""
    import redis

    from pipeline.queue.local_cluster import LocalCluster, cluster_binaries

    binaries = cluster_binaries()
    if binaries is None:
        raise RuntimeError("sluice bench data-plane starts a local Redis Cluster: it needs redis-server and "
                           "redis-cli of Redis 7 or later on PATH (the OS package redis-server has both)")
    proc, port = _single_node(binaries[0], folder / "single", p.appendfsync)
    single = redis.Redis(host="127.0.0.1", port=port)
    try:
        with LocalCluster(masters=p.masters, appendfsync=p.appendfsync, folder=folder / "cluster") as cluster:
            nodes = [n.client() for n in cluster.primaries()]
            for c in [single, *nodes]:
                # A rewrite forks and copies the AOF at a moment history decides; _drop rewrites between runs
                # instead, so that no run pays for another's bytes.
                c.config_set("auto-aof-rewrite-percentage", 0)
            version = str(single.info("server")["redis_version"])
            try:
                yield {"single": _Server("single", f"redis://127.0.0.1:{port}/0", [single], version),
                       "cluster": _Server("cluster", cluster.url, nodes, version)}
            finally:
                for c in nodes:
                    c.close()
    finally:
        single.close()
        proc.kill()
        proc.wait()


def _drop(server: _Server, run: str) -> None:
    """Every key of ``run`` (its own tag and its shard tags) off every node, then each AOF rewritten."""
    for c in server.nodes:
        keys = [k for pattern in (f"sluice:{{{run}}}:*", f"sluice:{{{run}/*")
                for k in c.scan_iter(match=pattern, count=1000)]
        for i in range(0, len(keys), 512):
            # One key a command: on a cluster node, keys of different slots cannot share a DEL.
            pipe = c.pipeline(transaction=False)
            for k in keys[i:i + 512]:
                pipe.delete(k)
            pipe.execute()
    for c in server.nodes:
        c.bgrewriteaof()
    for c in server.nodes:
        while any(int(c.info("persistence")[k]) for k in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")):
            time.sleep(0.05)


def _new_queue(server: _Server, run: str, groups: Sequence[str]) -> None:
    """A fresh run's stream with these consumer groups at its start."""
    from pipeline.queue.connection import connect
    from pipeline.queue.redis_streams import SampleQueue

    client = connect(server.url)
    try:
        queue = SampleQueue(client, run)
        for g in groups:
            queue.create_group(g, "0")
    finally:
        client.close()


def _check(server: _Server, run: str, group: str) -> dict[str, int]:
    """The run's stream length, and the entries ``group`` holds unacked."""
    from pipeline.queue.connection import connect
    from pipeline.queue.keys import RunKeys

    stream = RunKeys(run).samples
    client = connect(server.url)
    try:
        (info,) = [g for g in client.xinfo_groups(stream) if g["name"] in (group, group.encode())]
        return {"stream_length": int(client.xlen(stream)), "pending": int(info["pending"])}
    finally:
        client.close()


# ------------------------------------------------------------------------------------------------- the harness
class _Harness:
    """The worker processes of one benchmark: a producer, an evaluator and the trainer's ranks."""

    def __init__(self, p: DataPlaneParams, folder: Path, logs: Path) -> None:
        from pipeline.net import free_port

        self.p, self.folder = p, folder
        self.workers: list[_Worker] = []
        try:
            self.producer = self._start(_Worker("producer", ["producer"], logs))
            groups = max(p.e2e_samples, p.samples) // p.group_size
            self.producer.send(shape=_shape(p, groups))
            self.evaluator = self._start(_Worker("evaluator", ["evaluator"], logs))
            port = str(free_port())
            self.rank0 = self._start(_Worker("rank0", ["rank", "0", str(p.readers), port], logs))
            for r in range(1, p.readers):
                self._start(_Worker(f"rank{r}", ["rank", str(r), str(p.readers), port], logs, protocol=False))
            self.sizes = self.producer.recv("ready", 600.0)  # big shapes take a while to build
            self.evaluator.recv("ready", 600.0)
            self.rank0.recv("ready", 600.0)
        except BaseException:
            self.close()
            raise

    def _start(self, worker: _Worker) -> _Worker:
        self.workers.append(worker)
        return worker

    def e2e(self, server: _Server, mode: str, run: str) -> dict[str, Any]:
        p = self.p
        groups = p.e2e_samples // p.group_size
        _new_queue(server, run, ["trainer"])
        self.rank0.send(cmd="e2e", url=server.url, run=run, mode=mode, group="trainer", groups=groups,
                        batch_groups=p.batch_groups, ledger=str(self.folder / "ledger" / run))
        self.producer.send(cmd="put", url=server.url, run=run, count=groups)
        self.rank0.recv("armed")
        self.producer.recv("armed")
        self.rank0.send(cmd="go")  # the trainer first: it blocks on its read until the first put lands
        self.producer.send(cmd="go")
        producer = self.producer.recv("done", _STALL_S * 5)
        trainer = self.rank0.recv("done", _STALL_S * 5)
        check = {"put": producer["put"], "groups_drained": trainer["groups"],
                 "samples_decoded": sum(trainer["samples_per_rank"]), **_check(server, run, "trainer")}
        return {"seconds": trainer["end"] - producer["start"], "put_s": producer["put_s"], "steps": trainer["steps"],
                "fetched_bytes": trainer["fetched_bytes"], "broadcast_bytes": trainer["broadcast_bytes"],
                "check": check}

    def put(self, server: _Server, run: str, groups: int) -> None:
        self.producer.send(cmd="put", url=server.url, run=run, count=groups)
        self.producer.recv("armed")
        self.producer.send(cmd="go")
        self.producer.recv("done", _STALL_S * 5)

    def drain(self, server: _Server, mode: str, run: str, groups: int) -> dict[str, Any]:
        self.rank0.send(cmd="drain", url=server.url, run=run, mode=mode, group=f"trainer-{mode}", groups=groups,
                        ledger=str(self.folder / "ledger" / f"{run}-{mode}"))
        out = self.rank0.recv("done", _STALL_S * 5)
        out["check"] = _check(server, run, f"trainer-{mode}")
        return out

    def evaluate(self, server: _Server, mode: str, run: str, entries: int) -> dict[str, Any]:
        self.evaluator.send(url=server.url, run=run, mode=mode, repeats=self.p.eval_repeats, entries=entries,
                            cmd="eval")
        return self.evaluator.recv("done", _STALL_S * 5)

    def close(self) -> None:
        # Rank 0 first: its stop is broadcast to its peers, which then leave the group too.
        for w in self.workers:
            w.close()


def _rounds(p: DataPlaneParams, harness: _Harness, servers: dict[str, _Server], token: str
            ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]], dict[str, list[Any]]]:
    e2e: dict[str, list[dict[str, Any]]] = {v: [] for v in E2E_VARIANTS}
    drain: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    evals: dict[str, list[Any]] = {"full": [], "headers": []}
    batch = p.samples // p.group_size
    for r in range(p.rounds):
        shift = r % len(E2E_VARIANTS)
        for variant in E2E_VARIANTS[shift:] + E2E_VARIANTS[:shift]:
            server, mode = variant.split("_")
            run = f"bench-dp-{token}-{variant.replace('_', '-')}-{r}"
            e2e[variant].append(harness.e2e(servers[server], mode, run))
            _drop(servers[server], run)
        # The drain and the evaluator read one batch, put once, through a consumer group each.
        cluster = servers["cluster"]
        run = f"bench-dp-{token}-batch-{r}"
        _new_queue(cluster, run, [f"trainer-{m}" for m in MODES])
        harness.put(cluster, run, batch)
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            drain[mode].append(harness.drain(cluster, mode, run, batch))
        for mode in ("full", "headers") if r % 2 == 0 else ("headers", "full"):
            evals[mode].append(harness.evaluate(cluster, mode, run, batch))
        _drop(cluster, run)
    return e2e, drain, evals


# ------------------------------------------------------------------------------------------------- the summary
def _ratio(rounds: Sequence[float], kind: str) -> dict[str, Any]:
    op, goal = GOALS[kind]
    median = statistics.median(rounds)
    met = median >= goal if op == ">=" else median <= goal
    return {"median": median, "rounds": list(rounds), "goal": f"{op} {goal}", "met": met}


def _summary(p: DataPlaneParams, e2e: dict[str, list[dict[str, Any]]], drain: dict[str, list[dict[str, Any]]],
             evals: dict[str, list[Any]]) -> dict[str, Any]:
    e2e_samples = (p.e2e_samples // p.group_size) * p.group_size
    batch_samples = (p.samples // p.group_size) * p.group_size

    def rate(v: str) -> list[float]:
        return [e2e_samples / run["seconds"] for run in e2e[v]]

    def per_round(a: str, b: str) -> list[float]:
        # Per round: the two ran within seconds of each other, so their ratio cancels most of the machine's drift.
        return [x / y for x, y in zip(rate(a), rate(b))]

    variants = {v: {"samples_per_s": statistics.median(rate(v)), "samples_per_s_rounds": rate(v),
                    "put_s": statistics.median(run["put_s"] for run in e2e[v]),
                    "fetched_bytes_per_rank": e2e[v][0]["fetched_bytes"],
                    "broadcast_bytes": e2e[v][0]["broadcast_bytes"], "checks": [run["check"] for run in e2e[v]]}
                for v in E2E_VARIANTS}
    e2e_out = {"samples": e2e_samples, "variants": variants,
               "goal": _ratio(per_round("cluster_readers", "single_rank0"), "e2e"),
               "cluster_over_single_readers": statistics.median(per_round("cluster_readers", "single_readers")),
               "cluster_over_single_rank0": statistics.median(per_round("cluster_rank0", "single_rank0")),
               "readers_over_rank0_single": statistics.median(per_round("single_readers", "single_rank0")),
               "readers_over_rank0_cluster": statistics.median(per_round("cluster_readers", "cluster_rank0"))}

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in drain[mode])

    modes = {m: {"critical_s": med(m, "critical_s"), "critical_s_rounds": [x["critical_s"] for x in drain[m]],
                 "judge_s": med(m, "judge_s"), "plan_s": med(m, "plan_s"), "send_s": med(m, "send_s"),
                 "every_share_ready_s": statistics.median(max(x["share_ready_s"]) for x in drain[m]),
                 "broadcast_bytes": drain[m][0]["broadcast_bytes"],
                 "fetched_bytes_per_rank": drain[m][0]["fetched_bytes"],
                 "groups_per_rank": drain[m][0]["groups_per_rank"], "checks": [x["check"] for x in drain[m]]}
             for m in MODES}
    drain_out = {"samples": batch_samples, "modes": modes,
                 "goal": _ratio([n["critical_s"] / o["critical_s"] for n, o in zip(drain["readers"], drain["rank0"])],
                                "drain"),
                 "every_share_ready_readers_over_rank0": statistics.median(
                     max(n["share_ready_s"]) / max(o["share_ready_s"])
                     for n, o in zip(drain["readers"], drain["rank0"]))}

    def cpu_us(run: dict[str, Any]) -> float:
        return statistics.median(run["cpu_s"]) / batch_samples * 1e6

    eval_out = {"samples": batch_samples,
                "modes": {m: {"cpu_us_per_sample": statistics.median(cpu_us(x) for x in evals[m]),
                              "cpu_us_per_sample_rounds": [cpu_us(x) for x in evals[m]],
                              "wall_us_per_sample": statistics.median(
                                  statistics.median(x["wall_s"]) / batch_samples * 1e6 for x in evals[m]),
                              "samples_counted": [c for x in evals[m] for c in x["samples_counted"]]}
                          for m in evals},
                "goal": _ratio([cpu_us(h) / cpu_us(f) for h, f in zip(evals["headers"], evals["full"])], "eval")}
    return {"e2e": e2e_out, "drain": drain_out, "eval": eval_out}


def run_data_plane_bench(p: DataPlaneParams, folder: Path | None = None) -> dict[str, Any]:
    """Run the benchmark; ``folder`` (default ``p.out``) holds ``data-plane.json`` and the workers' logs."""
    if p.samples < p.group_size or p.e2e_samples < p.group_size or p.readers < 1 or p.rounds < 1:
        raise ValueError("samples and e2e_samples must hold a group at least; readers and rounds must be >= 1")
    out = Path(folder if folder is not None else p.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    # Absolute: redis-server resolves its log file's path from its --dir.
    with tempfile.TemporaryDirectory(dir=out.resolve(), prefix="work-") as tmp, _servers(p, Path(tmp)) as servers:
        harness = _Harness(p, Path(tmp), logs)
        try:
            e2e, drain, evals = _rounds(p, harness, servers, token)
        finally:
            harness.close()
        version = servers["single"].version
    result = {"benchmark": "data-plane", "params": asdict(p), "redis_version": version, "cpu_count": os.cpu_count(),
              "payload_bytes_per_group": harness.sizes["payload_bytes"],
              "header_bytes_per_group": harness.sizes["header_bytes"], **_summary(p, e2e, drain, evals)}
    bad = [c for v in result["e2e"]["variants"].values() for c in v["checks"]
           if not (c["put"] == c["groups_drained"] == c["stream_length"] and c["pending"] == 0
                   and c["samples_decoded"] == result["e2e"]["samples"])]
    bad += [c for m in result["drain"]["modes"].values() for c in m["checks"] if c["pending"] != 0]
    if bad:
        raise RuntimeError(f"a trainer did not drain, decode and ack every entry: {bad[:3]}")
    (out / "data-plane.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary_lines(r: dict[str, Any]) -> list[str]:
    """The short human table ``sluice bench data-plane`` prints: each goal's ratio, its references, pass or fail."""
    p = r["params"]

    def verdict(g: dict[str, Any]) -> str:
        return f"{g['median']:.3f} (goal {g['goal']}: {'pass' if g['met'] else 'FAIL'})  rounds " + \
            " ".join(f"{x:.3f}" for x in g["rounds"])

    e, d, v = r["e2e"], r["drain"], r["eval"]
    lines = [f"groups of {p['group_size']} x ({p['prompt_tokens']} + {p['response_tokens']} tokens), {p['layers']} "
             f"layers x top-{p['topk']} of {p['num_experts']}: payload {r['payload_bytes_per_group'] / 1e6:.2f} MB, "
             f"header {r['header_bytes_per_group'] / 1e3:.1f} kB a group; redis {r['redis_version']}, appendfsync "
             f"{p['appendfsync']}, {p['masters']} primaries, {p['readers']} readers, {r['cpu_count']} CPUs, "
             f"{p['rounds']} rounds",
             f"(a) end to end, {e['samples']} samples a run, {p['batch_groups']} groups a step: samples/s"]
    for name, x in e["variants"].items():
        lines.append(f"    {name:16s} {x['samples_per_s']:8.1f}")
    lines += [f"  cluster + readers / single node + rank0 = {verdict(e['goal'])}",
              f"  cluster / single node: readers {e['cluster_over_single_readers']:.3f}, rank0 "
              f"{e['cluster_over_single_rank0']:.3f}; readers / rank0: single node "
              f"{e['readers_over_rank0_single']:.3f}, cluster {e['readers_over_rank0_cluster']:.3f}",
              f"(b) rank 0's drain critical path, {d['samples']} samples already in the cluster's stream"]
    for name, x in d["modes"].items():
        lines.append(f"    {name:8s} {x['critical_s'] * 1e3:9.2f} ms (headers + judge {x['judge_s'] * 1e3:.2f}, plan "
                     f"{x['plan_s'] * 1e3:.2f}, pack + broadcast {x['send_s'] * 1e3:.2f}); broadcast "
                     f"{x['broadcast_bytes']:,} B; every share decoded at {x['every_share_ready_s'] * 1e3:.1f} ms")
    lines += [f"  readers / rank0 = {verdict(d['goal'])}",
              f"  until every rank holds its decoded share: readers / rank0 "
              f"{d['every_share_ready_readers_over_rank0']:.3f}",
              f"(c) stream evaluator CPU per sample, {v['samples']} samples, {p['eval_repeats']} passes a round"]
    for name, x in v["modes"].items():
        lines.append(f"    {name:8s} {x['cpu_us_per_sample']:9.1f} us CPU ({x['wall_us_per_sample']:.1f} us wall)")
    lines.append(f"  headers / full = {verdict(v['goal'])}")
    return lines


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role == "producer":
        _serving(_producer_main)
    elif role == "evaluator":
        _serving(_evaluator_main)
    elif role == "rank" and len(sys.argv) == 5:
        _rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit("usage: python -m pipeline.benchmarks.data_plane producer|evaluator|rank RANK WORLD PORT (the "
                 "harness runs these; use `sluice bench data-plane`)")
