"""FP8 weights in the block format of DeepSeek-V3 and SGLang's ``fp8``, and FP8 activations as its kernels make them.

**Weights**: a linear layer's ``[out, in]`` weight is stored as ``float8_e4m3fn`` with one float32 scale per
128 x 128 block, ``weight_scale_inv`` ``[ceil(out / 128), ceil(in / 128)]``, such that ``weight ~= q * scale_inv``
blockwise; each block's scale maps its largest magnitude to e4m3's largest finite value, 448. The checkpoint names
are the HF ones plus ``_scale_inv`` (``model.layers.0.self_attn.q_proj.weight`` and
``model.layers.0.self_attn.q_proj.weight_scale_inv``), with ``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}`` in config.json.

**Activations** are quantized at each FP8 linear's input, per token and per group of 128 input features, with one
float32 scale per group (``activation_scheme = "dynamic"``). The GEMM multiplies the FP8 values and applies both
scales in float32; ``fp8_linear`` computes exactly that product in float32 from the dequantized values, so what the
CPU engine samples is what FP8 inference samples, up to float32 summation order.

Which weights are FP8 (``is_fp8_weight``): the attention and MLP projections, dense, shared and routed experts, as in
DeepSeek-V3's and Qwen3's FP8 checkpoints. Embeddings, norms, the router and the LM head keep the model's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from pipeline.quant.blocks import (
    BLOCK,
    FP8_PROJECTIONS,
    QUANTIZATION_CONFIG,
    SCALE_SUFFIX,
    fp8_nbytes,
    is_fp8_weight,
    scale_name,
    scale_of,
    scale_shape,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value."""

__all__ = ["BLOCK", "FP8", "FP8_MAX", "FP8_PROJECTIONS", "QUANTIZATION_CONFIG", "SCALE_SUFFIX", "dequantize_weight",
           "fake_quantize_activation", "fp8_linear", "fp8_nbytes", "is_fp8_weight", "quantize_activation",
           "quantize_named", "quantize_weight", "scale_name", "scale_of", "scale_shape"]
def _blocks(w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``[out, in]`` zero-padded to whole blocks, as ``[rows, BLOCK, cols, BLOCK]`` float32."""
    out, inp = w.shape
    rows, cols = scale_shape(w.shape)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    return padded.view(rows, BLOCK, cols, BLOCK), out, inp


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)``: ``w`` ``[out, in]`` as float8_e4m3fn and one float32 scale per 128 x 128 block."""
    if w.dim() != 2:
        raise ValueError(f"an FP8 weight is [out, in]; got shape {list(w.shape)}")
    blocks, out, inp = _blocks(w)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    rows, cols = scale.shape
    return q.view(rows * BLOCK, cols * BLOCK)[:out, :inp].contiguous(), scale.contiguous()


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` blockwise, in float32, then cast to ``dtype``."""
    out, inp = q.shape
    if tuple(scale_inv.shape) != scale_shape(q.shape):
        raise ValueError(f"scale_inv of shape {list(scale_inv.shape)} does not match an FP8 weight of shape "
                         f"{list(q.shape)} (want {list(scale_shape(q.shape))})")
    full = scale_inv.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:out, :inp]
    return (q.float() * full).to(dtype)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` ``[..., K]`` as float8_e4m3fn, one float32 scale per token and group of 128 features
    (``[..., ceil(K / 128)]``; the last group may be shorter)."""
    k = x.shape[-1]
    groups = math.ceil(k / BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, groups * BLOCK - k)).reshape(*x.shape[:-1], groups, BLOCK)
    amax = padded.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*x.shape[:-1], groups * BLOCK)[..., :k], scale


def fake_quantize_activation(x: torch.Tensor) -> torch.Tensor:
    """``x`` as FP8 activation quantization leaves it (quantized, then dequantized), in float32."""
    k = x.shape[-1]
    q, scale = quantize_activation(x)
    groups = scale.shape[-1]
    padded = torch.nn.functional.pad(q.float(), (0, groups * BLOCK - k)).reshape(*x.shape[:-1], groups, BLOCK)
    return (padded * scale[..., None]).reshape(*x.shape[:-1], groups * BLOCK)[..., :k]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The FP8 GEMM's result, in x's dtype: ``x`` quantized per token group, times ``weight`` (already the dequantized
    FP8 weight), accumulated in float32."""
    return torch.nn.functional.linear(fake_quantize_activation(x), weight.float()).to(x.dtype)


def quantize_named(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights as an FP8 checkpoint holds them: each FP8 weight as ``(name, q)`` then ``(name_scale_inv,
    scale)``, every other tensor as it comes."""
    for name, tensor in named:
        if is_fp8_weight(name) and tensor.dim() == 2:
            q, scale = quantize_weight(tensor.detach())
            yield name, q
            yield scale_name(name), scale
        else:
            yield name, tensor
