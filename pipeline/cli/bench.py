"""``sluice bench queue|data-plane|rollout|sync|pipeline|gpu|faults|faults-merge|cluster-faults``: each a ratio
against a reference measured in the same run (the fault harnesses count instead)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

from pipeline.cli.common import add_dataclass_args, show


def cmd_bench_queue(args: argparse.Namespace) -> int:
    from dataclasses import fields
    from pathlib import Path

    from pipeline.benchmarks.queue import QueueBenchParams, run_queue_bench
    from pipeline.benchmarks.queue_e2e import QueueE2EParams, run_queue_e2e_bench, summary_lines

    if args.e2e:
        e2e = QueueE2EParams(**{f.name: getattr(args, f.name) for f in fields(QueueE2EParams)})
        res = run_queue_e2e_bench(e2e)
        # The default output is the run benchmarks/README.md quotes: its JSON goes beside the other results.
        results = Path("benchmarks/results")
        if e2e.out == QueueE2EParams.out and results.is_dir():
            (results / "queue-e2e.json").write_text(json.dumps(res, indent=1) + "\n")
        show(args, res, lambda r: print("\n".join(summary_lines(r))))
        return 0
    old = {f.name for f in fields(QueueBenchParams)}
    ignored = [f"--{f.name.replace('_', '-')}" for f in fields(QueueE2EParams)
               if f.name not in old and getattr(args, f.name) != f.default]
    if ignored:
        print(f"warning: ignored without --e2e: {', '.join(ignored)}", file=sys.stderr)
    params = QueueBenchParams(**{f.name: getattr(args, f.name) for f in fields(QueueBenchParams)})
    res = run_queue_bench(params)

    def human(r: dict[str, Any]) -> None:
        print(f"redis {r['redis_version']} appendfsync={r['params']['appendfsync']}, "
              f"{r['sample_bytes'] / 1e3:.0f} kB/sample")
        for k in ("raw", "sluice"):
            print(f"  {k:7s} {r[k]['samples_per_s']:9.0f} samples/s  {r[k]['MB_per_s']:8.1f} MB/s")
        print(f"  ratio sluice/raw = {r['ratio']:.3f} (goal {r['goal']})")
        c = r["codec_us_per_sample"]
        print(f"  codec: encode {c['encode']:.1f} us/sample, decode {c['decode']:.1f} us/sample")

    show(args, res, human)
    return 0


def cmd_bench_data_plane(args: argparse.Namespace) -> int:
    from dataclasses import fields
    from pathlib import Path

    from pipeline.benchmarks.data_plane import DataPlaneParams, run_data_plane_bench, summary_lines

    params = DataPlaneParams(**{f.name: getattr(args, f.name) for f in fields(DataPlaneParams)})
    res = run_data_plane_bench(params)
    # The default output is the run benchmarks/README.md quotes: its JSON goes beside the other results.
    results = Path("benchmarks/results")
    if params.out == DataPlaneParams.out and results.is_dir():
        (results / "data-plane.json").write_text(json.dumps(res, indent=1) + "\n")
    show(args, res, lambda r: print("\n".join(summary_lines(r))))
    return 0


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from pipeline.benchmarks.rollout import RolloutBenchParams, run_rollout_bench

    params = RolloutBenchParams(**{f.name: getattr(args, f.name) for f in fields(RolloutBenchParams)})
    res = run_rollout_bench(params)
    show(args, res, lambda r: print(json.dumps(r, indent=1, default=str)))
    return 0


def _summarized(module: str, params: str, run: str) -> Callable[[argparse.Namespace], int]:
    """The command of a benchmark whose module has a params dataclass, a run function and ``summary_lines``."""

    def cmd(args: argparse.Namespace) -> int:
        from dataclasses import fields

        bench = importlib.import_module(module)
        cls = getattr(bench, params)
        res = getattr(bench, run)(cls(**{f.name: getattr(args, f.name) for f in fields(cls)}))
        show(args, res, lambda r: print("\n".join(bench.summary_lines(r))))
        return 0

    return cmd


def cmd_bench_pipeline(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from pipeline.benchmarks.pipeline import PipelineBenchParams, run_pipeline_bench

    params = PipelineBenchParams(**{f.name: getattr(args, f.name) for f in fields(PipelineBenchParams)})
    res = run_pipeline_bench(params)

    def human(r: dict[str, Any]) -> None:
        for mode in ("sync", "async"):
            m = r[mode]
            print(f"  {mode:5s} {m['samples_per_s']:7.1f} samples/s  wait {m['t_wait']:.3f} s  train+push "
                  f"{m['t_train']:.3f} s  idle {m['idle_fraction']:.1%}  reward {m['reward_mean']:.3f}")
        print(f"  async/sync = {r['ratio']:.3f}; bound (t_gen + t_train) / max = {r['bound']:.3f}; "
              f"ratio/bound = {r['ratio_of_bound']:.3f} (goal >= 0.9)")
        print(f"  trainer idle in async {r['idle_fraction']:.1%} (goal <= 5%); first trained step "
              f"{r['first_step_s']:.1f} s after sluice run (goal <= 60 s)")

    show(args, res, human)
    return 0


def cmd_bench_gpu(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from pipeline.benchmarks.gpu_check import GpuCheckParams, run_gpu_check, summary_lines

    res = run_gpu_check(GpuCheckParams(**{f.name: getattr(args, f.name) for f in fields(GpuCheckParams)}))
    show(args, res, lambda r: print("\n".join(summary_lines(r))))
    return 1 if res["failed"] else 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``sluice`` parser's subcommands."""
    bench = sub.add_parser("bench", help="benchmarks, each a ratio against a reference measured in the same run")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    p = bsub.add_parser("queue", help="SampleQueue put+read+ack vs raw redis-py streams")
    p.add_argument("--json", action="store_true")
    p.add_argument("--e2e", action="store_true", help="a producer and a trainer-side consumer process at once, "
                   "compact and plain routing against raw redis-py (the --e2e-only flags are ignored without it)")
    add_dataclass_args(p, "pipeline.benchmarks.queue_e2e", "QueueE2EParams")
    p.set_defaults(func=cmd_bench_queue)
    p = bsub.add_parser("data-plane", help="the data plane's goals in one run: a cluster with data-parallel readers "
                                           "against one node, rank 0's drain and the evaluator's CPU against the "
                                           "paths before headers")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.data_plane", "DataPlaneParams")
    p.set_defaults(func=cmd_bench_data_plane)
    p = bsub.add_parser("rollout", help="cost of routing capture and encoding as a fraction of rollout time")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.rollout", "RolloutBenchParams")
    p.set_defaults(func=cmd_bench_rollout)
    p = bsub.add_parser("sync", help="the weight push's GB/s against one bare broadcast of the same bytes")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.sync", "SyncBenchParams")
    p.set_defaults(func=_summarized("pipeline.benchmarks.sync", "SyncBenchParams", "run_sync_bench"))
    p = bsub.add_parser("sync-sources", help="the push from every owner against rank 0 pushing alone: the trainer's "
                                             "blocked time, rank 0's bytes, sources killed mid-push")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.sync_sources", "SourcesBenchParams")
    p.set_defaults(func=_summarized("pipeline.benchmarks.sync_sources", "SourcesBenchParams", "run_sources_bench"))
    p = bsub.add_parser("export-bytes", help="bytes each trainer rank sends and receives to export one push, owners "
                                             "against rank 0, at several EP sizes")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.export_bytes", "ExportBytesParams")
    p.set_defaults(func=_summarized("pipeline.benchmarks.export_bytes", "ExportBytesParams", "run_export_bytes"))
    p = bsub.add_parser("lora", help="LoRA against full fine-tuning of one recipe's model, in one run: step time, "
                                     "optimizer state, trainable parameters and push bytes")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.lora", "LoRABenchParams")
    p.set_defaults(func=_summarized("pipeline.benchmarks.lora", "LoRABenchParams", "run_lora_bench"))
    p = bsub.add_parser("archive", help="the archive's lag behind a producer with one archiver process and with two "
                                        "(queue.archive.processes), in one run")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.archive", "ArchiveBenchParams")
    p.set_defaults(func=_summarized("pipeline.benchmarks.archive", "ArchiveBenchParams", "run_archive_bench"))
    p = bsub.add_parser("pipeline", help="samples trained per second, async vs sync on one recipe, against the "
                                         "perfect-overlap bound")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.pipeline", "PipelineBenchParams")
    p.set_defaults(func=cmd_bench_pipeline)
    p = bsub.add_parser("gpu", help="trainer step time and MFU, the memory plan against measured memory, R3 and the "
                                    "engine's k3, each part to its own JSON (tiny models with --device cpu)")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.gpu_check", "GpuCheckParams")
    p.set_defaults(func=cmd_bench_gpu)
    p = bsub.add_parser("faults", help="SIGKILL parts of a live run at random moments; check nothing lost or "
                                       "trained twice")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.faults", "FaultsBenchParams")
    p.set_defaults(func=lambda a: __import__("pipeline.benchmarks.faults", fromlist=["cmd"]).cmd(a))
    p = bsub.add_parser("faults-merge", help="fold the faults.json of `sluice bench faults` invocations into one "
                                             "record, its summaries recomputed from the trials")
    p.add_argument("runs", nargs="+", help="--out folders of `sluice bench faults` runs (or their faults.json)")
    p.add_argument("--into", default="benchmarks/results/faults.json", help="the record to update")
    p.set_defaults(func=lambda a: __import__("pipeline.benchmarks.fault_merge", fromlist=["cmd"]).cmd(a))
    p = bsub.add_parser("cluster-faults", help="one Redis Cluster fault per trial (the trimmer between its moves, a "
                                               "primary killed, a failover) under the real queue, drain and ledger; "
                                               "check nothing lost, trained twice or left behind")
    p.add_argument("--json", action="store_true")
    add_dataclass_args(p, "pipeline.benchmarks.cluster_faults", "ClusterFaultsParams")
    p.set_defaults(func=lambda a: __import__("pipeline.benchmarks.cluster_faults", fromlist=["cmd"]).cmd(a))
