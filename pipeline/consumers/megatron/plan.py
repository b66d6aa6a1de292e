"""The memory plan of a trainer layout, before anything starts: what one rank holds, and layouts that cannot work.

``sluice run --dry-run`` prints it. Pure arithmetic on a ``ModelConfig`` (read from a ``config.json``, no weights)
and the recipe's parallel sizes: no torch, no GPU, no checkpoint files.

Per rank, on CUDA (megatron's DDP and distributed optimizer, ``optim.py``):
- parameters in the model's dtype;
- gradients in fp32 (DDP's ``grad_reduce_in_fp32`` buffers);
- optimizer state, fp32 master weights plus Adam's two moments (12 bytes per parameter), sharded over the
  data-parallel ranks for dense weights and over the expert-data-parallel ranks for experts;
- a frozen KL reference, when ``trainer.loss.kl_coef > 0`` (parameters only);
- activations of one micro-batch (the train step runs forward and backward one micro-batch at a time): an
  estimate, the tensors each layer keeps for its backward with no recomputation, balanced routing, and the fp32
  logits of the loss.

On CPU (torch AdamW over the rank's own parameters, no sharding) parameters, gradients and both moments are counted
in fp32, plus fp32 master copies for low-precision parameters.

Sharding follows megatron-core: tensor parallelism (TP) splits attention heads, MLP columns and the vocabulary
(MLA's two down-projections stay whole on every TP rank, as TransformerEngine's spec keeps them); experts are split
over EP x ETP ranks, where megatron sets the expert-tensor-parallel size ETP to TP.

The weight push (``plan_push``, docs/weight-push.md) adds, in the wire dtype: the snapshot of the tensors this rank
sends (with ``trainer.overlap_push``), on the GPU or in pinned host memory (``sync.snapshot``); two bucket buffers;
and the gather of a sharded tensor by its owner. With ``sync.sources = "owners"`` a rank sends about its experts'
share and 1/world of the dense weights; with ``"rank0"`` rank 0 sends the whole model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config.hardware import HardwareConfig
from pipeline.config.model import ModelSource
from pipeline.config.sync import SyncConfig
from pipeline.config.trainer import TrainerConfig
from pipeline.errors import ConfigError
from pipeline.models.config import ModelConfig

GIB = 1 << 30
MIB = 1 << 20
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of the trainer (PP is 1: see ``TrainerConfig.pp``)."""

    world_size: int
    tp: int
    ep: int

    @property
    def dp(self) -> int:
        """Data-parallel ranks."""
        return self.world_size // self.tp

    @property
    def etp(self) -> int:
        """Expert-tensor-parallel size (megatron's default: TP)."""
        return self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (the distributed optimizer shards expert state over them)."""
        return self.world_size // (self.ep * self.etp)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts: the whole model, and one rank's share."""

    dense: int
    """Everything but the routed experts, whole model."""
    expert: int
    """Routed experts, whole model."""
    active: int
    """Parameters one token passes through (dense plus top-k experts)."""
    rank_dense: int
    """Dense parameters on one rank."""
    rank_expert: int
    """Expert parameters on one rank."""

    @property
    def total(self) -> int:
        return self.dense + self.expert

    @property
    def rank_total(self) -> int:
        return self.rank_dense + self.rank_expert


