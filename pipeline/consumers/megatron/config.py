"""sluice's typed parallel layout for the Megatron-core trainer, and the checks of a model under a layout.

``ModelConfig`` (the architecture) lives in ``pipeline.models.config`` and is re-exported here; ``adapter.py`` turns
the two into megatron-core's own config objects.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import ConfigError
from pipeline.models.config import DType, ModelConfig

__all__ = ["DType", "Device", "MegatronConfig", "ModelConfig", "ParallelConfig", "check_layout", "layout_problems"]

Device = Literal["auto", "cpu", "cuda"]


class ParallelConfig(BaseModel):
    """How the trainer's ranks split the model; data parallelism takes whatever ranks are left."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(default=1, ge=1, le=1024)
    """Tensor-parallel size (attention heads and MLP columns split across ranks)."""
    pp: int = Field(default=1, ge=1, le=1)
    """Pipeline-parallel size; sluice's trainer does not drive pipeline schedules, so only 1 is accepted."""
    ep: int = Field(default=1, ge=1, le=1024)
    """Expert-parallel size (each rank holds num_experts / ep experts)."""
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How MoE tokens reach experts on other EP ranks."""
    device: Device = "auto"
    """Where the trainer runs; auto picks CUDA when available, otherwise CPU."""

    def dp(self, world_size: int) -> int:
        """Data-parallel size implied by world_size; raises ConfigError when the layout does not divide it."""
        if world_size % (self.tp * self.pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*pp = {self.tp * self.pp}; "
                "change the number of trainer ranks or the parallel sizes"
            )
        dp = world_size // (self.tp * self.pp)
        if (dp * self.tp) % self.ep:
            raise ConfigError(
                f"ep={self.ep} must divide dp*tp = {dp * self.tp} (expert-parallel ranks are drawn from the "
                "data- and tensor-parallel ranks)"
            )
        return dp

    def resolved_device(self) -> Literal["cpu", "cuda"]:
        """The concrete device; imports torch only for ``auto``."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def check_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int | None = None) -> None:
    """Refuse model/layout combinations that cannot run, with the reason; None when the layout is fine."""
    problems = list(layout_problems(model, parallel))
    if world_size is not None:
        parallel.dp(world_size)
    if problems:
        raise ConfigError("invalid trainer layout: " + "; ".join(problems))


def layout_problems(model: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """Why ``model`` cannot be split as ``parallel`` (on its device); [] when it can."""
    problems = []
    if model.num_attention_heads % parallel.tp or model.num_kv_heads % parallel.tp:
        problems.append(
            f"tp={parallel.tp} must divide num_attention_heads={model.num_attention_heads} and "
            f"num_kv_heads={model.num_kv_heads}"
        )
    if model.vocab_size % parallel.tp:
        problems.append(f"tp={parallel.tp} must divide vocab_size={model.vocab_size} (the vocabulary is split by rows)")
    if parallel.ep > 1 and not model.is_moe:
        problems.append(f"ep={parallel.ep} needs an MoE model, but num_experts=0; set ep=1")
    if model.is_moe and model.num_experts % parallel.ep:
        problems.append(f"ep={parallel.ep} must divide num_experts={model.num_experts}")
    if parallel.resolved_device() == "cpu":
        if model.is_moe and parallel.tp > 1:
            problems.append(
                "MoE with tp > 1 needs sequence parallelism, which needs TransformerEngine or Apex norms that do "
                "not exist on CPU; use ep for experts and tp=1 on CPU"
            )
        if model.dtype == "float16":
            problems.append("dtype=float16 on CPU: fp16 needs loss scaling, which sluice does only through megatron's "
                            "optimizer on CUDA; use float32 (or bfloat16, with fp32 master weights) on CPU")
    return problems


class MegatronConfig(BaseModel):
    """The model plus its parallel layout, validated together."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig
    """Architecture of the trained model."""
    parallel: ParallelConfig = ParallelConfig()
    """How ranks split the model."""

    @model_validator(mode="after")
    def _check(self) -> MegatronConfig:
        problems = layout_problems(self.model, self.parallel)
        if problems:
            raise ValueError("invalid trainer layout: " + "; ".join(problems))
        return self
