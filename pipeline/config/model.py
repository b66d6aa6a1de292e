"""``[model]``: the HF model engines and trainer start from, and the user's layer spec and engine patch."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from pipeline.config.base import Strict
from pipeline.plugins import Signature

ENGINE_PATCH_SIGNATURE = Signature(args=(None,), described="(hf_model: transformers.PreTrainedModel) -> None",
                                   awaitable=False)
"""``model.engine_patch``: called on the CPU engine's transformers model right after it loads, to give it the
modules (and the weights, under their ``hf_weights`` names) that ``model.spec`` gives the trainer's model."""

SPEC_SIGNATURE = Signature(args=(None,), described="(context: SpecContext) -> ModuleSpec | TransformerBlockSubmodules",
                           awaitable=False)
"""``model.spec``: called with a ``pipeline.models.spec.SpecContext`` at every model build."""


class ModelSource(Strict):
    """The HF model both engines and trainer start from."""

    path: Path | None = None
    """An HF model folder (config.json, safetensors, tokenizer). None: a tiny model is written into the run folder."""
    init_tiny: Literal["qwen3", "qwen3-moe", "deepseek-v3"] = "qwen3-moe"
    """With path unset: the architecture of the tiny model sluice writes (CPU recipes; pipeline.models.families)."""
    init_overrides: dict[str, int | float | bool | str] = {}
    """HF config overrides for the tiny model (e.g. num_hidden_layers = 4)."""
    init_seed: int = Field(0, ge=0)
    """Seed of the tiny model's initial weights."""
    spec: str | None = None
    """``package.module:function`` returning the megatron-core layer spec with user modules swapped in; called with a
    ``pipeline.models.spec.SpecContext`` at every model build (docs/plugins.md, model specs). None: the family's."""
    engine_patch: str | None = None
    """``package.module:function`` called with the CPU engines' transformers model as it loads, giving it the modules
    model.spec adds (and their weights, by their HF names); needed when the spec adds weights and engine.type = cpu."""
