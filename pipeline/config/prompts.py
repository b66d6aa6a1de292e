"""``[prompts]``: where prompts come from, and the held-out split.

The synthetic tasks' sizes live here, since validation needs them (``prompts.size + prompts.heldout`` must fit a
task); the tasks themselves are ``pipeline.data.prompts.SYNTHETIC_TASKS``, which takes its sizes from here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import ConfigError

#: Each synthetic task's number of distinct prompts for a digit count.
SYNTHETIC_TASK_SPACES: dict[str, Callable[[int], int]] = {
    "addition": lambda d: 10 ** (2 * d),
    "multiplication": lambda d: 10 ** (2 * d),
    "increment": lambda d: 10**d,
    "copy": lambda d: 10 ** (d + 2),
    "reverse": lambda d: 10 ** (d + 1),
}


class PromptConfig(BaseModel):
    """Where prompts come from, and the held-out split the evaluator generates on (never trained on)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["synthetic", "jsonl", "parquet"] = "synthetic"
    """The kind of source."""
    path: Path | None = None
    """File to read (jsonl, parquet)."""
    task: str = "addition"
    """Synthetic task: addition, multiplication, increment, copy or reverse."""
    size: int = Field(1024, ge=1)
    """Number of synthetic training prompts (all distinct)."""
    digits: int = Field(2, ge=1, le=9)
    """Difficulty of synthetic prompts."""
    seed: int = Field(0, ge=0)
    """Seed of synthetic prompts (and of the split)."""
    heldout: int = Field(0, ge=0, le=1_000_000)
    """Prompts set aside for held-out evaluation: synthetic ones are distinct from every training prompt; from a
    file, the last ``heldout`` records. 0 = no held-out split (unless heldout_path is given)."""
    heldout_path: Path | None = None
    """A separate held-out file (jsonl or parquet, by suffix); the training file is then used whole."""

    @model_validator(mode="after")
    def _check_heldout(self) -> PromptConfig:
        if self.heldout_path is not None and self.heldout:
            raise ConfigError("prompts.heldout_path and prompts.heldout both name a held-out split; give one of them")
        if self.heldout_path is not None and self.heldout_path.suffix not in (".jsonl", ".parquet"):
            raise ConfigError(f"prompts.heldout_path {self.heldout_path} must end in .jsonl or .parquet")
        return self

    @property
    def has_heldout(self) -> bool:
        """Whether the config names a held-out split."""
        return bool(self.heldout) or self.heldout_path is not None
