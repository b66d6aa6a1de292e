"""The optimizer side of a train step: gradient sync, global-norm clipping, mixed precision and the update.

Two implementations of one small surface (:class:`Updater`), chosen by device:

- :class:`LocalUpdater` (CPU, and CUDA when asked): a torch optimizer plus an explicit gradient all-reduce over the
  data-parallel groups. megatron-core 0.16's distributed optimizer allocates on ``cuda`` and checks for CUDA tensor
  types, so this is the CPU path. When the model's parameters are bf16/fp16, the optimizer works on **fp32 master
  copies** (:class:`MasterWeightOptimizer`): gradients are upcast into the masters, Adam's moments are fp32, and the
  update is rounded into the low-precision parameters only after it has been applied in fp32. Without masters an
  update smaller than half a bf16 ulp of its weight (lr 1e-6 on a weight of 0.02, say) rounds away to nothing, every
  step.
- :class:`MegatronUpdater` (CUDA): megatron-core's ``DistributedDataParallel`` (gradients accumulated into
  contiguous fp32 buckets, reduce overlapped with the last micro-batch's backward; :class:`MegatronGrads`, which
  also sums the TP-partial gradients and checks that all are finite) and ``get_megatron_optimizer`` with the
  distributed optimizer (fp32 master weights and Adam state sharded over the data-parallel ranks). That is what
  runs at scale.

Both take losses that are already divided by the GLOBAL batch's counts (train_step.py), so gradients are summed,
never averaged, over ranks; both sum the same gradients over TP (:func:`_tp_partial`), and both skip a step whose
gradients are not all finite.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipeline.config.trainer import TrainStepConfig
from pipeline.consumers.rl.schedule import set_lr
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)
Tensor = torch.Tensor

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class Updater(Protocol):
    """Turns the gradients of one mini-batch into one optimizer step."""

    optimizer: Any
    """What a checkpoint saves beside the model (torch, master-weight or megatron optimizer)."""

    def zero_grad(self) -> None: ...

    def backward_of(self, last: bool) -> AbstractContextManager[None]:
        """Around one micro-batch's backward; ``last`` for the mini-batch's final one, after which the gradients
        may be reduced (before it, an updater that reduces during the backward must hold off)."""
        ...

    def step(self, lr: float, *, skip: bool) -> dict[str, float]: ...


def build_updater(model: torch.nn.Module, cfg: TrainStepConfig, optimizer: Any | None = None) -> Updater:
    """The updater for ``model``: megatron's DDP and distributed optimizer on CUDA (unless ``cfg.optimizer`` says
    otherwise or an ``optimizer`` is passed in), the local one elsewhere."""
    on_cuda = next(model.parameters()).is_cuda
    kind = cfg.optimizer
    if kind == "auto":
        kind = "megatron" if on_cuda and optimizer is None else "local"
    if kind == "megatron":
        if not on_cuda:
            raise ConfigError("trainer.optimizer = 'megatron' needs CUDA (megatron's distributed optimizer "
                              "allocates its state on the GPU); use 'auto' or 'local'")
        if optimizer is not None:
            raise ConfigError("an explicit optimizer was passed, but trainer.optimizer = 'megatron' builds its own")
        return MegatronUpdater(model, cfg)
    return LocalUpdater(model, cfg, optimizer)


def adamw(params: list[Tensor], cfg: TrainStepConfig) -> torch.optim.Optimizer:
    """AdamW over ``params`` with the config's hyper-parameters; the fused kernel where torch has one."""
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):  # no fused kernel for this device/dtype
        return torch.optim.AdamW(params, **kwargs)


# ------------------------------------------------------------------------------------------------- master weights


