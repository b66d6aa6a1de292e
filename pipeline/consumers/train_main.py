"""Wiring one trainer rank from a run's config: megatron model, train step, queue, ledger, weight push."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.config import SluiceConfig
from pipeline.consumers.drain import Drainer
from pipeline.consumers.ledger import Ledger
from pipeline.consumers.trainer import RedisClock, Trainer, TrainerSettings
from pipeline.sync.base import WeightUpdateEngine


def build_rank(cfg: SluiceConfig, model_dir: Path) -> tuple[Any, Any, Any, Any]:
    """(model config, megatron model, optimizer, train step) for this rank; initialises torch.distributed."""
    from pipeline.consumers.megatron.config import (
        ModelConfig,
        ParallelConfig,
        check_layout,
    )
    from pipeline.consumers.megatron.convert import load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel
    from pipeline.consumers.train_step import TrainStep

    hf_config = json.loads((model_dir / "config.json").read_text())
    model_cfg = ModelConfig.from_hf(hf_config)
    parallel = ParallelConfig(tp=cfg.trainer.tp, ep=cfg.trainer.ep)
    check_layout(model_cfg, parallel, cfg.trainer.world_size)
    init_parallel(parallel, seed=cfg.run.seed)
    model = build_gpt_model(model_cfg, parallel, r3=cfg.trainer.r3)
    load_hf_into_megatron(model, model_dir, model_cfg)
    step_cfg = cfg.trainer.model_copy(update={"pad_token_id": int(hf_config.get("pad_token_id") or 0)})
    step = TrainStep(model, model_cfg, step_cfg)
    return model_cfg, model, step.optimizer, step


def run_trainer(run_dir: Path, cfg: SluiceConfig, model_dir: Path,
                engines: Sequence[WeightUpdateEngine] | None = None) -> None:
    """Train this rank until ``trainer.steps``; rank 0 also drains the queue and pushes weights to ``engines``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from pipeline.consumers.megatron.convert import iter_hf_weights

    model_cfg, model, optimizer, step = build_rank(cfg, model_dir)
    rank = dist.get_rank()
    loop = asyncio.new_event_loop()
    source = clock = ledger = pusher = None
    if rank == 0:
        from pipeline.queue.rundir import open_run

        handle = open_run(run_dir=run_dir, redis_url=cfg.queue.redis_url, capacity=cfg.queue.capacity)
        ledger = Ledger(run_dir / "ledger")
        source = Drainer(handle.queue, ledger, cfg.staleness, consumer="trainer-0",
                         block_ms=cfg.trainer.drain_block_ms, claim_idle_ms=cfg.queue.claim_idle_ms)
        clock = RedisClock(handle.queue)
        if engines:
            pusher = loop.run_until_complete(_connect_pusher(cfg, engines))

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        # Clone: the tensors are views of live parameters, and the next optimizer step must not race the push.
        for name, tensor in iter_hf_weights(model, model_cfg):
            yield name, tensor.detach().clone()

    settings = TrainerSettings(steps=cfg.trainer.steps, batch_groups=cfg.trainer.batch_groups,
                               checkpoint_every=cfg.trainer.checkpoint_every,
                               keep_checkpoints=cfg.trainer.keep_checkpoints, run_dir=run_dir)
    trainer = Trainer(settings, model=model, optimizer=optimizer, step_fn=step, export_weights=export,
                      source=source, clock=clock, ledger=ledger, pusher=pusher, loop=loop,
                      dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size())
    try:
        trainer.train()
    finally:
        trainer.close()


async def _connect_pusher(cfg: SluiceConfig, engines: Sequence[WeightUpdateEngine]) -> Any:
    from pipeline.queue.redis_server import free_port
    from pipeline.sync.weights import WeightPusher

    backend = cfg.sync.backend if cfg.sync.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    port = cfg.sync.master_port or free_port()
    return await WeightPusher.connect(
        engines, master_address="127.0.0.1", master_port=port, backend=backend, timeout_s=cfg.sync.timeout_s,
        bucket_bytes=cfg.sync.bucket_mb * 2**20 if cfg.sync.bucket_mb else None,
    )
