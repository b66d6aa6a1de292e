"""The ``sluice`` command. Thin: parse, defer heavy imports to the subcommand that needs them, call into the library."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.errors import SluiceError


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", help="run folder (holds run.json and the embedded Redis)")
    p.add_argument("--redis", metavar="URL", help="redis://, rediss:// or unix:// URL of the run's server")
    p.add_argument("--run", help="run name (with --redis)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _open(args: argparse.Namespace) -> Any:
    from pipeline.queue.rundir import open_run

    return open_run(run_dir=args.run_dir, redis_url=args.redis, run=args.run)


def _print(args: argparse.Namespace, obj: Any, human: Callable[[Any], None]) -> None:
    if args.json:
        print(json.dumps(obj, default=str))
    else:
        human(obj)


def cmd_queue_stats(args: argparse.Namespace) -> int:
    from pipeline.queue.inspect import stats

    handle = _open(args)
    try:
        st = stats(handle.queue)
    finally:
        handle.close(stop_server=True)

    def human(st: dict[str, Any]) -> None:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        console.print(f"run [bold]{st['run']}[/]  length {st['length']}  produced {st['produced']}  "
                      f"dead-letter {st['deadletter']}  policy_version {st['policy_version']}")
        t = Table("group", "consumers", "pending", "lag", "last delivered")
        for g in st["groups"]:
            t.add_row(g["name"], str(g["consumers"]), str(g["pending"]), str(g["lag"]), g["last_delivered_id"])
        console.print(t)

    _print(args, st, human)
    return 0


def cmd_queue_tail(args: argparse.Namespace) -> int:
    from pipeline.queue.inspect import tail

    handle = _open(args)
    try:
        for rec in tail(handle.queue, count=args.count, follow=args.follow):
            if not args.json:
                rec = {k: v for k, v in rec.items() if k not in ("prompt_ids", "rollout_logprobs", "token_versions",
                                                                  "loss_mask")}
            print(json.dumps(rec, default=str), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        handle.close(stop_server=True)
    return 0


def cmd_queue_export(args: argparse.Namespace) -> int:
    from pipeline.queue.inspect import export

    handle = _open(args)
    start, _, end = (args.range or "-:+").partition(":")
    try:
        segs = export(handle.queue, args.to, start or "-", end or "+")
    finally:
        handle.close(stop_server=True)
    out = {"folder": args.to, "segments": len(segs), "samples": sum(s.samples for s in segs),
           "entries": sum(s.entries for s in segs)}
    _print(args, out, lambda o: print(f"wrote {o['samples']} samples ({o['entries']} entries) in "
                                      f"{o['segments']} segments to {o['folder']}"))
    return 0


def cmd_queue_audit(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from pipeline.queue.inspect import audit

    handle = _open(args)
    try:
        rep = asdict(audit(handle.queue, with_samples=args.samples))
    finally:
        handle.close(stop_server=True)

    def human(r: dict[str, Any]) -> None:
        print(f"run {r['run']}: produced {r['entries_produced']} entries; in stream {r['entries_in_stream']} "
              f"({r['samples_in_stream']} samples), trimmed {r['entries_trimmed']}, undecodable "
              f"{r['undecodable_in_stream']}, dead-lettered {r['deadlettered']}, duplicate sample ids "
              f"{r['duplicate_sample_ids']}")
        for g, c in r["groups"].items():
            print(f"  {g}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))

    _print(args, rep, human)
    return 0


def cmd_bench_queue(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from pipeline.benchmarks.queue import QueueBenchParams, run_queue_bench

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

    _print(args, res, human)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.demo import run_demo

    run_demo(Path(args.run_dir), groups=args.groups)
    return 0


def _add_dataclass_args(p: argparse.ArgumentParser, module: str, name: str) -> None:
    """One --flag per field of a (light) parameter dataclass, so defaults live in one place."""
    import dataclasses
    import importlib

    cls = getattr(importlib.import_module(module), name)
    for f in dataclasses.fields(cls):
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), default=f.default,
                       help=f"(default {f.default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Asynchronous RL post-training around a durable queue.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="the queue end to end on this machine (producer, staleness, archive)")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--groups", type=int, default=64)
    p.set_defaults(func=cmd_demo)

    queue = sub.add_parser("queue", help="look into a run's queue").add_subparsers(dest="queue_cmd", required=True)
    p = queue.add_parser("stats", help="length, groups with pending and lag, dead letters, policy version")
    _add_run_args(p)
    p.set_defaults(func=cmd_queue_stats)
    p = queue.add_parser("tail", help="the newest samples as JSON lines")
    _add_run_args(p)
    p.add_argument("-n", "--count", type=int, default=10)
    p.add_argument("-f", "--follow", action="store_true")
    p.set_defaults(func=cmd_queue_tail)
    p = queue.add_parser("export", help="write the stream as Parquet segments")
    _add_run_args(p)
    p.add_argument("--to", required=True, help="output folder")
    p.add_argument("--range", help="stream ids A:B (inclusive; either side may be empty)")
    p.set_defaults(func=cmd_queue_export)
    p = queue.add_parser("audit", help="every sample's fate per consumer group")
    _add_run_args(p)
    p.add_argument("--samples", action="store_true", help="include one record per sample")
    p.set_defaults(func=cmd_queue_audit)

    bench = sub.add_parser("bench", help="benchmarks, each a ratio against a reference measured in the same run")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    p = bsub.add_parser("queue", help="SampleQueue put+read+ack vs raw redis-py streams")
    p.add_argument("--json", action="store_true")
    _add_dataclass_args(p, "pipeline.benchmarks.queue", "QueueBenchParams")
    p.set_defaults(func=cmd_bench_queue)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except SluiceError as e:
        print(f"sluice: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
