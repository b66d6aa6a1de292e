"""Megatron dist-checkpoint save/load of the model plus a plain torch optimizer.

The optimizer state is sharded exactly like the parameters it belongs to, so a checkpoint taken under one TP/EP
layout loads under another. Saving writes into ``<dir>.tmp`` and renames it into place only when every rank has
finished, so a crash mid-save never leaves a directory that looks complete. Small scalar metadata (step, policy
version, ...) goes into a JSON file next to the shards.

megatron's writer runs in a subprocess; scripts that save must guard their entry point with
``if __name__ == "__main__":``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.errors import ConfigError, SluiceError

_META = "sluice_meta.json"
_ADAPTER = ".lora_"  # lora.ADAPTER_MARK, without importing megatron code here
_STEP_KEY = "common_step"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _model_params(optimizer: Any) -> list[torch.Tensor]:
    """The model parameters the optimizer's states belong to, in its order: the masters' models under fp32 master
    weights (``MasterWeightOptimizer.checkpoint_params``), the optimizer's own parameters otherwise."""
    params = getattr(optimizer, "checkpoint_params", None)
    return list(params) if params is not None else _optimizer_params(optimizer)


def _is_megatron_optimizer(optimizer: Any) -> bool:
    # megatron's optimizers shard their own state (the distributed optimizer's fp32 masters and moments).
    return hasattr(optimizer, "sharded_state_dict") and hasattr(optimizer, "get_grad_norm")


def _sharded_optimizer_state(optimizer: torch.optim.Optimizer, model_sharded: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    state = optimizer.state_dict()
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise ConfigError(f"optimizer parameters are at different steps {sorted(steps)}; cannot save one shared step")
    id_map = get_param_id_to_sharded_param_map(model_sharded, _model_params(optimizer))
    missing = set(state["state"]) - set(id_map)
    if missing:
        raise ConfigError(f"{len(missing)} optimizer parameters do not belong to the model being checkpointed")
    # The step is a scalar shared by all parameters; megatron shards only tensors shaped like their parameter.
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    if steps:
        state["state"][_STEP_KEY] = torch.tensor(steps.pop())
    return state


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter buffers (without changing any parameter) so a load has targets.

    One step at lr 0 with zero gradients builds exactly the state a real step would, for any torch optimizer.
    """
    if optimizer.state:
        return
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    params = _optimizer_params(optimizer)
    saved_grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr
    for p, grad in zip(params, saved_grads):
        p.grad = grad


def _has_adapters(model: Any) -> bool:
    return any(_ADAPTER in name for name, _ in model.named_parameters())


def _sharded_state(model: Any, optimizer: Any | None, *, loading: bool = False) -> dict[str, Any]:
    # model is a megatron MegatronModule (GPTModel), whose sharded_state_dict describes each rank's shards.
    model_sharded = model.sharded_state_dict()
    if _has_adapters(model):
        # LoRA: the base is frozen and rebuilt from its folder (checked by hash, check_base), so only the adapters
        # are saved; the optimizer holds state for them alone.
        model_sharded = {key: value for key, value in model_sharded.items() if _ADAPTER in key}
    state: dict[str, Any] = {"model": model_sharded}
    if optimizer is not None and _is_megatron_optimizer(optimizer):
        state["optimizer"] = optimizer.sharded_state_dict(model_sharded, is_loading=loading)
    elif optimizer is not None:
        state["optimizer"] = _sharded_optimizer_state(optimizer, model_sharded)
    return state


def save_checkpoint(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    meta: dict[str, Any] | None = None,
) -> float:
    """Save model (+ optimizer) shards and JSON ``meta`` to ``directory`` atomically; returns seconds taken.

    Collective: every trainer rank must call it. ``directory`` must not exist yet.
    """
    from megatron.core import dist_checkpointing

    start = time.perf_counter()
    final = Path(directory)
    staging = final.with_name(final.name + ".tmp")
    if final.exists():
        raise ConfigError(f"checkpoint {final} already exists; checkpoints are write-once, pick a new step directory")
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist_checkpointing.save(_sharded_state(model, optimizer), str(staging))
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        # What megatron reports for a full disk names neither the folder nor the cause ("Worker failure: [enforce
        # fail at inline_container.cc:672] . unexpected pos 704 vs 598"): say both. Nothing was committed.
        free = shutil.disk_usage(staging.parent).free
        raise SluiceError(
            f"could not write checkpoint {final} ({str(e).strip().splitlines()[-1][:300]}); is the disk under "
            f"{staging.parent} full ({free / 2**20:.0f} MiB free) or a quota or file-size limit in the way? Nothing "
            "is lost: the steps since the last checkpoint stay unacked, and the restarted trainer resumes from that "
            "checkpoint and trains them again") from e
    if _rank() == 0:
        # Only after megatron's save: it takes any file already in the folder for the remains of an old, broken
        # checkpoint and warns that it overwrites one. The rename below is the commit, so the meta is in time.
        (staging / _META).write_text(json.dumps(meta or {}, sort_keys=True))
    _barrier()
    if _rank() == 0:
        staging.rename(final)
    _barrier()
    return time.perf_counter() - start


def read_checkpoint_meta(directory: str | Path) -> dict[str, Any]:
    """The JSON metadata saved with a checkpoint."""
    path = Path(directory) / _META
    if not path.exists():
        raise ConfigError(f"{directory} is not a complete sluice checkpoint (no {_META})")
    return dict(json.loads(path.read_text()))


def load_checkpoint(
    directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load model (+ optimizer) state saved by ``save_checkpoint``, resharding to this run's layout; returns meta.

    Collective: every trainer rank must call it.
    """
    from megatron.core import dist_checkpointing

    meta = read_checkpoint_meta(directory)
    megatron_optimizer = optimizer is not None and _is_megatron_optimizer(optimizer)
    if optimizer is not None and not megatron_optimizer:
        _materialize_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, loading=True), str(directory))
    if _has_adapters(model):
        missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
        lost = [name for name in missing if _ADAPTER in name]
        if lost or unexpected:
            raise ConfigError(f"checkpoint {directory} does not hold this run's LoRA adapters (missing {lost[:3]}, "
                              f"unexpected {list(unexpected)[:3]}): were trainer.lora's targets or rank changed?")
    else:
        model.load_state_dict(loaded["model"], strict=True)
    if megatron_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])  # type: ignore[union-attr]
    elif optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer"])
    return meta


