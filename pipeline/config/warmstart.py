"""``[warmstart]``: supervised fine-tuning before RL
(``pipeline.consumers.warmstart.sft`` runs it; ``pipeline.consumers.warmstart.config`` has its folders)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.config.trainer import LRScheduleConfig


class WarmStartConfig(BaseModel):
    """Supervised fine-tuning (SFT) before RL, through the trainer's megatron-core model and checkpoint format."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Run the warm start before RL in ``sluice run`` (once: a finished one is skipped on a rerun)."""
    steps: int = Field(default=300, ge=1, le=10_000_000)
    """Optimizer steps of supervised training (the most, with ``until_loss`` or ``until_exact_match``)."""
    until_loss: float | None = Field(default=None, gt=0.0, le=1e6)
    """Stop at the first metrics line (every ``log_every`` steps) whose mean loss is at or below this: a warm start
    stopped on purpose part way is then equally far along whatever the seed, which a fixed step count is not on
    the steep part of the curve. None = run every step."""
    until_exact_match: float | None = Field(default=None, gt=0.0, le=1.0)
    """Stop at the first metrics line whose exact match reaches this: the fraction of the window's training pairs
    whose every answer token (and EOS) is the argmax given the right tokens before it, which is exactly what greedy
    decoding gets right, at no extra cost. It ties the warm start to RL's own reward, so every seed starts RL at
    the same pass rate (equal losses can mean different pass rates). None = no such stop; with ``until_loss`` too,
    the first criterion met stops it."""
    batch_size: int = Field(default=64, ge=1, le=1 << 20)
    """(prompt, answer) pairs per optimizer step, drawn without replacement within an epoch."""
    micro_batch_size: int | None = Field(default=None, ge=1, le=1 << 20)
    """Most pairs in one forward/backward (gradients accumulate up to batch_size); None = the whole batch at once."""
    lr: float = Field(default=1e-5, gt=0.0, le=1.0)
    """Peak AdamW learning rate (the schedule scales it per step)."""
    schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    """Warm-up and decay of the learning rate over the warm start's steps."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """AdamW first-moment decay."""
    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    """AdamW second-moment decay."""
    grad_clip: float | None = Field(default=1.0, gt=0.0, le=1e6)
    """Clip the gradient norm to this; None = no clipping."""
    expert_bias_update_rate: float = Field(default=1e-3, ge=0.0, le=1.0)
    """Per step, how far each expert's routing bias moves toward balance (megatron's moe_router_bias_update_rate);
    only for routers with an expert bias (DeepSeek-V3). 0 keeps the bias as loaded."""
    path: Path | None = None
    """A JSONL file of {"prompt", "answer"} records; None = the training split of [prompts] (never the held-out)."""
    seed: int = Field(default=0, ge=0)
    """Seed of the batch order."""
    log_every: int = Field(default=10, ge=1, le=1_000_000)
    """Write one metrics line (means over the window) every this many steps."""
    eval_prompts: int = Field(default=256, ge=0, le=1_000_000)
    """Prompts of the held-out split (else of the training data) on which the exported model's greedy exact match
    is measured at the end; 0 = skip the measurement."""

    @field_validator("path")
    @classmethod
    def _jsonl(cls, path: Path | None) -> Path | None:
        if path is not None and path.suffix != ".jsonl":
            raise ValueError(f"{path} must be a .jsonl file of {{\"prompt\", \"answer\"}} records, one per line")
        return path
