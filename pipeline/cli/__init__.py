"""The ``sluice`` command. Thin: parse, defer heavy imports to the subcommand that needs them, call into the library.

One module per command group, each adding its commands with ``register``; the order here is the order ``--help``
lists them in.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pipeline.cli import bench, evaluate, models, observe, queue, train
from pipeline.errors import SluiceError

GROUPS = (train, evaluate, observe, models, queue, bench)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``sluice`` parser."""
    parser = argparse.ArgumentParser(prog="sluice", description="Asynchronous RL post-training around a durable queue.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
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
