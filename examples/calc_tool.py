"""A multi-turn tool-use rollout: the model may call a calculator before it answers.

The task (``prompts.task = "multiplication"``) is a two-digit product, ``"37*45="`` -> ``"1665"``, which the tiny
CPU model cannot work out in its head. It may instead write a call, ``<calc>37*45</calc>``: the turn stops there
(the engine's stop string), the environment evaluates the expression and appends the result, ``1665``, and the model
continues. It answers on the last line::

    37*45=<calc>37*45</calc>1665          <- prompt | model turn | environment turn (loss_mask 0)
    1665<eos>                             <- model turn (the answer)

A response without a call is one line: the answer itself. ``reward`` gives 1 when the last line is the product,
so the reward climbs only as far as the policy learns to call the tool and copy its result. The warm start
(``calc_demos.jsonl``, written by ``python examples/calc_tool.py demos``) shows a call in 15% of its demonstrations
and a direct answer in the rest; RL then finds that the calls pay.

Recipe lines (``recipes/cpu-calc.toml``)::

    [plugins]
    paths = ["examples"]

    [producer]
    rollout = "calc_tool:rollout"
    reward = "calc_tool:reward"
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import random
from pathlib import Path
from typing import Any

from pipeline.data.prompts import Prompt, synthetic_split
from pipeline.producers.rollout import RolloutContext, Trajectory

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
MAX_CALLS = 2
"""Tool calls per trajectory; a model still calling after that ends the trajectory unanswered (reward 0)."""
ERROR = "error"
"""What the environment appends for an expression it refuses."""

_OPS: dict[type[ast.operator], Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                       ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv}
_MAX_ABS = 10**12
_MAX_EXPR_CHARS = 64


def calculate(expr: str) -> str:
    """Evaluate an integer expression of ``+ - * /`` and parentheses by walking its syntax tree (never ``eval``):
    anything else, a division by zero or a number past 10**12 gives ``"error"``."""
    if len(expr) > _MAX_EXPR_CHARS:
        return ERROR
    try:
        tree = ast.parse(expr.strip(), mode="eval")
        value = _eval(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return ERROR
    return str(value)


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = -_eval(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    else:
        raise ValueError(f"not allowed: {ast.dump(node)[:40]}")
    if abs(value) > _MAX_ABS:
        raise ValueError("too large")
    return int(value)


def _call_of(text: str) -> str | None:
    """The expression of a turn that ended in a call (``...<calc>EXPR</calc>``), else None."""
    if not text.endswith(CALL_CLOSE):
        return None
    head = text[: -len(CALL_CLOSE)]
    start = head.rfind(CALL_OPEN)
    return head[start + len(CALL_OPEN):] if start >= 0 else None


async def rollout(ctx: RolloutContext) -> list[Trajectory]:
    """The group's first turns in one request (n samples of the prompt), then each sample's calls and answer."""
    trajectories = await ctx.start(stop=[CALL_CLOSE])
    return list(await asyncio.gather(*(_continue(ctx, traj) for traj in trajectories)))


async def _continue(ctx: RolloutContext, traj: Trajectory) -> Trajectory:
    calls = 0
    while (expr := _call_of(traj.model_turns[-1].text)) is not None and calls < MAX_CALLS:
        calls += 1
        ctx.add_env_text(traj, calculate(expr))  # masked: the model is never trained to produce the result
        await ctx.extend(traj, stop=[CALL_CLOSE])
    traj.info["tool_calls"] = calls
    return traj


def reward(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    """1 when the response's last line is the answer; ``used_tool`` says whether it called the calculator."""
    answer = response.rsplit("\n", 1)[-1].strip()
    ok = answer == prompt.answer
    return float(ok), {"pass": ok, "used_tool": CALL_CLOSE in response}


def demonstrations(prompts: list[Prompt], tool_share: float, seed: int) -> list[dict[str, str]]:
    """Warm-start records: a share of them call the tool (the result, then the answer on its own line), the rest
    answer directly."""
    rng = random.Random(seed)
    out = []
    for p in prompts:
        expr = (p.text or "").rstrip("=")
        answer = str(p.answer)
        if rng.random() < tool_share:
            answer = f"{CALL_OPEN}{expr}{CALL_CLOSE}{calculate(expr)}\n{answer}"
        out.append({"prompt": str(p.text), "answer": answer})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the calc recipe's warm-start demonstrations.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demos = sub.add_parser("demos", help="write demonstrations from the recipe's training split (never held-out)")
    demos.add_argument("--out", type=Path, default=Path(__file__).parent / "calc_demos.jsonl")
    demos.add_argument("--count", type=int, default=3000)
    demos.add_argument("--tool-share", type=float, default=0.15)
    # These must match recipes/cpu-calc.toml's [prompts], so that no held-out prompt is demonstrated.
    demos.add_argument("--size", type=int, default=9000)
    demos.add_argument("--heldout", type=int, default=256)
    demos.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, _ = synthetic_split("multiplication", args.size, args.heldout, 2, args.seed)
    records = demonstrations([train[i] for i in range(min(args.count, len(train)))], args.tool_share, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} demonstrations -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
