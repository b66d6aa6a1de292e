"""Prompt sources: local JSONL or Parquet files, and built-in synthetic tasks for the CPU recipe.

A source is a finite, indexable list of prompts; producers walk it through a cursor held in Redis (see
``PromptCursor``), so any number of producers share one pass over the data and a restarted producer continues where
the run left off. Epochs wrap around.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import redis
from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import ConfigError
from pipeline.queue.keys import RunKeys


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
def _addition(rng: random.Random, i: int, digits: int) -> Prompt:
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return Prompt(prompt_id=f"add-{i}", text=f"{a}+{b}=", answer=str(a + b), metadata={"task": "addition"})


def _increment(rng: random.Random, i: int, digits: int) -> Prompt:
    a = rng.randrange(10**digits)
    return Prompt(prompt_id=f"inc-{i}", text=f"{a}+1=", answer=str(a + 1), metadata={"task": "increment"})


def _copy(rng: random.Random, i: int, digits: int) -> Prompt:
    s = "".join(rng.choice("abcdefghij") for _ in range(digits + 2))
    return Prompt(prompt_id=f"copy-{i}", text=f"copy {s}:", answer=s, metadata={"task": "copy"})


def _reverse(rng: random.Random, i: int, digits: int) -> Prompt:
    s = "".join(rng.choice("0123456789") for _ in range(digits + 1))
    return Prompt(prompt_id=f"rev-{i}", text=f"rev {s}:", answer=s[::-1], metadata={"task": "reverse"})


SYNTHETIC_TASKS: dict[str, Callable[[random.Random, int, int], Prompt]] = {
    "addition": _addition,
    "increment": _increment,
    "copy": _copy,
    "reverse": _reverse,
}


def synthetic(task: str, size: int = 1024, digits: int = 2, seed: int = 0) -> ListPrompts:
    """A deterministic synthetic task (the same seed gives the same prompts) with exact-match answers."""
    if task not in SYNTHETIC_TASKS:
        raise ConfigError(f"unknown synthetic task {task!r}; choose one of {sorted(SYNTHETIC_TASKS)}")
    rng = random.Random(seed)
    make = SYNTHETIC_TASKS[task]
    return ListPrompts([make(rng, i, digits) for i in range(size)])


class PromptConfig(BaseModel):
    """Where prompts come from."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["synthetic", "jsonl", "parquet"] = "synthetic"
    """The kind of source."""
    path: Path | None = None
    """File to read (jsonl, parquet)."""
    task: str = "addition"
    """Synthetic task: addition, increment, copy or reverse."""
    size: int = Field(1024, ge=1)
    """Number of synthetic prompts."""
    digits: int = Field(2, ge=1, le=9)
    """Difficulty of synthetic prompts."""
    seed: int = Field(0, ge=0)
    """Seed of synthetic prompts."""


def setup_prompts(cfg: PromptConfig) -> ListPrompts:
    """The prompt source a config names; raises ConfigError for an unknown type or a missing file."""
    if cfg.type == "synthetic":
        return synthetic(cfg.task, cfg.size, cfg.digits, cfg.seed)
    if cfg.path is None:
        raise ConfigError(f"prompts.type={cfg.type!r} needs prompts.path")
    loaders: dict[str, Callable[[Path], ListPrompts]] = {"jsonl": load_jsonl, "parquet": load_parquet}
    return loaders[cfg.type](cfg.path)


class PromptCursor:
    """The run's shared position in the prompt source, in Redis: producers hold no state of their own.

    ``next()`` first takes prompts handed back for another try (a failed generation, or the trainer requeueing a
    stale group), then advances the cursor with INCR, so two producers never take the same index.
    """

    def __init__(self, client: redis.Redis, run: str) -> None:
        keys = RunKeys(run)
        self.redis = client
        self.cursor_key = keys.extra("prompt_cursor")
        self.retry_key = keys.extra("prompt_retry")

    def next(self) -> tuple[int, bool]:
        """(prompt index, whether it is a retry)."""
        retry = self.redis.lpop(self.retry_key)
        if retry is not None:
            return int(retry), True
        return int(self.redis.incr(self.cursor_key)) - 1, False

    def give_back(self, index: int) -> None:
        """Hand a prompt index back so the next producer tries it again."""
        self.redis.rpush(self.retry_key, index)

    def position(self) -> int:
        return int(self.redis.get(self.cursor_key) or 0)
