"""``sluice eval`` (the stream evaluator, held-out generation) and ``sluice export`` (a checkpoint as an HF folder)."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.cli.common import add_run_args, show
from pipeline.errors import SluiceError


def cmd_eval(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    if args.heldout or args.checkpoints:
        return _eval_heldout(args)
    from pipeline.consumers.evaluator import run_eval

    report = run_eval(run_dir=args.run_dir, redis_url=args.redis, run=args.run, group=args.group,
                      start=args.start, until_idle_s=args.until_idle, reset=args.reset)
    show(args, asdict(report), lambda _: print(report.format_table()))
    return 0


def _eval_heldout(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.heldout.evaluate import evaluate_run
    from pipeline.observe.report import format_heldout
    from pipeline.rundir import CONFIG_FILE, config_path, eval_metrics_path, load_run_config, read_heldout

    if not args.run_dir:
        raise SluiceError("--heldout evaluates a run folder's weight snapshots; give --run-dir DIR")
    run_dir = Path(args.run_dir)
    if not config_path(run_dir).is_file():
        raise SluiceError(f"{run_dir} has no {CONFIG_FILE}: not the folder of a `sluice run`")
    cfg = load_run_config(run_dir)
    new = evaluate_run(run_dir, evaluation=cfg.eval, producer=cfg.producer, prompts=cfg.prompts, model=cfg.model,
                       engine=cfg.engine, run=cfg.run, plugins=cfg.plugins, metrics=cfg.metrics, trainer=cfg.trainer,
                       checkpoints=args.checkpoints)
    metrics = eval_metrics_path(run_dir)
    show(args, {"evaluated": new, "all": list(read_heldout(metrics).values())},
           lambda _: print(f"evaluated {len(new)} new version(s) {[d['version'] for d in new]}\n"
                           + format_heldout(metrics)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.consumers.export import export_run

    res = export_run(Path(args.run_dir), Path(args.to), args.step, adapter=args.adapter)
    out = {"folder": str(res.folder), "checkpoint": res.checkpoint.name, "step": res.step,
           "policy_version": res.policy_version}
    show(args, out, lambda o: print(f"exported {o['checkpoint']} (step {o['step']}, policy version "
                                      f"{o['policy_version']}) to {o['folder']}: "
                                      + ("a PEFT LoRA folder; peft.PeftModel.from_pretrained loads it onto the base"
                                         if args.adapter else
                                         "an HF folder; AutoModelForCausalLM.from_pretrained loads it")))
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``sluice`` parser's subcommands."""
    p = sub.add_parser("eval", help="attach an evaluator consumer to a live or finished run")
    add_run_args(p)
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
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters as a PEFT folder instead of the merged model")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_export)
