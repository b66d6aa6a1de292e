"""Prompt sources: local JSONL or Parquet files, and built-in synthetic tasks for the CPU recipe.

A source is a finite, indexable list of prompts, with its held-out split. Producers, the warm start and the held-out
evaluator all read it, so it lives below them (the standard library, and pyarrow only where a Parquet file is read).
Producers walk it through a cursor held in Redis (``pipeline.producers.cursor``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pipeline.config.prompts import SYNTHETIC_TASK_SPACES, PromptConfig
from pipeline.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text (or token ids), and what a reward function needs to score a response."""

    prompt_id: str
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ConfigError(f"prompt {self.prompt_id!r}: give exactly one of 'prompt' text or 'input_ids'")


class PromptSource(Protocol):
    """A finite list of prompts."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Prompt: ...


class ListPrompts:
    """Prompts held in memory."""

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        if not prompts:
            raise ConfigError("the prompt source is empty")
        self._prompts = list(prompts)

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self._prompts[index % len(self._prompts)]


def _record_to_prompt(rec: dict[str, Any], where: str, i: int) -> Prompt:
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: record {i} is not an object")
    text, ids = rec.get("prompt"), rec.get("input_ids")
    if text is None and ids is None:
        raise ConfigError(f"{where}: record {i} has neither 'prompt' nor 'input_ids'")
    answer = rec.get("answer")
    meta = {k: v for k, v in rec.items() if k not in ("id", "prompt", "input_ids", "answer")}
    return Prompt(
        prompt_id=str(rec.get("id", i)),
        text=None if text is None else str(text),
        input_ids=None if ids is None else tuple(int(t) for t in ids),
        answer=None if answer is None else str(answer),
        metadata=meta,
    )


def load_jsonl(path: str | Path) -> ListPrompts:
    """One JSON object per line: ``{"id", "prompt" | "input_ids", "answer", ...}``; other keys become metadata."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompt file {p} not found")
    prompts = []
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{i + 1}: not valid JSON ({e.msg})") from None
        prompts.append(_record_to_prompt(rec, f"{p}:{i + 1}", i))
    return ListPrompts(prompts)


