"""Qwen3 and Qwen3-MoE: grouped-query attention with per-head q/k norms, softmax routing over all experts.

The traps of the mapping (each caught by a conversion test): megatron's ``linear_qkv`` is grouped by kv head, and
the router's ``norm_topk_prob`` decides megatron's ``moe_router_pre_softmax``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConfigError
from pipeline.models.config import DType, HFGetter, ModelConfig, rope_parameters
from pipeline.models.families.base import ModelFamily
from pipeline.models.families.mapping import (
    Rule,
    dense_mlp_rules,
    expert_rules,
    norm_rules,
    router_rules,
    same,
)

if TYPE_CHECKING:
    import torch

# Shared by both architectures; small but with every feature of the real thing (GQA, qk-norm, RoPE).
_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # Wider than the usual 0.02 so that router scores and next-token logits are well separated: with a 64-wide
    # model at 0.02 many top-k choices sit within float rounding of a tie, which makes tests flaky, not stricter.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
_TINY_MOE: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
}


def _qkv_to_megatron(parts: Sequence[torch.Tensor], *, groups: int, per_group: int, d: int) -> torch.Tensor:
    # megatron's linear_qkv is grouped by kv head: for each group, that group's q rows, then its k rows, then v. A
    # plain cat([q, k, v]) has the same shape and silently wrong logits under GQA.
    import torch

    q, k, v = parts
    hidden = q.shape[-1]
    return torch.cat([q.reshape(groups, per_group * d, hidden), k.reshape(groups, d, hidden),
                      v.reshape(groups, d, hidden)], dim=1).reshape(-1, hidden)


def _qkv_to_hf(qkv: torch.Tensor, *, groups: int, per_group: int, d: int) -> list[torch.Tensor]:
    hidden = qkv.shape[-1]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, hidden).split([per_group * d, d, d], dim=1)
    return [q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]


class Qwen3Family(ModelFamily):
    """Qwen3 (dense) and Qwen3-MoE (every layer MoE)."""

    name = "qwen3"
    hf_model_types = ("qwen3", "qwen3_moe")
    tiny_archs = ("qwen3", "qwen3-moe")

    def tiny_config(self, arch: str, values: dict[str, Any]) -> Any:
        from transformers import Qwen3Config, Qwen3MoeConfig

        merged = {**_TINY_COMMON, **(_TINY_MOE if arch == "qwen3-moe" else {}), **values}
        return Qwen3MoeConfig(**merged) if arch == "qwen3-moe" else Qwen3Config(**merged)

    def model_config(self, get: HFGetter, dtype: DType) -> ModelConfig:
        model_type = get("model_type")
        if get("attention_bias", False):
            raise ConfigError("attention_bias=True is not supported by sluice's Qwen3 conversion")
        # transformers 5 writes num_local_experts to config.json and aliases num_experts to it on the object.
        experts = get("num_experts", None) or get("num_local_experts", 0)
        num_experts = int(experts or 0) if model_type == "qwen3_moe" else 0
        if num_experts:
            _refuse_mixed_dense_moe(get)
        num_heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        theta, rope = rope_parameters(get, 1_000_000.0)
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_type {rope['rope_type']!r} is not supported for Qwen3; only plain RoPE is")
        return ModelConfig(
            family="qwen3",
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            ffn_hidden_size=int(get("intermediate_size")),
            moe_ffn_hidden_size=int(get("moe_intermediate_size", 0) or 0) if num_experts else 0,
            num_layers=int(get("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_kv_heads=int(get("num_key_value_heads", None) or num_heads),
            head_dim=int(get("head_dim", None) or hidden // num_heads),
            qk_norm=True,
            num_experts=num_experts,
            moe_topk=int(get("num_experts_per_tok", 1)) if num_experts else 1,
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            rope_theta=theta,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            dtype=dtype,
        )

    def layer_rules(self, model: ModelConfig, layer: int) -> list[Rule]:
        dims = dict(groups=model.num_kv_heads, per_group=model.num_attention_heads // model.num_kv_heads,
                    d=model.head_dim)
        rules = [
            *norm_rules(),
            Rule("self_attention.linear_qkv.weight",
                 ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                 join=partial(_qkv_to_megatron, **dims), split=partial(_qkv_to_hf, **dims)),
            same("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
        ]
        if model.qk_norm:
            rules += [same("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                      same("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")]
        if model.is_moe_layer(layer):
            return rules + router_rules(expert_bias=False) + expert_rules(model.num_experts)
        return rules + dense_mlp_rules()


def _refuse_mixed_dense_moe(get: HFGetter) -> None:
    # Qwen3-MoE can interleave dense layers; sluice's ModelConfig describes leading dense layers only, and every
    # released Qwen3-MoE uses all-MoE layers.
    if int(get("decoder_sparse_step", 1) or 1) != 1 or list(get("mlp_only_layers", []) or []):
        raise ConfigError(
            "HF config mixes dense and MoE layers (decoder_sparse_step != 1 or mlp_only_layers set); "
            "sluice supports all-MoE Qwen3-MoE models only"
        )
