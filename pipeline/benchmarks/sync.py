"""``sluice bench sync``: the weight push against one bare broadcast of the same bytes, in one run.

For each model size, a Qwen3 of that many bytes of fp32 weights is written locally and served by a CPU engine process
(the receiver, which loads every bucket into its model). This process is the trainer's rank 0: it holds the weights
(cloned, resident, as live parameters are), hosts the weight group over gloo, and per round, in alternating order:

- **push**: ``WeightPusher.push`` of every weight, exactly as the trainer streams it (pause, per-bucket
  announcement and flat broadcast, packing of the next bucket during the send, the engine's load, end, continue);
- **reference**: one flat uint8 broadcast of the same number of bytes between the same two processes over the same
  group, from a buffer this process allocated once, into one the engine allocated beforehand
  (``/weight_group_probe``).

A size runs ``rounds`` rounds at least, and more until ``min_seconds`` of pushes and references: many for the
small models, whose single rounds vary most. The ratio is push GB/s over reference GB/s, the median over rounds
(goal >= 0.95), with its quartiles. Also reported: bytes sent per parameter byte (1.0 for an fp32 engine, 0.5 for
bf16), and rank 0's peak extra memory during the pushes: the peak RSS (reset through ``/proc/self/clear_refs`` before
each push) minus the RSS before the first push (the weights and the reference's buffer resident, no pusher yet), so
the two bucket buffers the pusher keeps from push to push count; next to it the buffers alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import EngineError
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.sync.base import DTYPE_ITEMSIZE

if TYPE_CHECKING:  # torch stays out of `sluice --help`, which builds this module's flags from SyncBenchParams
    import torch

    from pipeline.sync.pusher import WeightPusher

MB = 1 << 20
BIG_SIZES_MB = "500,1000,2000"
MAX_ROUNDS_FACTOR = 20


@dataclass
class SyncBenchParams:
    """What one ``sluice bench sync`` measures."""

    sizes_mb: str = "50,200"
    """Model sizes in MB of fp32 weights, comma-separated."""
    big: bool = False
    """Add the large sizes (500, 1000 and 2000 MB): minutes, and about four times the largest size in memory."""
    bucket_mb: int = 256
    """Bucket size (the CPU default, ``DEFAULT_BUCKET_BYTES["gloo"]``)."""
    engine_dtype: str = "float32"
    """The receiving engine's dtype; bfloat16 halves the bytes on the wire."""
    rounds: int = 7
    """Timed rounds per size at least; each runs the push and the reference once (a shared machine needs several)."""
    min_seconds: float = 4.0
    """More rounds until a size's pushes and references took this long in all (at most ``MAX_ROUNDS_FACTOR`` times
    ``rounds``): a round of the 50 MB model takes 50 ms, and single rounds there vary by a fifth on a shared machine,
    so its median needs far more rounds than the 2 GB model's."""
    out: str = ""
    """Also write the JSON result to this file."""


def _model_shape(size_mb: int) -> dict[str, int]:
    """A Qwen3 of about ``size_mb`` MB of fp32 weights: wide layers so that tensors, not Python, dominate."""
    hidden, inter = (512, 2048) if size_mb < 400 else (1024, 4096)
    per_layer = (4 * hidden * hidden + 3 * hidden * inter) * 4  # attention q/k/v/o + gate/up/down, fp32
    return {"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": hidden // 64,
            "num_key_value_heads": hidden // 64, "head_dim": 64,
            "num_hidden_layers": max(1, round(size_mb * MB / per_layer)), "max_position_embeddings": 256}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class _Engine:
    """A CPU engine process on a free port (started and stopped by this benchmark)."""

    def __init__(self, model_dir: Path, dtype: str, log_dir: Path) -> None:
        port_file = log_dir / f"engine-{model_dir.name}.port"
        port_file.unlink(missing_ok=True)
        self.log = log_dir / f"engine-{model_dir.name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--host", "127.0.0.1",
                 "--port", "0", "--port-file", str(port_file), "--dtype", dtype, "--log-level", "warning"],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        deadline = time.monotonic() + 600
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"the benchmark's CPU engine did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _wait_healthy(client: SGLangClient, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await client.health():
        if time.monotonic() > deadline:
            raise EngineError(f"engine {client.name} did not answer /health in {timeout_s:.0f}s")
        await asyncio.sleep(0.2)


