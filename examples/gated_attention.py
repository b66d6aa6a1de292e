"""A gated attention output as a sluice model spec: ``model.spec = "gated_attention:gated_attention"``.

Each attention head's output is scaled by a gate computed from the layer's input before the output projection, as
in Qwen3-Next's gated attention (there the gate comes out of a widened query projection; here it is a small
projection of its own, so the checkpoint's attention weights keep their shapes):

    gate[s, b, h] = 2 * sigmoid(hidden[s, b, :] @ W_gate[h, :] + b_gate[h])
    out[s, b, h, :] = attention[s, b, h, :] * gate[s, b, h]

W_gate and b_gate start at zero, so every gate is exactly 2 * sigmoid(0) = 1 and a model converted from a plain HF
checkpoint computes the same logits as before, bit for bit; training then moves the gates away from 1.

``patch_hf_model`` gives a transformers Qwen3 / Qwen3-MoE model the same gate, under the HF names the megatron
module declares, so that sluice's CPU engine samples from the model the trainer trains.

Recipe lines:

    [plugins]
    paths = ["examples"]

    [model]
    spec = "gated_attention:gated_attention"
    engine_patch = "gated_attention:patch_hf_model"
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from pipeline.models.spec import SpecContext


class GatedSelfAttention(SelfAttention):
    """megatron-core self-attention whose per-head outputs pass through an input-dependent sigmoid gate (starting
    at exactly 1) before the output projection."""

    hf_weights: ClassVar[dict[str, str]] = {
        "linear_gate.weight": "self_attn.head_gate.weight",
        "linear_gate.bias": "self_attn.head_gate.bias",
    }
    """How sluice names the gate in HF checkpoints and weight pushes (relative to ``model.layers.{i}.``)."""

    def __init__(self, config: Any, submodules: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        # Column-parallel over heads: under TP each rank gates its own heads, and megatron's sharding attributes
        # tell conversion and dist-checkpointing how to split and gather the gate like any other weight.
        self.linear_gate = ColumnParallelLinear(
            config.hidden_size, config.num_attention_heads, config=config, init_method=torch.nn.init.zeros_,
            bias=True, gather_output=False, skip_bias_add=False, is_expert=False, tp_group=self.pg_collection.tp,
        )
        with torch.no_grad():  # zero however megatron initialised (perform_initialization may be off)
            self.linear_gate.weight.zero_()
            self.linear_gate.bias.zero_()
        self._gate: torch.Tensor | None = None
        # The gate must act between core attention and linear_proj, inside the parent's forward; a pre-hook on
        # linear_proj does that without copying megatron's forward (and keeps linear_proj's parameter names).
        self.linear_proj.register_forward_pre_hook(self._gate_heads)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        logits, _ = self.linear_gate(hidden_states)  # [s, b, local heads]
        self._gate = 2.0 * torch.sigmoid(logits.float())
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self._gate = None

    def _gate_heads(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if self._gate is None:
            raise RuntimeError("GatedSelfAttention.linear_proj was called outside GatedSelfAttention.forward")
        attn, *rest = args  # [s, b, local heads * head_dim]
        s, b, _ = attn.shape
        heads = self._gate.shape[-1]
        gated = attn.reshape(s, b, heads, -1).float() * self._gate.unsqueeze(-1)
        return (gated.to(attn.dtype).reshape(s, b, -1), *rest)


class _HFHeadGate:
    """The same gate on a transformers attention module: ``head_gate`` (an ``nn.Linear(hidden, heads)``) computes it
    from the attention's input, and it scales ``o_proj``'s input head by head."""

    def __init__(self, attention: torch.nn.Module, hidden_size: int, heads: int) -> None:
        param = next(attention.parameters())
        attention.head_gate = torch.nn.Linear(hidden_size, heads, bias=True, dtype=param.dtype, device=param.device)
        with torch.no_grad():
            attention.head_gate.weight.zero_()
            attention.head_gate.bias.zero_()
        self.attention = attention
        self.gate: torch.Tensor | None = None
        attention.register_forward_pre_hook(self.compute, with_kwargs=True)
        attention.o_proj.register_forward_pre_hook(self.apply)

    def compute(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [b, s, hidden]
        self.gate = 2.0 * torch.sigmoid(self.attention.head_gate(hidden).float())

    def apply(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        attn, *rest = args  # [b, s, heads * head_dim]
        assert self.gate is not None, "o_proj ran outside its attention module"
        b, s, _ = attn.shape
        gated = attn.reshape(b, s, self.gate.shape[-1], -1).float() * self.gate.unsqueeze(-1)
        return (gated.to(attn.dtype).reshape(b, s, -1), *rest)


def patch_hf_model(hf_model: torch.nn.Module) -> None:
    """Add the gate (exactly 1 until weights arrive) to every layer of a transformers Qwen3 / Qwen3-MoE model, as
    ``model.layers.{i}.self_attn.head_gate.{weight,bias}``: the recipe's ``model.engine_patch``."""
    config = hf_model.config
    for layer in hf_model.model.layers:
        _HFHeadGate(layer.self_attn, config.hidden_size, config.num_attention_heads)


def gated_attention(context: SpecContext) -> TransformerBlockSubmodules:
    """The family's layer spec with every layer's self-attention gated (grouped-query attention models only)."""
    if context.model.mla is not None:
        raise ValueError("the gated attention example gates grouped-query attention (qwen3 family); this model uses "
                         "multi-head latent attention")
    for layer in context.default.layer_specs:
        layer.submodules.self_attention.module = GatedSelfAttention
    return context.default
