"""``sluice bench export-bytes``: what each trainer rank sends and receives to export one push, owners against rank 0.

For each expert-parallel size, that many gloo processes build the CPU recipe's model (the tiny Qwen3-MoE, real
megatron-core, TP 1, EP = world) and export it twice, counting every byte a gather or all-gather delivers to each
rank:

- **owners** (``sync.sources = "owners"``): each rank exports the tensors it owns (``OwnedExport``);
- **rank 0** (``sync.sources = "rank0"``): the whole model to rank 0 (``iter_hf_weights``), shards gathered to it
  alone.

The export before owners existed all-gathered the experts on every rank: each rank received (EP - 1) / EP of the
expert bytes, and rank 0 then sent the whole model. That figure is arithmetic on the same model, reported beside the
measured ones. Bytes through rank 0 = what it receives to export plus what it sends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.net import free_port


@dataclass
class ExportBytesParams:
    """What one ``sluice bench export-bytes`` measures."""

    ep: str = "2,4"
    """Expert-parallel sizes (one gloo process per rank), comma-separated."""
    out: str = ""
    """Also write the JSON result to this file."""


class ReceivedBytes:
    """Counts the bytes this rank receives by gather or all-gather (a rank's own part is not received)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.bytes = 0
        gather, all_gather = dist.gather, dist.all_gather

        def counted_gather(tensor: Any, gather_list: Any = None, dst: int = 0, group: Any = None, **kw: Any) -> Any:
            if gather_list is not None:
                self.bytes += sum(t.numel() * t.element_size() for t in gather_list[1:])
            return gather(tensor, gather_list, dst=dst, group=group, **kw)

        def counted_all_gather(tensor_list: Any, tensor: Any, group: Any = None, **kw: Any) -> Any:
            self.bytes += sum(t.numel() * t.element_size() for t in tensor_list[1:])
            return all_gather(tensor_list, tensor, group=group, **kw)

        dist.gather, dist.all_gather = counted_gather, counted_all_gather

    def take(self) -> int:
        taken, self.bytes = self.bytes, 0
        return taken


def _rank_main(rank: int, world: int, port: int, folder: str, out: str) -> None:
    """One rank (``python -m pipeline.benchmarks.export_bytes ...``)."""
    import torch.distributed as dist

    from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig
    from pipeline.consumers.megatron.convert import MEGATRON_EXPERT, iter_hf_weights, load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel
    from pipeline.consumers.megatron.owners import OwnedExport

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    model_cfg = ModelConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()), dtype="float32")
    parallel = ParallelConfig(tp=1, ep=world, device="cpu")
    init_parallel(parallel, seed=0)
    model = build_gpt_model(model_cfg, parallel, r3=False)
    load_hf_into_megatron(model, folder, model_cfg)
    received = ReceivedBytes()
    exporter = OwnedExport(model, model_cfg)
    received.take()
    owned_sent = sum(t.numel() * t.element_size() for _, t in exporter())
    owned_received = received.take()
    root_sent = sum(t.numel() * t.element_size() for _, t in iter_hf_weights(model, model_cfg))
    root_received = received.take()
    local_experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                        if MEGATRON_EXPERT.match(n))
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "owners_sent": owned_sent, "owners_received": owned_received, "rank0_sent": root_sent,
        "rank0_received": root_received, "local_expert_bytes": local_experts}))
    dist.destroy_process_group()


def run_export_bytes(params: ExportBytesParams) -> dict[str, Any]:
    """Run the benchmark; returns its JSON-ready result."""
    from pipeline.models.tiny import init_tiny_model

    res: dict[str, Any] = {"params": asdict(params), "model": "the CPU recipe's tiny qwen3-moe, fp32", "ep": {}}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-export-") as tmp:
        folder = init_tiny_model("qwen3-moe", Path(tmp) / "model", seed=0)
        for world in [int(e) for e in params.ep.split(",") if e.strip()]:
            out = Path(tmp) / f"ep{world}"
            out.mkdir()
            port = free_port()
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            procs = [subprocess.Popen([sys.executable, "-m", "pipeline.benchmarks.export_bytes", str(rank), str(world),
                                       str(port), str(folder), str(out)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE) for rank in range(world)]
            errors = [p.communicate(timeout=600)[1] for p in procs]
            for rank, (p, err) in enumerate(zip(procs, errors, strict=True)):
                if p.returncode != 0:
                    raise RuntimeError(f"rank {rank} failed: {err.decode(errors='replace')[-3000:]}")
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
            model_bytes = ranks[0]["rank0_sent"]
            experts = sum(r["local_expert_bytes"] for r in ranks)
            before_rank0 = experts * (world - 1) // world + model_bytes
            owners_rank0 = ranks[0]["owners_received"] + ranks[0]["owners_sent"]
            res["ep"][str(world)] = {
                "model_bytes": model_bytes,
                "expert_bytes": experts,
                "ranks": ranks,
                "rank0_through_before": before_rank0,
                "rank0_through_rank0_mode": ranks[0]["rank0_received"] + ranks[0]["rank0_sent"],
                "rank0_through_owners": owners_rank0,
                "owners_over_before": owners_rank0 / before_rank0,
                "received_by_non_senders_owners": sum(max(0, r["owners_received"] - r["owners_sent"])
                                                      for r in ranks),
                "received_by_non_senders_before": experts * (world - 1) // world * (world - 1),
                "owners_share_max_over_mean": max(r["owners_sent"] for r in ranks) * world / model_bytes,
            }
    if params.out:
        Path(params.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


def summary_lines(res: dict[str, Any]) -> list[str]:
    """Human-readable lines of a result."""
    lines = [f"bytes to export one push, {res['model']}:"]
    for ep, r in res["ep"].items():
        mb = 1 << 20
        lines.append(
            f"  EP {ep}: through rank 0 {r['rank0_through_owners'] / mb:.2f} MB with owners, "
            f"{r['rank0_through_rank0_mode'] / mb:.2f} MB with rank 0 alone, {r['rank0_through_before'] / mb:.2f} MB "
            f"before (all-gathers) = {r['owners_over_before']:.3f}; bytes received by ranks that do not send them "
            f"{r['received_by_non_senders_owners']} (before {r['received_by_non_senders_before'] / mb:.2f} MB); "
            f"largest share / mean {r['owners_share_max_over_mean']:.3f}")
    return lines


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