class MasterWeightOptimizer:
    """A torch optimizer stepping fp32 copies of low-precision parameters.

    ``checkpoint_params`` are the model's own parameters, in the order of the inner optimizer's: the checkpoint maps
    optimizer state to model shards through them, and saves each master beside Adam's moments (key ``master``), so
    a resume continues from the exact fp32 weights, not from their bf16 rounding.
    """

    def __init__(self, params: list[Tensor], cfg: TrainStepConfig) -> None:
        self.checkpoint_params = params
        self.master_params = [p.detach().float().clone().requires_grad_(True) for p in params]
        self.inner = adamw(self.master_params, cfg)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def grads_to_masters(self) -> None:
        """Upcast the model's gradients into the masters (fp32 from here on: all-reduce, norm, clip, step)."""
        for p, m in zip(self.checkpoint_params, self.master_params, strict=True):
            if p.grad is not None:
                m.grad = p.grad.detach().float()
                p.grad = None

    def step(self) -> None:
        self.grads_to_masters()
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.checkpoint_params, self.master_params, strict=True):
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.checkpoint_params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        state = self.inner.state_dict()
        for index, master in enumerate(self.master_params):
            state["state"].setdefault(index, {})["master"] = master.detach()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        masters = {i: s.pop("master") for i, s in state["state"].items() if "master" in s}
        with torch.no_grad():
            for index, master in masters.items():
                self.master_params[int(index)].copy_(master)
                self.checkpoint_params[int(index)].copy_(master)
        self.inner.load_state_dict(state)


# ------------------------------------------------------------------------------------------------ the local updater


class LocalUpdater:
    """Explicit gradient all-reduce, global-norm clipping and a torch optimizer (fp32 masters when needed)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainStepConfig, optimizer: Any | None = None) -> None:
        self.model, self.cfg = model, cfg
        params = [p for p in model.parameters() if p.requires_grad]
        low = sorted({str(p.dtype) for p in params if p.dtype in _LOW_PRECISION})
        if optimizer is None:
            optimizer = MasterWeightOptimizer(params, cfg) if low else adamw(params, cfg)
        elif low and not isinstance(optimizer, MasterWeightOptimizer):
            log.warning("the model has %s parameters and the optimizer steps them directly, with no fp32 master "
                        "copy: updates below the dtype's resolution are lost", ", ".join(low))
        self.optimizer = optimizer
        self._names = {id(p): n for n, p in model.named_parameters()}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward_of(self, last: bool) -> AbstractContextManager[None]:
        return nullcontext()  # gradients are reduced in step(), after every backward

    def _grads(self) -> Iterator[tuple[str, Tensor, Tensor]]:
        """(name, model parameter, its fp32 gradient) for every parameter with a gradient."""
        if isinstance(self.optimizer, MasterWeightOptimizer):
            self.optimizer.grads_to_masters()
            pairs = zip(self.optimizer.checkpoint_params, self.optimizer.master_params, strict=True)
            for p, m in pairs:
                if m.grad is not None:
                    yield self._names.get(id(p), ""), p, m.grad
            return
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                yield name, p, p.grad

    def step(self, lr: float, *, skip: bool) -> dict[str, float]:
        grads = list(self._grads())
        allreduce_grads(self.model, grads)
        norm = grad_norm(grads)
        router = math.sqrt(sum(float(g.double().pow(2).sum()) for n, _, g in grads if ".router." in n))
        coef = 1.0
        finite = math.isfinite(norm)
        if not finite:
            log.warning("gradient norm is %s; skipping this optimizer step (the batch's metrics still report)", norm)
        if self.cfg.grad_clip is not None and finite and norm > self.cfg.grad_clip:
            coef = self.cfg.grad_clip / (norm + 1e-6)
            torch._foreach_mul_([g for _, _, g in grads], coef)
        skipped = skip or not finite
        set_lr(self.optimizer, lr)
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "grad_norm_router": router, "grad_clip_coef": coef, "lr": lr,
                "skipped_step": float(skipped)}


def _tp_partial(name: str, param: Tensor, config: Any) -> bool:
    # Weights replicated across TP ranks whose gradient each rank sees only in part: the q/k norms act on the rank's
    # own heads, and under sequence parallelism the norms see only the rank's slice of tokens. megatron's
    # finalize_model_grads sums these over TP; without its DDP, sluice must do the same. MLA's q/kv norms act on the
    # whole (gathered) latent, so each TP rank already holds their full gradient.
    per_head = config.qk_layernorm and not getattr(config, "multi_latent_attention", False)
    qk_norm = per_head and ("q_layernorm" in name or "k_layernorm" in name)
    # A LoRA A replicated beside a column-parallel base meets only the rank's B shard (megatron/lora.py).
    lora = getattr(param, "lora_tp_partial", False)
    return bool(qk_norm or lora or (config.sequence_parallel and getattr(param, "sequence_parallel", False)))


def allreduce_grads(model: torch.nn.Module, grads: list[tuple[str, Tensor, Tensor]]) -> None:
    """Sum ``grads`` over their replicas: TP-partial ones over TP, dense over DP, expert weights over expert-DP.

    Expert weights sum over the smaller expert-DP group although EP took ranks from DP: the all-to-all already summed
    the other DP ranks' token contributions into them, as megatron's DDP assumes.
    """
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) > 1:
        for name, param, grad in grads:
            if _tp_partial(name, param, model.config):
                dist.all_reduce(grad, group=tp_group)
    dense, expert = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group()
    for _, param, grad in grads:
        # megatron tags expert weights allreduce=False: their replicas live in the expert-DP group instead.
        group = dense if getattr(param, "allreduce", True) else expert
        if dist.get_world_size(group) > 1:
            dist.all_reduce(grad, group=group)


def grad_norm(grads: list[tuple[str, Tensor, Tensor]]) -> float:
    """L2 norm of the whole model's gradient: each distinct shard counted once, experts of every EP rank."""
    from megatron.core import parallel_state as ps

    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    for _, param, grad in grads:
        is_expert = not getattr(param, "allreduce", True)
        # Replicated (non-TP) weights are identical on every TP rank after the all-reduce; count them once.
        if not getattr(param, "tensor_model_parallel", False) and (etp_rank if is_expert else tp_rank) != 0:
            continue
        square = grad.detach().double().pow(2).sum().cpu()
        if is_expert:
            expert += square
        else:
            dense += square
    for value, group in ((dense, ps.get_tensor_model_parallel_group()),
                         (expert, ps.get_expert_tensor_and_model_parallel_group())):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(value, group=group)
    return float((dense + expert).sqrt())


