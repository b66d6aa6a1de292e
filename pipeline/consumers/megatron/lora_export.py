"""LoRA adapters out of the trainer: by HF/PEFT names for the push, merged into the base for snapshots, and the
identity of the base they belong to.

An adapter of a fused megatron linear becomes one adapter per HF projection it targets, exactly: ``linear_qkv``'s
B rows split into q, k and v as its weight's rows do (by the family's rule), each with the shared A, so that
``B_q @ A`` is the q rows of ``B @ A``. A row-parallel linear (``o_proj``, ``down_proj``) maps to one projection.

Names are ``pipeline.sync.lora_names``'s; the push sends B already multiplied by alpha / r (``scaled=True``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.consumers.megatron.config import ModelConfig
from pipeline.consumers.megatron.convert import (
    MEGATRON_EXPERT,
    gather_to,
    iter_hf_weights,
    megatron_full_to_hf,
    unshard_to,
)
from pipeline.consumers.megatron.lora import lora_linears, merge_lora
from pipeline.sync.lora_names import adapter_names

Tensor = torch.Tensor

# The part of a fused linear each HF projection is; projections not listed are a whole linear.
_PART_OF = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": "gate", "up_proj": "up"}


def _targeted(hf_weight: str, parts: frozenset[str]) -> bool:
    projection = hf_weight.removesuffix(".weight").rsplit(".", 1)[-1]
    part = _PART_OF.get(projection, "all")
    return "all" in parts or part in parts


def _factors(linear: torch.nn.Module, scaled: bool) -> tuple[Tensor, Tensor]:
    b = linear.lora_b if linear.lora_mask is None else linear.lora_b * linear.lora_mask
    if scaled:
        b = b * linear.lora_scale
    return linear.lora_a.detach(), b.detach()


def _split(weight_name: str, linear: torch.nn.Module, a: Tensor, b: Tensor, model: ModelConfig
           ) -> list[tuple[str, Tensor]]:
    """Whole factors of one megatron linear -> PEFT (name, tensor) pairs of the projections it targets."""
    out = []
    if linear.lora_column:  # B's rows follow the weight's rows, A is every projection's
        for hf_name, b_part in megatron_full_to_hf(weight_name, b, model):
            if _targeted(hf_name, linear.lora_parts):
                name_a, name_b = adapter_names(hf_name)
                out += [(name_a, a), (name_b, b_part)]
    else:  # A's columns follow the weight's columns: one projection
        for hf_name, a_part in megatron_full_to_hf(weight_name, a, model):
            name_a, name_b = adapter_names(hf_name)
            out += [(name_a, a_part), (name_b, b)]
    return out


def iter_hf_adapters(mg_model: torch.nn.Module, model: ModelConfig, *, scaled: bool = True,
                     dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(PEFT name, whole tensor) of every adapter, yielded on global rank 0 only; every rank must exhaust it.

    Rank 0's tensor-parallel group gathers the dense adapters' sharded factor; expert adapters (expert tensor
    parallel size 1, which ``apply_lora`` requires) are gathered over the expert-parallel group of expert replica 0.
    """
    from megatron.core import parallel_state as ps

    single = not dist.is_initialized() or dist.get_world_size() == 1
    is_root = single or dist.get_rank() == 0
    for name, linear in lora_linears(mg_model).items():
        weight_name = f"{name}.weight"
        a, b = _factors(linear, scaled)
        column = linear.lora_column
        items: list[tuple[str, Tensor]] = []
        if MEGATRON_EXPERT.match(weight_name) is not None:
            items = _expert_adapters(weight_name, linear, a, b, model, single)
        elif single:
            items = _split(weight_name, linear, a, b, model)
        elif ps.get_data_parallel_rank() == 0:
            group = ps.get_tensor_model_parallel_group()
            sharded = linear.lora_b if column else linear.lora_a
            whole = unshard_to(sharded, weight_name, group, 0, b if column else a)
            if whole is not None:
                items = _split(weight_name, linear, a if column else whole, whole if column else b, model)
        if is_root:
            for hf_name, tensor in items:
                yield hf_name, (tensor.to(dtype) if dtype is not None else tensor).contiguous()


def _expert_adapters(weight_name: str, linear: torch.nn.Module, a: Tensor, b: Tensor, model: ModelConfig,
                     single: bool) -> list[tuple[str, Tensor]]:
    from megatron.core import parallel_state as ps

    if single:
        return _split(weight_name, linear, a, b, model)
    if ps.get_expert_data_parallel_rank() != 0:
        return []
    group = ps.get_expert_model_parallel_group()
    all_a, all_b = gather_to(a, group, 0), gather_to(b, group, 0)
    if all_a is None or all_b is None:
        return []
    local_count = model.num_experts // len(all_a)
    prefix, local, rest = MEGATRON_EXPERT.match(weight_name).groups()  # type: ignore[union-attr]
    items: list[tuple[str, Tensor]] = []
    for ep_rank, (ea, eb) in enumerate(zip(all_a, all_b, strict=True)):
        global_name = f"{prefix}.{int(local) + ep_rank * local_count}.{rest}"
        items += _split(global_name, linear, ea, eb, model)
    return items


def iter_hf_merged(mg_model: torch.nn.Module, model: ModelConfig, *, dtype: torch.dtype | None = None
                   ) -> Iterator[tuple[str, Tensor]]:
    """Every weight by HF name with the adapters merged in (base + alpha / r * B @ A), as ``iter_hf_weights``:
    collective, yielded on rank 0. What a held-out snapshot or a merged export holds."""
    yield from iter_hf_weights(mg_model, model, dtype=dtype, values=merge_lora(mg_model))


# ----------------------------------------------------------------------------------------------------- PEFT export
def write_peft_adapter(mg_model: torch.nn.Module, model: ModelConfig, *, rank: int, alpha: float,
                       targets: tuple[str, ...], base_dir: Path, out: Path) -> None:
    """The adapters as a PEFT LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained`` loads onto the HF model in ``base_dir``; collective, written on rank 0."""
    from safetensors.torch import save_file

    from pipeline.errors import ConfigError

    experts = [t for t in targets if t.startswith("experts.")]
    if experts:
        raise ConfigError(f"trainer.lora.targets {experts}: transformers 5 keeps a layer's experts fused in one "
                          "tensor, which PEFT's target_modules cannot address, so these adapters have no PEFT form; "
                          "export the merged model instead (sluice export without --adapter)")
    tensors = {f"base_model.model.{name}": tensor.detach().clone()  # q, k and v share A: one copy each
               for name, tensor in iter_hf_adapters(mg_model, model, scaled=False)}
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
              "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": str(base_dir.resolve()), "use_rslora": False, "use_dora": False}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    save_file(tensors, str(out / "adapter_model.safetensors"))


# ------------------------------------------------------------------------------------------------ the base's identity
def base_identity(model_dir: Path, cache: Path | None = None) -> dict[str, Any]:
    """The base model adapters belong to: its folder and the SHA-256 of its safetensors files (names and contents,
    in name order). ``cache`` (a JSON file) keeps the hash by the files' sizes and modification times, so a resume
    of a large base does not read it again."""
    files = sorted(model_dir.glob("*.safetensors"))
    stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    if cache is not None and cache.exists():
        known = json.loads(cache.read_text())
        if known.get("stamp") == stamp and known.get("path") == str(model_dir.resolve()):
            return {"path": known["path"], "sha256": known["sha256"]}
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    found = {"path": str(model_dir.resolve()), "sha256": digest.hexdigest()}
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({**found, "stamp": stamp}))
        tmp.replace(cache)
    return found
