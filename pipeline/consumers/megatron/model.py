"""Build and run the megatron-core ``GPTModel``: process groups, RNG seeding, the model, log-probs, gradient sync."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.consumers.megatron.adapter import build_gpt_model_args
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig, check_layout
from pipeline.consumers.megatron.cpu_shim import apply_cpu_shim, seed_cpu_rng
from pipeline.consumers.megatron.fixes import fix_expert_bias_padding_mask
from pipeline.errors import ConfigError
from pipeline.net import free_port

_WORLD_STORE: dist.TCPStore | None = None


def bind_world_store(world_size: int) -> int:
    """Rank 0: host the world's store on a port the OS picks; returns it. ``init_parallel`` then builds the world on
    this store, so no port is picked by one process and bound by another."""
    global _WORLD_STORE
    _WORLD_STORE = dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(minutes=30))
    return int(_WORLD_STORE.port)


def _init_process_group(device: str) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if _WORLD_STORE is not None:
        # The other ranks join by env://, and torch prefixes the store it makes for them with "default_pg" (but not a
        # store it is handed): without the same prefix here the ranks wait on different keys forever.
        dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", _WORLD_STORE), rank=0,
                                world_size=int(os.environ.get("WORLD_SIZE", "1")))
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend)  # torchrun, Ray or sluice's launcher set the world up
        return
    # A bare single process gets a private world of one, without writing RANK/MASTER_PORT into the environment:
    # child processes would inherit them and try to join (or bind) this world's store.
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def init_parallel(parallel: ParallelConfig, *, seed: int = 1234) -> None:
    """Set up torch.distributed (gloo on CPU, NCCL on CUDA), megatron's parallel groups and the RNG tracker.

    Reuses an existing default process group. Call once per process, before ``build_gpt_model``.
    """
    from megatron.core import parallel_state as ps

    device = parallel.resolved_device()
    if device == "cpu":
        apply_cpu_shim()
    if not dist.is_initialized():
        _init_process_group(device)
    parallel.dp(dist.get_world_size())
    if ps.model_parallel_is_initialized():
        if _same_layout(parallel):
            seed_rng(seed)  # the groups it has are the ones it would make
            return
        _destroy_model_parallel_groups()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
    )
    seed_rng(seed)


def _same_layout(parallel: ParallelConfig) -> bool:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size()) == (parallel.tp, parallel.pp, parallel.ep)


def _destroy_model_parallel_groups() -> None:
    """Megatron's own teardown only forgets its groups; torch keeps each one registered, and a gloo group keeps its
    threads. About 17 groups per layout, and a gloo TCP loop thread of each spends CPU while idle: a test process
    that set megatron up 70 times held 1,232 of them and spent both cores of the machine polling (CI, stop 18)."""
    from megatron.core import parallel_state as ps

    default = dist.distributed_c10d._get_default_group()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)
    ps.destroy_model_parallel()


def seed_rng(seed: int) -> None:
    """Seed torch and megatron's tracked RNG states (CPU generator states when CUDA is absent)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    if torch.cuda.is_available():
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
    else:
        seed_cpu_rng(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=ps.get_expert_tensor_parallel_rank())


def shutdown_parallel() -> None:
    """Tear down megatron's groups and the default process group (end of a run or a test)."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        dist.destroy_process_group()  # every group, megatron's too
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def build_gpt_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, *, r3: bool, spec: str | None = None,
                    hf_config: Mapping[str, Any] | None = None) -> Any:
    """The rank-local megatron-core ``GPTModel``; ``init_parallel`` must have run.

    r3 turns on megatron's built-in router replay; the global replay registry is cleared first, because megatron
    appends one RouterReplay per MoE layer of every model built in the process. ``spec`` names a ``model.spec``
    function that swaps user modules into the layer spec (``pipeline.models.spec``); ``hf_config`` is the HF
    config.json it is shown.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if not ps.model_parallel_is_initialized():
        raise ConfigError("build_gpt_model needs megatron's process groups; call init_parallel(parallel_cfg) first")
    check_layout(model_cfg, parallel_cfg)
    if model_cfg.router_expert_bias:
        fix_expert_bias_padding_mask()
    RouterReplay.clear_global_router_replay_instances()
    args = build_gpt_model_args(model_cfg, parallel_cfg, r3=r3, spec=spec, hf_config=hf_config)
    model = GPTModel(**args.kwargs())
    if parallel_cfg.resolved_device() == "cuda":
        model = model.cuda()
    return model


