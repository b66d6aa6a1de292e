"""``[hardware]``: what a GPU recipe runs on, for the dry run's memory plan (``pipeline.consumers.megatron.plan``)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

_WEIGHT_VERSION = re.compile(r"--weight-version[ =](\d+)(\s|$)")


class HardwareConfig(BaseModel):
    """What a GPU recipe runs on, for the dry run's memory plan and checks (a CPU recipe leaves it unset)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    gpu: str | None = None
    """The accelerator the recipe expects, e.g. 'H200 SXM 141GB' (printed with the plan)."""
    gpu_memory_gib: float | None = Field(None, gt=0, le=4096)
    """Memory of one GPU; set, the dry run refuses a layout whose per-rank estimate does not fit."""
    usable_fraction: float = Field(0.9, gt=0, le=1)
    """Share of gpu_memory_gib a rank may plan to use (the CUDA context, NCCL buffers and fragmentation take the
    rest)."""
    host_memory_gib: float | None = Field(None, gt=0, le=1 << 20)
    """Host (CPU) memory of one node; set, the dry run refuses a weight-push snapshot in pinned host memory
    (sync.snapshot) whose share of every trainer rank of a node does not fit in usable_fraction of it."""
    gpus_per_node: int = Field(8, ge=1, le=1024)
    """GPUs per node."""
    trainer_nodes: int | None = Field(None, ge=1, le=100_000)
    """Nodes of trainer ranks; must give trainer.world_size GPUs."""
    engine_nodes: int | None = Field(None, ge=1, le=100_000)
    """Nodes of SGLang engines (each runs sglang_launch)."""
    hf_config: Path | None = None
    """An HF config.json of the model, read when model.path holds none (the dry run needs no weights)."""
    seq_len: int | None = Field(None, ge=1, le=1 << 22)
    """Longest sample (prompt + response) in tokens, for the activation estimate when trainer.micro_batch_tokens is
    unset; None: the model's max_position_embeddings (an upper bound)."""
    sglang_launch: str | None = None
    """The command that starts each SGLang engine; it must return routed experts (R3) and name an integer weight
    version (sluice's policy versions are integers)."""

    @model_validator(mode="after")
    def _check_launch(self) -> HardwareConfig:
        cmd = self.sglang_launch
        if cmd is None:
            return self
        problems = []
        if "--enable-return-routed-experts" not in cmd.split():
            problems.append("it lacks --enable-return-routed-experts (R3 replays the routing the engines return)")
        if not _WEIGHT_VERSION.search(cmd):
            problems.append("it lacks an integer --weight-version (e.g. --weight-version 0): sluice's policy "
                            "versions are integers, and the engines report the version of every token")
        if problems:
            raise ValueError("hardware.sglang_launch: " + "; ".join(problems))
        return self
