"""``[hooks]``: user functions the trainer calls as the run goes (``pipeline.consumers.trainer.hooks`` calls them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.plugins import Signature

Kind = Literal["metrics", "after_step", "after_commit"]

SIGNATURES: dict[Kind, Signature] = {
    "metrics": Signature(args=(0, {}), described="(step, metrics: dict[str, float])", awaitable=False),
    "after_step": Signature(args=(0, {}), described="(step, info: dict)", awaitable=False),
    "after_commit": Signature(args=(0, ""), described="(step, checkpoint_dir: str)", awaitable=False),
}


class HooksConfig(BaseModel):
    """User functions the trainer calls with each step's metrics, after each step and after each commit."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    metrics: list[str] = []
    """'package.module:function's called as fn(step, metrics: dict[str, float]) with each step's metrics line."""
    after_step: list[str] = []
    """'package.module:function's called as fn(step, info) after each optimizer step (info: policy_version,
    samples, groups)."""
    after_commit: list[str] = []
    """'package.module:function's called as fn(step, checkpoint_dir: str) after each checkpoint commit."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait for one hook call; past it the call is counted as an error and training goes on."""

    def refs(self) -> list[tuple[str, str, Signature]]:
        """(recipe field, import path, call) of every hook, for ``SluiceConfig.plugin_refs``."""
        kinds: tuple[Kind, ...] = ("metrics", "after_step", "after_commit")
        return [(f"hooks.{kind}[{i}]", ref, SIGNATURES[kind]) for kind in kinds
                for i, ref in enumerate(getattr(self, kind))]
