"""``sluice status`` and ``sluice plot``: a live or finished run, seen from its folder and queue."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipeline.cli.common import open_run_of, show
from pipeline.errors import SluiceError


def cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.observe.plots import write_plots
    from pipeline.rundir import eval_dir, metrics_dir

    run_dir = Path(args.run_dir)
    if not metrics_dir(run_dir).is_dir() and not eval_dir(run_dir).is_dir():
        raise SluiceError(f"{run_dir} has no metrics/ or eval/ folder: not the folder of a `sluice run` (or it has not "
                          "trained a step yet)")
    out = {name: str(path) for name, path in write_plots(run_dir).items()}
    show(args, out, lambda o: print("\n".join(o.values())))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from rich.console import Console

    from pipeline.observe.live import collect, panel
    from pipeline.rundir import CONFIG_FILE, config_path, load_run_config

    run_dir = Path(args.run_dir)
    if not config_path(run_dir).is_file():
        raise SluiceError(f"{run_dir} has no {CONFIG_FILE}: not the folder of a `sluice run`")
    total = load_run_config(run_dir).trainer.steps
    handle = open_run_of(args)
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


def register(sub: Any) -> None:
    """Add this group's commands to the ``sluice`` parser's subcommands."""
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
