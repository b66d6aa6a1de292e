"""FP8 rollout by arithmetic, for ``--dry-run``: the engines' weight memory and one push's bytes with FP8 projections
(float8_e4m3fn and a float32 scale per 128 x 128 block, ``pipeline.quant.fp8``) against BF16.

Which weights are FP8 follows ``pipeline.quant.fp8.is_fp8_weight``: every attention projection (MHA or MLA) and every
MLP projection, routed, shared or dense; the rest (embeddings, norms, routers, the LM head) stays BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.consumers.megatron.config import ModelConfig
from pipeline.quant.blocks import fp8_nbytes


@dataclass(frozen=True)
class Fp8Bytes:
    fp8: int
    """Bytes of the model with FP8 projections (scales included) and everything else in BF16."""
    bf16: int
    """Bytes of the whole model in BF16."""
    scales: int
    """Bytes of the block scales alone."""


def _projection_shapes(model: ModelConfig, layer: int) -> list[tuple[tuple[int, int], int]]:
    """((out, in), count) of every FP8 projection of ``layer``."""
    h = model.hidden_size
    shapes: list[tuple[tuple[int, int], int]] = []
    if model.mla is None:
        heads, kv, d = model.num_attention_heads, model.num_kv_heads, model.head_dim
        shapes += [((heads * d, h), 1), ((kv * d, h), 2), ((h, heads * d), 1)]
    else:
        mla, heads = model.mla, model.num_attention_heads
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            shapes.append(((heads * qk, h), 1))
        else:
            shapes += [((mla.q_lora_rank, h), 1), ((heads * qk, mla.q_lora_rank), 1)]
        shapes += [((mla.kv_lora_rank + mla.qk_rope_head_dim, h), 1),
                   ((heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank), 1),
                   ((h, heads * mla.v_head_dim), 1)]
    if model.is_moe_layer(layer):
        f = model.moe_ffn_hidden_size
        shapes += [((f, h), 2 * model.num_experts), ((h, f), model.num_experts)]
        if model.shared_expert_ffn_hidden_size:
            s = model.shared_expert_ffn_hidden_size
            shapes += [((s, h), 2), ((h, s), 1)]
    else:
        f = model.ffn_hidden_size
        shapes += [((f, h), 2), ((h, f), 1)]
    return shapes


def fp8_bytes(model: ModelConfig, total_params: int) -> Fp8Bytes:
    """Model bytes with FP8 projections, against BF16; ``total_params`` is every parameter of the model."""
    projected = fp8 = scales = 0
    for layer in range(model.num_layers):
        for (out, inp), count in _projection_shapes(model, layer):
            projected += out * inp * count
            fp8 += fp8_nbytes((out, inp)) * count
            scales += (fp8_nbytes((out, inp)) - out * inp) * count
    rest = total_params - projected
    return Fp8Bytes(fp8=fp8 + 2 * rest, bf16=2 * total_params, scales=scales)


def format_fp8(counts: Fp8Bytes, selected: bool) -> list[str]:
    """The dry run's FP8 line."""
    state = "engine.weight_dtype = fp8" if selected else "with engine.weight_dtype = fp8"
    return [f"  fp8        {state}: engine weights {_size(counts.fp8)} (block scales {_size(counts.scales)}) vs "
            f"{_size(counts.bf16)} in BF16; push bytes FP8 / BF16 = {counts.fp8 / counts.bf16:.3f}"]


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"



def sglang_fp8_problems(model: ModelConfig, sglang_args: list[str]) -> list[str]:
    """Why SGLang's block-FP8 layers could not hold this model with these server flags
    (``pipeline.quant.checkpoint.fp8_shape_problems``)."""
    from pipeline.quant.checkpoint import fp8_shape_problems, sglang_parallel

    tp, ep = sglang_parallel(sglang_args)
    config = {"hidden_size": model.hidden_size, "num_attention_heads": model.num_attention_heads,
              "num_key_value_heads": model.num_kv_heads, "head_dim": model.head_dim,
              "intermediate_size": model.ffn_hidden_size if model.first_dense_layers or not model.is_moe else None,
              "moe_intermediate_size": model.moe_ffn_hidden_size or None,
              "kv_lora_rank": model.mla.kv_lora_rank if model.mla is not None else None}
    return [f"engine.weight_dtype = 'fp8' on SGLang (tp {tp}, ep {ep}): {p}; SGLang's block-FP8 layers need whole "
            "128-wide blocks on every rank (serve with fewer TP ranks or with --ep-size, use engine.type = 'cpu', "
            "or serve BF16)" for p in fp8_shape_problems(config, tp, ep)]
