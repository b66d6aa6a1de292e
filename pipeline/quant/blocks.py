"""The FP8 block layout's names and sizes, without torch (``--dry-run`` and the config load use them).

``pipeline.quant.fp8`` has the format itself; this module only says which weights are FP8, what their scales are
called and how large both are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

BLOCK = 128
"""Weight blocks are BLOCK x BLOCK; activation groups are BLOCK features of one token."""
SCALE_SUFFIX = "_scale_inv"
"""``X.weight`` is dequantized with ``X.weight_scale_inv``."""
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
"""config.json's ``quantization_config`` of an FP8 checkpoint in this layout (SGLang's ``Fp8Config`` reads it)."""

FP8_PROJECTIONS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
})
"""HF module names whose weights are FP8: attention (MHA and MLA) and MLP projections, routed, shared or dense."""


def is_fp8_weight(name: str) -> bool:
    """Whether the HF weight ``name`` is stored as FP8 (a projection's ``.weight``; never a router, an embedding,
    a norm or the LM head)."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    return module in FP8_PROJECTIONS


def scale_name(weight: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv``."""
    return weight + SCALE_SUFFIX


def scale_of(name: str) -> str | None:
    """The weight a scale belongs to (``X.weight_scale_inv`` -> ``X.weight``), or None if ``name`` is not a scale."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def scale_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The block-scale shape of an ``[out, in]`` weight."""
    out, inp = int(shape[-2]), int(shape[-1])
    return math.ceil(out / BLOCK), math.ceil(inp / BLOCK)


def fp8_nbytes(shape: Sequence[int]) -> int:
    """Bytes of an FP8 weight and its block scales."""
    rows, cols = scale_shape(shape)
    return math.prod(int(d) for d in shape) + 4 * rows * cols
