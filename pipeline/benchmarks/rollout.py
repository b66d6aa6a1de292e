"""``sluice bench rollout``: what returning MoE routing costs a producer, as a fraction of its rollout time.

One run starts a tiny Qwen3-MoE in a CPU engine process with ``--enable-return-routed-experts`` and an embedded
redis-server, then times the same rollouts (seeded, fixed length) through a real ``Producer`` twice per round:
with ``return_routed_experts`` and without. The difference prices what routing adds on the request path: the
engine building the int32 rows and base64-encoding them, the larger HTTP answer, the client's decode, the cast to
uint8, the codec and the bigger Redis entry. The order of the variants alternates across rounds and the reported
fraction is the median of per-round ratios: each pair runs back to back, so their ratio cancels most of the noise of
a shared machine.

Once the flag is on, the engine (like SGLang) records routing for every request, so the same-process comparison does
not include the recording hook itself. With ``capture_reference`` a second engine without the flag serves a third
variant, and ``fraction_incl_capture`` prices the whole thing, hook included.
"""

from __future__ import annotations

import asyncio
import base64
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.config.producer import ProducerConfig, SamplingConfig
from pipeline.data.prompts import synthetic
from pipeline.errors import EngineError
from pipeline.net import free_port
from pipeline.producers.producer import Producer, load_tokenize, read_num_experts
from pipeline.producers.rewards import exact_match
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.queue.redis_server import EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue


@dataclass
class RolloutBenchParams:
    """What one ``sluice bench rollout`` measures."""

    groups: int = 16
    """Prompt groups per variant per round."""
    group_size: int = 4
    """Samples per prompt."""
    max_new_tokens: int = 128
    """Response length (EOS is ignored, so every response has exactly this many tokens)."""
    concurrency: int = 4
    """Groups in flight per producer."""
    rounds: int = 5
    """Timed rounds; each runs every variant once."""
    layers: int = 2
    """MoE layers of the tiny model."""
    num_experts: int = 8
    """Experts per layer."""
    topk: int = 2
    """Experts per token."""
    capture_reference: bool = True
    """Also time an engine started without --enable-return-routed-experts (prices the recording hook too)."""
    temperature: float = 1.0
    """Sampling temperature."""


_ROUTED, _PLAIN, _NO_CAPTURE = "routed", "plain", "no_capture"


