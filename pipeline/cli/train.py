"""``sluice run``, ``sluice replay`` and ``sluice sft``: the jobs that train."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipeline.cli.common import load_recipe


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_recipe(args)
    if args.dry_run:
        from pipeline.config import dump_config
        from pipeline.consumers.megatron.plan import dry_run_plan

        print(dump_config(cfg))
        # raises, naming why, for a layout that cannot run or cannot fit
        print(dry_run_plan(cfg.trainer, cfg.model, cfg.hardware))
        return 0
    from pipeline.launch.launcher import run
    from pipeline.metrics import check_metrics_config

    check_metrics_config(cfg.metrics)  # before anything starts: a tool the recipe asks for must be installed
    return run(cfg)


def cmd_replay(args: argparse.Namespace) -> int:
    from pathlib import Path

    cfg = load_recipe(args)
    from pipeline.consumers.trainer.main import run_replay
    from pipeline.consumers.trainer.replay import parse_range
    from pipeline.rundir import model_folder, trainer_metrics_path

    id_range = parse_range(args.range)
    model_dir = model_folder(cfg)
    if not (model_dir / "config.json").exists():
        hint = ("--set model.path=RUN_DIR/warmstart/model --set warmstart.enabled=false" if cfg.warmstart.enabled
                else "--set model.path=RUN_DIR/model")
        print(f"sluice: error: no model at {model_dir}; set model.path to the run's starting model "
              f"(e.g. {hint})", file=sys.stderr)
        return 2
    model_out = run_replay(model_dir, Path(args.source), id_range, Path(cfg.run.run_dir), run=cfg.run, model=cfg.model,
                           trainer=cfg.trainer, staleness=cfg.staleness, filters=cfg.filters, metrics=cfg.metrics,
                           hooks=cfg.hooks)
    print(json.dumps({"model": str(model_out), "metrics": str(trainer_metrics_path(cfg.run.run_dir))}))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from pathlib import Path

    cfg = load_recipe(args)
    from pipeline.consumers.warmstart.config import format_summary
    from pipeline.consumers.warmstart.sft import run_warmstart
    from pipeline.launch.launcher import ensure_base_model
    from pipeline.rundir import warmstart_metrics_path, warmstart_model_dir

    run_dir = Path(cfg.run.run_dir)
    summary = run_warmstart(run_dir, ensure_base_model(cfg), warmstart=cfg.warmstart, prompts=cfg.prompts, run=cfg.run,
                            model=cfg.model)
    print(format_summary(summary))
    print(f"model: {warmstart_model_dir(run_dir)}  (metrics: {warmstart_metrics_path(run_dir)})")
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``sluice`` parser's subcommands."""
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
