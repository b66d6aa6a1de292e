"""Reward functions: built-in verifiers for the synthetic tasks, and user functions named by import path.

A reward function takes ``(prompt, response_text)`` and returns a float, or ``(float, info_dict)``; it may be sync
or async. It is resolved and checked when the recipe loads, so a typo fails before anything starts. At run time a
function that raises or runs past its timeout does not stop the producer: the sample is marked ``failed`` with the
error in ``reward_info`` and counted.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import ConfigError
from pipeline.producers.prompts import Prompt

RewardValue = float | tuple[float, dict[str, Any]]
RewardFn = Callable[[Prompt, str], RewardValue | Awaitable[RewardValue]]


def _answer_of(prompt: Prompt) -> str:
    if prompt.answer is None:
        raise ValueError(f"prompt {prompt.prompt_id!r} has no answer to check against")
    return prompt.answer.strip()


def exact_match(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    """1 if the response, up to its first newline and without surrounding space, equals the answer."""
    got = response.split("\n", 1)[0].strip()
    ok = got == _answer_of(prompt)
    return float(ok), {"pass": ok}


_NUMBER = re.compile(r"-?\d+")


def integer_match(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    """1 if the first integer in the response equals the answer; a partial credit of 0.1 for a well-formed integer.

    The shaping term gives a tiny model something to climb before it gets any answer right.
    """
    m = _NUMBER.match(response.strip())
    if m is None:
        return 0.0, {"pass": False, "parsed": False}
    ok = m.group(0) == _answer_of(prompt)
    return (1.0 if ok else 0.1), {"pass": ok, "parsed": True}


def prefix_match(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    """The fraction of the answer's characters the response gets right, in place (dense reward for copy/reverse)."""
    answer = _answer_of(prompt)
    got = response.split("\n", 1)[0].strip()
    right = sum(1 for a, b in zip(answer, got) if a == b)
    score = right / max(len(answer), len(got), 1)
    return score, {"pass": got == answer}


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "integer_match": integer_match,
    "prefix_match": prefix_match,
}


_INLINE = frozenset(BUILTIN_REWARDS.values())


def resolve_reward(spec: str) -> RewardFn:
    """A built-in name or ``package.module:function``; raises ConfigError saying what is wrong."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"reward {spec!r} is neither a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) nor an import path "
            "'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"reward {spec!r}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: {attr!r} is not callable")
    try:
        inspect.signature(fn).bind(None, "")
    except TypeError:
        raise ConfigError(f"reward {spec!r}: must accept (prompt, response_text); its signature is "
                          f"{inspect.signature(fn)}") from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return fn  # type: ignore[no-any-return]


@dataclass
class RewardOutcome:
    """A scored sample: the reward, its info, and whether scoring failed."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    failed: bool = False


async def score(fn: RewardFn, prompt: Prompt, response: str, timeout_s: float) -> RewardOutcome:
    """Run a reward function with a timeout; a raise, a timeout or a non-finite value gives a failed outcome."""
    try:
        if inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(prompt, response), timeout_s)  # type: ignore[arg-type]
        elif fn in _INLINE:
            # The built-ins are a few string operations: a thread hop per sample would cost more than they do.
            value = fn(prompt, response)
        else:
            # A thread keeps a slow sync verifier from stalling the event loop; a hung one is abandoned, not joined.
            value = await asyncio.wait_for(asyncio.to_thread(fn, prompt, response), timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout_s)
    except TimeoutError:
        return RewardOutcome(0.0, {"error": f"reward function timed out after {timeout_s}s"}, failed=True)
    except Exception as e:  # a user's function may raise anything; the producer must go on
        return RewardOutcome(0.0, {"error": f"{type(e).__name__}: {e}"[:500]}, failed=True)
    info: dict[str, Any] = {}
    if isinstance(value, tuple):
        value, info = value
    try:
        reward = float(value)
    except (TypeError, ValueError):
        return RewardOutcome(0.0, {"error": f"reward function returned {type(value).__name__}, not a float"},
                             failed=True)
    if not math.isfinite(reward):
        return RewardOutcome(0.0, {"error": f"reward function returned {reward}"}, failed=True)
    return RewardOutcome(reward, _json_safe(info))


def _json_safe(info: Any) -> dict[str, Any]:
    if not isinstance(info, dict):
        return {"info": str(info)}
    out: dict[str, Any] = {}
    for k, v in info.items():
        out[str(k)] = v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
    return out
