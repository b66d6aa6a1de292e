"""``sluice bench sync-sources``: the push from every owner against rank 0 pushing alone, in one run.

A Qwen3 of ``size_mb`` MB of fp32 weights is written locally and served by ``engines`` CPU engine processes. The
benchmark starts ``sources`` gloo processes, the trainer's ranks, each holding the whole model (as data-parallel
replicas do) and owning a share of its tensors (split by bytes, largest first, as the owner plan splits replicated
tensors). Per round, in alternating order:

- **rank 0 alone**: ``WeightPusher.push`` of every tensor streamed from rank 0, as ``sync.sources = "rank0"`` with
  ``trainer.overlap_push = false`` pushes: the trainer is blocked for the whole push;
- **every owner**: each rank packs its share (the trainer's only blocking work: the next step starts right after),
  then the push from every source (``pipeline.sync.sources_push``) sends them while the trainer would train.

Reported per mode: the push's seconds, the bytes rank 0 sent, and the trainer's blocked seconds; the ratio of
blocked time to push time (goal <= 0.2 for the owners, 1.0 for rank 0 streaming alone). With ``kill_trials``, each
trial starts two fresh ranks, SIGKILLs rank 1 after a random bucket of its share, checks that no engine took the new
label, and has rank 0 push alone (as the restarted trainer does) and checks that every engine took that one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.benchmarks.sync import MB, _Engine, _model_shape
from pipeline.net import free_port
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient

if TYPE_CHECKING:
    import torch


@dataclass
class SourcesBenchParams:
    """What one ``sluice bench sync-sources`` measures."""

    size_mb: int = 200
    """Model size in MB of fp32 weights."""
    sources: int = 2
    """Trainer ranks, each sending its own share."""
    engines: int = 1
    """CPU engine processes receiving every push."""
    bucket_mb: int = 64
    """Bucket size."""
    rounds: int = 3
    """Timed rounds per mode."""
    kill_trials: int = 0
    """Trials of a source SIGKILLed mid-push (each starts two fresh ranks)."""
    out: str = ""
    """Also write the JSON result to this file."""


def _shares(weights: list[tuple[str, torch.Tensor]], sources: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors split by bytes, largest first to the lightest rank, each share in name order."""
    loads, owned = [0] * sources, [[] for _ in range(sources)]  # type: list[int], list[list[tuple[str, Any]]]
    for name, tensor in sorted(weights, key=lambda nt: (-nt[1].numel() * nt[1].element_size(), nt[0])):
        rank = min(range(sources), key=lambda r: (loads[r], r))
        owned[rank].append((name, tensor))
        loads[rank] += tensor.numel() * tensor.element_size()
    return [sorted(share, key=lambda nt: nt[0]) for share in owned]


async def engine_labels(urls: list[str]) -> list[str]:
    labels = []
    for url in urls:
        async with SGLangClient(url, retry=NO_RETRY) as client:
            labels.append(str(await client.weight_version()))
    return labels


