"""LoRA adapters on a megatron-core ``GPTModel`` (``[trainer.lora]``; ``lora_export`` takes them out by HF name).

:func:`apply_lora` freezes every base parameter and hangs two parameters, ``lora_a`` [r, in] and ``lora_b``
[out, r], on each targeted megatron linear, with a forward hook that adds ``scale * B(A(dropout(x)))`` to the linear's
``(output, bias)``. The linear keeps its own parameter names, so a name containing ``.lora_`` is an adapter and
nothing else: ``convert.named_weights`` skips those, which keeps loading, the HF export and the owners' push working on
the base weights exactly as without LoRA.

Tensor parallelism follows the base layer:

- column-parallel (``linear_qkv``, ``linear_fc1``): A is replicated, B split on the output dim like the base weight;
  each rank adds ``B_i(A x)`` to its output shard. A's gradient is partial per rank (it sees only ``B_i``), so it is
  tagged ``lora_tp_partial`` for ``optim._tp_partial`` to sum over TP; the input passes a copy-to-TP region (identity
  forward, all-reduce backward), as the base's does, so that the gradient reaching earlier layers is whole.
- row-parallel (``linear_proj``, ``linear_fc2``): A is split on the input dim like the base weight; the r-wide
  ``A_i x_i`` is all-reduced (small), then the replicated B applies to it, giving a replicated addition to the
  replicated output.

A targeted part of a fused linear (q of ``linear_qkv``, gate of ``linear_fc1``) has its B rows outside the part masked
to zero in the forward: their gradient is exactly zero, so they stay zero under Adam(W) and never reach the merged
weight. A is drawn from a generator seeded by ``seed`` and the layer's global name, full size then sliced, so TP
peers and any TP layout hold the same adapter.
"""

from __future__ import annotations

import math
import types
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.errors import ConfigError

Tensor = torch.Tensor

# HF projection -> (megatron linear under the layer, part of its fused output).
_DENSE_TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "q"),
    "k_proj": ("self_attention.linear_qkv", "k"),
    "v_proj": ("self_attention.linear_qkv", "v"),
    "o_proj": ("self_attention.linear_proj", "all"),
    "gate_proj": ("mlp.linear_fc1", "gate"),
    "up_proj": ("mlp.linear_fc1", "up"),
    "down_proj": ("mlp.linear_fc2", "all"),
}
# The routed experts' projections (SequentialMLP, expert tensor parallel size 1): every local expert gets its own pair.
_EXPERT_TARGETS: dict[str, tuple[str, str]] = {
    "experts.gate_proj": ("mlp.experts.local_experts.{e}.linear_fc1", "gate"),
    "experts.up_proj": ("mlp.experts.local_experts.{e}.linear_fc1", "up"),
    "experts.down_proj": ("mlp.experts.local_experts.{e}.linear_fc2", "all"),
}
VALID_TARGETS = (*_DENSE_TARGETS, *_EXPERT_TARGETS)
ADAPTER_MARK = ".lora_"
"""Every adapter parameter's name contains this, and no base parameter's does."""


@dataclass(frozen=True)
class LoRASpec:
    """Rank, scale, dropout and targets (HF projection names) of the adapters :func:`apply_lora` adds."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """HF names: q/k/v/o_proj, gate/up/down_proj (dense MLPs), experts.gate/up/down_proj (routed experts)."""

    def __post_init__(self) -> None:
        unknown = [t for t in self.targets if t not in VALID_TARGETS]
        if unknown:
            raise ConfigError(f"LoRA targets {unknown} are unknown; valid targets are {list(VALID_TARGETS)}")
        if not self.targets:
            raise ConfigError(f"LoRA needs at least one target; valid targets are {list(VALID_TARGETS)}")
        if self.rank < 1:
            raise ConfigError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _is_column(linear: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return isinstance(linear, ColumnParallelLinear)


def _part_mask(linear: torch.nn.Module, prefix: str, parts: set[str], config: Any) -> Tensor | None:
    """1 on this rank's output rows that belong to ``parts``, 0 elsewhere; None when every row does."""
    rows = linear.weight.shape[0]
    if "all" in parts:
        return None
    if prefix.endswith("linear_qkv"):
        # megatron fuses QKV per query group: [q heads of the group; k; v] for each group this rank holds.
        per_group = config.num_attention_heads // config.num_query_groups
        d = config.kv_channels
        pattern = torch.cat([torch.full((per_group * d,), "q" in parts), torch.full((d,), "k" in parts),
                             torch.full((d,), "v" in parts)])
        mask = pattern.repeat(rows // pattern.numel())
    else:
        # A GLU fc1 shard is [this rank's gate rows; this rank's up rows].
        half = rows // 2
        mask = torch.cat([torch.full((half,), "gate" in parts), torch.full((half,), "up" in parts)])
    if mask.numel() != rows:
        raise ConfigError(f"{prefix}: cannot split its {rows} output rows into the parts {sorted(parts)}")
    return None if bool(mask.all()) else mask.to(linear.weight.dtype).unsqueeze(1)


def _draw_a(name: str, rank: int, fan_in: int, seed: int) -> Tensor:
    # The bound of nn.Linear's default (Kaiming uniform, a = sqrt(5)): 1 / sqrt(fan_in). Seeded by the layer's name so
    # every TP peer and every layout draws the same full A.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() and group is not None else 1


def _group_rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_initialized() and group is not None else 0


def _lora_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    x = args[0] if args else kwargs["input_"]
    out, bias = output
    x = module.lora_dropout(x)
    b = module.lora_b if module.lora_mask is None else module.lora_b * module.lora_mask
    tp = None if module.is_expert else module.tp_group
    if _is_column(module):
        if _group_size(tp) > 1:
            x = copy_to_tensor_model_parallel_region(x, group=tp)
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, module.lora_a), b)
    else:
        low = torch.nn.functional.linear(x, module.lora_a)
        if _group_size(tp) > 1:
            low = reduce_from_tensor_model_parallel_region(low, group=tp)
        delta = torch.nn.functional.linear(low, b)
    return out + module.lora_scale * delta.to(out.dtype), bias