# ----------------------------------------------------------------------------------------------- megatron's (CUDA)


class MegatronGrads:
    """megatron-core's ``DistributedDataParallel`` around the model, plus the gradient sums it leaves to its caller.

    DDP's hooks accumulate each parameter's gradient into fp32 ``main_grad`` buckets and reduce-scatter a bucket over
    the data-parallel ranks (the distributed optimizer's layout) as soon as the bucket's last gradient of the
    mini-batch is in, overlapping the backward. :meth:`finish` waits for those, sums over TP the gradients that each TP
    rank holds only part of, and says whether every gradient on every rank is finite. It needs no optimizer, so it
    also runs on CPU (gloo, with sluice's CPU shim placing the buckets in host memory); :class:`MegatronUpdater` puts
    megatron's CUDA-only distributed optimizer on top of it.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        config = model.config
        # Losses arrive divided by the global batch's counts: DDP must sum over DP, not average.
        config.calculate_per_token_loss = True
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                                   use_distributed_optimizer=True, check_for_nan_in_grad=False)
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        self._tp_partial = [p for n, p in model.named_parameters() if p.requires_grad and _tp_partial(n, p, config)]
        self._buffers = self.ddp.buffers + self.ddp.expert_parallel_buffers

    def zero(self) -> None:
        self.ddp.zero_grad_buffer()

    def backward_of(self, last: bool) -> AbstractContextManager[None]:
        # DDP records in its first mini-batch how often each parameter's gradient becomes ready, and from then on
        # starts a bucket's reduce the moment that count is reached. Under no_sync a backward is not counted, so
        # only the last micro-batch counts and the target is the same whatever the number of micro-batches; counting
        # them all would freeze the first mini-batch's number: a later one with more micro-batches would reduce
        # before its last backward (wrong gradients, silently), one with fewer would never start the reduce.
        # This needs every trained parameter in the last micro-batch's graph: an empty micro-batch keeps the graph
        # whole (a loss times zero), and experts given no tokens still run on an empty slice.
        return nullcontext() if last else self.ddp.no_sync()

    def finish(self) -> bool:
        """Complete the mini-batch's gradients; True when all of them are finite, the same answer on every rank.

        After it, each rank's shard of the buckets (the part its optimizer steps) holds the summed gradient.
        """
        from megatron.core import parallel_state as ps

        self.ddp.finish_grad_sync()
        # megatron's finalize_model_grads would make this TP sum, but it also moves the routers' expert bias and
        # zeroes their token counts (update_expert_bias does both once per step, at sluice's rate), and without
        # sequence parallelism it would sum MLA's q_layernorm, whose gradient each TP rank already holds whole. With
        # pp = 1 nothing else in it applies. The set is LocalUpdater's; the sum covers each whole main_grad, since
        # TP peers share the bucket layout and the data-parallel shard they own.
        tp_group = ps.get_tensor_model_parallel_group()
        if self._tp_partial and dist.get_world_size(tp_group) > 1:
            grads = [p.main_grad for p in self._tp_partial]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=tp_group)
            for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                grad.copy_(summed.view_as(grad))
        return self._all_finite()

    def _all_finite(self) -> bool:
        # A non-finite value on any rank reaches its owner's shard through the reduce-scatter and stays in the
        # sender's own (unowned) part of the buffer, so a check of each rank's whole buffer, agreed by a MAX over
        # every rank, is the same on all of them. aminmax propagates NaN and shows +-inf, without a buffer-sized
        # temporary and without the overflow a sum or norm of large finite values could report.
        ends = torch.stack([torch.stack(torch.aminmax(b.grad_data)) for b in self._buffers])
        bad = torch.logical_not(torch.isfinite(ends).all()).to(torch.float32).reshape(1)
        # The default group is the trainer's ranks (every model-parallel and data-parallel rank; pp = 1).
        if dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())


class MegatronUpdater:
    """:class:`MegatronGrads` and megatron-core's distributed optimizer (CUDA only: it allocates on ``cuda``).

    The model keeps running unwrapped (the step's router hooks and replay live on it); DDP's hooks sit on its
    parameters. A step whose gradients hold a NaN or inf anywhere (bf16 has no loss scaler to catch it) is skipped on
    every rank: the weights and Adam's state stay as they were, and ``skipped_step`` reports it, as on the local path.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainStepConfig) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.grads = MegatronGrads(model)
        self.ddp = self.grads.ddp
        self.cfg = cfg
        config = model.config
        opt_config = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=0.0, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.grad_clip or 0.0,
            bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype, use_distributed_optimizer=True,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
        self._model = model

    def zero_grad(self) -> None:
        self.grads.zero()
        self.optimizer.zero_grad()

    def backward_of(self, last: bool) -> AbstractContextManager[None]:
        return self.grads.backward_of(last)

    def step(self, lr: float, *, skip: bool) -> dict[str, float]:
        finite = self.grads.finish()
        router = math.sqrt(sum(float(p.main_grad.double().pow(2).sum())
                               for n, p in self._model.named_parameters()
                               if ".router." in n and getattr(p, "main_grad", None) is not None))
        set_lr(self.optimizer, lr)
        if skip or not finite:
            # Without a loss scaler megatron's optimizer never looks for NaN: its clip test is false on a NaN norm
            # and Adam would step on it, so the check is here, before the optimizer touches anything.
            if not finite and not skip:
                log.warning("a gradient is NaN or inf; skipping this optimizer step (the batch's metrics still "
                            "report)")
            self.zero_grad()
            return {"grad_norm": 0.0 if skip else math.nan, "grad_norm_router": router, "grad_clip_coef": 1.0,
                    "lr": lr, "skipped_step": 1.0}
        ok, norm, _ = self.optimizer.step()
        norm = float(norm) if norm is not None else math.nan
        clip = self.cfg.grad_clip
        coef = clip / (norm + 1e-6) if clip is not None and math.isfinite(norm) and norm > clip else 1.0
        self.zero_grad()
        return {"grad_norm": norm, "grad_norm_router": router, "grad_clip_coef": coef, "lr": lr,
                "skipped_step": float(not ok)}
