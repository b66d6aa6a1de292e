"""FP8 weights in the CPU engine (``--weight-dtype fp8``), with the numerics of FP8 inference (``pipeline.quant.fp8``).

Every FP8 projection's weight is kept as float8_e4m3fn with its 128 x 128 block scales: the tensors a push or a
checkpoint writes, under the names an FP8 checkpoint uses (``X.weight``, ``X.weight_scale_inv``). The model's own
float32 parameter holds the dequantized weight (``q * scale_inv``, exact FP8 values times their scale), rewritten
whenever either part is written. Each FP8 linear quantizes its input per token and group of 128 features first, as
FP8 kernels do; the routed experts, which transformers keeps fused and runs in its own loop, get the same at both of
their inputs. A float (not FP8) weight sent to an FP8 weight's name is quantized on arrival, as SGLang quantizes a
BF16 checkpoint it serves in FP8; a trainer that quantizes before sending saves half the bytes and gets its own FP8
bytes in the engine unchanged.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from pipeline.errors import EngineError
from pipeline.quant.fp8 import (
    FP8,
    dequantize_weight,
    fake_quantize_activation,
    is_fp8_weight,
    quantize_weight,
    scale_name,
    scale_of,
    scale_shape,
)
from pipeline.sync.base import TensorMeta, dtype_name


class EngineFp8:
    """The FP8 copies of an engine's projection weights and the activation quantization around them."""

    def __init__(self, model: nn.Module, targets: dict[str, torch.Tensor]) -> None:
        self._compute = {name: t for name, t in targets.items() if is_fp8_weight(name) and t.dim() == 2}
        if not self._compute:
            raise EngineError("--weight-dtype fp8: the model has no projection weights to store in FP8")
        wrong = sorted({str(t.dtype) for t in self._compute.values()} - {"torch.float32"})
        if wrong:
            raise EngineError(f"--weight-dtype fp8 computes in float32 from the FP8 values, but the model's weights "
                              f"are {wrong}; start the engine with --dtype float32")
        self.q: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        for name, weight in self._compute.items():
            q, scale = quantize_weight(weight)
            self.q[name] = q
            self.scales[scale_name(name)] = scale
            self._refresh(name)
        self._install(model)

    def handles(self, name: str) -> bool:
        return name in self.q or name in self.scales

    def storage(self, name: str) -> torch.Tensor:
        """Where a pushed FP8 weight or scale lands (in place, when it comes in this dtype and shape)."""
        return self.q[name] if name in self.q else self.scales[name]

    def metas(self) -> dict[str, TensorMeta]:
        """Every FP8 weight and scale by name (the FP8 weights also take a float tensor, quantized on arrival)."""
        found = {n: TensorMeta(n, dtype_name(FP8), tuple(t.shape)) for n, t in self.q.items()}
        found.update({n: TensorMeta(n, "float32", tuple(t.shape)) for n, t in self.scales.items()})
        return found

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Write a received weight or scale; a float weight is quantized here."""
        with torch.no_grad():
            if name in self.q and tensor.dtype != FP8:
                q, scale = quantize_weight(tensor)
                self.q[name].copy_(q)
                self.scales[scale_name(name)].copy_(scale)
            else:
                self.storage(name).copy_(tensor)
        self.written(name)

    def written(self, name: str) -> None:
        """A weight or a scale changed (received in place or loaded): its dequantized weight follows."""
        weight = scale_of(name) or name
        if weight in self.q:
            self._refresh(weight)

    def _refresh(self, weight: str) -> None:
        with torch.no_grad():
            self._compute[weight].copy_(dequantize_weight(self.q[weight], self.scales[scale_name(weight)]))

    def nbytes(self) -> int:
        """Bytes of the FP8 weights and their scales."""
        return sum(t.numel() for t in self.q.values()) + 4 * sum(t.numel() for t in self.scales.values())

    # ---------------------------------------------------------------------------------------- activation quantization
    def _install(self, model: nn.Module) -> None:
        storages = {t.untyped_storage().data_ptr() for t in self._compute.values()}
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.weight.untyped_storage().data_ptr() in storages:
                module.register_forward_pre_hook(_quantize_input)
            elif _is_fused_experts(module) and module.get_parameter("down_proj").untyped_storage().data_ptr() \
                    in storages:
                module.forward = types.MethodType(_fp8_experts_forward, module)


def check_scale_shapes(fp8: EngineFp8) -> None:
    """Every scale matches its weight's blocks (a consistency check after a load from disk)."""
    for name, q in fp8.q.items():
        if tuple(fp8.scales[scale_name(name)].shape) != scale_shape(q.shape):
            raise EngineError(f"{scale_name(name)} does not match {name}'s blocks")


def _quantize_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    x = args[0]
    return (fake_quantize_activation(x).to(x.dtype), *args[1:])


def _is_fused_experts(module: nn.Module) -> bool:
    return (hasattr(module, "gate_up_proj") and isinstance(getattr(module, "down_proj", None), nn.Parameter)
            and hasattr(module, "act_fn"))


def _fp8_experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' fused-experts loop with FP8 activation quantization at both projections' inputs."""
    final = torch.zeros_like(hidden_states)
    num_experts = self.gate_up_proj.shape[0]
    quantized = fake_quantize_activation(hidden_states).to(hidden_states.dtype)  # per token: the same for any expert
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit:
        e = int(expert[0])
        if e == num_experts:
            continue
        position, token = torch.where(mask[e])
        gate, up = nn.functional.linear(quantized[token], self.gate_up_proj[e]).chunk(2, dim=-1)
        inner = self.act_fn(gate) * up
        out = nn.functional.linear(fake_quantize_activation(inner).to(inner.dtype), self.down_proj[e])
        out = out * top_k_weights[token, position, None]
        final.index_add_(0, token, out.to(final.dtype))
    return final
