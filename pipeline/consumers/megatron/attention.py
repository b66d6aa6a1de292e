"""Core attention for multi-head latent attention in megatron-core's local (non-TransformerEngine) layer spec.

megatron-core 0.16's local ``DotProductAttention`` assumes one head width for queries, keys and values, and refuses
the ``k_channels``/``v_channels`` MLA passes (queries and keys are ``qk_nope + qk_rope`` wide, values ``v_head_dim``).
On CUDA the TE spec brings its own fused attention; on CPU this module takes the local one's place in the spec.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class LatentCoreAttention(MegatronModule):
    """Softmax attention over ``[s, b, heads, d_qk]`` queries and keys and ``[s, b, heads, d_v]`` values, returning
    ``[s, b, heads * d_v]``, with MLA's own softmax scale (it folds YaRN's temperature in)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("LatentCoreAttention does not split sequences over context-parallel ranks")
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None, attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("LatentCoreAttention takes padded [s, b, h, d] batches without an attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        # megatron's mask is True where attention is blocked; SDPA's boolean mask is True where it is allowed.
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )  # fmt: skip
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
