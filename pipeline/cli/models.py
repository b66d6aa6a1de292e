"""``sluice engine serve`` (the CPU engine) and ``sluice model init-tiny`` (a tiny local model)."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.models.tiny import TINY_ARCHS


def cmd_engine_serve(args: argparse.Namespace) -> int:
    from pipeline.producers.cpu_engine.__main__ import main as engine_main

    engine_main([args.model_dir, *args.engine_args])
    return 0


def cmd_model_init_tiny(args: argparse.Namespace) -> int:
    from pipeline.models.tiny import main as tiny_main

    tiny_main(["--arch", args.arch, "--out", args.out, "--seed", str(args.seed),
               *(x for kv in (args.set or []) for x in ("--set", kv))])
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``sluice`` parser's subcommands."""
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