class _Engine:
    """A CPU engine subprocess the benchmark started; stopped by its PID."""

    def __init__(self, model_dir: Path, log: Path, capture: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), "--log-level", "warning", "--num-threads", "1"]  # fmt: skip
        if capture:
            args.append("--enable-return-routed-experts")
        with log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip

    async def wait_healthy(self, timeout_s: float = 120.0) -> None:
        async with SGLangClient(self.url, retry=NO_RETRY, health_timeout=2.0) as client:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise EngineError(f"the benchmark's engine exited with {self.proc.returncode}; see {self.log}")
                if await client.health():
                    return
                await asyncio.sleep(0.1)
        raise EngineError(f"the benchmark's engine at {self.url} was not healthy after {timeout_s}s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class _Variant:
    name: str
    url: str
    return_routed_experts: bool


async def _timed_rollout(
    p: RolloutBenchParams, variant: _Variant, client: SGLangClient, queue: SampleQueue, model_dir: Path
) -> tuple[float, int]:
    """Seconds to put ``p.groups`` groups on a fresh run's queue, and the queue bytes they took."""
    cfg = ProducerConfig(
        group_size=p.group_size, concurrency=p.concurrency, return_routed_experts=variant.return_routed_experts,
        sampling=SamplingConfig(temperature=p.temperature, max_new_tokens=p.max_new_tokens, ignore_eos=True, seed=0),
    )  # fmt: skip
    producer = Producer(
        cfg, name=f"bench-{variant.name}", queue=queue, engine=client, prompts=synthetic("addition", 1024),
        tokenize=load_tokenize(model_dir), reward_fn=exact_match, pacing=None, num_experts=read_num_experts(model_dir),
    )  # fmt: skip
    start = time.perf_counter()
    await producer.run(max_groups=p.groups)
    seconds = time.perf_counter() - start
    rows: Any = queue.redis.xrange(queue.keys.samples)
    payload = sum(int(fields[b"psize"]) + len(fields[b"head"]) for _, fields in rows)
    _drop_run(queue)
    return seconds, payload


def _drop_run(queue: SampleQueue) -> None:
    keys = list(queue.redis.scan_iter(match=f"{queue.keys.prefix}:*"))
    if keys:
        queue.redis.delete(*keys)


async def _wire_bytes(url: str, p: RolloutBenchParams) -> dict[str, float]:
    """Routing bytes per routed token: base64 int32 on the wire, raw int32, and the queue's uint8."""
    async with SGLangClient(url, retry=NO_RETRY) as client:
        body = {"input_ids": [5, 6, 7, 8], "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0.0}}  # fmt: skip
        answer = await client.generate_raw(body)
    encoded = answer["meta_info"]["routed_experts"]
    rows = 4 + len(answer["output_ids"]) - 1
    raw = len(base64.b64decode(encoded))
    ids_per_row = raw // 4 // rows
    return {
        "wire_base64_int32": len(encoded) / rows,
        "raw_int32": raw / rows,
        "queue_uint8": ids_per_row * (1 if p.num_experts <= 256 else 2),
        "ids_per_token": ids_per_row,
    }


async def _bench(p: RolloutBenchParams, folder: Path) -> dict[str, Any]:
    from pipeline.models.tiny import init_tiny_model

    model_dir = init_tiny_model("qwen3-moe", folder / "model", num_hidden_layers=p.layers,
                                num_experts=p.num_experts, num_experts_per_tok=p.topk)  # fmt: skip
    engines = [_Engine(model_dir, folder / "engine.log", capture=True)]
    if p.capture_reference:
        engines.append(_Engine(model_dir, folder / "engine-nocapture.log", capture=False))
    server = EmbeddedRedis(folder / "redis", appendfsync="everysec").start()
    try:
        await asyncio.gather(*(e.wait_healthy() for e in engines))
        variants = [_Variant(_ROUTED, engines[0].url, True), _Variant(_PLAIN, engines[0].url, False)]
        if p.capture_reference:
            variants.append(_Variant(_NO_CAPTURE, engines[1].url, False))
        redis = server.client()
        clients = {v.name: SGLangClient(v.url) for v in variants}
        seconds: dict[str, list[float]] = {v.name: [] for v in variants}
        payload: dict[str, int] = {}
        try:
            for r in range(-1, p.rounds):  # round -1 warms up every variant and is not counted
                # Rotate which variant goes first, so a drift in load or AOF size hits all of them alike.
                shift = max(r, 0) % len(variants)
                for v in variants[shift:] + variants[:shift]:
                    queue = SampleQueue(redis, f"bench-rollout-{v.name}-{r + 1}", capacity=p.groups + 1)
                    dt, size = await _timed_rollout(p, v, clients[v.name], queue, model_dir)
                    if r >= 0:
                        seconds[v.name].append(dt)
                        payload[v.name] = size
            wire = await _wire_bytes(engines[0].url, p)
        finally:
            await asyncio.gather(*(c.close() for c in clients.values()))
    finally:
        server.stop()
        for engine in engines:
            engine.stop()
    return _report(p, seconds, payload, wire)


def _report(
    p: RolloutBenchParams, seconds: dict[str, list[float]], payload: dict[str, int], wire: dict[str, float]
) -> dict[str, Any]:
    samples = p.groups * p.group_size
    tokens = samples * p.max_new_tokens

    def overhead(reference: str) -> float:
        # The median of per-round ratios: each pair ran back to back, so their ratio cancels most shared noise.
        return statistics.median(a / b for a, b in zip(seconds[_ROUTED], seconds[reference], strict=True)) - 1.0

    result: dict[str, Any] = {
        "benchmark": "rollout",
        "params": asdict(p),
        "seconds": seconds,
        "tokens_per_s": {k: tokens / statistics.median(v) for k, v in seconds.items()},
        "fraction": overhead(_PLAIN),
        "goal": "<= 0.05",
        "routing_bytes_per_token": wire,
        "queue_bytes_per_sample": {k: v / samples for k, v in payload.items()},
    }
    if _NO_CAPTURE in seconds:
        result["fraction_incl_capture"] = overhead(_NO_CAPTURE)
    return result


def run_rollout_bench(params: RolloutBenchParams, folder: Path | None = None) -> dict[str, Any]:
    """Run the benchmark in a temporary folder (under ``folder`` if given) and return its JSON-ready report."""
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        return asyncio.run(_bench(params, Path(tmp)))
