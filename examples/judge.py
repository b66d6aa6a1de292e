"""Group rewards (``producer.group_reward``): judges that score each response against the rest of its group.

A group reward is called once per prompt group as ``fn(prompt, responses)`` and returns one float, or one
``(float, info)`` pair, per response, in order. It may be a plain function (run in a thread of its own) or
``async def``. These two would be impossible as per-sample rewards: the same response earns a different score in a
different group.

Recipe lines::

    [plugins]
    paths = ["examples"]

    [producer]
    group_reward = "judge:pairwise"      # or "judge:consensus"; leave producer.reward unset
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

_INT = re.compile(r"-?\d+")


def _parsed(response: str) -> int | None:
    m = _INT.match(response.strip())
    return int(m.group(0)) if m else None


def _closer(a: int | None, b: int | None, answer: int) -> float:
    """1 if a is closer to the answer than b, 0.5 for a tie, 0 otherwise (an unparsed response loses to any)."""
    if a is None or b is None:
        return 0.5 if a is b else float(b is None)
    da, db = abs(a - answer), abs(b - answer)
    return 0.5 if da == db else float(da < db)


def pairwise(prompt: Any, responses: list[str]) -> list[tuple[float, dict[str, Any]]]:
    """A round-robin tournament: each response's reward is its win rate against the others of its group, a win
    going to the integer closer to the answer. A pairwise preference model would slot in for ``_closer``."""
    answer = int(prompt.answer)
    values = [_parsed(r) for r in responses]
    out = []
    for i, a in enumerate(values):
        games = [_closer(a, b, answer) for j, b in enumerate(values) if j != i]
        out.append((sum(games) / max(len(games), 1), {"pass": a == answer, "games": len(games)}))
    return out


async def consensus(prompt: Any, responses: list[str]) -> list[tuple[float, dict[str, Any]]]:
    """Self-consistency without a reference answer: a response earns the share of its group that gives the same
    integer (majority voting as a reward, for prompts with no verifier)."""
    values = [_parsed(r) for r in responses]
    votes = Counter(v for v in values if v is not None)
    n = len(responses)
    return [((votes[v] / n) if v is not None else 0.0, {"votes": votes[v] if v is not None else 0}) for v in values]
