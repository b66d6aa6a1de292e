"""``sluice bench queue --e2e``: the producer's put and the trainer's read, decode and ack, in two processes at once.

Four variants move the same groups through one Redis (embedded with AOF everysec, or ``--redis-url``):

- ``sluice_compact`` / ``sluice_plain``: ``SampleQueue(routing_codec=...)``. A producer process calls ``put(group)``
  once per group, as ``pipeline.producers.producer`` does; a consumer process reads as the trainer's drain does
  (``read(count=batch, block_ms=1000)``, decoding and validating every entry) and acks each batch.
- ``raw_plain`` / ``raw_compact``: redis-py only, on the bytes ``encode_samples(group, routing=...)`` gives,
  encoded before the clock starts: pipelined ``XADD`` against ``XREADGROUP`` + ``XACK``, nothing decoded.

So compact / raw_plain is what the compact codec buys the real path over moving plain bytes for free, and
compact / raw_compact is what sluice's own work (codec, validation, the put's counter and backpressure check) costs
on top of moving the compact bytes. Rounds run every variant once, in a rotating order, so that the machine's noise
hits them alike; ratios are medians of per-round ratios.

Each process builds its own groups from small parameters (a seed, or the path of the routing recorded by the CPU
engine, cached as ``.npz``): no sample data crosses a process boundary, and nothing is pickled.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import redis

from pipeline.benchmarks.queue import QueueBenchParams
from pipeline.errors import ConfigError, QueueError, SluiceError
from pipeline.queue.codec import SCHEMA_VERSION, decode_samples, encode_samples
from pipeline.queue.connection import connect
from pipeline.queue.redis_server import EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.routing_codec import plain_routing_bytes
from pipeline.queue.sample import Sample, compact_routing

VARIANTS = ("sluice_compact", "sluice_plain", "raw_plain", "raw_compact")
SOURCES = ("synthetic", "engine")
#: The trainer drain's blocking read (``trainer.drain_block_ms``'s default).
BLOCK_MS = 1000
#: Prompts the engine generates per recorded shape; with groups of 8 that is the CPU engine's default batch.
ENGINE_PROMPTS = 4
#: The recipe's own model (``init_tiny_model("qwen3-moe", dir)``): 2 layers, 8 experts, top-2.
RECIPE_SHAPE = {"layers": 2, "num_experts": 8, "topk": 2}
# A run that sees no entry for this long has lost its producer; fail rather than hang.
_STALL_S = 120.0
_CODEC_GROUPS = 4
_CODEC_REPS = 3
_GOALS = {"compact_over_raw_plain": ">= 1.5", "compact_over_raw_compact": ">= 0.9", "routing_bytes": "<= 0.5"}


@dataclass
class QueueE2EParams(QueueBenchParams):
    """What one ``sluice bench queue --e2e`` measures; the inherited fields mean what they mean for the old mode,
    except ``batch_entries``: the consumer's read count (the trainer's ``batch_groups``) and the raw producer's
    XADDs per round trip (sluice's producer puts one group per call)."""

    routing: str = "synthetic"
    """Where routing comes from: synthetic, engine (recorded by the CPU engine) or both."""
    redis_url: str = ""
    """Benchmark this server (keys under a fresh prefix, removed after) instead of an embedded one."""
    engine_layers: int = 16
    """MoE layers of the model the CPU engine records with (top-k and experts as above). Fewer than ``layers``
    because a 48-layer, 128-expert model takes over a minute to build, load and generate with on two cores."""
    engine_prompt_tokens: int = 16
    """Prompt length of the engine-recorded groups (1 : 8 to the response, as in the synthetic 256 + 2048)."""
    engine_response_tokens: int = 128
    """Response length of the engine-recorded groups (EOS ignored, so every response has exactly this many)."""
    engine_samples: int = 1024
    """Samples per run with engine routing (the recorded groups, cycled: they are small)."""
    out: str = "runs/bench-queue-e2e"
    """Output folder: the result JSON, the embedded Redis and the recorded routing cache."""


@dataclass(frozen=True)
class _Shape:
    """The groups one process builds: a routing source and its sizes (small enough to send to a worker)."""

    source: str
    groups: int
    group_size: int
    prompt_tokens: int
    response_tokens: int
    layers: int
    topk: int
    num_experts: int
    cache: str = ""  # the engine's recorded routing (.npz), for source "engine"


# ------------------------------------------------------------------------------------------------------ the groups
def _topk_rows(rng: np.random.Generator, rows: int, layers: int, topk: int, num_experts: int) -> np.ndarray:
    """Uniformly random top-k rows of distinct experts (draw with replacement, redraw the rows with a repeat)."""
    ids = rng.integers(0, num_experts, (rows * layers, topk), dtype=np.int32)
    todo = np.arange(len(ids))
    while len(todo):
        sub = ids[todo]
        repeat = np.zeros(len(todo), dtype=bool)
        for i in range(1, topk):
            for j in range(i):
                repeat |= sub[:, i] == sub[:, j]
        todo = todo[repeat]
        ids[todo] = rng.integers(0, num_experts, (len(todo), topk), dtype=np.int32)
    return ids.reshape(rows, layers, topk)


def _synthetic_group(shape: _Shape, rng: np.random.Generator, g: int) -> list[Sample]:
    # A GRPO group shares its prompt, and its prompt's routing rows: the same prefix under the same weights.
    p, r = shape.prompt_tokens, shape.response_tokens
    prompt = rng.integers(0, 150_000, p, dtype=np.int32)
    prompt_rows = _topk_rows(rng, p, shape.layers, shape.topk, shape.num_experts)
    group_id = f"g{g}"
    out = []
    for i in range(shape.group_size):
        routed = np.concatenate([prompt_rows, _topk_rows(rng, r - 1, shape.layers, shape.topk, shape.num_experts)])
        out.append(Sample(
            prompt_ids=prompt, response_ids=rng.integers(0, 150_000, r, dtype=np.int32),
            rollout_logprobs=-rng.random(r, dtype=np.float32) * 5, token_versions=np.zeros(r, dtype=np.int32),
            routed_experts=compact_routing(routed, shape.num_experts), reward=float(rng.random()),
            group_id=group_id, prompt_id=group_id, index=i, producer="bench",
        ))  # fmt: skip
    return out


def _engine_groups(shape: _Shape) -> list[list[Sample]]:
    """The recorded groups, cycled to ``shape.groups`` (each copy with its own group and sample ids)."""
    with np.load(shape.cache, allow_pickle=False) as z:
        rec = {k: z[k] for k in z.files}
    recorded = rec["prompt_ids"].shape[0]
    out = []
    for g in range(shape.groups):
        j = g % recorded
        group_id = f"g{g}"
        out.append([
            Sample(prompt_ids=rec["prompt_ids"][j], response_ids=rec["response_ids"][j, i],
                   rollout_logprobs=rec["logprobs"][j, i], token_versions=np.zeros_like(rec["response_ids"][j, i]),
                   routed_experts=rec["routing"][j, i], reward=float(i % 2), group_id=group_id, prompt_id=group_id,
                   index=i, producer="bench")
            for i in range(rec["response_ids"].shape[1])
        ])  # fmt: skip
    return out


def build_groups(shape: _Shape, seed: int = 0) -> list[list[Sample]]:
    """The same groups in every process that asks with the same shape (sample ids aside)."""
    if shape.source == "engine":
        return _engine_groups(shape)
    rng = np.random.default_rng(seed)
    return [_synthetic_group(shape, rng, g) for g in range(shape.groups)]


# ------------------------------------------------------------------------------------------- the engine's routing
def record_engine_routing(cache_dir: Path, layers: int, num_experts: int, topk: int, group_size: int,
                          prompt_tokens: int, response_tokens: int) -> tuple[Path, dict[str, Any]]:
    """Routing recorded by the CPU engine on a tiny Qwen3-MoE of this shape, cached as ``.npz`` (numpy arrays only).

    Returns the cache file and how it was made (``record_s`` is 0 when it was cached already)."""
    name = f"engine-L{layers}-E{num_experts}-K{topk}-n{group_size}-P{prompt_tokens}-R{response_tokens}.npz"
    path = cache_dir / name
    info = {"layers": layers, "num_experts": num_experts, "topk": topk, "prompts": ENGINE_PROMPTS,
            "group_size": group_size, "prompt_tokens": prompt_tokens, "response_tokens": response_tokens}
    if path.exists():
        return path, {**info, "cached": True, "record_s": 0.0}
    import asyncio

    start = time.perf_counter()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        arrays = asyncio.run(_record(Path(tmp), info))
        partial = path.with_suffix(".tmp.npz")
        np.savez(partial, **arrays)
        partial.rename(path)  # a killed recording leaves no cache that looks complete
    return path, {**info, "cached": False, "record_s": time.perf_counter() - start}


async def _record(folder: Path, info: dict[str, Any]) -> dict[str, np.ndarray]:
    from pipeline.benchmarks.rollout import _Engine
    from pipeline.data.prompts import synthetic
    from pipeline.models.tiny import init_tiny_model
    from pipeline.producers.producer import load_tokenize
    from pipeline.producers.sglang_client import SGLangClient

    p, r, n = info["prompt_tokens"], info["response_tokens"], info["group_size"]
    model_dir = init_tiny_model("qwen3-moe", folder / "model", num_hidden_layers=info["layers"],
                                num_experts=info["num_experts"], num_experts_per_tok=info["topk"],
                                max_position_embeddings=max(1024, p + r + 1))  # fmt: skip
    # Prompts are the recipe's arithmetic, several problems to a prompt until it has p tokens.
    tokenize, problems = load_tokenize(model_dir), synthetic("addition", 4096)
    prompts, k = [], 0
    for _ in range(ENGINE_PROMPTS):
        ids: list[int] = []
        while len(ids) < p:
            ids += tokenize(f"{problems[k].text}{problems[k].answer} ")
            k += 1
        prompts.append(ids[:p])
    engine = _Engine(model_dir, folder / "engine.log", capture=True)
    try:
        await engine.wait_healthy()
        async with SGLangClient(engine.url) as client:
            results = await client.generate_many(
                prompts, {"n": n, "max_new_tokens": r, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 0},
                return_routed_experts=True)
    finally:
        engine.stop()
    if any(len(x.output_ids) != r or x.routed_experts is None or x.output_logprobs is None for x in results):
        raise SluiceError(f"the CPU engine did not return {r} tokens with logprobs and routing for every sample; "
                          f"see {folder / 'engine.log'}")
    def stack(get: Any) -> np.ndarray:
        return np.stack([np.stack([get(results[g * n + i]) for i in range(n)]) for g in range(ENGINE_PROMPTS)])

    return {
        "prompt_ids": np.asarray(prompts, dtype=np.int32),
        "response_ids": stack(lambda x: x.output_ids.astype(np.int32)),
        "logprobs": stack(lambda x: np.asarray(x.output_logprobs, dtype=np.float32)),
        "routing": stack(lambda x: compact_routing(x.routed_experts, info["num_experts"])),
    }


# ----------------------------------------------------------------------------------------------------- the workers
# A worker is `python -m pipeline.benchmarks.queue_e2e producer|consumer`, spoken to in JSON lines on its stdin and
# stdout: its config, then per run "arm" (set up, answer "armed") and "go" (run, answer "done"), until "stop". Both
# are armed before either goes, so neither's set-up is timed; the clock runs from the producer's first put to the
# consumer's last ack.
Run = Callable[[], dict[str, Any]]


def _producer(client: redis.Redis, groups: list[list[Sample]], blobs: dict[str, list[bytes]], variant: str,
              run: str, key: str, batch: int) -> Run:
    kind, codec = variant.split("_")
    queue = SampleQueue(client, run, capacity=max(1024, len(groups) + 1), routing_codec=codec)  # type: ignore[arg-type]
    fields = [{"v": SCHEMA_VERSION, "n": len(g), "vmin": 0, "vmax": 0, "seq": i + 1} for i, g in enumerate(groups)]

    def go() -> dict[str, Any]:
        start = time.perf_counter()
        if kind == "sluice":
            for g in groups:
                queue.put(g)  # one group per call, as the producer does
        else:
            data = blobs[codec]
            for i in range(0, len(groups), batch):
                pipe = client.pipeline(transaction=False)
                for j in range(i, min(i + batch, len(groups))):
                    pipe.xadd(key, {**fields[j], "data": data[j]})
                pipe.execute()
        return {"start": start, "put_s": time.perf_counter() - start, "put": len(groups)}

    return go


def _consumer(client: redis.Redis, variant: str, run: str, key: str, groups: int, batch: int) -> Run:
    kind, codec = variant.split("_")
    queue = SampleQueue(client, run, routing_codec=codec)  # type: ignore[arg-type]

    def read(want: int) -> tuple[list[str], int]:
        if kind == "sluice":
            entries = queue.read("trainer", "trainer-0", count=want, block_ms=BLOCK_MS)
            return [e.id for e in entries], sum(len(e.samples) for e in entries)
        reply = client.xreadgroup("trainer", "trainer-0", {key: ">"}, count=want, block=BLOCK_MS)
        return [eid.decode() for eid, _ in (reply[0][1] if reply else [])], 0

    def go() -> dict[str, Any]:
        received = acked = samples = 0
        idle_since = time.monotonic()
        while received < groups:
            # The trainer's drain: ask for what the batch still lacks, blocking up to a second; ack the whole batch.
            ids: list[str] = []
            target = min(batch, groups - received)
            while len(ids) < target:
                got, n = read(target - len(ids))
                ids += got
                samples += n
                if got:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > _STALL_S:
                    raise QueueError(f"{variant}: no entry for {_STALL_S:.0f} s after {received} of {groups} groups")
            acked += queue.ack("trainer", ids) if kind == "sluice" else int(client.xack(key, "trainer", *ids))
            received += len(ids)
        return {"end": time.perf_counter(), "received": received, "acked": acked, "samples": samples}

    return go


def _serve(role: str) -> None:
    """A worker's main: build its own groups from the config line, then arm and run what the parent sends."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else prints goes to stderr, never into the protocol

    def send(kind: str, **body: Any) -> None:
        proto.write(json.dumps({"kind": kind, **body}) + "\n")

    # The one crash handler of this process: the parent learns why and stops the peer.
    try:
        cfg = json.loads(sys.stdin.readline())
        shape, batch, client = _Shape(**cfg["shape"]), int(cfg["batch"]), connect(cfg["url"])
        groups: list[list[Sample]] = []
        blobs: dict[str, list[bytes]] = {}
        if role == "producer":
            groups = build_groups(shape)
            blobs = {c: [encode_samples(g, routing=c) for g in groups] for c in ("plain", "compact")}  # type: ignore[arg-type]
        send("ready")
        while True:
            msg = json.loads(sys.stdin.readline() or '{"cmd": "stop"}')
            if msg["cmd"] == "stop":
                return
            variant, run, key = msg["variant"], msg["run"], msg["key"]
            if role == "producer":
                go = _producer(client, groups, blobs, variant, run, key, batch)
            else:
                go = _consumer(client, variant, run, key, shape.groups, batch)
            gc.collect()
            send("armed")
            json.loads(sys.stdin.readline())  # "go"
            send("done", **go())
    except BaseException:
        send("error", text=traceback.format_exc())
        sys.exit(1)


class _Workers:
    """The producer and consumer processes of one routing source, started and stopped by this benchmark."""

    ROLES = ("producer", "consumer")

    def __init__(self, url: str, shape: _Shape, batch: int, log_dir: Path) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = {role: log_dir / f"worker-{role}.log" for role in self.ROLES}
        try:
            for role in self.ROLES:
                with self.logs[role].open("ab") as log:
                    self.procs[role] = subprocess.Popen(
                        [sys.executable, "-m", "pipeline.benchmarks.queue_e2e", role], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=log, bufsize=0, env={**os.environ, "OMP_NUM_THREADS": "1"})
                self._send(role, url=url, shape=asdict(shape), batch=batch)
            for role in self.ROLES:
                self._recv(role, "ready", timeout_s=600.0)  # big shapes take a while to build and encode
        except BaseException:
            self.close()
            raise

    def _send(self, role: str, **msg: Any) -> None:
        stdin = self.procs[role].stdin
        assert stdin is not None
        stdin.write((json.dumps(msg) + "\n").encode())

    def _recv(self, role: str, kind: str, timeout_s: float) -> dict[str, Any]:
        proc = self.procs[role]
        assert proc.stdout is not None
        # The worker's stdout is unbuffered here and it has at most one line outstanding, so select sees it all.
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else b""
        if not line:
            raise SluiceError(f"the benchmark's {role} sent nothing in {timeout_s:.0f} s (exit code {proc.poll()}); "
                              f"see {self.logs[role]}")
        msg: dict[str, Any] = json.loads(line)
        if msg["kind"] == "error":
            raise SluiceError(f"the benchmark's {role} failed:\n{msg['text']}")
        if msg["kind"] != kind:
            raise SluiceError(f"the benchmark's {role} answered {msg['kind']!r} where {kind!r} was due")
        return msg

    def run(self, variant: str, run: str, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
        for role in self.ROLES:
            self._send(role, cmd="arm", variant=variant, run=run, key=key)
        for role in self.ROLES:
            self._recv(role, "armed", _STALL_S)
        for role in ("consumer", "producer"):  # the consumer first: it blocks until the first put lands
            self._send(role, cmd="go")
        consumer = self._recv("consumer", "done", _STALL_S * 2)
        return self._recv("producer", "done", _STALL_S), consumer

    def close(self) -> None:
        for role, proc in self.procs.items():
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    self._send(role, cmd="stop")
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


# ------------------------------------------------------------------------------------------------------- measuring
def _codec_cost(groups: list[list[Sample]]) -> dict[str, dict[str, float]]:
    """Encode and decode microseconds per sample, in this process, per routing codec."""
    some = groups[:_CODEC_GROUPS]
    n = sum(len(g) for g in some) * _CODEC_REPS
    out = {}
    for codec in ("compact", "plain"):
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(_CODEC_REPS):
            blobs = [encode_samples(g, routing=codec) for g in some]  # type: ignore[arg-type]
        t1 = time.perf_counter()
        for _ in range(_CODEC_REPS):
            for b in blobs:
                decode_samples(b)
        t2 = time.perf_counter()
        out[codec] = {"encode": (t1 - t0) / n * 1e6, "decode": (t2 - t1) / n * 1e6}
    return out


def _bytes(groups: list[list[Sample]]) -> dict[str, Any]:
    """Payload and routing bytes per sample per codec; routing bytes are what an entry loses without its routing."""
    n = sum(len(g) for g in groups)
    bare = [[replace(s, routed_experts=None) for s in g] for g in groups]
    payload, routing = {}, {}
    for codec in ("compact", "plain"):
        total = sum(len(encode_samples(g, routing=codec)) for g in groups)  # type: ignore[arg-type]
        without = sum(len(encode_samples(g, routing=codec)) for g in bare)  # type: ignore[arg-type]
        payload[codec], routing[codec] = total / n, (total - without) / n
    uint8 = sum(plain_routing_bytes(g) for g in groups) / n
    return {
        "payload_bytes_per_sample": payload,
        "routing_bytes_per_sample": {**routing, "uint8_array": uint8},
        "routing_ratio": routing["compact"] / routing["plain"],
        "goal": _GOALS["routing_bytes"],
    }


def _check(client: redis.Redis, key: str, put: int, consumer: dict[str, Any]) -> dict[str, Any]:
    """Did the consumer get and ack every entry? (what the stream and its group say, beside what it counted)."""
    (info,) = [g for g in client.xinfo_groups(key) if g["name"] in (b"trainer", "trainer")]
    last = client.xrevrange(key, count=1)
    last_id = last[0][0] if last else None
    return {
        "put": put,
        "stream_length": int(client.xlen(key)),
        "received": consumer["received"],
        "acked": consumer["acked"],
        "pending": int(info["pending"]),
        "last_delivered_is_last": info["last-delivered-id"] == last_id,
    }


def _delivered(c: dict[str, Any]) -> bool:
    return (c["put"] == c["stream_length"] == c["received"] == c["acked"]) and c["pending"] == 0 \
        and c["last_delivered_is_last"]


def _memory(client: redis.Redis, key: str, before: int, samples: int) -> dict[str, float]:
    used = int(client.info("memory")["used_memory"])
    # sluice's entries keep their payloads in keys of their own beside the stream (one server: the run's own tag).
    payloads = client.scan_iter(match=key.rsplit(":", 1)[0] + ":payload:*", count=1000)
    usage = sum(int(client.execute_command("MEMORY", "USAGE", k, "SAMPLES", 0) or 0) for k in [key, *payloads])
    return {"memory_usage": usage / samples, "used_memory_delta": (used - before) / samples}


def _drop(client: redis.Redis, run: str, embedded: bool) -> None:
    keys = list(client.scan_iter(match=f"sluice:{{{run}}}:*"))
    if keys:
        client.delete(*keys)
    if embedded:
        # The AOF grows by every run's bytes; rewriting it while nothing is timed keeps each run's fsyncs alike.
        client.bgrewriteaof()
        while any(int(client.info("persistence")[k]) for k in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")):
            time.sleep(0.05)


def _measure(p: QueueE2EParams, client: redis.Redis, url: str, embedded: bool, shape: _Shape, token: str,
             folder: Path) -> dict[str, Any]:
    """Every variant, ``p.rounds`` times in a rotating order, with one pair of worker processes."""
    samples = shape.groups * shape.group_size
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    put_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    memory: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    checks: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    workers = _Workers(url, shape, p.batch_entries, folder)
    try:
        for r in range(p.rounds):
            shift = r % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                run = f"bench-e2e-{token}-{variant}-{r}"
                queue = SampleQueue(client, run)
                queue.create_group("trainer", "0")
                before = int(client.info("memory")["used_memory"])
                producer, consumer = workers.run(variant, run, queue.keys.samples)
                seconds[variant].append(consumer["end"] - producer["start"])
                put_s[variant].append(producer["put_s"])
                memory[variant].append(_memory(client, queue.keys.samples, before, samples))
                checks[variant].append(_check(client, queue.keys.samples, producer["put"], consumer))
                if variant.startswith("sluice") and consumer["samples"] != samples:
                    checks[variant][-1]["decoded_samples"] = consumer["samples"]
                _drop(client, run, embedded)
    finally:
        workers.close()
    bad = [(v, c) for v in VARIANTS for c in checks[v] if not _delivered(c) or "decoded_samples" in c]
    if bad:
        raise QueueError(f"the consumer did not receive and ack every entry: {bad}")
    return _summary(shape, seconds, put_s, memory, checks)


def _summary(shape: _Shape, seconds: dict[str, list[float]], put_s: dict[str, list[float]],
             memory: dict[str, list[dict[str, float]]], checks: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    samples = shape.groups * shape.group_size

    def ratio(a: str, b: str, goal: str = "") -> dict[str, Any]:
        # Per round: the two ran within seconds of each other, so their ratio cancels most of the machine's drift.
        rounds = [tb / ta for ta, tb in zip(seconds[a], seconds[b])]
        return {"median": statistics.median(rounds), "rounds": rounds, **({"goal": _GOALS[goal]} if goal else {})}

    variants = {
        v: {
            "samples_per_s": samples / statistics.median(seconds[v]),
            "seconds": seconds[v],
            "producer_put_s": statistics.median(put_s[v]),
            "redis_memory_per_sample": {k: statistics.median(m[k] for m in memory[v]) for k in memory[v][0]},
            "checks": checks[v],
            "all_delivered_and_acked": all(_delivered(c) for c in checks[v]),
        }
        for v in VARIANTS
    }
    return {
        "samples": samples,
        "variants": variants,
        "ratios": {
            "compact_over_raw_plain": ratio("sluice_compact", "raw_plain", "compact_over_raw_plain"),
            "compact_over_raw_compact": ratio("sluice_compact", "raw_compact", "compact_over_raw_compact"),
            "compact_over_plain": ratio("sluice_compact", "sluice_plain"),
        },
    }


# ----------------------------------------------------------------------------------------------------- the driver
def _sources(routing: str) -> list[str]:
    if routing == "both":
        return list(SOURCES)
    if routing not in SOURCES:
        raise ConfigError(f"--routing {routing!r}: choose synthetic, engine or both")
    return [routing]


def _shape(p: QueueE2EParams, source: str, folder: Path) -> tuple[_Shape, dict[str, Any]]:
    if source == "synthetic":
        groups = max(1, p.samples // p.group_size)
        return _Shape(source, groups, p.group_size, p.prompt_tokens, p.response_tokens, p.layers, p.topk,
                      p.num_experts), {}
    cache, info = record_engine_routing(folder / "cache", p.engine_layers, p.num_experts, p.topk, p.group_size,
                                        p.engine_prompt_tokens, p.engine_response_tokens)
    groups = max(1, p.engine_samples // p.group_size)
    return _Shape(source, groups, p.group_size, p.engine_prompt_tokens, p.engine_response_tokens, p.engine_layers,
                  p.topk, p.num_experts, str(cache)), info


def _recipe_shape_bytes(p: QueueE2EParams, folder: Path) -> dict[str, Any]:
    """Bytes only: the recipe model's samples are tiny, so their throughput says little."""
    s = RECIPE_SHAPE
    cache, info = record_engine_routing(folder / "cache", s["layers"], s["num_experts"], s["topk"], p.group_size,
                                        p.engine_prompt_tokens, p.engine_response_tokens)
    shape = _Shape("engine", ENGINE_PROMPTS, p.group_size, p.engine_prompt_tokens, p.engine_response_tokens,
                   s["layers"], s["topk"], s["num_experts"], str(cache))
    return {"recording": info, **_bytes(build_groups(shape))}


@contextlib.contextmanager
def _server(p: QueueE2EParams, folder: Path) -> Iterator[tuple[redis.Redis, str, bool]]:
    """(client, url, embedded): the given server, or an embedded one with AOF that this benchmark stops."""
    if p.redis_url:
        client = connect(p.redis_url)
        try:
            yield client, p.redis_url, False
        finally:
            client.close()
        return
    with tempfile.TemporaryDirectory(dir=folder, prefix="redis-") as tmp:
        server = EmbeddedRedis(Path(tmp), appendfsync=p.appendfsync).start()  # type: ignore[arg-type]
        try:
            client = server.client()
            # A background rewrite forks and rewrites the whole AOF at a moment that depends on history; _drop
            # rewrites it between runs instead, so that no run pays for another's bytes.
            client.config_set("auto-aof-rewrite-percentage", 0)
            yield client, server.url, True
            client.close()
        finally:
            server.stop()


def run_queue_e2e_bench(p: QueueE2EParams, folder: Path | None = None) -> dict[str, Any]:
    """Run the benchmark; ``folder`` (default ``p.out``) holds the server, the routing cache and ``queue-e2e.json``."""
    sources = _sources(p.routing)
    out = Path(folder if folder is not None else p.out)
    out.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    result: dict[str, Any] = {"benchmark": "queue-e2e", "params": asdict(p), "variants": list(VARIANTS),
                              "block_ms": BLOCK_MS, "sources": {}}
    shapes = {s: _shape(p, s, out) for s in sources}  # record engine routing before any server runs
    with _server(p, out) as (client, url, embedded):
        result.update(server="embedded" if embedded else url, redis_version=client.info("server")["redis_version"])
        for source, (shape, recording) in shapes.items():
            groups = build_groups(shape)
            r: dict[str, Any] = {"shape": asdict(shape) | {"cache": Path(shape.cache).name if shape.cache else ""}}
            if recording:
                r["recording"] = recording
            r.update(_bytes(groups), codec_us_per_sample=_codec_cost(groups))
            del groups
            r.update(_measure(p, client, url, embedded, shape, token, out))
            for v, m in r["variants"].items():
                m["payload_bytes_per_sample"] = r["payload_bytes_per_sample"][v.split("_")[1]]
                m["MB_per_s"] = m["samples_per_s"] * m["payload_bytes_per_sample"] / 1e6
            result["sources"][source] = r
    if "engine" in sources:
        result["recipe_shape"] = _recipe_shape_bytes(p, out)
    (out / "queue-e2e.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary_lines(r: dict[str, Any]) -> Sequence[str]:
    """The short human table ``sluice bench queue --e2e`` prints."""
    lines = [f"redis {r['redis_version']} ({r['server']}), appendfsync={r['params']['appendfsync']}, "
             f"read count {r['params']['batch_entries']}, block {r['block_ms']} ms"]
    layers = r["params"]["layers"]
    for source, s in r["sources"].items():
        sh = s["shape"]
        engine_note = ", recorded by the CPU engine" + (
            f" ({sh['layers']} layers, not {layers}: see --engine-layers)" if sh["layers"] != layers else "")
        lines.append(f"{source}: {s['samples']} samples, {sh['layers']} layers x top-{sh['topk']} of "
                     f"{sh['num_experts']}, {sh['prompt_tokens']} + {sh['response_tokens']} tokens, groups of "
                     f"{sh['group_size']}" + (engine_note if source == "engine" else ""))
        lines.append(f"  {'variant':15s} {'samples/s':>10s} {'MB/s':>8s} {'kB/sample':>10s} {'redis kB/sample':>16s}")
        for v, m in s["variants"].items():
            lines.append(f"  {v:15s} {m['samples_per_s']:10.0f} {m['MB_per_s']:8.1f} "
                         f"{m['payload_bytes_per_sample'] / 1e3:10.1f} "
                         f"{m['redis_memory_per_sample']['memory_usage'] / 1e3:16.1f}")
        for k, x in s["ratios"].items():
            lines.append(f"  {k:26s} {x['median']:.2f}" + (f" (goal {x['goal']})" if "goal" in x else "")
                         + "  rounds " + " ".join(f"{v:.2f}" for v in x["rounds"]))
        rb = s["routing_bytes_per_sample"]
        lines.append(f"  routing bytes compact/plain {s['routing_ratio']:.3f} (goal {s['goal']}): "
                     f"{rb['compact'] / 1e3:.1f} / {rb['plain'] / 1e3:.1f} kB per sample")
        c = s["codec_us_per_sample"]
        lines.append(f"  codec us/sample: compact encode {c['compact']['encode']:.0f} decode "
                     f"{c['compact']['decode']:.0f}, plain encode {c['plain']['encode']:.0f} decode "
                     f"{c['plain']['decode']:.0f}")
    if "recipe_shape" in r:
        rs = r["recipe_shape"]
        rb = rs["routing_bytes_per_sample"]
        lines.append(f"recipe shape (2 layers x top-2 of 8, engine): routing bytes compact/plain "
                     f"{rs['routing_ratio']:.3f}: {rb['compact']:.0f} / {rb['plain']:.0f} B per sample")
    return lines


if __name__ == "__main__":
    _serve(sys.argv[1])
