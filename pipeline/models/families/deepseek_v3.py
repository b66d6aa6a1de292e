"""DeepSeek-V3 (and the models built on its layout: Kimi K2, DeepSeek-V3.1/V3.2 without sparse attention).

Multi-head latent attention, a shared expert beside the routed ones, a sigmoid router with a learned per-expert bias
that only steers the choice (aux-loss-free balancing), group-limited top-k, and dense MLPs in the first
``first_k_dense_replace`` layers. What sluice refuses, and why (each one would train a different model than the
engines serve):

- ``rope_interleave = false``: megatron's MLA always rotates RoPE pairs interleaved, as HF does by default;
- group scoring other than top-2: HF scores an expert group by the sum of its 2 best experts, megatron by its best
  ``topk / topk_group``; the two agree only when that quotient is 2 (DeepSeek-V3: 8 / 4);
- ``norm_topk_prob = false`` or top-1 routing: megatron always renormalises the sigmoid scores of the chosen experts;
- quantized checkpoints (DeepSeek-V3's FP8 release): dequantize to bf16 first.

The multi-token-prediction layer a checkpoint may carry (``model.layers.{num_hidden_layers}``) is not trained and
is skipped on load.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.errors import ConfigError
from pipeline.models.config import DType, HFGetter, MLAConfig, ModelConfig, YarnScaling, rope_parameters
from pipeline.models.families.base import ModelFamily
from pipeline.models.families.mapping import (
    Rule,
    dense_mlp_rules,
    expert_rules,
    norm_rules,
    router_rules,
    same,
    shared_expert_rules,
)

# Small, with every feature: MLA with both latents, 16 experts in 4 groups (a token draws its 4 experts from the 2
# best groups, so group limiting actually removes candidates), a shared expert, a leading dense layer, a non-trivial
# routed scaling factor.
_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    # Wider than the usual 0.02, for the same reason as the Qwen3 tiny model: well separated router scores.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
# The tiny model's expert bias: about a third of the spread of its sigmoid scores, so it changes some choices.
_TINY_BIAS_STD = 0.05
# HF's DeepseekV3TopkRouter scores a group by the sum of its two best experts' scores (a constant in its code).
_HF_GROUP_SCORE_TOPK = 2
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3Family(ModelFamily):
    """DeepSeek-V3-style MoE: MLA, shared expert, sigmoid router with expert bias, group-limited top-k."""

    name = "deepseek-v3"
    hf_model_types = ("deepseek_v3", "kimi_k2")
    tiny_archs = ("deepseek-v3",)

    def tiny_config(self, arch: str, values: dict[str, Any]) -> Any:
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**{**_TINY, **values})

    def model_config(self, get: HFGetter, dtype: DType) -> ModelConfig:
        _refuse_unsupported(get)
        heads = int(get("num_attention_heads"))
        experts = int(get("n_routed_experts", None) or get("num_local_experts", 0) or 0)
        topk = int(get("num_experts_per_tok", 1))
        groups, group_topk = int(get("n_group", 1) or 1), int(get("topk_group", 1) or 1)
        if groups > 1 and topk // group_topk != _HF_GROUP_SCORE_TOPK:
            raise ConfigError(
                f"n_group={groups} with num_experts_per_tok={topk} and topk_group={group_topk}: HF scores an expert "
                f"group by its {_HF_GROUP_SCORE_TOPK} best experts, megatron by its best num_experts_per_tok / "
                f"topk_group = {topk // group_topk}, so the two would route differently; sluice needs that quotient "
                f"to be {_HF_GROUP_SCORE_TOPK} (or n_group = 1)"
            )
        if not bool(get("norm_topk_prob", True)) or topk == 1:
            raise ConfigError("norm_topk_prob=false or top-1 routing: megatron always renormalises the sigmoid scores "
                              "of a token's chosen experts, so it would weigh experts differently from HF")
        mla = MLAConfig(q_lora_rank=get("q_lora_rank", None), kv_lora_rank=int(get("kv_lora_rank")),
                        qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
                        v_head_dim=int(get("v_head_dim")))
        theta, yarn = _rope(get)
        return ModelConfig(
            family="deepseek-v3",
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            ffn_hidden_size=int(get("intermediate_size")),
            moe_ffn_hidden_size=int(get("moe_intermediate_size")),
            num_layers=int(get("num_hidden_layers")),
            num_attention_heads=heads,
            num_kv_heads=heads,
            head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            qk_norm=True,  # the q and kv latents' RMSNorms (q_a_layernorm, kv_a_layernorm)
            mla=mla,
            num_experts=experts,
            moe_topk=topk,
            first_dense_layers=int(get("first_k_dense_replace", 0) or 0),
            shared_expert_ffn_hidden_size=int(get("moe_intermediate_size")) * int(get("n_shared_experts", 0) or 0),
            router_score="sigmoid",
            norm_topk_prob=True,
            router_expert_bias=True,
            router_groups=groups,
            router_group_topk=group_topk if groups > 1 else 1,
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0) or 1.0),
            rope_theta=theta,
            yarn=yarn,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            dtype=dtype,
        )

    def layer_rules(self, model: ModelConfig, layer: int) -> list[Rule]:
        rules = norm_rules() + _mla_rules(model)
        if not model.is_moe_layer(layer):
            return rules + dense_mlp_rules()
        rules += router_rules(expert_bias=model.router_expert_bias) + expert_rules(model.num_experts)
        return rules + (shared_expert_rules() if model.shared_expert_ffn_hidden_size else [])

    def init_tiny_weights(self, hf_model: Any, generator: Any) -> None:
        # HF starts the expert bias at zero; a trained model's is not, and a zero bias would let every test pass
        # with the bias ignored on the way from checkpoint to router.
        import torch

        with torch.no_grad():
            for name, buffer in hf_model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(_TINY_BIAS_STD * torch.randn(buffer.shape, generator=generator))

    def ignored_hf_tensor(self, name: str, model: ModelConfig) -> bool:
        # The multi-token-prediction module comes after the decoder layers; sluice trains the next-token head only.
        match = _LAYER.match(name)
        return match is not None and int(match.group(1)) >= model.num_layers


def _mla_rules(model: ModelConfig) -> list[Rule]:
    # Head layouts already agree: HF's q_b_proj rows are [nope, rope] per head and kv_b_proj rows [nope, v] per head,
    # as megatron's linear_q_up_proj / linear_kv_up_proj; kv_a_proj_with_mqa is [latent, shared rope key] in both.
    assert model.mla is not None
    attn = "self_attention."
    if model.mla.q_lora_rank is None:
        query = [same(f"{attn}linear_q_proj.weight", "self_attn.q_proj.weight")]
    else:
        query = [same(f"{attn}linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
                 same(f"{attn}q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
                 same(f"{attn}linear_q_up_proj.weight", "self_attn.q_b_proj.weight")]
    return query + [
        same(f"{attn}linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        same(f"{attn}kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
        same(f"{attn}linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
        same(f"{attn}linear_proj.weight", "self_attn.o_proj.weight"),
    ]


def _refuse_unsupported(get: HFGetter) -> None:
    problems = []
    if get("quantization_config", None):
        problems.append("the checkpoint is quantized (quantization_config is set, e.g. DeepSeek-V3's FP8 release); "
                        "dequantize it to bf16 first")
    if get("attention_bias", False):
        problems.append("attention_bias=true: megatron's MLA projections have no biases")
    if not bool(get("rope_interleave", True)):
        problems.append("rope_interleave=false: megatron's MLA rotates interleaved RoPE pairs only")
    if get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={get('hidden_act')!r}: sluice builds SwiGLU MLPs only")
    if get("scoring_func", "sigmoid") != "sigmoid" or get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"scoring_func={get('scoring_func', None)!r}, topk_method={get('topk_method', None)!r}: sluice "
                        "maps DeepSeek-V3's sigmoid router with bias-corrected group top-k (noaux_tc) only")
    if int(get("moe_layer_freq", 1) or 1) != 1:
        problems.append("moe_layer_freq != 1: sluice describes leading dense layers (first_k_dense_replace) only")
    if problems:
        raise ConfigError("unsupported DeepSeek-V3 config: " + "; ".join(problems))


def _rope(get: HFGetter) -> tuple[float, YarnScaling | None]:
    theta, params = rope_parameters(get, 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ConfigError(f"rope_type {kind!r} is not supported for DeepSeek-V3; plain RoPE and YaRN are")
    return theta, YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        mscale=float(params.get("mscale", 1.0)),
        mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
    )