def count_parameters(model: ModelConfig, layout: Layout) -> ParamCounts:
    """Parameters of ``model`` (megatron's, which are HF's but for the MTP layer a checkpoint may carry), whole and
    per rank under ``layout``."""
    h = model.hidden_size
    outputs = 1 if model.tie_word_embeddings else 2
    parts = [(outputs * model.vocab_size * h, True), (h, False)]  # embedding (+ output layer), final norm
    for layer in range(model.num_layers):
        parts += [(2 * h, False), *_attention_params(model)]  # the two norms, attention
        if not model.is_moe_layer(layer):
            parts.append((3 * h * model.ffn_hidden_size, True))
            continue
        parts.append((model.num_experts * h, False))  # the router (its expert bias is a buffer)
        if model.shared_expert_ffn_hidden_size:
            parts.append((3 * h * model.shared_expert_ffn_hidden_size, True))
    dense = sum(count for count, _ in parts)
    rank_dense = sum(count // layout.tp if sharded else count for count, sharded in parts)
    per_expert = 3 * h * model.moe_ffn_hidden_size
    experts = model.num_moe_layers * model.num_experts * per_expert
    return ParamCounts(dense=dense, expert=experts, active=dense + model.num_moe_layers * model.moe_topk * per_expert,
                       rank_dense=rank_dense, rank_expert=experts // (layout.ep * layout.etp))


def _attention_params(model: ModelConfig) -> list[tuple[int, bool]]:
    """(count, split over TP) of one layer's attention weights."""
    h, heads, mla = model.hidden_size, model.num_attention_heads, model.mla
    if mla is None:
        d, kv = model.head_dim, model.num_kv_heads
        return [(h * (heads + 2 * kv) * d, True), (heads * d * h, True), (2 * d if model.qk_norm else 0, False)]
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank is None:
        query = [(h * heads * qk, True)]
    else:  # down-projection and its norm whole on every TP rank, up-projection split by heads
        query = [(h * mla.q_lora_rank + mla.q_lora_rank, False), (mla.q_lora_rank * heads * qk, True)]
    return [*query,
            (h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank, False),
            (mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim), True),
            (heads * mla.v_head_dim * h, True)]


def activation_bytes(model: ModelConfig, layout: Layout, tokens: int) -> int:
    """Estimate of one micro-batch's activations on one rank (see the module docstring)."""
    h, heads = model.hidden_size, model.num_attention_heads
    if model.mla is None:
        attention = 2 * h + 2 * heads * model.head_dim + 2 * model.num_kv_heads * model.head_dim
    else:
        mla = model.mla
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        latents = (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim
        attention = 2 * h + latents + heads * (2 * qk + 2 * mla.v_head_dim)
    dense_mlp = h + 3 * model.ffn_hidden_size
    moe = (2 * model.num_experts + model.moe_topk * (h + 3 * model.moe_ffn_hidden_size)
           + (h + 3 * model.shared_expert_ffn_hidden_size if model.shared_expert_ffn_hidden_size else 0))
    per_token = sum(attention + (moe if model.is_moe_layer(i) else dense_mlp) for i in range(model.num_layers))
    elem = _BYTES[model.dtype]
    # Sequence parallelism (on whenever an MoE model uses TP) splits every per-token tensor over the TP ranks.
    layers = tokens * per_token * elem // layout.tp
    logits = tokens * (model.vocab_size // layout.tp) * (elem + 8)  # the logits, their fp32 copy and its gradient
    return layers + logits


@dataclass(frozen=True)
class PushPlan:
    """What the weight push holds on the trainer rank that sends the most (docs/weight-push.md)."""

    sources: Literal["owners", "rank0"]
    """``sync.sources``: every rank sends the tensors it owns, or rank 0 sends them all."""
    setting: Literal["auto", "device", "host"]
    """``sync.snapshot`` as the recipe asks it; ``where`` is what it came to."""
    wire_dtype: str
    share: int
    """Bytes this rank sends per push, in the wire dtype (an upper bound in owners mode)."""
    snapshot: int
    """Bytes of the snapshot of ``share``; 0 when the push streams from the live weights (no ``overlap_push``)."""
    where: Literal["device", "host"]
    """Where the snapshot lives: the rank's device (on CPU: its memory) or pinned host memory."""
    bucket: int
    """One bucket buffer; the sender keeps two (the one on the wire and the one packed ahead)."""
    gather: int
    """An owner gathering a sharded tensor holds its parts and the joined whole at once: twice the largest."""

    @property
    def device_bytes(self) -> int:
        return 2 * self.bucket + self.gather + (self.snapshot if self.where == "device" else 0)

    @property
    def host_bytes(self) -> int:
        return self.snapshot if self.where == "host" else 0


def _dense_tensors(model: ModelConfig) -> list[tuple[int, bool]]:
    """(elements, split over TP) of each kind of megatron dense tensor: the units an owner gathers and sends."""
    h = model.hidden_size
    tensors = [(model.vocab_size * h, True), *_attention_params(model)]  # an untied output layer: the embedding's
    if model.num_layers > model.num_moe_layers:
        tensors += [(2 * h * model.ffn_hidden_size, True), (h * model.ffn_hidden_size, True)]  # fc1 = cat(gate, up)
    if model.is_moe:
        tensors.append((model.num_experts * h, False))
    if shared := model.shared_expert_ffn_hidden_size:
        tensors += [(2 * h * shared, True), (h * shared, True)]
    return tensors


def plan_push(model: ModelConfig, layout: Layout, *, device: Literal["cuda", "cpu"], sync: SyncConfig,
              overlap_push: bool, room: int | None) -> PushPlan:
    """The weight push's memory on its busiest source under ``layout``; ``room`` is what the device has left after
    training (None: no limit known), which ``sync.snapshot = "auto"`` fills before it goes to the host."""
    counts = count_parameters(model, layout)
    wire_dtype = model.dtype if sync.dtype == "auto" else sync.dtype
    elem = _BYTES[wire_dtype]
    dense = _dense_tensors(model)
    sharded = [n for n, split in dense if split] if layout.tp > 1 else []
    expert_fc1 = 2 * model.hidden_size * model.moe_ffn_hidden_size if model.is_moe else 0
    if sync.sources == "rank0":
        share = counts.total * elem
        # rank 0 also takes every expert from the rank that holds it
        gathered = sharded + ([expert_fc1] if layout.ep * layout.etp > 1 else [])
    else:
        # Experts are owned only by expert-data-parallel replica 0, one ETP rank per tensor; the dense tensors are
        # spread over every rank by bytes, and whole tensors can overshoot an even split by at most the largest.
        largest = max(n for n, _ in dense)
        share = min(counts.expert // (layout.ep * layout.etp) + counts.dense // layout.world_size + largest,
                    counts.total) * elem
        gathered = sharded + ([expert_fc1] if layout.etp > 1 else [])
    bucket = (sync.bucket_mb or (512 if device == "cuda" else 256)) * MIB
    gather = 2 * max(gathered, default=0) * elem
    # Owners always send from a snapshot of their share (packed before the next step, sent while it trains or
    # before it); rank 0 alone streams without one unless the push overlaps the next step.
    snapshot = share if overlap_push or sync.sources == "owners" else 0
    where: Literal["device", "host"]
    if device == "cpu" or sync.snapshot == "device":
        where = "device"
    elif sync.snapshot == "host":
        where = "host"
    else:
        where = "device" if room is None or 2 * bucket + gather + snapshot <= room else "host"
    return PushPlan(sources=sync.sources, setting=sync.snapshot, wire_dtype=wire_dtype, share=share,
                    snapshot=snapshot, where=where, bucket=bucket, gather=gather)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one trainer rank holds, by kind."""

    counts: ParamCounts
    layout: Layout
    device: Literal["cuda", "cpu"]
    tokens: int
    params: int
    grads: int
    optimizer: int
    reference: int
    activations: int
    push: PushPlan
    """The weight push; its device part is in ``total``, a snapshot in host memory is not."""

    @property
    def training(self) -> int:
        """Everything but the push."""
        return self.params + self.grads + self.optimizer + self.reference + self.activations

    @property
    def total(self) -> int:
        return self.training + self.push.device_bytes


def plan_memory(model: ModelConfig, layout: Layout, *, device: Literal["cuda", "cpu"], tokens: int,
                kl_reference: bool, sync: SyncConfig | None = None, overlap_push: bool = True,
                usable: int | None = None, trainable: float = 1.0) -> MemoryPlan:
    """The per-rank memory of training ``model`` under ``layout`` with micro-batches of ``tokens`` tokens, and of
    pushing its weights; ``usable`` is the device memory a rank may fill (None: unknown). ``trainable`` is the
    fraction of parameters that train (LoRA's adapters): gradients and optimizer state scale with it."""
    counts = count_parameters(model, layout)
    elem = _BYTES[model.dtype]
    params = counts.rank_total * elem
    if device == "cuda":
        grads = counts.rank_total * 4
        optimizer = 12 * (counts.rank_dense // layout.dp + counts.rank_expert // layout.expert_dp)
    else:
        grads = counts.rank_total * elem
        optimizer = counts.rank_total * (8 + (4 if elem < 4 else 0))
    grads, optimizer = int(grads * trainable), int(optimizer * trainable)
    reference = params if kl_reference else 0
    activations = activation_bytes(model, layout, tokens)
    training = params + grads + optimizer + reference + activations
    push = plan_push(model, layout, device=device, sync=sync or SyncConfig(), overlap_push=overlap_push,
                     room=None if usable is None else usable - training)
    return MemoryPlan(counts=counts, layout=layout, device=device, tokens=tokens, params=params, grads=grads,
                      optimizer=optimizer, reference=reference, activations=activations, push=push)


def gpu_layout_problems(model: ModelConfig, layout: Layout) -> list[str]:
    """Why megatron-core could not build or run ``model`` under ``layout`` on GPUs; [] when it can."""
    from pipeline.consumers.megatron.config import ParallelConfig, layout_problems

    problems = layout_problems(model, ParallelConfig(tp=layout.tp, ep=layout.ep, device="cuda"))
    if layout.world_size % layout.tp:
        problems.append(f"trainer.world_size={layout.world_size} is not divisible by tp={layout.tp}")
    elif (layout.dp * layout.tp) % layout.ep:
        problems.append(f"ep={layout.ep} must divide dp*tp = {layout.dp * layout.tp}")
    if model.is_moe and layout.world_size % (layout.ep * layout.etp):
        problems.append(f"ep x etp = {layout.ep} x {layout.etp} (megatron's expert-tensor-parallel size is tp) must "
                        f"divide trainer.world_size={layout.world_size}")
    if model.ffn_hidden_size % layout.tp:
        problems.append(f"tp={layout.tp} must divide the dense MLP width {model.ffn_hidden_size}")
    if model.is_moe and model.moe_ffn_hidden_size % layout.etp:
        problems.append(f"etp={layout.etp} must divide the expert width {model.moe_ffn_hidden_size}")
    return problems


def plan_model_config(model: ModelSource, hardware: HardwareConfig) -> tuple[ModelConfig, str]:
    """The model a recipe trains, from a config.json alone, and where it came from (weights are never read)."""
    path = model.path
    if path is not None and (Path(path) / "config.json").is_file():
        source = Path(path) / "config.json"
    elif hardware.hf_config is not None:
        source = Path(hardware.hf_config)
        if not source.is_file():
            raise ConfigError(f"hardware.hf_config {source} is not a file; point it at the model's config.json")
    elif path is None:
        from pipeline.models.families import family_for_tiny
        from pipeline.models.tiny import CHARACTERS, SPECIAL_TOKENS

        arch = model.init_tiny
        values = {"vocab_size": len(SPECIAL_TOKENS) + len(CHARACTERS), **model.init_overrides}
        hf = family_for_tiny(arch).tiny_config(arch, values).to_dict()
        return ModelConfig.from_hf(hf, dtype="float32"), f"the tiny {arch} model (model.init_tiny)"
    else:
        raise ConfigError(f"model.path {path} holds no config.json and hardware.hf_config is unset: the dry run "
                          "plans from the model's config.json alone; set hardware.hf_config to one")
    return ModelConfig.from_hf(json.loads(source.read_text())), str(source)


def dry_run_plan(trainer: TrainerConfig, model: ModelSource, hardware: HardwareConfig,
                 sync: SyncConfig | None = None, *, fp8: bool = False, sglang_args: list[str] | None = None) -> str:
    """The dry run's plan: the model, the layout and one rank's memory, the weight push's included; ConfigError for
    a layout that cannot run or cannot fit (every reason at once, and the settings that would make it fit).
    ``fp8`` with ``sglang_args`` (the servers' flags): SGLang serves block FP8, which constrains the model's shape."""
    hw = hardware
    sync = sync or SyncConfig()
    model_cfg, source = plan_model_config(model, hardware)
    layout = Layout(world_size=trainer.world_size, tp=trainer.tp, ep=trainer.ep)
    problems = gpu_layout_problems(model_cfg, layout)
    if fp8 and sglang_args is not None:
        from pipeline.consumers.megatron.fp8_plan import sglang_fp8_problems

        problems += sglang_fp8_problems(model_cfg, sglang_args)
    if hw.trainer_nodes is not None and hw.trainer_nodes * hw.gpus_per_node != trainer.world_size:
        problems.append(f"hardware.trainer_nodes x gpus_per_node = {hw.trainer_nodes} x {hw.gpus_per_node} GPUs, "
                        f"but trainer.world_size = {trainer.world_size}")
    if problems:
        raise ConfigError("this layout cannot run: " + "; ".join(problems))
    device: Literal["cuda", "cpu"] = "cuda" if hw.gpu_memory_gib is not None else "cpu"
    tokens = (trainer.micro_batch_tokens
              or trainer.micro_batch_samples * (hw.seq_len or model_cfg.max_position_embeddings))
    usable = _usable(hw)
    lora = None
    if trainer.lora is not None:
        from pipeline.consumers.megatron.lora_plan import format_lora, lora_counts

        lora = lora_counts(model_cfg, trainer.lora, count_parameters(model_cfg, layout).total)

    def plan_with(sync: SyncConfig, overlap_push: bool) -> MemoryPlan:
        return plan_memory(model_cfg, layout, device=device, tokens=tokens, kl_reference=trainer.loss.kl_coef > 0,
                           sync=sync, overlap_push=overlap_push, usable=usable,
                           trainable=1.0 if lora is None else lora.trainer / lora.full)

    plan = plan_with(sync, trainer.overlap_push)
    text = format_plan(plan, model_cfg, source, hardware)
    if lora is not None and trainer.lora is not None:
        wire = _BYTES[model_cfg.dtype] if sync.dtype == "auto" else _BYTES[sync.dtype]
        text += "\n" + "\n".join(format_lora(lora, trainer.lora, wire))
    if trainer.lora is None:
        from pipeline.consumers.megatron.fp8_plan import format_fp8, fp8_bytes

        text += "\n" + "\n".join(format_fp8(fp8_bytes(model_cfg, count_parameters(model_cfg, layout).total), fp8))
    overflow = _overflow(plan, hw)
    if not overflow:
        return text
    shrink = ("raise ep (experts over more ranks), tp, or trainer.world_size, or lower micro_batch_samples / "
              "micro_batch_tokens")
    if usable is not None and plan.training > usable:
        raise ConfigError(f"{text}\nthis layout cannot fit: {'; '.join(overflow)}; {shrink}")
    # Training fits and the push does not: name the push settings that would make it fit, each tried in full.
    fixes = [label for label, fix, overlap in _push_fixes(plan, sync, trainer.overlap_push, usable)
             if not _overflow(plan_with(fix, overlap), hw)]
    advice = "set " + ", or ".join(fixes) if fixes else shrink
    raise ConfigError(f"{text}\nthis layout cannot fit its weight push: {'; '.join(overflow)}; {advice}")


def _push_fixes(plan: MemoryPlan, sync: SyncConfig, overlap_push: bool,
                usable: int | None) -> list[tuple[str, SyncConfig, bool]]:
    """Push settings that might make ``plan`` fit: (what to set, the sync config, overlap_push) to re-plan with."""
    push = plan.push
    fixes: list[tuple[str, SyncConfig, bool]] = []
    if push.snapshot and push.where == "device":
        fixes.append(('sync.snapshot = "host" (the snapshot in pinned host memory)',
                      sync.model_copy(update={"snapshot": "host"}), overlap_push))
    if push.host_bytes:
        fixes.append(('sync.snapshot = "device"', sync.model_copy(update={"snapshot": "device"}), overlap_push))
    if push.sources == "rank0":
        fixes.append(('sync.sources = "owners" (each rank sends the tensors it holds)',
                      sync.model_copy(update={"sources": "owners"}), overlap_push))
    if push.snapshot:
        fixes.append(("trainer.overlap_push = false (no snapshot: the push streams from the live weights, and the "
                      "next step waits for it)", sync, False))
    if usable is not None:
        bucket_mb = (usable - (plan.total - 2 * push.bucket)) // (2 * MIB)
        if 1 <= bucket_mb < push.bucket // MIB:
            fixes.append((f"sync.bucket_mb = {bucket_mb}", sync.model_copy(update={"bucket_mb": bucket_mb}),
                          overlap_push))
    return fixes


def _usable(hw: HardwareConfig) -> int | None:
    return None if hw.gpu_memory_gib is None else int(hw.usable_fraction * hw.gpu_memory_gib * GIB)


def _host_need(plan: MemoryPlan, hw: HardwareConfig) -> int:
    """Pinned host memory the push's snapshots take on the busiest node (rank0 mode: rank 0's alone)."""
    senders = 1 if plan.push.sources == "rank0" else min(hw.gpus_per_node, plan.layout.world_size)
    return senders * plan.push.host_bytes


def _overflow(plan: MemoryPlan, hw: HardwareConfig) -> list[str]:
    """Why ``plan`` does not fit ``hw``; [] when it does."""
    reasons = []
    usable = _usable(hw)
    if usable is not None and plan.total > usable:
        push = f", {plan.push.device_bytes / GIB:.1f} GiB of it the weight push" if plan.push.device_bytes else ""
        reasons.append(f"one rank needs about {plan.total / GIB:.1f} GiB{push}, and {hw.usable_fraction:g} x "
                       f"{hw.gpu_memory_gib:g} GiB = {usable / GIB:.1f} GiB is usable")
    host = _host_need(plan, hw)
    if hw.host_memory_gib is not None and host > hw.usable_fraction * hw.host_memory_gib * GIB:
        reasons.append(f"the push's snapshots take {host / GIB:.1f} GiB of pinned host memory on a node, and "
                       f"{hw.usable_fraction:g} x hardware.host_memory_gib = "
                       f"{hw.usable_fraction * hw.host_memory_gib:.1f} GiB is usable")
    return reasons


def format_plan(plan: MemoryPlan, model: ModelConfig, source: str, hardware: HardwareConfig) -> str:
    """The plan as the dry run prints it."""
    c, lay, hw = plan.counts, plan.layout, hardware
    shape = f"{model.num_experts} experts, top-{model.moe_topk}" if model.is_moe else "dense"
    where = f"{hw.trainer_nodes} node(s) x {hw.gpus_per_node} {hw.gpu}" if hw.trainer_nodes and hw.gpu else (
        hw.gpu or "this machine")
    lines = [
        f"memory plan per trainer rank ({plan.device}; from {source})",
        f"  model      {model.family}, {_count(c.total)} parameters ({_count(c.active)} active per token; {shape}; "
        f"{model.dtype})",
        f"  layout     world {lay.world_size} = tp {lay.tp} x dp {lay.dp} (pp 1); ep {lay.ep} x etp {lay.etp}, "
        f"expert-dp {lay.expert_dp}; on {where}",
        f"  parameters {_gib(plan.params)}  {_count(c.rank_dense)} dense + {_count(c.rank_expert)} expert",
        f"  gradients  {_gib(plan.grads)}",
        f"  optimizer  {_gib(plan.optimizer)}",
    ]
    if plan.reference:
        lines.append(f"  reference  {_gib(plan.reference)}  (KL anchor, parameters only)")
    lines.append(f"  activations {_gib(plan.activations)[1:]}  (estimate: micro-batch of {plan.tokens} tokens, "
                 "no recomputation)")
    lines.append(f"  push       {_gib(plan.push.device_bytes)}  ({_describe_push(plan, model)})")
    total = f"  total      {_gib(plan.total)}"
    if hw.gpu_memory_gib is not None:
        total += f"  of {hw.usable_fraction * hw.gpu_memory_gib:.1f} GiB usable ({hw.gpu_memory_gib:g} GiB GPU)"
    lines.append(total)
    if plan.push.host_bytes:
        host = f"  host memory: {plan.push.host_bytes / GIB:.2f} GiB pinned per sending rank (the push's snapshot)"
        if plan.push.sources == "owners":
            host += f", {_host_need(plan, hw) / GIB:.1f} GiB per node"
        if hw.host_memory_gib is not None:
            host += f" of {hw.usable_fraction * hw.host_memory_gib:.1f} GiB usable"
        lines.append(host)
    if hw.sglang_launch:
        nodes = f" on {hw.engine_nodes} node(s)" if hw.engine_nodes else ""
        lines.append(f"engines{nodes}, each started with: {hw.sglang_launch}")
    return "\n".join(lines)


def _describe_push(plan: MemoryPlan, model: ModelConfig) -> str:
    push, lay = plan.push, plan.layout
    parts = [f"2 x {push.bucket // MIB} MB buckets"]
    if push.gather:
        parts.append(f"gather {push.gather / GIB:.2f} GiB")
    if not push.snapshot:
        parts.append("no snapshot: trainer.overlap_push = false streams from the live weights")
    elif plan.device == "cpu":
        parts.append(f"snapshot {push.snapshot / GIB:.2f} GiB")
    else:
        where = "on the GPU" if push.where == "device" else "in pinned host memory"
        why = "" if push.setting != "auto" else " (auto: it fits)" if push.where == "device" else " (auto: no room)"
        parts.append(f"snapshot {push.snapshot / GIB:.2f} GiB {where}{why}")
    if push.sources == "rank0":
        parts.append(f"rank0: rank 0 sends the whole model, {push.share / GIB:.2f} GiB in {push.wire_dtype}")
    else:
        experts = f"~1/{lay.ep * lay.etp} of the experts and " if model.is_moe else ""
        parts.append(f"owners: a rank sends {experts}~1/{lay.world_size} of the dense weights, at most "
                     f"{push.share / GIB:.2f} GiB in {push.wire_dtype}")
    return "; ".join(parts)


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:9.2f} GiB"
