"""Model families: everything sluice does differently for one family of HF architectures, in one module each.

The registry is an explicit dict (a closed set, STYLE.md). ``docs/models.md`` describes the layout and how to add a
family. Importing this package does not import torch.
"""

from __future__ import annotations

from pipeline.errors import ConfigError
from pipeline.models.families.base import ModelFamily
from pipeline.models.families.deepseek_v3 import DeepseekV3Family
from pipeline.models.families.qwen3 import Qwen3Family

FAMILIES: dict[str, ModelFamily] = {
    "qwen3": Qwen3Family(),
    "deepseek-v3": DeepseekV3Family(),
}


def family(name: str) -> ModelFamily:
    """The family called ``name`` (a ``ModelConfig.family``)."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; sluice knows {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_for_hf(model_type: str | None) -> ModelFamily:
    """The family that reads HF configs of ``model_type``; ConfigError naming the supported types otherwise."""
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    known = sorted(t for fam in FAMILIES.values() for t in fam.hf_model_types)
    raise ConfigError(f"HF model_type {model_type!r} is not supported; sluice converts {', '.join(known)}")


def family_for_tiny(arch: str) -> ModelFamily:
    """The family that writes tiny models of ``arch`` (a ``model.init_tiny`` value)."""
    for fam in FAMILIES.values():
        if arch in fam.tiny_archs:
            return fam
    raise ConfigError(f"unknown tiny model arch {arch!r}; choose one of {', '.join(tiny_archs())}")


def tiny_archs() -> tuple[str, ...]:
    """Every ``model.init_tiny`` value, family by family."""
    return tuple(arch for fam in FAMILIES.values() for arch in fam.tiny_archs)


__all__ = ["FAMILIES", "ModelFamily", "family", "family_for_hf", "family_for_tiny", "tiny_archs"]
