"""Model specs: ``model.spec = "package.module:function"`` puts user PyTorch modules into the megatron-core model.

The function is called once per model build (policy, KL reference, checkpoint exporter, warm start) with a
``SpecContext`` and returns the layer spec megatron-core builds the decoder from: a ``TransformerBlockSubmodules``
(one ``ModuleSpec`` per layer, like ``context.default``) or a single layer ``ModuleSpec`` used for every layer.
The usual body edits ``context.default`` (a private copy) and returns it::

    def gated_attention(context: SpecContext) -> TransformerBlockSubmodules:
        for layer in context.default.layer_specs:
            layer.submodules.self_attention.module = GatedSelfAttention
        return context.default

Parameters a user module adds have no counterpart in the family's HF weight mapping. The module declares their
HF names in a class attribute ``hf_weights`` (parameter name relative to the module -> HF name relative to the
decoder layer, e.g. ``{"linear_gate.weight": "self_attn.head_gate.weight"}``); conversion then maps them both ways.
A module that declares none trains and checkpoints normally, but its weights cannot be exported or pushed to
engines, and the trainer refuses such a run at start-up (``consumers/megatron/convert.py``: ``spec_weights``).

Importing this module does not import torch (the recipe's loader uses the signature below).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import plugins
from pipeline.config.model import SPEC_SIGNATURE
from pipeline.errors import ConfigError
from pipeline.models.config import ModelConfig

FIELD = "model.spec"
HF_WEIGHTS_ATTR = "hf_weights"
"""Class attribute of a user module: its parameter names (relative to the module) -> HF names (relative to the
decoder layer, ``model.layers.{i}.``)."""


@dataclass(frozen=True)
class SpecContext:
    """What a ``model.spec`` function gets: the model being built, in megatron's and HF's terms."""

    config: Any
    """The megatron-core ``TransformerConfig`` (``MLATransformerConfig`` for latent attention) of the model."""
    model: ModelConfig
    """sluice's description of the architecture (family, sizes, MoE layout, dtype)."""
    hf_config: Mapping[str, Any]
    """The HF ``config.json`` as a dict (empty when the model was not built from an HF folder)."""
    default: Any
    """The layer spec sluice would use: a ``TransformerBlockSubmodules`` with one ``ModuleSpec`` per layer (local
    modules on CPU, TransformerEngine ones on CUDA when installed). A deep copy: edit it and return it."""


ENGINE_PATCH_FIELD = "model.engine_patch"


def engine_patch_args(patch: str | None, paths: Sequence[str | Path]) -> list[str]:
    """CPU-engine command-line flags that run ``model.engine_patch`` (imported from ``plugins.paths``) on its model."""
    if patch is None:
        return []
    args = ["--patch", patch]
    for path in paths:
        args += ["--plugin-path", str(Path(path).resolve())]
    return args


def build_user_spec(ref: str, context: SpecContext) -> Any:
    """Call the ``model.spec`` function ``ref`` names and check what it returned; ConfigError naming the field."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    fn = plugins.resolve(ref, field=FIELD, signature=SPEC_SIGNATURE)
    try:
        spec = fn(context)
    except ConfigError as e:
        raise ConfigError(f"{FIELD} = {ref!r}: {e}") from e
    except Exception as e:  # the user's code failed while building the spec: say whose code, and stop the build
        raise ConfigError(f"{FIELD} = {ref!r} raised {type(e).__name__}: {e}") from e
    if isinstance(spec, TransformerBlockSubmodules):
        layers = len(spec.layer_specs or [])
        if layers != context.model.num_layers:
            raise ConfigError(f"{FIELD} = {ref!r} returned a block spec of {layers} layer specs for a model of "
                              f"{context.model.num_layers} layers; edit and return context.default")
        return spec
    if isinstance(spec, ModuleSpec):
        return spec
    raise ConfigError(f"{FIELD} = {ref!r} returned {type(spec).__name__}, not a megatron-core ModuleSpec (one layer "
                      "spec, used for every layer) or TransformerBlockSubmodules (context.default, edited)")
