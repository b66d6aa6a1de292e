"""HF checkpoint weights <-> megatron-core ``GPTModel`` parameters, for every family sluice knows.

A hand-written mapping rather than mbridge: mbridge needs eight patches on CPU, knows only the TransformerEngine
names and ignores ``norm_topk_prob``. The mapping works in two halves:
- name/layout conversion between full (unsharded) tensors, in ``megatron_from_hf`` / ``megatron_full_to_hf``, by the
  rules the model's family lists per layer (``pipeline.models.families``);
- sharding: slicing a full tensor down to this rank's TP/EP shard on load, gathering shards back on export, the
  same for every family.

HF names are the checkpoint (and SGLang) names, one tensor per expert: ``model.layers.{i}.mlp.experts.{e}.
{gate,up,down}_proj.weight``. transformers 5 keeps experts fused in memory (``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]); ``unfuse_hf_experts`` / ``fuse_hf_experts`` translate.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.consumers.megatron.config import ModelConfig
from pipeline.errors import ConfigError
from pipeline.models.families import family
from pipeline.models.families.mapping import GLOBAL_NAMES, HF_LAYER, MEGATRON_LAYER, Rule

HFStateDict = dict[str, torch.Tensor]
log = logging.getLogger(__name__)

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
MEGATRON_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts)\.(\d+)\.(linear_fc[12]\.weight)$")


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
    for i in (i for i in range(model.num_layers) if model.is_moe_layer(i)):
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


# --- full-tensor layout conversion ----------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _layer_rules(model: ModelConfig, layer: int) -> dict[str, Rule]:
    """The family's rules of one layer, by megatron suffix (cached: a layer of 256 experts has 512 rules)."""
    return {rule.megatron: rule for rule in family(model.family).layer_rules(model, layer)}


def _layer_rule(name: str, model: ModelConfig) -> tuple[int, Rule]:
    match = _LAYER_NAME.match(name)
    rule = None
    if match is not None and int(match.group(1)) < model.num_layers:
        rule = _layer_rules(model, int(match.group(1))).get(match.group(2))
    if match is None or rule is None:
        raise ConfigError(f"megatron parameter {name!r} has no HF counterpart in sluice's {model.family} mapping")
    return int(match.group(1)), rule


def _has_rule(name: str, model: ModelConfig) -> bool:
    if name in GLOBAL_NAMES:
        return True
    match = _LAYER_NAME.match(name)
    return (match is not None and int(match.group(1)) < model.num_layers
            and match.group(2) in _layer_rules(model, int(match.group(1))))


def spec_weights(mg_model: torch.nn.Module, model: ModelConfig) -> dict[str, str | None]:
    """The weights user modules (``model.spec``) added, which the family's mapping does not know: local-spec name ->
    the HF name their module declares in ``hf_weights`` (``pipeline.models.spec``), or None where it declares none.

    Empty for a model built without a spec (or with one that swaps modules without adding weights).
    """
    from pipeline.models.spec import HF_WEIGHTS_ATTR

    out: dict[str, str | None] = {}
    for name, _ in named_weights(mg_model):
        if _has_rule(_global_name(name, 0), model):
            continue
        parts = name.split(".")
        owners = [mg_model.get_submodule(".".join(parts[:cut])) for cut in range(len(parts) - 1, 0, -1)]
        if not any(_is_user_module(m) for m in owners):
            continue  # a gap in the family's own mapping: megatron_from_hf / megatron_full_to_hf name it
        out[name] = None
        for cut, owner in zip(range(len(parts) - 1, 0, -1), owners):  # the innermost declaring module wins
            declared = getattr(owner, HF_WEIGHTS_ATTR, None)
            if declared is None or ".".join(parts[cut:]) not in declared:
                continue
            hf_name = str(declared[".".join(parts[cut:])])
            match = _LAYER_NAME.match(name)
            out[name] = HF_LAYER.format(i=int(match.group(1))) + hf_name if match else hf_name
            break
    return out


_LIBRARY_MODULES = ("megatron.", "transformer_engine", "torch.", "pipeline.")


def _is_user_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a class of user code (a ``model.spec`` module) rather than megatron's, TE's or sluice's."""
    return declares_hf_weights(module) or not type(module).__module__.startswith(_LIBRARY_MODULES)


def declares_hf_weights(module: torch.nn.Module) -> bool:
    """Whether ``module`` names its weights for HF checkpoints (``pipeline.models.spec``)."""
    from pipeline.models.spec import HF_WEIGHTS_ATTR

    return getattr(module, HF_WEIGHTS_ATTR, None) is not None


def check_exportable(mg_model: torch.nn.Module, model: ModelConfig) -> dict[str, str]:
    """The spec weights' HF names; ConfigError naming the weights when a user module declares none for some (they
    could not be written to an HF folder or pushed to an engine)."""
    extra = spec_weights(mg_model, model)
    undeclared = sorted(name for name, hf_name in extra.items() if hf_name is None)
    if undeclared:
        shown = ", ".join(undeclared[:4]) + (f" and {len(undeclared) - 4} more" if len(undeclared) > 4 else "")
        raise ConfigError(
            f"model.spec added weights with no HF name: {shown}. They cannot be exported to an HF folder or pushed "
            f"to rollout engines; declare them in their module's class attribute `hf_weights` (parameter name -> HF "
            "name under model.layers.{i}., docs/plugins.md), or run without pushing or exporting"
        )
    return {name: hf_name for name, hf_name in extra.items() if hf_name is not None}


