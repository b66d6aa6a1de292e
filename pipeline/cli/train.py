"""``sluice run``, ``sluice replay`` and ``sluice sft``: the jobs that train."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.cli.common import load_recipe, show

if TYPE_CHECKING:
    from pipeline.config import SluiceConfig


def sglang_args(cfg: SluiceConfig) -> list[str] | None:
    """The SGLang servers' flags as far as the recipe knows them (a managed engine's ``engine.launch_args``, else
    ``hardware.sglang_launch``), or None when the engines are not SGLang."""
    import shlex

    if cfg.engine.type != "sglang":
        return None
    return [*cfg.engine.launch_args, *shlex.split(cfg.hardware.sglang_launch or "")]


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_recipe(args)
    if args.dry_run:
        from pipeline.config import dump_config
        from pipeline.consumers.megatron.plan import dry_run_plan

        print(dump_config(cfg))
        # raises, naming why, for a layout that cannot run or cannot fit
        print(dry_run_plan(cfg.trainer, cfg.model, cfg.hardware, cfg.sync, fp8=cfg.engine.weight_dtype == "fp8",
                          sglang_args=sglang_args(cfg)))
        return 0
    from pipeline.launch.launcher import run
    from pipeline.metrics import check_metrics_config

    check_metrics_config(cfg.metrics)  # before anything starts: a tool the recipe asks for must be installed
    return run(cfg)


def cmd_replay(args: argparse.Namespace) -> int:
    import time

    started = time.monotonic()
    cfg = load_recipe(args)
    from pipeline.consumers.trainer.main import run_replay
    from pipeline.consumers.trainer.replay import parse_range
    from pipeline.rundir import ledger_dir, trainer_metrics_path

    id_range = parse_range(args.range)
    source = Path(args.source)
    if not source.is_dir():
        print(f"sluice: error: --from {source}: no such folder (an archive, such as RUN_DIR/archive, or a run folder)",
              file=sys.stderr)
        return 2
    model_dir, origin = replay_start_model(cfg, source)
    if not (model_dir / "config.json").exists():
        print(f"sluice: error: no model at {model_dir} ({origin}); set model.path to the recorded run's starting "
              "model (RUN_DIR/warmstart/model when that run warm-started, else its model.path or RUN_DIR/model)",
              file=sys.stderr)
        return 2
    out_dir = Path(cfg.run.run_dir)
    model_out = run_replay(model_dir, source, id_range, out_dir, run=cfg.run, model=cfg.model, trainer=cfg.trainer,
                           staleness=cfg.staleness, filters=cfg.filters, metrics=cfg.metrics, hooks=cfg.hooks)
    summary = replay_summary(source, model_dir, model_out, trainer_metrics_path(out_dir), ledger_dir(out_dir))
    summary["start_model_from"] = origin
    summary["seconds"] = round(time.monotonic() - started, 1)
    show(args, summary, lambda s: print(format_replay(s)))
    return 0


def replay_start_model(cfg: SluiceConfig, source: Path) -> tuple[Path, str]:
    """The HF folder a replay starts from, and where that choice came from.

    ``model.path`` when given. Otherwise, when ``source`` is a run folder or a folder inside one (its archive), the
    model that run started from: the warm-started one when it ran a warm start, which a replay must not repeat,
    since the recorded samples came from the policy that followed it. Otherwise the recipe's own starting model in
    the replay's folder (a warm start `sluice sft` wrote there, or the base model).
    """
    from pipeline.rundir import config_path, load_run_config, model_folder

    if cfg.model.path is not None:
        return Path(cfg.model.path), "model.path"
    for run_dir in (source, source.parent):
        if config_path(run_dir).is_file():
            recorded = load_run_config(run_dir)
            # The saved config names the run folder as its launcher saw it, maybe from another working directory.
            recorded = recorded.model_copy(update={"run": recorded.run.model_copy(update={"run_dir": run_dir})})
            return model_folder(recorded), f"the starting model of the run in {run_dir}"
    return model_folder(cfg), f"no run folder holds {source}, so the recipe's starting model in {cfg.run.run_dir}"


def replay_summary(source: Path, start_model: Path, model_out: Path, metrics: Path, ledger: Path) -> dict[str, Any]:
    """What a replay did: its learning curve, every sample's fate, where it started and where the model went."""
    from collections import Counter

    from pipeline.consumers.trainer.ledger import read_ledger
    from pipeline.observe.report import learning_curve
    from pipeline.rundir import trainer_rows

    rows = trainer_rows(metrics)
    fates = Counter(line.fate for line in read_ledger(ledger))
    return {"source": str(source), "start_model": str(start_model), "model": str(model_out), "metrics": str(metrics),
            "steps": len(rows), "versions": [rows[0].get("policy_version"), rows[-1].get("policy_version")]
            if rows else None, "samples": dict(sorted(fates.items())), "curve": learning_curve(metrics)}


def format_replay(summary: dict[str, Any]) -> str:
    from pipeline.observe.report import format_curve

    fates = ", ".join(f"{n} {fate}" for fate, n in summary["samples"].items()) or "none"
    first, last = summary["versions"] or (None, None)
    versions = f" (policy version {first} -> {last})" if first is not None else ""
    return "\n".join([
        format_curve([tuple(row) for row in summary["curve"]]),
        f"replayed {summary['steps']} steps{versions} from {summary['source']}; samples: {fates}",
        f"started from: {summary['start_model']}  ({summary['start_model_from']})",
        f"model: {summary['model']}  (metrics: {summary['metrics']})",
        f"wall time: {summary['seconds']:.0f} s",
    ])


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
                   help="a Parquet archive folder, or a run folder whose stream to read; the replay starts from the "
                   "model that run started from (its warm-started one), unless model.path is set")
    p.add_argument("--range", help="stream ids A:B (inclusive; either side may be empty)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)")
    p.add_argument("--run-dir", help="output folder for checkpoints, ledger and metrics (overrides run.run_dir)")
    p.add_argument("--steps", type=int, help="most trainer steps (overrides trainer.steps)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("sft", help="only the recipe's [warmstart]: supervised training into RUN_DIR/warmstart "
                       "(always from the base model; a later `sluice run` with warmstart.enabled reuses it)")
    p.add_argument("recipe", help="a recipe TOML: model, prompts and [warmstart] settings")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)")
    p.add_argument("--run-dir", help="run folder (overrides run.run_dir)")
    p.set_defaults(func=cmd_sft)
