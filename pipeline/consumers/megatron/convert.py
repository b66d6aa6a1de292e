"""HF Qwen3 / Qwen3-MoE weights <-> megatron-core ``GPTModel`` parameters, by hand.

A hand-written mapping rather than mbridge: mbridge needs eight patches on CPU, knows only the TransformerEngine
names and ignores ``norm_topk_prob``. The mapping works in two halves:
- name/layout conversion between full (unsharded) tensors, in ``megatron_from_hf`` / ``megatron_full_to_hf``;
- sharding: slicing a full tensor down to this rank's TP/EP shard on load, gathering shards back on export.

HF names are the checkpoint (and SGLang) names, one tensor per expert: ``model.layers.{i}.mlp.experts.{e}.
{gate,up,down}_proj.weight``. transformers 5 keeps experts fused in memory (``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]); ``unfuse_hf_experts`` / ``fuse_hf_experts`` translate.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.consumers.megatron.config import ModelConfig
from pipeline.errors import ConfigError

HFStateDict = dict[str, torch.Tensor]

_LAYER = "decoder.layers.{i}."
_HF_LAYER = "model.layers.{i}."
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_MEGATRON_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts)\.(\d+)\.(linear_fc[12]\.weight)$")


# --- reading HF weights ------------------------------------------------------------------------------------------


class HFCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a local HF safetensors checkpoint folder, read lazily one tensor at a time.

    Lazy on purpose: an EP rank needs only its own experts, so it should not read (or hold) everyone else's.
    """

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.folder / "model.safetensors").exists():
            with safe_open(str(self.folder / "model.safetensors"), framework="pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise ConfigError(
                f"no safetensors weights in {self.folder}: expected model.safetensors or model.safetensors.index.json "
                "(save the model with save_pretrained)"
            )
        self._weight_map = weight_map
        self._open = safe_open

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._weight_map[name]
        with self._open(str(self.folder / file), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)


def read_hf_checkpoint(folder: str | Path) -> HFStateDict:
    """All tensors of a local HF checkpoint folder, loaded eagerly."""
    checkpoint = HFCheckpoint(folder)
    return {name: checkpoint[name] for name in checkpoint}


def unfuse_hf_experts(state: Mapping[str, torch.Tensor]) -> HFStateDict:
    """Split transformers-5 fused expert tensors into the per-expert checkpoint names; other names pass through."""
    out: HFStateDict = {}
    for name, tensor in state.items():
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return out