def megatron_names(model: ModelConfig) -> list[str]:
    """Full-model megatron local-spec tensor names (global expert ids), in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(model.num_layers):
        names += [MEGATRON_LAYER.format(i=i) + suffix for suffix in _layer_rules(model, i)]
    names.append("decoder.final_layernorm.weight")
    if not model.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def megatron_from_hf(name: str, hf: Mapping[str, torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """One full (unsharded) megatron local-spec tensor (global expert ids) from per-expert HF tensors."""
    if name in GLOBAL_NAMES:
        return _require(hf, GLOBAL_NAMES[name])
    layer, rule = _layer_rule(name, model)
    prefix = HF_LAYER.format(i=layer)
    return rule.join([_require(hf, prefix + suffix) for suffix in rule.hf])


def hf_to_megatron_full(hf: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """All full (unsharded) megatron local-spec tensors, with global expert ids, from per-expert HF tensors."""
    return {name: megatron_from_hf(name, hf, model) for name in megatron_names(model)}


def megatron_full_to_hf(name: str, tensor: torch.Tensor, model: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full megatron tensor (global expert ids)."""
    if name in GLOBAL_NAMES:
        return [(GLOBAL_NAMES[name], tensor)]
    layer, rule = _layer_rule(name, model)
    prefix = HF_LAYER.format(i=layer)
    return [(prefix + suffix, part) for suffix, part in zip(rule.hf, rule.split(tensor), strict=True)]


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
    match = MEGATRON_EXPERT.match(name)
    if match is None or offset == 0:
        return name
    prefix, local, rest = match.groups()
    return f"{prefix}.{int(local) + offset}.{rest}"


# The TE layer spec fuses the pre-attention and (dense) pre-MLP norms into the following linear layer; everything
# else keeps the local spec's name. Normalising to local names lets one mapping serve both specs.
_EXPERT_BIAS = ".mlp.router.expert_bias"
_TE_FUSED_NORMS = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
)