async def _measure(client: SGLangClient, weights: list[tuple[str, torch.Tensor]], params: SyncBenchParams,
                   param_bytes: int) -> dict[str, Any]:
    import torch

    from pipeline.sync.pusher import PushOptions, WeightPusher

    await _wait_healthy(client)
    # The reference's buffer, allocated and touched once and resident throughout: one allocated and freed per round
    # was sometimes still counted at the next push's reset (a 514 MB and a 54 MB reading, once in 35 and 85 pushes).
    itemsize = DTYPE_ITEMSIZE[params.engine_dtype]
    flat = torch.ones(sum(t.numel() * (itemsize if t.is_floating_point() else t.element_size()) for _, t in weights),
                      dtype=torch.uint8)
    baseline = _status("VmRSS")  # the weights are resident already; what the push adds is measured from here
    pusher = await WeightPusher.connect([client], master_address="127.0.0.1", backend="gloo", timeout_s=600,
                                        options=PushOptions(bucket_bytes=params.bucket_mb * MB,
                                                            dtype=params.engine_dtype))
    try:
        await pusher.push(weights, 0)  # warm: connections, the engine's first load, the packer's buffers
        pushes: list[dict[str, Any]] = []
        references: list[float] = []
        version = 0
        round_, spent = 0, 0.0
        while more_rounds(round_, spent, params):
            round_ += 1
            for kind in (("push", "reference") if round_ % 2 == 1 else ("reference", "push")):
                if kind == "push":
                    version += 1
                    measured = _reset_peak()
                    stats = await pusher.push(weights, version)
                    spent += stats.seconds
                    pushes.append({"seconds": stats.seconds, "bytes": stats.bytes, "buckets": stats.buckets,
                                   "peak_buffer_bytes": stats.peak_buffer_bytes,
                                   "peak_extra_rss": _status("VmHWM") - baseline if measured else None})
                else:
                    references.append(await _reference(client, pusher, flat))
                    spent += references[-1]
        # Where the push's time beyond the broadcast goes, part one: casting and packing alone (no send), which on a
        # machine with cores to spare overlaps the previous bucket's transfer.
        packing = []
        for _ in range(3):
            start = time.perf_counter()
            for bucket, _last in pusher.packer().stream(weights):
                bucket.release()
            packing.append(time.perf_counter() - start)
    finally:
        await pusher.close()
    wire = pushes[0]["bytes"]
    if wire != flat.numel():
        raise EngineError(f"the push sent {wire} bytes, the reference {flat.numel()}; they must send the same")
    push_s = statistics.median(p["seconds"] for p in pushes)
    ref_s = statistics.median(references)
    ratios = [r / p["seconds"] for r, p in zip(references, pushes, strict=True)]
    rss = [p["peak_extra_rss"] for p in pushes if p["peak_extra_rss"] is not None]
    return {
        "param_bytes": param_bytes,
        "wire_bytes": wire,
        "bytes_per_param_byte": wire / param_bytes,
        "buckets": pushes[0]["buckets"],
        "push_s": push_s,
        "reference_s": ref_s,
        "push_GB_per_s": wire / push_s / 1e9,
        "reference_GB_per_s": wire / ref_s / 1e9,
        "ratio": statistics.median(ratios),
        "ratio_quartiles": quartiles(ratios),
        "rounds": len(ratios),
        "ratios": ratios,
        # On a shared machine the fastest round of each is the one least disturbed by other processes; their ratio
        # estimates the cost of the push's own work apart from that noise.
        "ratio_of_minimums": min(references) / min(p["seconds"] for p in pushes),
        "push_s_rounds": [p["seconds"] for p in pushes],
        "reference_s_rounds": references,
        "pack_only_s": statistics.median(packing),
        "peak_buffer_MB": max(p["peak_buffer_bytes"] for p in pushes) / MB,
        "peak_extra_rss_MB": max(rss) / MB if rss else None,
    }


def more_rounds(done: int, seconds: float, params: SyncBenchParams) -> bool:
    """Whether a size runs another round after ``done`` rounds that took ``seconds`` (pushes and references): up to
    ``rounds`` always, then until ``min_seconds``, and never beyond ``MAX_ROUNDS_FACTOR`` times ``rounds``."""
    return done < params.rounds or (done < MAX_ROUNDS_FACTOR * params.rounds and seconds < params.min_seconds)


def quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles: how far single rounds spread around the median."""
    if len(values) < 2:
        return [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [q1, q3]


async def _reference(client: SGLangClient, pusher: WeightPusher, flat: torch.Tensor) -> float:
    """One flat broadcast of ``flat`` (allocated and touched before the clock starts) into a buffer the engine
    prepared; its seconds."""
    nbytes = flat.numel()
    group = pusher.group.group_name
    reply = await client.weight_group_probe(group, nbytes, prepare=True)
    if not reply.success:
        raise EngineError(f"engine {client.name} could not prepare the reference: {reply.message}")
    start = time.perf_counter()
    receiving = asyncio.ensure_future(client.weight_group_probe(group, nbytes))
    await asyncio.to_thread(pusher.group.broadcast, flat, 0)
    reply = await receiving
    seconds = time.perf_counter() - start
    if not reply.success:
        raise EngineError(f"engine {client.name} failed the reference broadcast: {reply.message}")
    return seconds


def run_sync_bench(params: SyncBenchParams) -> dict[str, Any]:
    """Run the benchmark; returns its JSON-ready result."""
    import torch
    from safetensors.torch import load_file

    from pipeline.models.tiny import init_tiny_model

    sizes = [int(s) for s in params.sizes_mb.split(",") if s.strip()]
    if params.big:
        sizes += [int(s) for s in BIG_SIZES_MB.split(",") if int(s) not in sizes]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-sync-") as tmp:
        for size in sizes:
            folder = init_tiny_model("qwen3", Path(tmp) / f"model-{size}", **_model_shape(size))
            # Cloned out of the file mapping: resident, as a trainer's parameters are.
            weights = [(n, t.clone()) for n, t in sorted(load_file(str(folder / "model.safetensors")).items())]
            param_bytes = sum(t.numel() * t.element_size() for _, t in weights)
            engine = _Engine(folder, params.engine_dtype, Path(tmp))
            try:
                client = SGLangClient(engine.url, retry=NO_RETRY, weight_timeout=3600)
                try:
                    results[str(size)] = asyncio.run(_measure(client, weights, params, param_bytes))
                finally:
                    asyncio.run(client.close())
            finally:
                engine.stop()
            del weights
            print(f"  {size} MB: push {results[str(size)]['push_GB_per_s']:.3f} GB/s, reference "
                  f"{results[str(size)]['reference_GB_per_s']:.3f} GB/s, ratio {results[str(size)]['ratio']:.3f}",
                  file=sys.stderr, flush=True)
    ratios = [r["ratio"] for r in results.values()]
    res = {
        "params": asdict(params),
        "backend": "gloo",
        "torch": torch.__version__,
        "sizes": results,
        "ratio_min": min(ratios),
        "goal": ">= 0.95",
    }
    if params.out:
        Path(params.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


def summary_lines(res: dict[str, Any]) -> list[str]:
    """Human-readable lines of a result."""
    lines = [f"weight push vs one bare broadcast of the same bytes, gloo, {res['params']['bucket_mb']} MB buckets, "
             f"engine {res['params']['engine_dtype']}:"]
    for size, r in res["sizes"].items():
        rss = "n/a" if r["peak_extra_rss_MB"] is None else f"{r['peak_extra_rss_MB']:.0f} MB"
        lines.append(f"  {size:>5} MB model: push {r['push_GB_per_s']:.3f} GB/s / reference "
                     f"{r['reference_GB_per_s']:.3f} GB/s = {r['ratio']:.3f} (quartiles "
                     f"{r['ratio_quartiles'][0]:.3f}-{r['ratio_quartiles'][1]:.3f} over {r['rounds']} rounds; of "
                     f"the fastest rounds {r['ratio_of_minimums']:.3f}); {r['bytes_per_param_byte']:.2f} bytes "
                     f"per parameter byte; rank 0 peak extra {rss} (bucket buffers {r['peak_buffer_MB']:.0f} MB)")
    lines.append(f"  lowest ratio {res['ratio_min']:.3f} (goal {res['goal']})")
    return lines
