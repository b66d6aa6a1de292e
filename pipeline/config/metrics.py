"""``[metrics]``: where metrics go besides the JSONL files (``pipeline.metrics`` writes them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MetricsConfig(BaseModel):
    """Where metrics go besides the JSONL files every process writes."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tensorboard: bool = True
    """Mirror every process's metrics into RUN_DIR/tensorboard/<process>/ (``tensorboard --logdir`` on it)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs ``pip install wandb``); one W&B run per process, grouped by run name."""
    wandb_project: str = Field("sluice", min_length=1)
    """The W&B project."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes RUN_DIR/wandb/ for a later ``wandb sync``; online needs WANDB_API_KEY in the environment."""
    producer_every_s: float = Field(10.0, gt=0, le=3600)
    """How often each producer appends a line of its counters and throughput."""