def named_weights(mg_model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(local-spec name, tensor) of every weight an HF checkpoint holds: the parameters (tied output weights
    appear once, as the embedding; LoRA adapters not at all) and the routers' expert biases, which megatron keeps as
    buffers (they are set by a rule, not by gradients) while HF checkpoints store them as
    ``e_score_correction_bias``."""
    for name, param in mg_model.named_parameters():
        if ".lora_" in name:
            continue  # a LoRA adapter (megatron/lora.py): no HF checkpoint holds it; the base weight is exported as is
        for te_suffix, local_suffix in _TE_FUSED_NORMS:
            if name.endswith(te_suffix):
                name = name[: -len(te_suffix)] + local_suffix
        yield name, param
    for name, buffer in mg_model.named_buffers():
        if name.endswith(_EXPERT_BIAS):
            yield name, buffer


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
    extra = _spec_weights_to_load(mg_model, model, hf)
    for name, param in named_weights(mg_model):
        if name in extra:
            hf_name = extra[name]
            if hf_name is None:
                continue  # a plain checkpoint: the user module keeps its own initial values
            full = hf[hf_name]
        else:
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


def _spec_weights_to_load(mg_model: torch.nn.Module, model: ModelConfig,
                          hf: Mapping[str, torch.Tensor]) -> dict[str, str | None]:
    """Spec weights -> the HF name to load each from, or None to keep the module's initial value: all of them when the
    checkpoint holds none (a plain HF model, the usual start), all of them when it holds every one (one this spec
    exported); a checkpoint with only some is refused (it was written by another spec)."""
    extra = spec_weights(mg_model, model)
    present = {name for name, hf_name in extra.items() if hf_name is not None and hf_name in hf}
    if not present:
        if extra:
            log.info("model.spec weights not in the HF checkpoint keep their initial values: %s",
                     ", ".join(sorted(extra)[:4]) + (" ..." if len(extra) > 4 else ""))
        return dict.fromkeys(extra)
    missing = sorted(set(extra) - present)
    if missing:
        raise ConfigError(
            f"the HF checkpoint holds some of model.spec's weights but not {missing[:4]} (their HF names: "
            f"{[extra[m] for m in missing[:4]]}); it was written for another spec or model"
        )
    return extra


def _check_all_used(hf: _Recording, model: ModelConfig) -> None:
    # Experts of other EP ranks are legitimately unread here, and a tied model's checkpoint may still carry lm_head;
    # anything else unread means the ModelConfig describes a different model than the checkpoint.
    ignorable = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")
    fam = family(model.family)
    unused = [n for n in hf if n not in hf.read and not ignorable.match(n) and not fam.ignored_hf_tensor(n, model)]
    if model.tie_word_embeddings and "lm_head.weight" in unused:
        unused.remove("lm_head.weight")
    if unused:
        raise ConfigError(f"HF tensors with no megatron parameter: {unused[:5]} (the ModelConfig does not match, or "
                          "the checkpoint was exported from a model with a model.spec whose weights these are)")


# --- export (weight push) ------------------------------------------------------------------------------------------


def gather_to(tensor: torch.Tensor, group: Any, dst: int) -> list[torch.Tensor] | None:
    """Every member's ``tensor`` of ``group``, in group order, on global rank ``dst``; None on the others. A gather,
    not an all-gather: no rank receives bytes it would drop."""
    if dist.get_world_size(group) == 1:
        return [tensor]
    mine = dist.get_rank() == dst
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))] if mine else None
    dist.gather(tensor.contiguous(), parts, dst=dst, group=group)
    return parts


def join_shards(parts: list[torch.Tensor], param: torch.Tensor, name: str) -> torch.Tensor:
    """The full tensor from its TP shards in rank order (a GLU fc1's gate and up halves each joined)."""
    dim = _partition_dim(param)
    if _is_glu_fc1(name):
        gates, ups = zip(*(p.chunk(2, dim=dim) for p in parts))
        return torch.cat([*gates, *ups], dim=dim)
    return torch.cat(parts, dim=dim)


def is_tp_sharded(param: torch.Tensor, group: Any) -> bool:
    """Whether ``param`` is split over ``group`` (megatron tags such parameters; a group of one splits nothing)."""
    return bool(getattr(param, "tensor_model_parallel", False)) and dist.get_world_size(group) > 1


def unshard_to(param: torch.Tensor, name: str, group: Any, dst: int,
               value: torch.Tensor | None = None) -> torch.Tensor | None:
    """``param`` whole on global rank ``dst`` (a member of ``group``), None on the other members. ``value``, sharded
    as ``param`` is, is gathered in its place (a LoRA-merged weight)."""
    local = (param if value is None else value).detach()
    if not is_tp_sharded(param, group):
        return local if dist.get_rank() == dst else None
    parts = gather_to(local, group, dst)
    return None if parts is None else join_shards(parts, param, name)


def iter_hf_weights(
    mg_model: torch.nn.Module, model: ModelConfig, *, dtype: torch.dtype | None = None,
    values: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every weight, in a fixed order; yields only on global rank 0.

    Every trainer rank must exhaust this iterator together. Shards are gathered to rank 0 alone, and only by the
    ranks whose groups hold rank 0 (its tensor-parallel group for dense weights; data-parallel replica 0 of the
    experts for those): no rank receives a tensor it would drop. Unsharded tensors are views of the live parameters
    (no copy), so send or clone them before the next optimizer step. ``pipeline.consumers.megatron.owners`` exports
    each tensor from the rank that owns it instead. ``values`` replaces named parameters' local shards with tensors
    sharded the same way (``lora.merge_lora``'s merged weights).
    """
    from megatron.core import parallel_state as ps

    single = not dist.is_initialized() or dist.get_world_size() == 1
    is_root = single or dist.get_rank() == 0
    # Every rank checks (and refuses) before the first collective, so a refusal cannot leave a rank in a gather.
    extra = check_exportable(mg_model, model)
    dense_replica_0 = single or ps.get_data_parallel_rank() == 0
    for name, param in named_weights(mg_model):
        value = None if values is None else values.get(name)
        match = MEGATRON_EXPERT.match(name)
        if match is not None:
            items = _expert_items(name, param, model, single, value)
        elif not dense_replica_0:
            continue  # rank 0's TP group gathers these; this rank's group holds another replica
        else:
            local = (param if value is None else value).detach()
            full = local if single else unshard_to(param, name, ps.get_tensor_model_parallel_group(), 0, value)
            if full is None:
                continue
            items = [(extra[name], full)] if name in extra else megatron_full_to_hf(name, full, model)
        if is_root:
            for hf_name, tensor in items:
                yield hf_name, (tensor.to(dtype) if dtype is not None else tensor).contiguous()


def _expert_items(name: str, param: torch.Tensor, model: ModelConfig, single: bool,
                  value: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor]]:
    """This expert parameter of every EP rank, on rank 0 (empty elsewhere): each ETP group of expert replica 0
    gathers its shards to its first rank, whose EP group (rank 0's) then gathers the experts to rank 0."""
    from megatron.core import parallel_state as ps

    if single:
        return megatron_full_to_hf(name, (param if value is None else value).detach(), model)
    if ps.get_expert_data_parallel_rank() != 0:
        return []
    etp_group = ps.get_expert_tensor_parallel_group()
    full_local = unshard_to(param, name, etp_group, dist.get_process_group_ranks(etp_group)[0], value)
    if full_local is None:
        return []
    per_rank = gather_to(full_local, ps.get_expert_model_parallel_group(), 0)
    if per_rank is None:
        return []
    local_count = model.num_experts // len(per_rank)
    prefix, local, rest = MEGATRON_EXPERT.match(name).groups()  # type: ignore[union-attr]
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
