"""Options of the CPU engine, validated when it starts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CpuEngineConfig(BaseModel):
    """Everything the CPU engine needs to start; one instance per engine process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str
    """Folder with an HF causal LM (config.json + safetensors) and its tokenizer."""
    host: str = "127.0.0.1"
    """Address the HTTP server binds to."""
    port: int = Field(default=30000, ge=0, le=65535)
    """TCP port of the HTTP server; 0 lets the OS pick a free one (see ``port_file``)."""
    port_file: str | None = None
    """Once the server's socket is bound, write its port here (atomically), so that whoever started the engine
    with port 0 learns where it listens without picking a port for it."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights and activations; logits are always turned into float32 before sampling."""
    max_batch: int = Field(default=32, ge=1, le=4096)
    """Most sequences decoded together in one forward pass; further requests wait for a free row."""
    enable_return_routed_experts: bool = False
    """Record the router's top-k expert ids of every token (SGLang's --enable-return-routed-experts)."""
    logprob_mode: Literal["temperature", "original"] = "temperature"
    """Distribution the returned logprobs come from: softmax(logits / T) like SGLang's default, or softmax(logits)
    like SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1. Greedy requests (T = 0) always use softmax(logits)."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """transformers attention kernel."""
    max_context_len: int | None = Field(default=None, ge=2)
    """Longest prompt + output in tokens; defaults to the model's max_position_embeddings."""
    num_threads: int | None = Field(default=None, ge=1, le=1024)
    """torch intra-op threads; None keeps torch's default (which honours OMP_NUM_THREADS)."""
    tp: int = Field(default=1, ge=1, le=64)
    """Ranks the engine holds in the trainer's weight group, as an SGLang server with this TP size does; each receives
    every broadcast, rank 0 applies it (the model itself is not sharded)."""
    initial_weight_version: str = "0"
    """weight_version reported before the first weight update."""
    hold_until_update: bool = False
    """Hold generation (requests queue, nothing is sampled) until the first complete weight update: an engine that
    restarted, or that a resumed run started, would otherwise serve its start-up weights, not the trainer's."""
    disable_radix_cache: bool = False
    """Keep no prefix cache (SGLang's --disable-radix-cache): every prompt is computed whole, ``/model_info`` says
    ``"prefix_cache": false``, and a pusher then skips ``/flush_cache``."""
    prefix_cache_mb: float = Field(default=256.0, gt=0)
    """Most memory the prefix cache's keys, values and routing rows take; the least recently used prompts go first."""
    seed: int = Field(default=0, ge=0)
    """Seeds the process RNG that requests without a sampling_seed draw from (batched, so their draws depend on
    what they are batched with; a request that must repeat itself passes sampling_seed)."""
    patch: str | None = None
    """``package.module:function`` called with the loaded transformers model to add the modules a trainer-side
    ``model.spec`` adds (the recipe's ``model.engine_patch``); tensors of the folder that only the patched model
    knows are loaded after it ran."""
    plugin_paths: list[str] = []
    """Folders ``patch`` is imported from (the recipe's ``plugins.paths``)."""
    lora: Literal["merge", "adapter"] = "merge"
    """How pushed LoRA adapters (``*.lora_A.weight`` / ``*.lora_B.weight``) are served: merged into the weights, or
    applied beside the base as SGLang does (``pipeline.producers.cpu_engine.lora``)."""
    weight_dtype: Literal["auto", "fp8"] = "auto"
    """"fp8": projection weights stored as float8_e4m3fn with 128 x 128 block scales and inputs quantized per token
    group of 128, as FP8 inference does (``pipeline.producers.cpu_engine.fp8``); needs dtype float32."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Logging level of the engine process."""