def _rank_main(rank: int, world: int, port: int, folder: str, urls: list[str], params: SourcesBenchParams,
               out: str, mode: str, kill_after: int) -> None:
    """One trainer rank of the benchmark (``python -m pipeline.benchmarks.sync_sources ...``)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from pipeline.sync.pusher import PushOptions, WeightPusher
    from pipeline.sync.share_sender import ShareSender
    from pipeline.sync.snapshot_pool import SnapshotPool
    from pipeline.sync.sources_push import ControlChannel, SourcesLead

    weights = [(n, t.clone()) for n, t in sorted(load_file(str(Path(folder) / "model.safetensors")).items())]
    share = _shares(weights, world)[rank]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    control = ControlChannel.create(timeout_s=120)
    loop = asyncio.new_event_loop()
    pool = SnapshotPool(params.bucket_mb * MB, torch.device("cpu"))
    options = PushOptions(bucket_bytes=params.bucket_mb * MB)
    rounds = params.rounds if mode == "rounds" else 1
    if rank != 0:
        sender = ShareSender(control, lambda url: SGLangClient(url, retry=NO_RETRY, weight_timeout=3600),
                             master_address="127.0.0.1", backend="gloo", timeout_s=120, options=options)
        if mode == "kill":
            send, sent = WeightPusher._push_bucket, [0]

            async def killed(self: WeightPusher, *args: Any, **kwargs: Any) -> None:
                await send(self, *args, **kwargs)
                sent[0] += 1
                if sent[0] > kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)

            WeightPusher._push_bucket = killed  # type: ignore[method-assign]
        blocked = []
        for _ in range(rounds):
            control.broadcast(None)  # the round starts for every rank at once
            start = time.perf_counter()
            pool.recycle()
            packed = pool.pack(share, None)
            blocked.append(time.perf_counter() - start)
            sender.serve(packed, loop)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"blocked_s": blocked}))
        sender.close(loop)
        return

    async def lead() -> dict[str, Any]:
        clients = [SGLangClient(u, retry=NO_RETRY, weight_timeout=3600) for u in urls]
        pusher = await WeightPusher.connect(clients, master_address="127.0.0.1", backend="gloo", timeout_s=120,
                                            options=options, sources=SourcesLead(control))
        sources = pusher.sources
        assert sources is not None
        result: dict[str, Any] = {"alone": [], "owners": []}
        version = int((await engine_labels(urls))[0] or 0) if mode == "kill" else 0
        for _ in range(rounds):
            if mode == "rounds":
                pusher.sources, version = None, version + 1
                start = time.perf_counter()
                stats = await pusher.push(weights, version)
                seconds = time.perf_counter() - start
                result["alone"].append({"push_s": seconds, "blocked_s": seconds, "rank0_bytes": stats.bytes})
                pusher.sources = sources
            control.broadcast({"op": "round"})
            start = time.perf_counter()
            pool.recycle()
            packed = pool.pack(share, None)
            blocked = time.perf_counter() - start
            version += 1
            start = time.perf_counter()
            try:
                await pusher.push(packed, version)
                ok = True
            except Exception as exc:  # noqa: BLE001 - a killed source fails the push; the trial checks the rest
                ok, result["error"] = False, str(exc)[:300]
            seconds = time.perf_counter() - start
            if mode == "kill":
                result["labels_after_kill"] = await engine_labels(urls)
                result["pushed_version"] = str(version)
                pusher.sources = None
                await pusher.push(weights, version + 1)  # rank 0 alone, as the restarted trainer's first push
                result["labels_after_next"] = await engine_labels(urls)
                result["next_version"] = str(version + 1)
                return result
            await sources.done()
            result["owners"].append({"push_s": seconds, "blocked_s": blocked, "ok": ok,
                                     "rank0_bytes": pusher.last_reports[0].bytes,
                                     "bytes": [r.bytes for r in pusher.last_reports]})
        await pusher.close()
        for client in clients:
            await client.close()
        return result

    result = loop.run_until_complete(lead())
    Path(out, "rank0.json").write_text(json.dumps(result))
    os._exit(0)  # a killed peer's group would hold up the teardown


def _start_ranks(world: int, folder: Path, urls: list[str], params: SourcesBenchParams, out: Path, mode: str,
                 kill_after: int = 0) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return [subprocess.Popen([sys.executable, "-m", "pipeline.benchmarks.sync_sources", str(rank), str(world),
                              str(port), str(folder), json.dumps(urls), json.dumps(asdict(params)), str(out), mode,
                              str(kill_after)], env=env, stdout=subprocess.DEVNULL,
                             stderr=open(out / f"rank{rank}.log", "ab"))  # noqa: SIM115 - the child keeps it
            for rank in range(world)]


def _finish(procs: list[subprocess.Popen[bytes]], timeout_s: float, out: Path) -> None:
    try:
        for proc in procs:
            proc.wait(timeout_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if procs[0].returncode != 0:
        raise RuntimeError(f"rank 0 failed: {(out / 'rank0.log').read_text()[-3000:]}")


def run_sources_bench(params: SourcesBenchParams) -> dict[str, Any]:
    """Run the benchmark; returns its JSON-ready result."""
    import torch

    from pipeline.models.tiny import init_tiny_model

    res: dict[str, Any] = {"params": asdict(params), "torch": torch.__version__, "backend": "gloo"}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-sources-") as tmp:
        folder = init_tiny_model("qwen3", Path(tmp) / "model", **_model_shape(params.size_mb))
        engines = [_Engine(folder, "float32", Path(tmp)) for _ in range(params.engines)]
        try:
            urls = [e.url for e in engines]
            out = Path(tmp) / "rounds"
            out.mkdir()
            _finish(_start_ranks(params.sources, folder, urls, params, out, "rounds"), 3600, out)
            rounds = json.loads((out / "rank0.json").read_text())
            others = [json.loads((out / f"rank{r}.json").read_text())["blocked_s"] for r in range(1, params.sources)]
            for i, row in enumerate(rounds["owners"]):
                row["blocked_by_rank_s"] = [row["blocked_s"], *(o[i] for o in others)]
                row["blocked_s"] = max(row["blocked_by_rank_s"])
            res["alone"], res["owners"] = rounds["alone"], rounds["owners"]
            res.update(_summary(rounds))
            if params.kill_trials:
                res["kill_trials"] = _kill_trials(params, folder, urls, Path(tmp))
        finally:
            for engine in engines:
                engine.stop()
    if params.out:
        Path(params.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


def _summary(rounds: dict[str, Any]) -> dict[str, Any]:
    alone, owners = rounds["alone"], rounds["owners"]
    median = statistics.median
    return {
        "alone_push_s": median(r["push_s"] for r in alone),
        "owners_push_s": median(r["push_s"] for r in owners),
        "owners_blocked_s": median(r["blocked_s"] for r in owners),
        "blocked_over_push": median(r["blocked_s"] / r["push_s"] for r in owners),
        "rank0_bytes_alone": alone[0]["rank0_bytes"],
        "rank0_bytes_owners": owners[0]["rank0_bytes"],
        "rank0_bytes_ratio": owners[0]["rank0_bytes"] / alone[0]["rank0_bytes"],
        "owners_ok": all(r["ok"] for r in owners),
    }


def _kill_trials(params: SourcesBenchParams, folder: Path, urls: list[str], tmp: Path) -> dict[str, Any]:
    """SIGKILL rank 1 after a random bucket of its share, ``kill_trials`` times."""
    rng = random.Random(0)
    buckets = max(1, (params.size_mb // 2) // params.bucket_mb)
    trials = []
    for trial in range(params.kill_trials):
        out = tmp / f"kill-{trial}"
        out.mkdir()
        kill_after = rng.randrange(buckets)
        procs = _start_ranks(2, folder, urls, params, out, "kill", kill_after)
        _finish(procs, 600, out)
        row = json.loads((out / "rank0.json").read_text())
        trials.append({
            "kill_after_buckets": kill_after,
            "source_killed": procs[1].returncode == -signal.SIGKILL,
            "new_label_without_every_source": row["pushed_version"] in row["labels_after_kill"],
            "next_push_landed_everywhere": all(v == row["next_version"] for v in row["labels_after_next"]),
        })
        print(f"  kill trial {trial}: {trials[-1]}", file=sys.stderr, flush=True)
    return {
        "trials": trials,
        "killed": sum(t["source_killed"] for t in trials),
        "bad_labels": sum(t["new_label_without_every_source"] for t in trials),
        "next_push_landed": sum(t["next_push_landed_everywhere"] for t in trials),
    }


def summary_lines(res: dict[str, Any]) -> list[str]:
    """Human-readable lines of a result."""
    p = res["params"]
    lines = [f"push from {p['sources']} owners vs rank 0 alone, {p['size_mb']} MB fp32 model, {p['engines']} "
             f"engine(s), gloo, {p['bucket_mb']} MB buckets:",
             f"  rank 0 alone (streamed): push {res['alone_push_s']:.3f} s, trainer blocked for all of it (1.00)",
             f"  every owner: push {res['owners_push_s']:.3f} s, trainer blocked {res['owners_blocked_s']:.3f} s "
             f"(packing its share) = {res['blocked_over_push']:.3f} of the push (goal <= 0.2)",
             f"  bytes rank 0 sent per push: {res['rank0_bytes_owners'] / MB:.1f} MB against "
             f"{res['rank0_bytes_alone'] / MB:.1f} MB alone ({res['rank0_bytes_ratio']:.3f})"]
    kills = res.get("kill_trials")
    if kills:
        n = len(kills["trials"])
        lines.append(f"  source SIGKILLed mid-push: {kills['killed']}/{n} killed, {kills['bad_labels']} engines "
                     f"with the new label, next push landed on every engine {kills['next_push_landed']}/{n}")
    return lines


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]),
               SourcesBenchParams(**json.loads(sys.argv[6])), sys.argv[7], sys.argv[8], int(sys.argv[9]))
