"""``[staleness]``: how old a prompt group may be when the trainer drains it
(``pipeline.consumers.trainer.staleness`` applies it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import ConfigError

Action = Literal["train", "drop", "requeue"]


class StalenessConfig(BaseModel):
    """How old a prompt group may be when the trainer drains it, and what happens to older ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_lag: int = Field(default=1, ge=0, le=1_000_000)
    """Largest group lag (policy versions behind the trainer) that trains normally; 0 = on-policy (eta in AReaL)."""

    action: Action = "drop"
    """What to do with a group over ``max_lag``: drop it, requeue its prompt, or train it anyway (flagged stale)."""

    lag_from: Literal["version_min", "version_max"] = "version_min"
    """Which token version a sample's lag counts from: its oldest token (default) or its newest one."""

    train_max_lag: int | None = Field(default=None, ge=0, le=1_000_000)
    """With ``action="train"``: groups whose lag exceeds this are dropped anyway; None = no hard limit."""

    max_requeues: int | None = Field(default=2, ge=0, le=1_000)
    """With ``action="requeue"``: a group already requeued this many times is dropped; None = requeue forever."""

    on_future_version: Literal["error", "drop", "train"] = "error"
    """A token newer than the trainer's version (version_max > current): raise, drop the group, or train it."""

    @model_validator(mode="after")
    def _check_limits(self) -> StalenessConfig:
        if self.train_max_lag is not None and self.train_max_lag < self.max_lag:
            raise ConfigError(
                f"staleness.train_max_lag={self.train_max_lag} is below staleness.max_lag={self.max_lag}: the hard "
                "limit must be at least the soft one. Raise train_max_lag or set it to None."
            )
        return self