def _targets(model: torch.nn.Module, spec: LoRASpec) -> dict[str, set[str]]:
    """Module name -> the parts of its output the spec targets, for every matching linear of the model."""
    found: dict[str, set[str]] = {}
    matched: set[str] = set()
    for layer_name, layer in model.named_modules():
        if not layer_name.startswith("decoder.layers.") or layer_name.count(".") != 2:
            continue
        for target in spec.targets:
            if target in _DENSE_TARGETS:
                path, part = _DENSE_TARGETS[target]
                paths = [path]
            else:
                path, part = _EXPERT_TARGETS[target]
                experts = getattr(getattr(layer, "mlp", None), "experts", None)
                local = getattr(experts, "local_experts", None)
                if experts is not None and local is None:
                    raise ConfigError(f"LoRA target {target!r} needs SequentialMLP experts (local_experts); "
                                      f"{layer_name}.mlp.experts is a {type(experts).__name__} (grouped GEMM)")
                paths = [path.format(e=e) for e in range(len(local or []))]
            for p in paths:
                try:
                    layer.get_submodule(p)
                except AttributeError:
                    continue
                found.setdefault(f"{layer_name}.{p}", set()).add(part)
                matched.add(target)
    missing = [t for t in spec.targets if t not in matched]
    if missing:
        raise ConfigError(f"LoRA targets {missing} match no linear of this model (a MoE layer has no dense "
                          "gate/up/down_proj: use experts.*; a dense one has no experts); drop them from the targets")
    return found


def apply_lora(model: torch.nn.Module, spec: LoRASpec, *, seed: int) -> list[str]:
    """Freeze every base parameter and add ``spec``'s adapters (A seeded, B zero, so the model's output is
    unchanged); returns the added parameter names, in model order."""
    config = model.config
    if getattr(config, "sequence_parallel", False):
        raise ConfigError("LoRA does not support sequence parallelism yet (the adapters would see sequence-sharded "
                          "inputs); set parallel.sequence_parallel = false")
    targets = _targets(model, spec)
    for name in targets:
        _check_linear(model.get_submodule(name), name, spec)
    for p in model.parameters():
        p.requires_grad_(False)
    ep_offset = _expert_offset(model)
    added = []
    for name, parts in targets.items():
        linear = model.get_submodule(name)
        _add_adapter(linear, _global_name(name, ep_offset), parts, spec, seed, config)
        added += [f"{name}.lora_a", f"{name}.lora_b"]
    return added


def _expert_offset(model: torch.nn.Module) -> int:
    from megatron.core import parallel_state as ps

    for name, module in model.named_modules():
        if name.endswith("mlp.experts.local_experts") and ps.model_parallel_is_initialized():
            return ps.get_expert_model_parallel_rank() * len(module)
    return 0


def _global_name(name: str, offset: int) -> str:
    head, sep, tail = name.partition(".local_experts.")
    if not sep:
        return name
    index, _, rest = tail.partition(".")
    return f"{head}{sep}{int(index) + offset}.{rest}"


