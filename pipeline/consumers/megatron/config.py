"""sluice's typed model and parallel layout for the Megatron-core trainer.

Only these two models face the user; ``adapter.py`` turns them into megatron-core's own config objects.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]

# HF model types the hand-written conversion in convert.py knows.
SUPPORTED_HF_MODEL_TYPES = ("qwen3_moe", "qwen3")


class ModelConfig(BaseModel):
    """Architecture of a Qwen3 / Qwen3-MoE decoder; ``num_experts = 0`` is the dense Qwen3."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(ge=1, le=1 << 22)
    """Rows of the embedding and of the output layer."""
    hidden_size: int = Field(ge=1, le=65536)
    """Width of the residual stream."""
    ffn_hidden_size: int = Field(ge=1, le=1 << 20)
    """Intermediate width of the dense MLP (unused by MoE layers)."""
    moe_ffn_hidden_size: int = Field(default=0, ge=0, le=1 << 20)
    """Intermediate width of one expert; required when num_experts > 0."""
    num_layers: int = Field(ge=1, le=1024)
    """Decoder layers."""
    num_attention_heads: int = Field(ge=1, le=1024)
    """Query heads."""
    num_kv_heads: int = Field(ge=1, le=1024)
    """Key/value heads (GQA groups); must divide num_attention_heads."""
    head_dim: int = Field(ge=1, le=1024)
    """Width of one attention head (Qwen3 sets it independently of hidden_size)."""
    qk_norm: bool = True
    """RMS-normalise queries and keys per head before RoPE (Qwen3 does)."""
    num_experts: int = Field(default=0, ge=0, le=65536)
    """Routed experts per MoE layer; 0 means a dense model."""
    moe_topk: int = Field(default=1, ge=1, le=256)
    """Experts each token is routed to."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1."""
    rope_theta: float = Field(default=1_000_000.0, gt=0)
    """RoPE base frequency."""
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
        """Whether the MLPs are routed experts."""
        return self.num_experts > 0

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; GQA needs whole query groups per kv head"
            )
        if self.is_moe:
            if self.moe_ffn_hidden_size == 0:
                raise ValueError("num_experts > 0 needs moe_ffn_hidden_size (the width of one expert)")
            if self.moe_topk > self.num_experts:
                raise ValueError(f"moe_topk={self.moe_topk} exceeds num_experts={self.num_experts}")
        return self

    @classmethod
    def from_hf(cls, hf_config: Any, *, dtype: DType | None = None) -> ModelConfig:
        """Read a transformers ``Qwen3MoeConfig`` / ``Qwen3Config`` (object or ``config.json`` dict)."""
        get = _getter(hf_config)
        model_type = get("model_type")
        if model_type not in SUPPORTED_HF_MODEL_TYPES:
            raise ConfigError(
                f"HF model_type {model_type!r} is not supported; sluice converts {SUPPORTED_HF_MODEL_TYPES}"
            )
        if get("attention_bias", False):
            raise ConfigError("attention_bias=True is not supported by sluice's Qwen3 conversion")
        # transformers 5 writes num_local_experts to config.json and aliases num_experts to it on the object.
        experts = get("num_experts", None) or get("num_local_experts", 0)
        num_experts = int(experts or 0) if model_type == "qwen3_moe" else 0
        if num_experts:
            _refuse_mixed_dense_moe(get)
        num_heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        return cls(
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
            rope_theta=_rope_theta(get),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            dtype=dtype or _hf_dtype(get),
        )


def _getter(hf_config: Any) -> Any:
    if isinstance(hf_config, dict):
        return lambda key, default=...: hf_config[key] if default is ... else hf_config.get(key, default)

    def get(key: str, default: Any = ...) -> Any:
        return getattr(hf_config, key) if default is ... else getattr(hf_config, key, default)

    return get


def _refuse_mixed_dense_moe(get: Any) -> None:
    # Qwen3-MoE can interleave dense layers; megatron needs a per-layer MoE pattern for that, which sluice does not
    # build yet. Every released Qwen3-MoE uses all-MoE layers.
    if int(get("decoder_sparse_step", 1) or 1) != 1 or list(get("mlp_only_layers", []) or []):
        raise ConfigError(
            "HF config mixes dense and MoE layers (decoder_sparse_step != 1 or mlp_only_layers set); "
            "sluice supports all-MoE Qwen3-MoE models only"
        )


def _rope_theta(get: Any) -> float:
    # transformers 5 moved rope_theta into rope_parameters; 4.x keeps it at the top level.
    params = get("rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        if params.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_type {params['rope_type']!r} is not supported; only plain RoPE is")
        return float(params["rope_theta"])
    return float(get("rope_theta", 1_000_000.0))


def _hf_dtype(get: Any) -> DType:
    raw = get("dtype", None) or get("torch_dtype", None)
    name = str(raw).removeprefix("torch.") if raw is not None else "bfloat16"
    return name if name in ("float32", "bfloat16", "float16") else "bfloat16"  # type: ignore[return-value]


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
    problems = list(_layout_problems(model, parallel))
    if world_size is not None:
        parallel.dp(world_size)
    if problems:
        raise ConfigError("invalid trainer layout: " + "; ".join(problems))


def _layout_problems(model: ModelConfig, parallel: ParallelConfig) -> list[str]:
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
        problems = _layout_problems(self.model, self.parallel)
        if problems:
            raise ValueError("invalid trainer layout: " + "; ".join(problems))
        return self
