"""What a model family tells sluice: its config mapping, its weight mapping and where its routers are."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from pipeline.models.config import DType, HFGetter, ModelConfig
from pipeline.models.families.mapping import Rule

if TYPE_CHECKING:
    from torch import nn


class ModelFamily(ABC):
    """One family of HF architectures (say Qwen3 and Qwen3-MoE), everything sluice does differently for it.

    - **config mapping**: ``model_config`` reads the family's HF config fields into a ``ModelConfig``, refusing
      what sluice cannot reproduce exactly; ``tiny_config`` writes the config of a tiny test model;
    - **weight mapping**: ``layer_rules`` names the megatron tensors of a layer and the HF tensors they are made of;
    - **routing capture**: ``routers`` finds the modules of an HF model whose output holds each token's experts.

    Nothing outside the family's own module branches on the family.
    """

    name: ClassVar[str]
    """The family's name in ``ModelConfig.family``."""
    hf_model_types: ClassVar[tuple[str, ...]]
    """HF ``model_type`` values this family reads."""
    tiny_archs: ClassVar[tuple[str, ...]]
    """``model.init_tiny`` names whose tiny models this family writes."""
    router_indices: ClassVar[int] = 2
    """Position of the ``[tokens, topk]`` expert ids in the output tuple of the HF router modules."""

    @abstractmethod
    def tiny_config(self, arch: str, values: dict[str, Any]) -> Any:
        """The transformers config of a tiny ``arch`` model: the family's small defaults, then ``values`` (vocab,
        special token ids and the user's overrides) on top."""

    @abstractmethod
    def model_config(self, get: HFGetter, dtype: DType) -> ModelConfig:
        """The ``ModelConfig`` of an HF config of this family; raises ConfigError for what sluice cannot train."""

    @abstractmethod
    def layer_rules(self, model: ModelConfig, layer: int) -> list[Rule]:
        """Every tensor of decoder layer ``layer``: its megatron name and HF names (see ``mapping.py``)."""

    def init_tiny_weights(self, hf_model: nn.Module, generator: Any) -> None:
        """Give a freshly initialised tiny model the values HF's init leaves at a constant but a trained model does
        not (so that tests exercise them); ``generator`` is a seeded ``torch.Generator``. Default: nothing."""
        return None

    def ignored_hf_tensor(self, name: str, model: ModelConfig) -> bool:
        """Whether an HF checkpoint tensor that no megatron parameter reads is expected (and may be left unread)."""
        return False

    def routers(self, hf_model: nn.Module) -> list[nn.Module]:
        """The router module of every MoE layer of an HF model of this family, in layer order (empty when dense).

        The default finds ``layer.mlp.gate`` next to ``layer.mlp.experts``, the layout of every family so far.
        """
        layers = getattr(getattr(hf_model, "model", hf_model), "layers", [])
        routers = []
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            if mlp is not None and hasattr(mlp, "gate") and hasattr(mlp, "experts"):
                routers.append(mlp.gate)
        return routers
