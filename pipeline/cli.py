"""The ``sluice`` command. Thin: parse, defer heavy imports to the subcommand that needs them, call into the library."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.errors import SluiceError
from pipeline.models.tiny import TINY_ARCHS


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
        if handle.run_dir is not None and (handle.run_dir / "ledger").is_dir():
            from pipeline.consumers.audit import audit_trainer

            rep["trainer_ledger"] = asdict(audit_trainer(handle.queue, handle.run_dir))
    finally:
        handle.close(stop_server=True)

    def human(r: dict[str, Any]) -> None:
        print(f"run {r['run']}: produced {r['entries_produced']} entries; in stream {r['entries_in_stream']} "
              f"({r['samples_in_stream']} samples), trimmed {r['entries_trimmed']}, undecodable "
              f"{r['undecodable_in_stream']}, dead-lettered {r['deadlettered']}, duplicate sample ids "
              f"{r['duplicate_sample_ids']}")
        for g, c in r["groups"].items():
            print(f"  {g}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        t = r.get("trainer_ledger")
        if t:
            print(f"  trainer ledger (committed step {t['committed_step']}): trained {t['trained']}, stale "
                  f"{t['stale']}, invalid {t['invalid']}, pending {t['pending']}, undelivered {t['undelivered']}, "
                  f"duplicates {t['duplicates']}, lost {t['lost']}")

    _print(args, rep, human)
    return 0


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
        _print(args, res, lambda r: print("\n".join(summary_lines(r))))
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

    _print(args, res, human)
    return 0


def _load(args: argparse.Namespace) -> Any:
    from pipeline.config import load_config

    overrides = list(args.set or [])
    if getattr(args, "run_dir", None):
        overrides.append(f"run.run_dir={json.dumps(str(args.run_dir))}")
    if getattr(args, "steps", None):
        overrides.append(f"trainer.steps={int(args.steps)}")
    if getattr(args, "ray_address", None):
        overrides.append(f"ray.address={json.dumps(str(args.ray_address))}")
    return load_config(args.recipe, overrides)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if args.dry_run:
        from pipeline.config import dump_config
        from pipeline.consumers.megatron.plan import dry_run_plan

        print(dump_config(cfg))
        print(dry_run_plan(cfg))  # raises, naming why, for a layout that cannot run or cannot fit
        return 0
    from pipeline.launch import run
    from pipeline.metrics import check_metrics_config

    check_metrics_config(cfg.metrics)  # before anything starts: a tool the recipe asks for must be installed
    return run(cfg)


def cmd_replay(args: argparse.Namespace) -> int:
    from pathlib import Path

    cfg = _load(args)
    from pipeline.consumers.replay import parse_range
    from pipeline.consumers.train_main import run_replay
    from pipeline.launch import model_folder

    id_range = parse_range(args.range)
    model_dir = model_folder(cfg)
    if not (model_dir / "config.json").exists():
        hint = ("--set model.path=RUN_DIR/warmstart/model --set warmstart.enabled=false" if cfg.warmstart.enabled
                else "--set model.path=RUN_DIR/model")
        print(f"sluice: error: no model at {model_dir}; set model.path to the run's starting model "
              f"(e.g. {hint})", file=sys.stderr)
        return 2
    model_out = run_replay(cfg, model_dir, Path(args.source), id_range, Path(cfg.run.run_dir))
    print(json.dumps({"model": str(model_out), "metrics": str(Path(cfg.run.run_dir) / "metrics" / "trainer.jsonl")}))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from pathlib import Path

    cfg = _load(args)
    from pipeline.consumers.sft import run_warmstart
    from pipeline.consumers.sft_config import format_summary, warmstart_model_dir
    from pipeline.launch import ensure_base_model

    run_dir = Path(cfg.run.run_dir)
    summary = run_warmstart(cfg, run_dir, ensure_base_model(cfg))
    print(format_summary(summary))
    print(f"model: {warmstart_model_dir(run_dir)}  (metrics: {run_dir / 'metrics' / 'warmstart.jsonl'})")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    if args.heldout or args.checkpoints:
        return _eval_heldout(args)
    from pipeline.consumers.evaluator import run_eval

    report = run_eval(run_dir=args.run_dir, redis_url=args.redis, run=args.run, group=args.group,
                      start=args.start, until_idle_s=args.until_idle, reset=args.reset)
    _print(args, asdict(report), lambda _: print(report.format_table()))
    return 0


def _eval_heldout(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.consumers.heldout import evaluate_run, read_heldout
    from pipeline.launch import CONFIG_FILE, load_run_config
    from pipeline.report import format_heldout

    if not args.run_dir:
        raise SluiceError("--heldout evaluates a run folder's weight snapshots; give --run-dir DIR")
    run_dir = Path(args.run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise SluiceError(f"{run_dir} has no {CONFIG_FILE}: not the folder of a `sluice run`")
    new = evaluate_run(run_dir, load_run_config(run_dir), checkpoints=args.checkpoints)
    metrics = run_dir / "eval" / "metrics.jsonl"
    _print(args, {"evaluated": new, "all": list(read_heldout(metrics).values())},
           lambda _: print(f"evaluated {len(new)} new version(s) {[d['version'] for d in new]}\n"
                           + format_heldout(metrics)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.export import export_run

    res = export_run(Path(args.run_dir), Path(args.to), args.step)
    out = {"folder": str(res.folder), "checkpoint": res.checkpoint.name, "step": res.step,
           "policy_version": res.policy_version}
    _print(args, out, lambda o: print(f"exported {o['checkpoint']} (step {o['step']}, policy version "
                                      f"{o['policy_version']}) to {o['folder']}: an HF folder; "
                                      "AutoModelForCausalLM.from_pretrained loads it"))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.plots import write_plots

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics").is_dir() and not (run_dir / "eval").is_dir():
        raise SluiceError(f"{run_dir} has no metrics/ or eval/ folder: not the folder of a `sluice run` (or it has not "
                          "trained a step yet)")
    out = {name: str(path) for name, path in write_plots(run_dir).items()}
    _print(args, out, lambda o: print("\n".join(o.values())))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from rich.console import Console

    from pipeline.launch import CONFIG_FILE, load_run_config
    from pipeline.live import collect, panel

    run_dir = Path(args.run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise SluiceError(f"{run_dir} has no {CONFIG_FILE}: not the folder of a `sluice run`")
    total = load_run_config(run_dir).trainer.steps
    handle = _open(args)
    console = Console()
    try:
        if args.json:
            print(json.dumps(collect(run_dir, handle.queue, total).to_json()))
        elif not args.watch:
            console.print(panel(collect(run_dir, handle.queue, total)))
        else:
            from rich.live import Live

            with Live(panel(collect(run_dir, handle.queue, total)), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(1.0)
                    live.update(panel(collect(run_dir, handle.queue, total)), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        handle.close(stop_server=True)
    return 0


def cmd_engine_serve(args: argparse.Namespace) -> int:
    from pipeline.producers.cpu_engine.__main__ import main as engine_main

    engine_main([args.model_dir, *args.engine_args])
    return 0


def cmd_model_init_tiny(args: argparse.Namespace) -> int:
    from pipeline.models.tiny import main as tiny_main

    tiny_main(["--arch", args.arch, "--out", args.out, "--seed", str(args.seed),
               *(x for kv in (args.set or []) for x in ("--set", kv))])
    return 0


def _add_dataclass_args(p: argparse.ArgumentParser, module: str, name: str) -> None:
    """One --flag per field of a (light) parameter dataclass, so defaults live in one place."""
    import dataclasses
    import importlib

    cls = getattr(importlib.import_module(module), name)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, dest=f.name, type=type(f.default), default=f.default, help=f"(default {f.default})")


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from pipeline.benchmarks.rollout import RolloutBenchParams, run_rollout_bench

    params = RolloutBenchParams(**{f.name: getattr(args, f.name) for f in fields(RolloutBenchParams)})
    res = run_rollout_bench(params)
    _print(args, res, lambda r: print(json.dumps(r, indent=1, default=str)))
    return 0


def cmd_bench_sync(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from pipeline.benchmarks.sync import SyncBenchParams, run_sync_bench, summary_lines

    params = SyncBenchParams(**{f.name: getattr(args, f.name) for f in fields(SyncBenchParams)})
    res = run_sync_bench(params)
    _print(args, res, lambda r: print("\n".join(summary_lines(r))))
    return 0


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

    _print(args, res, human)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Asynchronous RL post-training around a durable queue.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="the main job: engines, producers, trainer, archiver, evaluator")
    p.add_argument("recipe", help="a recipe TOML (see recipes/)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)")
    p.add_argument("--run-dir", help="run folder (overrides run.run_dir)")
    p.add_argument("--steps", type=int, help="trainer steps (overrides trainer.steps)")
    p.add_argument("--ray-address", help="run on this Ray cluster (\"auto\", HOST:PORT; overrides ray.address); "
                   "by default the run starts a private Ray instance on this machine")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("replay", help="train on stored rollouts (an archive or a run's stream), no generation")
    p.add_argument("recipe", help="a recipe TOML: model, staleness, trainer and loss settings")
    p.add_argument("--from", dest="source", required=True, metavar="ARCHIVE|RUN_DIR",
                   help="a Parquet archive folder, or a run folder whose stream to read")
    p.add_argument("--range", help="stream ids A:B (inclusive; either side may be empty)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)")
    p.add_argument("--run-dir", help="output folder for checkpoints, ledger and metrics (overrides run.run_dir)")
    p.add_argument("--steps", type=int, help="most trainer steps (overrides trainer.steps)")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("sft", help="only the recipe's [warmstart]: supervised training into RUN_DIR/warmstart "
                       "(always from the base model; a later `sluice run` with warmstart.enabled reuses it)")
    p.add_argument("recipe", help="a recipe TOML: model, prompts and [warmstart] settings")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)")
    p.add_argument("--run-dir", help="run folder (overrides run.run_dir)")
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("eval", help="attach an evaluator consumer to a live or finished run")
    _add_run_args(p)
    p.add_argument("--group", default="eval")
    p.add_argument("--start", default="0", help='"0" from the oldest kept entry, "$" only new ones, or an id')
    p.add_argument("--until-idle", type=float, default=None, metavar="SECONDS",
                   help="exit after this long without new entries (default: run until interrupted)")
    p.add_argument("--reset", action="store_true", help="drop the group and its counters and start over")
    p.add_argument("--heldout", action="store_true",
                   help="generate on the held-out split with every weight snapshot not yet evaluated, then exit")
    p.add_argument("--checkpoints", action="store_true",
                   help="with --heldout: also evaluate the run's Megatron checkpoints (converted to HF here)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="a run's Megatron checkpoint as an HF safetensors folder (config, tokenizer)")
    p.add_argument("--run-dir", required=True, help="the run folder")
    p.add_argument("--step", type=int, help="the checkpoint of this trainer step (default: the newest)")
    p.add_argument("--to", required=True, help="output folder (must not exist)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("status", help="the live view's panel for a run started elsewhere (Redis and metrics files)")
    p.add_argument("--run-dir", required=True, help="the run folder")
    p.add_argument("--redis", metavar="URL", help="the run's Redis, when it is not the folder's embedded one")
    p.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status, run=None)

    p = sub.add_parser("plot", help="PNG plots of a run, live or finished, into RUN_DIR/plots")
    p.add_argument("--run-dir", required=True, help="the run folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("engine", help="rollout engines").add_subparsers(dest="engine_cmd", required=True)
    p = p.add_parser("serve", help="the CPU engine (SGLang's HTTP protocol) for an HF model folder")
    p.add_argument("model_dir")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="--port, --dtype, ... (see --help of the engine)")
    p.set_defaults(func=cmd_engine_serve)

    p = sub.add_parser("model", help="local models").add_subparsers(dest="model_cmd", required=True)
    p = p.add_parser("init-tiny", help="write a tiny model (Qwen3, Qwen3-MoE, DeepSeek-V3) and tokenizer (no hub)")
    p.add_argument("--arch", choices=TINY_ARCHS, default="qwen3-moe")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="HF config override (repeatable)")
    p.set_defaults(func=cmd_model_init_tiny)

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
    p.add_argument("--e2e", action="store_true", help="a producer and a trainer-side consumer process at once, "
                   "compact and plain routing against raw redis-py (the --e2e-only flags are ignored without it)")
    _add_dataclass_args(p, "pipeline.benchmarks.queue_e2e", "QueueE2EParams")
    p.set_defaults(func=cmd_bench_queue)
    p = bsub.add_parser("rollout", help="cost of routing capture and encoding as a fraction of rollout time")
    p.add_argument("--json", action="store_true")
    _add_dataclass_args(p, "pipeline.benchmarks.rollout", "RolloutBenchParams")
    p.set_defaults(func=cmd_bench_rollout)
    p = bsub.add_parser("sync", help="the weight push's GB/s against one bare broadcast of the same bytes")
    p.add_argument("--json", action="store_true")
    _add_dataclass_args(p, "pipeline.benchmarks.sync", "SyncBenchParams")
    p.set_defaults(func=cmd_bench_sync)
    p = bsub.add_parser("pipeline", help="samples trained per second, async vs sync on one recipe, against the "
                                         "perfect-overlap bound")
    p.add_argument("--json", action="store_true")
    _add_dataclass_args(p, "pipeline.benchmarks.pipeline", "PipelineBenchParams")
    p.set_defaults(func=cmd_bench_pipeline)
    p = bsub.add_parser("faults", help="SIGKILL parts of a live run at random moments; check nothing lost or "
                                       "trained twice")
    p.add_argument("--json", action="store_true")
    _add_dataclass_args(p, "pipeline.benchmarks.faults", "FaultsBenchParams")
    p.set_defaults(func=lambda a: __import__("pipeline.benchmarks.faults", fromlist=["cmd"]).cmd(a))
    p = bsub.add_parser("faults-merge", help="fold the faults.json of `sluice bench faults` invocations into one "
                                             "record, its summaries recomputed from the trials")
    p.add_argument("runs", nargs="+", help="--out folders of `sluice bench faults` runs (or their faults.json)")
    p.add_argument("--into", default="benchmarks/results/faults.json", help="the record to update")
    p.set_defaults(func=lambda a: __import__("pipeline.benchmarks.fault_merge", fromlist=["cmd"]).cmd(a))
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
