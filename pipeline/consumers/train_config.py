"""The train step's configuration, apart from ``train_step.py`` so that loading a recipe does not import torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.consumers.loss_config import LossConfig
from pipeline.consumers.schedule import LRScheduleConfig


class TrainStepConfig(BaseModel):
    """The training step: R3, micro-batching, optimizer and loss."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    r3: bool = True
    """Replay the rollout's MoE routing (R3) in the proximal and training forwards; ignored for dense models."""
    measure_r3: bool = True
    """One extra no-grad forward per micro-batch to measure mismatch and routing agreement the other way."""
    temperature: float | None = Field(default=None, gt=0.0, le=100.0)
    """Score tokens at this temperature; None = each sample's own sampling temperature."""
    micro_batch_samples: int = Field(default=8, ge=1, le=1 << 20)
    """Most samples in one forward/backward."""
    micro_batch_tokens: int | None = Field(default=None, ge=1, le=1 << 30)
    """Most padded tokens (rows x padded length) in one forward/backward; None = no token budget."""
    mini_batches: int = Field(default=1, ge=1, le=4096)
    """Optimizer steps per drained batch: its samples are shuffled and split into this many mini-batches. With more
    than one, the decoupled ratio current/proximal moves away from 1 after the first, and the PPO clip acts."""
    epochs: int = Field(default=1, ge=1, le=64)
    """Passes over each drained batch (each split into ``mini_batches``); proximal log-probs are computed once."""
    lr: float = Field(default=1e-6, gt=0.0, le=1.0)
    """Peak AdamW learning rate."""
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    """Warm-up and decay of the learning rate, over optimizer steps (trainer steps x epochs x mini_batches)."""
    optimizer: Literal["auto", "local", "megatron"] = "auto"
    """auto: megatron's DDP + distributed optimizer on CUDA, torch AdamW with an explicit all-reduce on CPU (fp32
    master weights for bf16/fp16 parameters in both); local or megatron force one."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """AdamW first-moment decay."""
    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    """AdamW second-moment decay."""
    adam_eps: float = Field(default=1e-8, gt=0.0, le=1.0)
    """AdamW denominator epsilon."""
    expert_bias_update_rate: float = Field(default=1e-3, ge=0.0, le=1.0)
    """Per optimizer step, how far each expert's routing bias moves toward balance (megatron's
    moe_router_bias_update_rate); only for routers with an expert bias (DeepSeek-V3). 0 keeps the bias as loaded."""
    grad_clip: float | None = Field(default=1.0, gt=0.0, le=1e6)
    """Clip the global gradient norm (over all ranks, experts included) to this; None = no clipping."""
    failed_in_group_stats: bool = True
    """Failed/aborted samples (never trained on) still count in their group's GRPO reward mean and std."""
    pad_token_id: int = Field(default=0, ge=0, le=1 << 22)
    """Token id written into padding (never scored)."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy-gradient loss."""
