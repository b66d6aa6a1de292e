"""Pushed LoRA adapters in the CPU engine, served one of two ways (``--lora``):

- **merge**: the engine keeps a copy of each adapted weight as it was last written whole (the base it loaded, or a
  later full push), and serves ``base + B @ A``: after each bucket the pairs it touched are merged again, so a new
  adapter replaces the old one exactly, never stacks on it. Any target, the fused experts' views included.
- **adapter**: the weight stays the base, and a forward hook adds ``(x @ A^T) @ B^T`` to the projection's output, as
  SGLang's ``--enable-lora`` serves an adapter beside the base. Single ``nn.Linear`` projections only.

Either way, a push that writes an adapted weight whole makes that the new base and drops its adapter. Between the
buckets of one push the served weights can mix old and new factors, as a full push mixes old and new weights; the
engine is paused in place meanwhile and keeps its old version label until the whole push has landed.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from pipeline.errors import EngineError
from pipeline.sync.lora_names import adapted_weight, is_adapter_a

LoRAServe = Literal["merge", "adapter"]


class EngineAdapters:
    """The adapters an engine has received, by the HF weight each belongs to."""

    def __init__(self, model: nn.Module, targets: dict[str, torch.Tensor], serve: LoRAServe) -> None:
        self.serve = serve
        self._targets = targets
        self._linears = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self._base: dict[str, torch.Tensor] = {}
        self._factors: dict[str, dict[str, torch.Tensor]] = {}
        self._hooked: set[str] = set()

    @property
    def adapted(self) -> list[str]:
        """The weights that hold a complete adapter now."""
        return sorted(w for w, f in self._factors.items() if len(f) == 2)

    def problem(self, name: str, shape: tuple[int, ...]) -> str | None:
        """Why an announced adapter tensor cannot be served, or None."""
        weight = adapted_weight(name)
        assert weight is not None
        target = self._targets.get(weight)
        if target is None or target.dim() != 2:
            return f"{name}: no 2-D weight {weight} in the model to adapt"
        if len(shape) != 2:
            return f"{name}: an adapter factor is 2-D, got shape {list(shape)}"
        out, fan_in = target.shape
        if is_adapter_a(name) and shape[1] != fan_in:
            return f"{name}: A must be [r, {fan_in}] for {weight} {list(target.shape)}, got {list(shape)}"
        if not is_adapter_a(name) and shape[0] != out:
            return f"{name}: B must be [{out}, r] for {weight} {list(target.shape)}, got {list(shape)}"
        if self.serve == "adapter" and weight not in self._linears:
            return (f"{name}: the engine serves adapters beside the base (--lora adapter) on single nn.Linear "
                    f"projections only, and {weight} is not one (a fused expert?); start it with --lora merge")
        return None

    def written(self, weight: str) -> None:
        """``weight`` was written whole: that is its base now, and its adapter is gone."""
        self._base.pop(weight, None)
        self._factors.pop(weight, None)

    def receive(self, name: str, tensor: torch.Tensor) -> str:
        """Keep one factor; returns the weight it belongs to (``refresh`` it once the bucket is in)."""
        weight = adapted_weight(name)
        assert weight is not None
        key = "a" if is_adapter_a(name) else "b"
        self._factors.setdefault(weight, {})[key] = tensor.detach().to(torch.float32).clone()
        return weight

    @torch.no_grad()
    def refresh(self, weights: set[str]) -> None:
        """Serve the current factors of ``weights``: merge them, or hook them beside the base."""
        for weight in weights:
            factors = self._factors.get(weight, {})
            if len(factors) != 2:
                continue  # the other factor is in a later bucket of this push
            a, b = factors["a"], factors["b"]
            if a.shape[0] != b.shape[1]:
                raise EngineError(f"the adapter on {weight} has A of rank {a.shape[0]} and B of rank {b.shape[1]}")
            if self.serve == "merge":
                target = self._targets[weight]
                base = self._base.setdefault(weight, target.detach().clone())
                target.copy_((base.double() + b.double() @ a.double()).to(target.dtype))
            elif weight not in self._hooked:
                self._linears[weight].register_forward_hook(self._hook(weight))
                self._hooked.add(weight)

    def _hook(self, weight: str) -> Any:
        def add_adapter(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            factors = self._factors.get(weight)
            if factors is None or len(factors) != 2:
                return output
            x = args[0]
            low = nn.functional.linear(x.to(torch.float32), factors["a"])
            return output + nn.functional.linear(low, factors["b"]).to(output.dtype)

        return add_adapter