def _check_linear(linear: torch.nn.Module, name: str, spec: LoRASpec) -> None:
    """Refuse a linear the adapter cannot follow, before anything is changed."""
    from megatron.core.tensor_parallel import RowParallelLinear

    column = _is_column(linear)
    if hasattr(linear, "lora_a"):
        raise ConfigError(f"{name} already has a LoRA adapter")
    if not column and not isinstance(linear, RowParallelLinear):
        raise ConfigError(f"{name} is a {type(linear).__name__}; LoRA supports the local spec's "
                          "ColumnParallelLinear and RowParallelLinear only (not Transformer Engine's layers)")
    if column and getattr(linear, "gather_output", False):
        raise ConfigError(f"{name}: LoRA on a column-parallel linear that gathers its output is not supported")
    if not column and not getattr(linear, "input_is_parallel", True):
        raise ConfigError(f"{name}: LoRA on a row-parallel linear with a replicated input is not supported")
    size = _group_size(linear.tp_group)
    if linear.is_expert and size > 1:
        raise ConfigError(f"{name}: LoRA on experts needs expert tensor parallel size 1 (the token dispatcher "
                          f"does the experts' TP collectives), got {size}")
    if spec.dropout > 0 and size > 1:
        raise ConfigError("LoRA dropout with tensor parallelism is not supported yet (TP peers would drop different "
                          "elements of their shared input); set dropout = 0")


def _add_adapter(linear: torch.nn.Module, global_name: str, parts: set[str], spec: LoRASpec, seed: int,
                 config: Any) -> None:
    weight = linear.weight
    column = _is_column(linear)
    size, rank = _group_size(linear.tp_group), _group_rank(linear.tp_group)
    out_local, in_local = weight.shape
    if column:
        a = _draw_a(global_name, spec.rank, in_local, seed)
    else:
        a = _draw_a(global_name, spec.rank, in_local * size, seed).chunk(size, dim=1)[rank]
    linear.lora_a = torch.nn.Parameter(a.to(weight.dtype).to(weight.device).contiguous())
    linear.lora_b = torch.nn.Parameter(torch.zeros(out_local, spec.rank, dtype=weight.dtype, device=weight.device))
    sharded, replicated = (linear.lora_b, linear.lora_a) if column else (linear.lora_a, linear.lora_b)
    # The attributes megatron's own weights carry, read by the gradient sync, the norm and the checkpoint.
    sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = size > 1, 0 if column else 1, 1
    replicated.tensor_model_parallel = False
    for p in (linear.lora_a, linear.lora_b):
        p.allreduce = getattr(weight, "allreduce", True)
    if column:
        linear.lora_a.lora_tp_partial = True
    mask = _part_mask(linear, global_name, parts, config)
    linear.register_buffer("lora_mask", None if mask is None else mask.to(weight.device), persistent=False)
    linear.lora_dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else torch.nn.Identity()
    linear.lora_scale = spec.scale
    linear.lora_parts = frozenset(parts)
    linear.lora_column = column
    linear.register_forward_hook(_lora_hook, with_kwargs=True)
    linear.sharded_state_dict = types.MethodType(_adapted_sharded_state_dict, linear)


def _adapted_sharded_state_dict(self: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (),
                                metadata: dict | None = None) -> dict[str, Any]:
    """The linear's own sharded state with its adapter's TP-split factor declared split, as the base weight is (the
    class's method would save it as replicated: each TP rank's shard under one key, and all but one lost)."""
    from megatron.core.transformer.utils import make_tp_sharded_tensor_for_checkpoint

    state = type(self).sharded_state_dict(self, prefix, sharded_offsets, metadata)
    name, axis = ("lora_b", 0) if self.lora_column else ("lora_a", 1)
    if _group_size(self.tp_group) > 1:
        state[f"{prefix}{name}"] = make_tp_sharded_tensor_for_checkpoint(
            getattr(self, name), f"{prefix}{name}", axis, prepend_offsets=sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"))
    return state


def lora_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name -> every linear carrying an adapter."""
    return {name: m for name, m in model.named_modules() if isinstance(getattr(m, "lora_a", None), torch.nn.Parameter)}


@torch.no_grad()
def merged_weight(linear: torch.nn.Module) -> Tensor:
    """This rank's shard of ``base + scale * B @ A``, sharded as the base weight is.

    A column-parallel shard needs only local tensors (``B_i @ A``); a row-parallel one too (``B @ A_i``): the shard
    of a product whose inner dim (r) is whole on every rank.
    """
    b = linear.lora_b if linear.lora_mask is None else linear.lora_b * linear.lora_mask
    delta = (b.double() @ linear.lora_a.double()) * linear.lora_scale
    return (linear.weight.double() + delta).to(linear.weight.dtype)


@torch.no_grad()
def merge_lora(model: torch.nn.Module) -> dict[str, Tensor]:
    """The merged weight of every adapted linear, by the base weight's megatron name (``....linear_qkv.weight``),
    this rank's shard; the model is left as it is."""
    return {f"{name}.weight": merged_weight(m) for name, m in lora_linears(model).items()}


def lora_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """Only the adapter tensors (this rank's shards), by their parameter names (``....linear_qkv.lora_a``)."""
    return {name: p.detach() for name, p in model.named_parameters() if ADAPTER_MARK in name}