def check_base(directory: str | Path, base: dict[str, Any] | None) -> None:
    """Refuse to resume LoRA adapters onto another base than the one they were trained on, and a full-weight run
    from an adapters-only checkpoint (or the other way round); ``base`` is this run's (None: no LoRA)."""
    saved = read_checkpoint_meta(directory).get("lora_base")
    if saved is None and base is None:
        return
    if saved is None:
        raise ConfigError(f"checkpoint {directory} holds every weight (trained without [trainer.lora]), but this run "
                          "trains LoRA adapters; start a new run folder, or remove [trainer.lora] to resume it")
    if base is None:
        raise ConfigError(f"checkpoint {directory} holds LoRA adapters only (base {saved['path']}), but this run "
                          "has no [trainer.lora]; restore the recipe's [trainer.lora] to resume it")
    if saved.get("sha256") != base.get("sha256"):
        raise ConfigError(f"checkpoint {directory} holds LoRA adapters trained on the base at {saved['path']} (sha256 "
                          f"{saved.get('sha256', '?')[:12]}...), but this run's base at {base.get('path')} has sha256 "
                          f"{str(base.get('sha256'))[:12]}...: adapters only mean something on their own base. Point "
                          "model.path at that base, or start a new run folder")


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    step = state["state"].pop(_STEP_KEY, None)
    if step is not None:
        for per_param in state["state"].values():
            per_param["step"] = step.clone().to(torch.float32)
    optimizer.load_state_dict(state)
