"""The one place that turns sluice's typed config into megatron-core's objects.

Nothing else in sluice sets a megatron flag: the trainer, conversion and checkpoint code all receive the
``TransformerConfig``, layer spec and ``GPTModel`` keyword arguments built here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig, check_layout

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Qwen3's init std; only matters for models that are not loaded from an HF checkpoint (tests, from-scratch runs).
_INIT_STD = 0.02


def torch_dtype(model: ModelConfig) -> torch.dtype:
    """The torch dtype of the model's parameters."""
    return _TORCH_DTYPES[model.dtype]


def transformer_engine_available() -> bool:
    """Whether TransformerEngine can be imported (it decides the layer spec on GPU)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def use_te_spec(parallel: ParallelConfig) -> bool:
    """TE layer spec on CUDA with TE installed; the local (pure megatron-core) spec everywhere else."""
    return parallel.resolved_device() == "cuda" and transformer_engine_available()


def build_transformer_config(model: ModelConfig, parallel: ParallelConfig, *, r3: bool) -> Any:
    """megatron-core ``TransformerConfig`` (``MLATransformerConfig`` for latent attention) for ``model`` laid out as
    ``parallel``; r3 turns on routing replay."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_layout(model, parallel)
    on_cpu = parallel.resolved_device() == "cpu"
    dtype = torch_dtype(model)
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_kv_heads,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        qk_layernorm=model.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        # MoE layers need add_bias_linear=False (in-place view error in mlp.py otherwise); Qwen3 has no biases.
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=_INIT_STD,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        # megatron requires sequence parallelism for MoE under TP (only reachable on CUDA; check_layout refuses it on
        # CPU, where the TE/Apex norms it needs do not exist).
        sequence_parallel=parallel.tp > 1 and model.is_moe,
        use_cpu_initialization=on_cpu,
        # The fused kernels below are CUDA-only; keeping them off also makes CPU and GPU numerics comparable.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    if model.is_moe:
        kwargs.update(_moe_kwargs(model, parallel, r3=r3))
    if model.mla is not None:
        return MLATransformerConfig(**kwargs, **_mla_kwargs(model))
    return TransformerConfig(**kwargs)


def _mla_kwargs(model: ModelConfig) -> dict[str, Any]:
    assert model.mla is not None
    yarn = model.yarn
    rope: dict[str, Any] = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if yarn is not None:
        rope = dict(rope_type="yarn", rotary_scaling_factor=yarn.factor, mscale=yarn.mscale,
                    mscale_all_dim=yarn.mscale_all_dim, beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow,
                    original_max_position_embeddings=yarn.original_max_position_embeddings)
    return dict(
        q_lora_rank=model.mla.q_lora_rank,
        kv_lora_rank=model.mla.kv_lora_rank,
        qk_head_dim=model.mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.mla.qk_rope_head_dim,
        v_head_dim=model.mla.v_head_dim,
        rotary_base=model.rope_theta,
        **rope,
    )


def _moe_kwargs(model: ModelConfig, parallel: ParallelConfig, *, r3: bool) -> dict[str, Any]:
    return dict(
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_topk,
        moe_router_score_function=model.router_score,
        # Softmax routers (Qwen3-MoE): softmax over all experts, then top-k, renormalised iff norm_topk_prob.
        # megatron's pre_softmax=False takes top-k on logits then softmaxes the k (the renormalised form);
        # pre_softmax=True keeps the full-softmax probabilities (the un-normalised form). Sigmoid routers always
        # renormalise the chosen scores (the family refuses configs that do not).
        moe_router_pre_softmax=not model.norm_topk_prob and model.router_score == "softmax",
        # Aux-loss-free balancing: a bias on the scores that only steers the choice. The train step updates it
        # (megatron does in finalize_model_grads, which sluice's update path does not call).
        moe_router_enable_expert_bias=model.router_expert_bias,
        moe_router_num_groups=model.router_groups if model.router_groups > 1 else None,
        moe_router_group_topk=model.router_group_topk if model.router_groups > 1 else None,
        moe_router_topk_scaling_factor=model.routed_scaling_factor if model.routed_scaling_factor != 1.0 else None,
        # HF's sigmoid router (DeepSeek-V3) computes its logits in fp32, and keeps its weight in fp32 too.
        moe_router_dtype="fp32" if model.router_score == "sigmoid" else None,
        moe_shared_expert_intermediate_size=model.shared_expert_ffn_hidden_size or None,
        # RL fine-tuning keeps routing as trained; an aux loss would also make losses differ from the reference.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=parallel.dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_enable_routing_replay=r3,
        # Leading dense layers (DeepSeek-V3's first_k_dense_replace) as megatron's per-layer pattern.
        moe_layer_freq=model.moe_layer_pattern,
    )


def build_layer_spec(model: ModelConfig, parallel: ParallelConfig, config: Any) -> Any:
    """The decoder block spec, one layer spec per layer (dense or MoE as ``config.moe_layer_freq`` says): TE modules
    on CUDA when available, else megatron-core's local modules."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = use_te_spec(parallel)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if model.mla is not None and not te:
        _local_mla_spec(spec)
    return spec


def _local_mla_spec(spec: Any) -> None:
    """Make megatron's local spec run MLA: its own core attention cannot (``attention.py``), and its MLA module's TE
    checks need TE's absence stated (``cpu_shim.patch_mla_without_te``)."""
    from pipeline.consumers.megatron.attention import LatentCoreAttention
    from pipeline.consumers.megatron.cpu_shim import patch_mla_without_te

    patch_mla_without_te()
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = LatentCoreAttention


@dataclass(frozen=True)
class GPTModelArgs:
    """Everything ``GPTModel(...)`` takes, built from sluice's config."""

    config: Any
    transformer_layer_spec: Any
    vocab_size: int
    max_sequence_length: int
    share_embeddings_and_output_weights: bool
    rotary_base: float

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``megatron.core.models.gpt.GPTModel``."""
        return dict(
            config=self.config,
            transformer_layer_spec=self.transformer_layer_spec,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=self.rotary_base,
        )


def build_gpt_model_args(model: ModelConfig, parallel: ParallelConfig, *, r3: bool, spec: str | None = None,
                         hf_config: Mapping[str, Any] | None = None) -> GPTModelArgs:
    """Arguments of the ``GPTModel`` for ``model`` under ``parallel``; ``spec`` is a ``model.spec`` import path whose
    function edits the layer spec (``pipeline.models.spec``), ``hf_config`` the config.json it is shown."""
    config = build_transformer_config(model, parallel, r3=r3)
    layer_spec = build_layer_spec(model, parallel, config)
    if spec is not None:
        from pipeline.models.spec import SpecContext, build_user_spec

        # A copy: megatron's spec builders may hand out shared objects, and the next plain build must not see edits.
        context = SpecContext(config=config, model=model, hf_config=dict(hf_config or {}),
                              default=copy.deepcopy(layer_spec))
        layer_spec = build_user_spec(spec, context)
    return GPTModelArgs(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        rotary_base=model.rope_theta,
    )
