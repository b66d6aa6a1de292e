"""The names LoRA adapters travel under: PEFT's, without its ``base_model.model.`` prefix.

``model.layers.0.self_attn.q_proj.lora_A.weight`` [r, in] and ``...q_proj.lora_B.weight`` [out, r] are the adapter
on ``model.layers.0.self_attn.q_proj.weight``. The push sends B already multiplied by alpha / r, so a receiver serves
``W + B @ A`` and needs no alpha.
"""

from __future__ import annotations

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")

ADAPTER_PREFIX = "sluice-v"
"""The names SGLang engines load the pushed adapters under: ``sluice-v{version}`` (``pipeline.sync.adapter_push``)."""


def adapter_name(version: str | int) -> str:
    """The name version ``version``'s adapters are loaded under on every SGLang engine."""
    return f"{ADAPTER_PREFIX}{version}"


def base_label(label: str) -> bool:
    """Whether an engine at weight version ``label`` serves its base alone: version 0 (the adapters start at B = 0,
    so the base is version 0's policy) or a label SGLang gives before any update."""
    return label in ("", "0", "default")


def adapter_names(weight: str) -> tuple[str, str]:
    """The (A, B) names of the adapter on the HF weight ``weight`` (``....q_proj.weight``)."""
    stem = weight.removesuffix(".weight")
    return f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"


def adapted_weight(name: str) -> str | None:
    """The HF weight an adapter tensor belongs to, or None if ``name`` is not an adapter's."""
    for suffix in ADAPTER_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return None


def is_adapter_a(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES[0])