def model_device(model: torch.nn.Module) -> torch.device:
    """The device holding the model's parameters."""
    return next(model.parameters()).device


def causal_attention_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """megatron's boolean attention mask, ``True`` where attention is blocked, shaped [1, 1, s, s].

    megatron builds its default causal mask with device="cuda", so on CPU it must be passed in. Causal alone is
    right for right-padded rows: real tokens never look ahead into the padding.
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Rank-local logits [batch, seq, vocab / tp] of a right-padded batch; ``attention_mask`` is 1 on real tokens.

    ``padding_mask`` (True = leave out) names the positions the routers leave out of their per-expert token counts
    (the expert-bias update's input); default: the padding. Routing and logits do not depend on it.
    """
    _check_batch(input_ids, attention_mask)
    batch, seq = input_ids.shape
    device = input_ids.device
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    return model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=causal_attention_mask(seq, device),
        padding_mask=attention_mask == 0 if padding_mask is None else padding_mask,
    )


def forward_logprobs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each next token: out[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1]).

    Shape [batch, seq - 1], differentiable; 0 where the next token is padding. Works under TP (vocab-parallel
    logits are reduced across the TP group without gathering the vocabulary).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0 to compute log-probs, got {temperature}")
    logits = forward_logits(model, input_ids, attention_mask)
    # A new tensor on purpose: vocab_parallel_cross_entropy works in place on its input.
    scaled = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:]
    # megatron's loss kernels expect [seq, batch, vocab].
    nll = vocab_parallel_cross_entropy(scaled.transpose(0, 1).contiguous(), targets.transpose(0, 1).contiguous())
    logprobs = -nll.transpose(0, 1)
    return logprobs * attention_mask[:, 1:].to(logprobs.dtype)


def _check_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ConfigError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be "
            "[batch, seq]"
        )
    # Right padding only: a real token after a pad would see the pad in its causal window.
    mask = attention_mask.to(torch.int8)
    if bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ConfigError("attention_mask must be right-padded (1s then 0s per row); left/inner padding is not handled")


def _tp_partial_grad(name: str, param: torch.Tensor, config: Any) -> bool:
    # Weights replicated across TP ranks whose gradient each rank sees only in part: the q/k norms act on the rank's
    # own heads, and under sequence parallelism the norms see only the rank's slice of tokens. megatron's
    # finalize_model_grads sums these over TP; without DDP, sluice must do the same. MLA's q/kv norms act on the
    # whole (gathered) latent, so each TP rank already holds their full gradient.
    per_head = config.qk_layernorm and not getattr(config, "multi_latent_attention", False)
    qk_norm = per_head and ("q_layernorm" in name or "k_layernorm" in name)
    return qk_norm or (config.sequence_parallel and getattr(param, "sequence_parallel", False))


def _sync_tp_replicated_grads(model: torch.nn.Module) -> None:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    config = model.config
    for name, param in model.named_parameters():
        if param.grad is not None and _tp_partial_grad(name, param, config):
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)


def allreduce_gradients(model: torch.nn.Module, *, scale: float | None = None) -> None:
    """Sum gradients over data-parallel replicas (dense weights over DP, expert weights over expert-DP), times scale.

    The default scale, 1 / DP size, is right when each rank's loss is a mean over its own batch (the global loss is
    then the mean over ranks). Pass ``scale=1.0`` when each rank's loss is already divided by the GLOBAL token count.

    megatron's DistributedDataParallel and distributed optimizer are not used: on CPU the distributed optimizer
    gives wrong results, so sluice pairs a plain torch optimizer with this explicit all-reduce.
    """
    from megatron.core import parallel_state as ps

    _sync_tp_replicated_grads(model)
    dense_group = ps.get_data_parallel_group()
    expert_group = ps.get_expert_data_parallel_group()
    # The same scale applies to expert weights although their expert-DP group is smaller (EP took ranks from DP):
    # the all-to-all already summed the other DP ranks' token contributions into them, as megatron's DDP assumes.
    if scale is None:
        scale = 1.0 / dist.get_world_size(dense_group)
    for param in model.parameters():
        if param.grad is None:
            continue
        # megatron tags expert weights allreduce=False: their replicas live in the expert-DP group instead.
        group = dense_group if getattr(param, "allreduce", True) else expert_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
        if scale != 1.0:
            param.grad.mul_(scale)