def load_parquet(path: str | Path) -> ListPrompts:
    """A Parquet file with the same columns as the JSONL format."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"prompt file {p} not found")
    return ListPrompts([_record_to_prompt(r, str(p), i) for i, r in enumerate(pq.read_table(p).to_pylist())])


# --------------------------------------------------------------------------------------------- synthetic tasks
# Each task maps a code in [0, space) to one prompt, so a set of distinct codes is a set of distinct prompts: the
# training and held-out splits are drawn together without replacement and can never share a prompt.
def _addition(code: int, digits: int) -> tuple[str, str]:
    a, b = divmod(code, 10**digits)
    return f"{a}+{b}=", str(a + b)


def _multiplication(code: int, digits: int) -> tuple[str, str]:
    a, b = divmod(code, 10**digits)
    return f"{a}*{b}=", str(a * b)


def _increment(code: int, digits: int) -> tuple[str, str]:
    return f"{code}+1=", str(code + 1)


def _letters(code: int, width: int, alphabet: str) -> str:
    out = []
    for _ in range(width):
        code, r = divmod(code, len(alphabet))
        out.append(alphabet[r])
    return "".join(out)


def _copy(code: int, digits: int) -> tuple[str, str]:
    s = _letters(code, digits + 2, "abcdefghij")
    return f"copy {s}:", s


def _reverse(code: int, digits: int) -> tuple[str, str]:
    s = _letters(code, digits + 1, "0123456789")
    return f"rev {s}:", s[::-1]


@dataclass(frozen=True)
class _Task:
    make: Callable[[int, int], tuple[str, str]]
    prefix: str
    space: Callable[[int], int]
    """Number of distinct prompts for a digit count (the recipe checks sizes against it before anything starts)."""


_SPACE = SYNTHETIC_TASK_SPACES
SYNTHETIC_TASKS: dict[str, _Task] = {
    "addition": _Task(_addition, "add", _SPACE["addition"]),
    "multiplication": _Task(_multiplication, "mul", _SPACE["multiplication"]),  # "37*45=" -> "1665" (tool use)
    "increment": _Task(_increment, "inc", _SPACE["increment"]),
    "copy": _Task(_copy, "copy", _SPACE["copy"]),
    "reverse": _Task(_reverse, "rev", _SPACE["reverse"]),
}


def synthetic_split(
    task: str, size: int = 1024, heldout: int = 0, digits: int = 2, seed: int = 0
) -> tuple[ListPrompts, ListPrompts | None]:
    """(training prompts, held-out prompts or None): ``size + heldout`` distinct prompts of a synthetic task.

    Deterministic in (task, size, heldout, digits, seed). Every prompt is distinct, within and across the splits, so
    a held-out pass rate measures generalisation, not recall of a prompt seen in training.
    """
    if task not in SYNTHETIC_TASKS:
        raise ConfigError(f"unknown synthetic task {task!r}; choose one of {sorted(SYNTHETIC_TASKS)}")
    spec = SYNTHETIC_TASKS[task]
    space = spec.space(digits)
    if size + heldout > space:
        raise ConfigError(
            f"synthetic task {task!r} with digits={digits} has {space} distinct prompts, fewer than prompts.size + "
            f"prompts.heldout = {size + heldout}; lower them or raise prompts.digits"
        )
    codes = random.Random(seed).sample(range(space), size + heldout)

    def build(code: int, pid: str) -> Prompt:
        text, answer = spec.make(code, digits)
        return Prompt(prompt_id=pid, text=text, answer=answer, metadata={"task": task})

    train = ListPrompts([build(c, f"{spec.prefix}-{i}") for i, c in enumerate(codes[:size])])
    held = [build(c, f"{spec.prefix}-heldout-{i}") for i, c in enumerate(codes[size:])]
    return train, (ListPrompts(held) if held else None)


def synthetic(task: str, size: int = 1024, digits: int = 2, seed: int = 0) -> ListPrompts:
    """A deterministic synthetic task (the same seed gives the same prompts) of distinct exact-match prompts."""
    return synthetic_split(task, size, 0, digits, seed)[0]


def _load_file(kind: str, path: Path | None) -> ListPrompts:
    if path is None:
        raise ConfigError(f"prompts.type={kind!r} needs prompts.path")
    loaders: dict[str, Callable[[Path], ListPrompts]] = {"jsonl": load_jsonl, "parquet": load_parquet}
    return loaders[kind](path)


def _split(cfg: PromptConfig) -> tuple[ListPrompts, ListPrompts | None]:
    if cfg.type == "synthetic":
        return synthetic_split(cfg.task, cfg.size, cfg.heldout, cfg.digits, cfg.seed)
    source = _load_file(cfg.type, cfg.path)
    if cfg.heldout_path is not None:
        return source, _load_file(cfg.heldout_path.suffix.lstrip("."), cfg.heldout_path)
    if not cfg.heldout:
        return source, None
    if cfg.heldout >= len(source):
        raise ConfigError(f"prompts.heldout={cfg.heldout} leaves no training prompts in {cfg.path} "
                          f"({len(source)} records); lower it")
    cut = len(source) - cfg.heldout
    return ListPrompts([source[i] for i in range(cut)]), ListPrompts([source[i] for i in range(cut, len(source))])


def setup_prompts(cfg: PromptConfig) -> ListPrompts:
    """The training prompts a config names (without its held-out split); raises ConfigError for a bad source."""
    return _split(cfg)[0]


def setup_heldout(cfg: PromptConfig) -> ListPrompts:
    """The held-out prompts a config names; raises ConfigError when it names none."""
    held = _split(cfg)[1]
    if held is None:
        raise ConfigError("no held-out split: set prompts.heldout (a count) or prompts.heldout_path")
    return held
