"""Weight-mapping rules: one megatron-core (local spec) tensor and the HF checkpoint tensors it is made of.

A family lists the rules of each decoder layer; ``consumers/megatron/convert.py`` applies them in both directions
and does the sharding, which is the same for every family. Rules work on full (unsharded) tensors with global
expert ids. The building blocks here are what families share; anything family-specific (Qwen3's grouped QKV, MLA's
projections) lives in the family's own module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Join = Callable[[Sequence["torch.Tensor"]], "torch.Tensor"]
Split = Callable[["torch.Tensor"], list["torch.Tensor"]]

MEGATRON_LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."

# Tensors outside the decoder layers, the same in every family sluice knows: megatron name -> HF name.
GLOBAL_NAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _only(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def _as_list(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat(list(parts))


def _halves(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(tensor.chunk(2, dim=0))


@dataclass(frozen=True)
class Rule:
    """One megatron tensor of a layer (suffix after ``decoder.layers.{i}.``) and its HF tensors (suffixes after
    ``model.layers.{i}.``): ``join`` builds the megatron tensor from the HF ones, ``split`` is its exact inverse."""

    megatron: str
    hf: tuple[str, ...]
    join: Join = _only
    split: Split = _as_list


def same(megatron: str, hf: str) -> Rule:
    """A tensor that only changes its name."""
    return Rule(megatron, (hf,))


def norm_rules() -> list[Rule]:
    """The two RMSNorms of every layer in the local spec (the TE spec fuses them; convert.py renames those)."""
    return [
        same("input_layernorm.weight", "input_layernorm.weight"),
        same("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ]


def glu_rules(megatron_prefix: str, hf_prefix: str) -> list[Rule]:
    """A gated MLP: megatron's ``linear_fc1`` is cat(gate_proj, up_proj), gate first (its GLU applies the activation
    to the first half); ``linear_fc2`` is ``down_proj``."""
    return [
        Rule(f"{megatron_prefix}linear_fc1.weight", (f"{hf_prefix}gate_proj.weight", f"{hf_prefix}up_proj.weight"),
             join=_cat, split=_halves),
        same(f"{megatron_prefix}linear_fc2.weight", f"{hf_prefix}down_proj.weight"),
    ]


def dense_mlp_rules() -> list[Rule]:
    """The dense MLP of a layer."""
    return glu_rules("mlp.", "mlp.")


def expert_rules(num_experts: int) -> list[Rule]:
    """Every routed expert of an MoE layer (global ids), in the per-expert names HF checkpoints and SGLang use."""
    return [rule for e in range(num_experts)
            for rule in glu_rules(f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}.")]


def router_rules(expert_bias: bool) -> list[Rule]:
    """The router's weight, and its aux-loss-free expert bias when it has one (HF's ``e_score_correction_bias``,
    which engines load like any weight, so it travels with every push)."""
    rules = [same("mlp.router.weight", "mlp.gate.weight")]
    if expert_bias:
        rules.append(same("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"))
    return rules


def shared_expert_rules() -> list[Rule]:
    """The shared expert(s) of an MoE layer, one gated MLP as wide as all of them together."""
    return glu_rules("mlp.shared_experts.", "mlp.shared_experts.")
