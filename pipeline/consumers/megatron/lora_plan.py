"""LoRA by arithmetic, for ``--dry-run``: how many adapter parameters the trainer holds (and Adam keeps state for),
and how many elements one push carries, against the full model's.

The trainer's count follows ``lora.apply_lora``: one adapter per megatron linear, so a fused ``linear_qkv`` has one A
and a B over all its rows. The push's follows ``lora_export``: one adapter per HF projection, so q, k and v each
carry their own copy of A. Both ratios are element ratios: adapters and weights travel in the same wire dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.trainer import LoRAConfig
from pipeline.consumers.megatron.config import ModelConfig
from pipeline.errors import ConfigError

# The HF projections each megatron linear fuses (linear_qkv, linear_proj, linear_fc1, linear_fc2, and the experts').
_FUSED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",),
          ("experts.gate_proj", "experts.up_proj"), ("experts.down_proj",))


@dataclass(frozen=True)
class LoRACounts:
    trainer: int
    """Adapter parameters the trainer holds, trains and keeps optimizer state for."""
    push: int
    """Elements of one adapter push."""
    full: int
    """Elements of one full-weight push (every parameter of the model)."""


def _projections(model: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each HF projection LoRA can target in ``layer``, per expert for the experts'."""
    h, d, heads, kv = model.hidden_size, model.head_dim, model.num_attention_heads, model.num_kv_heads
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h)}
    if model.is_moe_layer(layer):
        f = model.moe_ffn_hidden_size
        shapes.update({"experts.gate_proj": (h, f), "experts.up_proj": (h, f), "experts.down_proj": (f, h)})
    else:
        f = model.ffn_hidden_size
        shapes.update({"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)})
    return shapes


def lora_counts(model: ModelConfig, lora: LoRAConfig, full: int) -> LoRACounts:
    """Adapter counts of ``lora`` on ``model``, whose full push is ``full`` elements; ConfigError for targets the
    model does not have."""
    if model.mla is not None and any(t in lora.targets for t in ("q_proj", "k_proj", "v_proj", "o_proj")):
        raise ConfigError("trainer.lora.targets q/k/v/o_proj need standard attention; this model uses multi-head "
                          "latent attention (MLA), whose projections LoRA does not cover yet: target the experts' or "
                          "dense MLP projections only")
    r = lora.rank
    trainer = push = 0
    matched: set[str] = set()
    for layer in range(model.num_layers):
        shapes = _projections(model, layer)
        experts = model.num_experts if model.is_moe_layer(layer) else 1
        targeted = [t for t in lora.targets if t in shapes]
        matched.update(targeted)
        for target in targeted:
            fan_in, out = shapes[target]
            push += r * (fan_in + out) * (experts if target.startswith("experts.") else 1)
        # The trainer's fused linears: one A over the input, one B over every output row of the linear.
        for parts in _FUSED:
            if not any(p in targeted for p in parts):
                continue
            fan_in = shapes[parts[0]][0]
            rows = sum(shapes[p][1] for p in parts)
            trainer += r * (fan_in + rows) * (experts if parts[0].startswith("experts.") else 1)
    missing = [t for t in lora.targets if t not in matched]
    if missing:
        raise ConfigError(f"trainer.lora.targets {missing} match no layer of this model (a MoE layer has no dense "
                          "gate/up/down_proj: use experts.*; a dense one has no experts); drop them")
    return LoRACounts(trainer=trainer, push=push, full=full)


def format_lora(counts: LoRACounts, lora: LoRAConfig, wire_bytes: int) -> list[str]:
    """The dry run's LoRA lines."""
    mib = 2**20
    return [
        f"  lora       rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}: {counts.trainer:,} "
        f"adapter parameters, {counts.trainer / counts.full:.4%} of the model (gradients and optimizer state only "
        f"for them: optimizer state / full = {counts.trainer / counts.full:.4f})",
        f"  lora push  {counts.push * wire_bytes / mib:.2f} MiB per version vs {counts.full * wire_bytes / mib:.1f} "
        f"MiB for every weight: push bytes / full = {counts.push / counts.full:.5f} (engines serve: {lora.serve})",
    ]
