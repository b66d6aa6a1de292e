"""What every command group of the ``sluice`` command shares: the run-folder options, opening a run's queue, and
printing a result as JSON or for people."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", help="run folder (holds run.json and the embedded Redis)")
    p.add_argument("--redis", metavar="URL", help="redis://, rediss:// or unix:// URL of the run's server")
    p.add_argument("--run", help="run name (with --redis)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def open_run_of(args: argparse.Namespace) -> Any:
    from pipeline.queue.rundir import open_run

    return open_run(run_dir=args.run_dir, redis_url=args.redis, run=args.run)


def show(args: argparse.Namespace, obj: Any, human: Callable[[Any], None]) -> None:
    if args.json:
        print(json.dumps(obj, default=str))
    else:
        human(obj)


def load_recipe(args: argparse.Namespace) -> Any:
    from pipeline.config import load_config

    overrides = list(args.set or [])
    if getattr(args, "run_dir", None):
        overrides.append(f"run.run_dir={json.dumps(str(args.run_dir))}")
    if getattr(args, "steps", None):
        overrides.append(f"trainer.steps={int(args.steps)}")
    if getattr(args, "ray_address", None):
        overrides.append(f"ray.address={json.dumps(str(args.ray_address))}")
    return load_config(args.recipe, overrides)


def add_dataclass_args(p: argparse.ArgumentParser, module: str, name: str) -> None:
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
