"""sluice's typed description of a decoder architecture, independent of any framework.

A ``ModelConfig`` is built from an HF ``config.json`` by the model's family (``pipeline.models.families``): the
family knows its HF field names, the model config only the architecture's features (attention kind, router, shared
experts, dense layers). Megatron's objects are built from these features in ``consumers/megatron/adapter.py``, and
the planner counts parameters from them (``consumers/megatron/plan.py``), so neither needs to know the family.

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]
FamilyName = Literal["qwen3", "deepseek-v3"]
HFGetter = Callable[..., Any]
"""``get(key)`` or ``get(key, default)`` on an HF config object or ``config.json`` dict."""


class MLAConfig(BaseModel):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries and keys/values pass through low-rank latents,
    and only a small part of each head (the rope part) carries positions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    q_lora_rank: int | None = Field(ge=1, le=1 << 16)
    """Width of the query latent; None projects queries at full rank."""
    kv_lora_rank: int = Field(ge=1, le=1 << 16)
    """Width of the shared key/value latent."""
    qk_nope_head_dim: int = Field(ge=1, le=4096)
    """Per-head query/key width without positions."""
    qk_rope_head_dim: int = Field(ge=1, le=4096)
    """Per-head query/key width that RoPE rotates (one rope key shared by all heads)."""
    v_head_dim: int = Field(ge=1, le=4096)
    """Per-head value width."""


class YarnScaling(BaseModel):
    """YaRN context extension of RoPE (DeepSeek-V3 and Kimi K2 checkpoints use it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factor: float = Field(gt=0)
    """Context extension factor."""
    original_max_position_embeddings: int = Field(ge=1)
    """Context the model was pretrained at, before the extension."""
    beta_fast: float = 32.0
    """YaRN's high-frequency boundary."""
    beta_slow: float = 1.0
    """YaRN's low-frequency boundary."""
    mscale: float = 1.0
    """Attention temperature coefficient of the rotary part."""
    mscale_all_dim: float = 0.0
    """Attention temperature coefficient applied to the whole softmax scale."""


class ModelConfig(BaseModel):
    """Architecture of a decoder-only transformer as sluice trains it; ``num_experts = 0`` is a dense model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: FamilyName = "qwen3"
    """The family whose HF names and config fields describe this model (``pipeline.models.families``)."""
    vocab_size: int = Field(ge=1, le=1 << 22)
    """Rows of the embedding and of the output layer."""
    hidden_size: int = Field(ge=1, le=65536)
    """Width of the residual stream."""
    ffn_hidden_size: int = Field(ge=1, le=1 << 20)
    """Intermediate width of the dense MLPs (every layer of a dense model, the dense layers of an MoE one)."""
    moe_ffn_hidden_size: int = Field(default=0, ge=0, le=1 << 20)
    """Intermediate width of one routed expert; required when num_experts > 0."""
    num_layers: int = Field(ge=1, le=1024)
    """Decoder layers."""
    num_attention_heads: int = Field(ge=1, le=1024)
    """Query heads."""
    num_kv_heads: int = Field(ge=1, le=1024)
    """Key/value heads (GQA groups); must divide num_attention_heads. MLA models have one per query head."""
    head_dim: int = Field(ge=1, le=4096)
    """Width of one attention head (Qwen3 sets it independently of hidden_size; MLA uses its own widths)."""
    qk_norm: bool = True
    """RMS-normalise queries and keys: per head before RoPE (Qwen3), or the query and key/value latents (MLA)."""
    mla: MLAConfig | None = None
    """Multi-head latent attention; None is grouped-query attention."""
    num_experts: int = Field(default=0, ge=0, le=65536)
    """Routed experts per MoE layer; 0 means a dense model."""
    moe_topk: int = Field(default=1, ge=1, le=256)
    """Experts each token is routed to."""
    first_dense_layers: int = Field(default=0, ge=0, le=1024)
    """In an MoE model, how many leading layers have a dense MLP instead of experts (DeepSeek-V3: 3, Kimi K2: 1)."""
    shared_expert_ffn_hidden_size: int = Field(default=0, ge=0, le=1 << 20)
    """Intermediate width of the shared expert(s) every token also passes through; 0 for none."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """How router logits become scores: softmax over experts (Qwen3), or an independent sigmoid each (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1."""
    router_expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only (aux-loss-free balancing); sigmoid only."""
    router_groups: int = Field(default=1, ge=1, le=65536)
    """Expert groups for group-limited routing; 1 turns it off."""
    router_group_topk: int = Field(default=1, ge=1, le=65536)
    """Groups each token may draw its experts from (with router_groups > 1)."""
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    """Multiplies the routed experts' weights (DeepSeek-V3: 2.5)."""
    rope_theta: float = Field(default=1_000_000.0, gt=0)
    """RoPE base frequency."""
    yarn: YarnScaling | None = None
    """YaRN scaling of RoPE; None is plain RoPE."""
    rms_norm_eps: float = Field(default=1e-6, gt=0, le=1e-1)
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output layer."""
    max_position_embeddings: int = Field(default=4096, ge=1, le=1 << 22)
    """Longest sequence the model is built for."""
    dtype: DType = "bfloat16"
    """Parameter and compute dtype; use float32 on CPU."""

    @property
    def is_moe(self) -> bool:
        """Whether (some of) the MLPs are routed experts."""
        return self.num_experts > 0

    @property
    def moe_layer_pattern(self) -> list[int]:
        """Per layer, 1 for an MoE layer and 0 for a dense one (megatron's ``moe_layer_freq`` list)."""
        if not self.is_moe:
            return [0] * self.num_layers
        return [0 if i < self.first_dense_layers else 1 for i in range(self.num_layers)]

    @property
    def num_moe_layers(self) -> int:
        """Layers with routed experts: the layers whose routing an engine reports and R3 replays."""
        return sum(self.moe_layer_pattern)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has routed experts."""
        return self.moe_layer_pattern[layer] == 1

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; GQA needs whole query groups per kv head"
            )
        if self.is_moe:
            self._check_moe()
        return self

    def _check_moe(self) -> None:
        if self.moe_ffn_hidden_size == 0:
            raise ValueError("num_experts > 0 needs moe_ffn_hidden_size (the width of one expert)")
        if self.moe_topk > self.num_experts:
            raise ValueError(f"moe_topk={self.moe_topk} exceeds num_experts={self.num_experts}")
        if self.first_dense_layers >= self.num_layers:
            raise ValueError(f"first_dense_layers={self.first_dense_layers} leaves no MoE layer of {self.num_layers}")
        if self.router_expert_bias and self.router_score != "sigmoid":
            raise ValueError("router_expert_bias needs router_score = 'sigmoid' (megatron biases sigmoid scores only)")
        if self.num_experts % self.router_groups:
            raise ValueError(f"router_groups={self.router_groups} must divide num_experts={self.num_experts}")
        if self.router_group_topk > self.router_groups:
            raise ValueError(f"router_group_topk={self.router_group_topk} exceeds router_groups={self.router_groups}")
        if self.router_groups > 1 and self.moe_topk % self.router_group_topk:
            raise ValueError(f"router_group_topk={self.router_group_topk} must divide moe_topk={self.moe_topk}")

    @classmethod
    def from_hf(cls, hf_config: Any, *, dtype: DType | None = None) -> ModelConfig:
        """Read an HF config (a transformers config object or a ``config.json`` dict) through its family."""
        from pipeline.models.families import family_for_hf

        get = hf_getter(hf_config)
        return family_for_hf(get("model_type", None)).model_config(get, dtype or hf_dtype(get))


def hf_getter(hf_config: Any) -> HFGetter:
    """``get(key[, default])`` over an HF config object or a ``config.json`` dict."""
    if isinstance(hf_config, dict):
        return lambda key, default=...: hf_config[key] if default is ... else hf_config.get(key, default)

    def get(key: str, default: Any = ...) -> Any:
        return getattr(hf_config, key) if default is ... else getattr(hf_config, key, default)

    return get


def hf_dtype(get: HFGetter) -> DType:
    """The checkpoint's dtype (``dtype`` in transformers 5, ``torch_dtype`` before); bfloat16 when unknown."""
    raw = get("dtype", None) or get("torch_dtype", None)
    name = str(raw).removeprefix("torch.") if raw is not None else "bfloat16"
    return name if name in ("float32", "bfloat16", "float16") else "bfloat16"  # type: ignore[return-value]


def rope_parameters(get: HFGetter, default_theta: float) -> tuple[float, dict[str, Any]]:
    """(rope_theta, the rope_parameters/rope_scaling dict or {}): transformers 5 moved both into rope_parameters."""
    params = get("rope_parameters", None) or get("rope_scaling", None) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be a mapping, got {params!r}")
    theta = params.get("rope_theta", get("rope_theta", default_theta))
    return float(theta), params