def fuse_hf_experts(state: Mapping[str, torch.Tensor], model: ModelConfig) -> HFStateDict:
    """Inverse of ``unfuse_hf_experts``: per-expert names into transformers-5 fused ``gate_up_proj``/``down_proj``."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for i in range(model.num_layers if model.is_moe else 0):
        prefix = f"model.layers.{i}.mlp.experts"
        experts = range(model.num_experts)
        gates = [state[f"{prefix}.{e}.gate_proj.weight"] for e in experts]
        ups = [state[f"{prefix}.{e}.up_proj.weight"] for e in experts]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(gates, ups)])
        out[f"{prefix}.down_proj"] = torch.stack([state[f"{prefix}.{e}.down_proj.weight"] for e in experts])
    return out


HFSource = str | Path | torch.nn.Module | Mapping[str, torch.Tensor]


def hf_weights(source: HFSource) -> Mapping[str, torch.Tensor]:
    """HF weights with per-expert names: a folder is read lazily, a model or state dict is viewed (no copies)."""
    if isinstance(source, (str, Path)):
        checkpoint = HFCheckpoint(source)
        if not any(_FUSED_EXPERTS.match(name) for name in checkpoint):
            return checkpoint
        return unfuse_hf_experts({name: checkpoint[name] for name in checkpoint})
    if isinstance(source, torch.nn.Module):
        return unfuse_hf_experts(source.state_dict())
    return unfuse_hf_experts(source)


def hf_state_dict(source: HFSource) -> HFStateDict:
    """HF weights from a checkpoint folder, a transformers model or a state dict, with per-expert names."""
    weights = hf_weights(source)
    return {name: weights[name] for name in weights}


# --- full-tensor layout conversion -------------------------------------------------------------------------------


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    # megatron's linear_qkv is grouped by kv head: for each group, that group's q rows, then its k rows, then v. A
    # plain cat([q, k, v]) has the same shape and silently wrong logits under GQA.
    groups, per_group, d = model.num_kv_heads, model.num_attention_heads // model.num_kv_heads, model.head_dim
    hidden = q.shape[-1]
    q = q.reshape(groups, per_group * d, hidden)
    k = k.reshape(groups, d, hidden)
    v = v.reshape(groups, d, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _qkv_to_hf(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group, d = model.num_kv_heads, model.num_attention_heads // model.num_kv_heads, model.head_dim
    hidden = qkv.shape[-1]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, hidden).split([per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _layer_pairs(model: ModelConfig) -> list[tuple[str, str]]:
    """(megatron suffix, HF suffix) for the one-to-one tensors of a layer."""
    pairs = [
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ]
    if model.qk_norm:
        pairs += [
            ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        ]
    if model.is_moe:
        pairs.append(("mlp.router.weight", "mlp.gate.weight"))
    else:
        pairs.append(("mlp.linear_fc2.weight", "mlp.down_proj.weight"))
    return pairs


def megatron_names(model: ModelConfig) -> list[str]:
    """Full-model megatron local-spec parameter names (global expert ids), in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(model.num_layers):
        mg = _LAYER.format(i=i)
        names += [mg + suffix for suffix, _ in _layer_pairs(model)]
        names.append(mg + "self_attention.linear_qkv.weight")
        if model.is_moe:
            for e in range(model.num_experts):
                names += [f"{mg}mlp.experts.local_experts.{e}.linear_fc{fc}.weight" for fc in (1, 2)]
        else:
            names.append(mg + "mlp.linear_fc1.weight")
    names.append("decoder.final_layernorm.weight")
    if not model.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def megatron_from_hf(name: str, hf: Mapping[str, torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """One full (unsharded) megatron local-spec tensor (global expert ids) from per-expert HF tensors."""
    fixed = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    if name in fixed:
        return _require(hf, fixed[name])
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if match is None:
        raise ConfigError(f"megatron parameter {name!r} has no HF counterpart in sluice's Qwen3 mapping")
    h, suffix = _HF_LAYER.format(i=int(match.group(1))), match.group(2)
    for mg_suffix, hf_suffix in _layer_pairs(model):
        if suffix == mg_suffix:
            return _require(hf, h + hf_suffix)
    if suffix == "self_attention.linear_qkv.weight":
        q, k, v = (_require(hf, f"{h}self_attn.{p}_proj.weight") for p in "qkv")
        return _qkv_to_megatron(q, k, v, model)
    # fc1 = cat(gate, up), gate first: megatron's GLU applies the activation to the first half.
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([_require(hf, h + "mlp.gate_proj.weight"), _require(hf, h + "mlp.up_proj.weight")])
    expert = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", suffix)
    if expert is not None:
        src = f"{h}mlp.experts.{expert.group(1)}."
        if expert.group(2) == "2":
            return _require(hf, src + "down_proj.weight")
        return torch.cat([_require(hf, src + "gate_proj.weight"), _require(hf, src + "up_proj.weight")])
    raise ConfigError(f"megatron parameter {name!r} has no HF counterpart in sluice's Qwen3 mapping")


def hf_to_megatron_full(hf: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """All full (unsharded) megatron local-spec tensors, with global expert ids, from per-expert HF tensors."""
    return {name: megatron_from_hf(name, hf, model) for name in megatron_names(model)}


def megatron_full_to_hf(name: str, tensor: torch.Tensor, model: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full megatron tensor (global expert ids); [] for tensors HF lacks."""
    fixed = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    if name in fixed:
        return [(fixed[name], tensor)]
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if match is None:
        raise ConfigError(f"megatron parameter {name!r} has no HF counterpart in sluice's Qwen3 mapping")
    i, suffix = int(match.group(1)), match.group(2)
    h = _HF_LAYER.format(i=i)
    for mg_suffix, hf_suffix in _layer_pairs(model):
        if suffix == mg_suffix:
            return [(h + hf_suffix, tensor)]
    if suffix == "self_attention.linear_qkv.weight":
        q, k, v = _qkv_to_hf(tensor, model)
        return [(f"{h}self_attn.{p}_proj.weight", t) for p, t in zip("qkv", (q, k, v))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(h + "mlp.gate_proj.weight", gate), (h + "mlp.up_proj.weight", up)]
    expert = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", suffix)
    if expert is not None:
        e, fc = expert.groups()
        if fc == "2":
            return [(f"{h}mlp.experts.{e}.down_proj.weight", tensor)]
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{h}mlp.experts.{e}.gate_proj.weight", gate), (f"{h}mlp.experts.{e}.up_proj.weight", up)]
    raise ConfigError(f"megatron parameter {name!r} has no HF counterpart in sluice's Qwen3 mapping")


def _require(hf: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise ConfigError(
            f"HF weights lack {name!r}: the checkpoint does not match the ModelConfig (wrong layer count, "
            "experts or tie_word_embeddings?)"
        )
    return hf[name]


# --- sharding ------------------------------------------------------------------------------------------------------


def _parallel_coords(is_expert: bool) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group that shards this kind of parameter."""
    from megatron.core import parallel_state as ps

    if is_expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _expert_offset(model: ModelConfig) -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank() * (model.num_experts // ps.get_expert_model_parallel_world_size())


def _is_glu_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def _partition_dim(param: torch.Tensor) -> int:
    # megatron tags tensor-parallel weights with the dimension they are split along.
    return int(getattr(param, "partition_dim"))


def _shard(full: torch.Tensor, param: torch.Tensor, name: str, rank: int, size: int) -> torch.Tensor:
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = _partition_dim(param)
    if _is_glu_fc1(name):
        # Each TP rank holds [its gate rows; its up rows], not a contiguous slice of cat(gate, up).
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)
    return full.chunk(size, dim=dim)[rank]


def _global_name(name: str, offset: int) -> str:
    match = _MEGATRON_EXPERT.match(name)
    if match is None or offset == 0:
        return name
    prefix, local, rest = match.groups()
    return f"{prefix}.{int(local) + offset}.{rest}"


# The TE layer spec fuses the pre-attention and (dense) pre-MLP norms into the following linear layer; everything
# else keeps the local spec's name. Normalising to local names lets one mapping serve both specs.
_TE_FUSED_NORMS = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
)


def _named_parameters(mg_model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(local-spec name, parameter); tied output weights appear once, as the embedding."""
    for name, param in mg_model.named_parameters():
        for te_suffix, local_suffix in _TE_FUSED_NORMS:
            if name.endswith(te_suffix):
                name = name[: -len(te_suffix)] + local_suffix
        yield name, param


class _Recording(Mapping[str, torch.Tensor]):
    """A view of HF weights that remembers which names were read."""

    def __init__(self, inner: Mapping[str, torch.Tensor]) -> None:
        self.inner = inner
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.inner[name]
        self.read.add(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


@torch.no_grad()
def load_hf_into_megatron(mg_model: torch.nn.Module, source: HFSource, model: ModelConfig) -> None:
    """Copy HF weights into this rank's shard of a megatron-core ``GPTModel``.

    Reads only the tensors this rank needs (its own experts), lazily when ``source`` is a checkpoint folder.
    """
    hf = _Recording(hf_weights(source))
    offset = _expert_offset(model) if model.is_moe else 0
    for name, param in _named_parameters(mg_model):
        full = megatron_from_hf(_global_name(name, offset), hf, model)
        rank, size = _parallel_coords(".mlp.experts." in name)
        shard = _shard(full, param, name, rank, size)
        if shard.shape != param.shape:
            raise ConfigError(
                f"{name}: HF gives shape {tuple(shard.shape)} for this rank, the model has {tuple(param.shape)}; "
                "the checkpoint and ModelConfig disagree"
            )
        param.copy_(shard)
    _check_all_used(hf, model)


def _check_all_used(hf: _Recording, model: ModelConfig) -> None:
    # Experts of other EP ranks are legitimately unread here, and a tied model's checkpoint may still carry lm_head;
    # anything else unread means the ModelConfig describes a different model than the checkpoint.
    ignorable = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")
    unused = [n for n in hf if n not in hf.read and not ignorable.match(n)]
    if model.tie_word_embeddings and "lm_head.weight" in unused:
        unused.remove("lm_head.weight")
    if unused:
        raise ConfigError(f"HF tensors with no megatron parameter: {unused[:5]} (the ModelConfig does not match)")


# --- export (weight push) ------------------------------------------------------------------------------------------


def _gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _unshard(param: torch.Tensor, name: str, group: Any) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return param.detach()
    parts = _gather(param.detach(), group)
    dim = _partition_dim(param)
    if _is_glu_fc1(name):
        gates, ups = zip(*(p.chunk(2, dim=dim) for p in parts))
        return torch.cat([*gates, *ups], dim=dim)
    return torch.cat(parts, dim=dim)


def iter_hf_weights(
    mg_model: torch.nn.Module, model: ModelConfig, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every weight, in a fixed order; yields only on global rank 0.

    Every trainer rank must exhaust this iterator together: TP and EP shards are all-gathered on the way, and a
    rank that stops early deadlocks the others. Unsharded tensors are views of the live parameters (no copy), so
    send or clone them before the next optimizer step.
    """
    from megatron.core import parallel_state as ps

    single = not dist.is_initialized() or dist.get_world_size() == 1
    is_root = single or dist.get_rank() == 0
    for name, param in _named_parameters(mg_model):
        match = _MEGATRON_EXPERT.match(name)
        if match is None:
            full = param.detach() if single else _unshard(param, name, ps.get_tensor_model_parallel_group())
            items = megatron_full_to_hf(name, full, model)
        else:
            items = _expert_items(name, param, model, single)
        if is_root:
            for hf_name, tensor in items:
                yield hf_name, (tensor.to(dtype) if dtype is not None else tensor).contiguous()


def _expert_items(name: str, param: torch.Tensor, model: ModelConfig, single: bool) -> list[tuple[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    if single:
        return megatron_full_to_hf(name, param.detach(), model)
    full_local = _unshard(param, name, ps.get_expert_tensor_parallel_group())
    per_rank = _gather(full_local, ps.get_expert_model_parallel_group())
    local_count = model.num_experts // len(per_rank)
    prefix, local, rest = _MEGATRON_EXPERT.match(name).groups()  # type: ignore[union-attr]
    items: list[tuple[str, torch.Tensor]] = []
    for ep_rank, tensor in enumerate(per_rank):
        global_name = f"{prefix}.{int(local) + ep_rank * local_count}.{rest}"
        items += megatron_full_to_hf(global_name, tensor, model)
    return items


def bucket_by_bytes(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into consecutive buckets of at most ``bucket_bytes`` (a bigger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def megatron_to_hf_state_dict(mg_model: torch.nn.Module, model: ModelConfig) -> HFStateDict:
    """The whole model as an HF per-expert state dict (rank 0 gets it; other ranks get {} after the gathers)."""
    return dict(iter_hf_weights(mg_model, model))
