"""``[ray]``: where the run's processes go on Ray, and their restart budget."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.base import Strict


class RoleResources(Strict):
    """What Ray reserves for one process of a role; custom resources pin it to the nodes that offer them."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = {}
    """Custom Ray resources, e.g. {rollout = 1} for a node started with --resources='{"rollout": 8}'."""


class RayConfig(Strict):
    """Where the run's processes go. Every process is a Ray actor's child; Ray places, sluice supervises."""

    address: str | None = None
    """An existing cluster ("auto", "HOST:PORT"); None starts a private Ray instance on this machine for the run.
    `sluice run --ray-address` sets it too."""
    dashboard: bool = False
    """Start the dashboard with the private instance (about 300 MB and a few seconds more); a cluster's own
    dashboard is printed whenever it has one."""
    trainer_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of the trainer ranks (and of nothing else)."""
    engine: RoleResources = RoleResources(num_cpus=1.0)
    producer: RoleResources = RoleResources(num_cpus=0.5)
    trainer: RoleResources = RoleResources(num_cpus=1.0)
    """Per trainer rank, and for the warm start."""
    evaluator: RoleResources = RoleResources(num_cpus=0.5)
    archiver: RoleResources = RoleResources(num_cpus=0.25)
    restart_limit: int = Field(5, ge=0)
    """Restarts a process (or the trainer group) may take within restart_window_s before the run gives up."""
    restart_window_s: float = Field(300.0, gt=0)
    """The window of restart_limit; a process that stayed up this long starts with a fresh budget and backoff."""
    startup_timeout_s: float = Field(180.0, gt=0)
    """How long a process may take to be placed and started (a node with its resources may have to join first)."""
