"""Wiring one trainer rank from a run's config: megatron model, train step, queue, ledger, weight push."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.config.engine import EngineConfig
from pipeline.config.eval import HeldoutConfig
from pipeline.config.filters import FilterConfig
from pipeline.config.hooks import HooksConfig
from pipeline.config.metrics import MetricsConfig
from pipeline.config.model import ModelSource
from pipeline.config.queue import QueueConfig
from pipeline.config.run import RunConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.config.sync import SyncConfig
from pipeline.config.trainer import LoRAConfig, TrainerConfig
from pipeline.consumers.trainer.drain import Drainer
from pipeline.consumers.trainer.hooks import HookRunner
from pipeline.consumers.trainer.ledger import Ledger
from pipeline.consumers.trainer.loop import RankZero, RedisClock, Trainer, TrainerSettings
from pipeline.consumers.trainer.push import Owners
from pipeline.consumers.trainer.readers import FetchMode, SharePlanner, ShareReader
from pipeline.consumers.trainer.snapshots import SnapshotWriter
from pipeline.errors import ConfigError
from pipeline.metrics import open_sinks
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.rundir import RunHandle
from pipeline.rundir import base_model_dir, engines_path, latest_checkpoint, ledger_dir
from pipeline.sync.base import WeightPush, WeightUpdateEngine
from pipeline.sync.pusher import PushOptions
from pipeline.sync.sources_push import SourcesLead

log = logging.getLogger(__name__)


def build_rank(model_dir: Path, *, trainer: TrainerConfig, run: RunConfig, model: ModelSource
               ) -> tuple[Any, Any, Any, Any]:
    """(model config, megatron model, optimizer, train step) for this rank; initialises torch.distributed.

    With ``trainer.loss.kl_coef > 0`` a second, frozen model with the same layout holds the starting weights as the
    KL reference; it lives inside the train step only.
    """
    from pipeline.consumers.megatron.config import (
        ModelConfig,
        ParallelConfig,
        check_layout,
    )
    from pipeline.consumers.megatron.convert import load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel
    from pipeline.consumers.rl.train_step import TrainStep

    hf_config = json.loads((model_dir / "config.json").read_text())
    model_cfg = ModelConfig.from_hf(hf_config)
    parallel = ParallelConfig(tp=trainer.tp, ep=trainer.ep)
    check_layout(model_cfg, parallel, trainer.world_size)
    init_parallel(parallel, seed=run.seed)
    megatron_model = build_gpt_model(model_cfg, parallel, r3=trainer.r3, spec=model.spec, hf_config=hf_config)
    load_hf_into_megatron(megatron_model, model_dir, model_cfg)
    if trainer.lora is not None:
        from pipeline.consumers.megatron.lora import LoRASpec, apply_lora

        lora = trainer.lora
        apply_lora(megatron_model, LoRASpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                            targets=lora.targets), seed=run.seed)
    reference = None
    if trainer.loss.kl_coef > 0:
        # The KL anchor is the starting weights, so it is never checkpointed: a resume rebuilds it from model_dir.
        reference = build_gpt_model(model_cfg, parallel, r3=trainer.r3, spec=model.spec, hf_config=hf_config)
        load_hf_into_megatron(reference, model_dir, model_cfg)
    step_cfg = trainer.model_copy(update={"pad_token_id": int(hf_config.get("pad_token_id") or 0)})
    step = TrainStep(megatron_model, model_cfg, step_cfg, reference=reference, total_steps=trainer.steps)
    return model_cfg, megatron_model, step.optimizer, step


def run_trainer(run_dir: Path, model_dir: Path,
                engines: Sequence[WeightUpdateEngine] | Callable[[], Sequence[WeightUpdateEngine]] | None = None, *,
                run: RunConfig, model: ModelSource, engine: EngineConfig, trainer: TrainerConfig,
                staleness: StalenessConfig, filters: FilterConfig, queue: QueueConfig, sync: SyncConfig,
                heldout: HeldoutConfig, metrics: MetricsConfig, hooks: HooksConfig) -> None:
    """Train this rank until ``trainer.steps`` or a stop; rank 0 also drains the queue and pushes weights to engines.

    ``engines`` may be a call that waits for them: it is made once the model is built, so that the build overlaps
    the engines' start.

    The rank's process is expected to exit afterwards (see the end).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from pipeline.consumers.megatron.convert import iter_hf_weights

    model_cfg, megatron_model, optimizer, step = build_rank(model_dir, trainer=trainer, run=run, model=model)
    if engines is not None or heldout.enabled:
        # Every rank checks, so that all refuse together (only rank 0 is handed the engines; the others get []).
        check_spec_weights(megatron_model, model_cfg, source=model, engine=engine)
    rank = dist.get_rank()
    loop = asyncio.new_event_loop()
    # With LoRA the push is the adapters, from rank 0: the owners' push sends shards of the base.
    fp8 = engine.weight_dtype == "fp8"
    owners = _owners(sync, megatron_model, model_cfg, quantize=fp8) \
        if engines is not None and trainer.lora is None else None
    lead: RankZero | None = None
    if rank == 0:
        from pipeline.queue.rundir import open_run

        handle = open_run(run_dir=run_dir, redis_url=queue.redis_url, capacity=queue.capacity, start_server=False)
        ledger = Ledger(ledger_dir(run_dir))
        source = Drainer(handle.queue, ledger, staleness, filters=filters, consumer="trainer-0",
                         block_ms=trainer.drain_block_ms, claim_idle_ms=queue.claim_idle_ms,
                         min_groups=ps.get_data_parallel_world_size())
        lead = RankZero(source=source, clock=RedisClock(handle.queue), ledger=ledger)
        members = engines() if callable(engines) else engines
        if members and trainer.lora is not None and engine.type == "sglang":
            lead.pusher = _adapter_pusher(trainer.lora, sync, members, run_dir, model_dir)
        elif members:
            lead.pusher = loop.run_until_complete(_connect_pusher(
                sync, members, run_dir, model_dir, sources=owners.lead if owners is not None else None, fp8=fp8))
        if heldout.enabled:
            lead.snapshots = SnapshotWriter.for_run(run_dir, model_dir, heldout, lead.clock.get())
        lead.scalars = open_sinks(run_dir, "trainer", metrics, run.name)
        lead.hooks = HookRunner.from_config(hooks)

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        # Views of the live parameters where no gather or conversion made a new tensor: the trainer packs or clones
        # them before the next optimizer step can change them (Trainer.push_weights).
        yield from iter_hf_weights(megatron_model, model_cfg)

    export_full = None
    base = None
    if trainer.lora is not None:
        from pipeline.consumers.megatron.lora_export import base_identity, iter_hf_adapters, iter_hf_merged

        def export() -> Iterator[tuple[str, torch.Tensor]]:  # noqa: F811 - with LoRA the push carries adapters
            yield from iter_hf_adapters(megatron_model, model_cfg)

        def export_full() -> Iterator[tuple[str, torch.Tensor]]:
            yield from iter_hf_merged(megatron_model, model_cfg)

        base = base_identity(model_dir, cache=run_dir / "checkpoints" / "base-sha256.json") if rank == 0 else None
        if dist.get_world_size() > 1:  # rank 0 reads the base once; every rank checks a resume against it
            from pipeline.consumers.trainer.readers import broadcast_msgpack_from

            base = broadcast_msgpack_from(base, 0, dist.new_group(backend="gloo"))
    if fp8:
        from pipeline.quant.fp8 import quantize_named

        unquantized = export

        def export() -> Iterator[tuple[str, torch.Tensor]]:  # noqa: F811 - FP8 engines get FP8 bytes and scales
            yield from quantize_named(unquantized())

        def export_full() -> Iterator[tuple[str, torch.Tensor]]:  # held-out snapshots: the trained weights
            yield from unquantized()

    settings = TrainerSettings(steps=trainer.steps, batch_groups=trainer.batch_groups,
                               checkpoint_every=trainer.checkpoint_every,
                               keep_checkpoints=trainer.keep_checkpoints, run_dir=run_dir,
                               overlap_push=trainer.overlap_push, profile_steps=trainer.profile_steps, base=base)
    reader, reader_handle = _reader(run_dir, queue, trainer.fetch, None if lead is None else handle.queue)
    planner = None if lead is None else SharePlanner(ps.get_data_parallel_world_size(), trainer.fetch,
                                                     handle.queue)
    driver = Trainer(settings, model=megatron_model, optimizer=optimizer, step_fn=step, export_weights=export,
                     export_full=export_full, lead=lead, loop=loop, dp_rank=ps.get_data_parallel_rank(),
                     dp_size=ps.get_data_parallel_world_size(), owners=owners, reader=reader, planner=planner)
    try:
        driver.train()
    finally:
        driver.close()
        if reader_handle is not None:
            reader_handle.close()
        if lead is not None and lead.snapshots is not None:
            lead.snapshots.close()  # the final snapshot must be on disk before the launcher sees this rank finish
        # The interpreter's last collection at exit would walk every object megatron and torch made: about 5 s on
        # CPU, which a stop waits for. Nothing here needs collecting any more, so take it all out of its sight.
        gc.freeze()


def check_spec_weights(model: Any, model_cfg: Any, *, source: ModelSource, engine: EngineConfig) -> None:
    """Refuse, at start-up rather than at the first push, a run whose ``model.spec`` adds weights its engines cannot
    receive: weights without HF names, or any added weights when engines are sluice's CPU engine without a
    ``model.engine_patch`` (it serves the plain HF architecture, so it could neither load nor run them; the held-out
    evaluator's engine is one too). ``source`` is the recipe's ``[model]``, ``model`` the built megatron model."""
    from pipeline.consumers.megatron.convert import check_exportable

    if source.spec is None:
        return
    added = check_exportable(model, model_cfg)
    if not added:
        return
    shown = ", ".join(sorted(added.values())[:4]) + (" ..." if len(added) > 4 else "")
    if engine.type == "cpu" and source.engine_patch is None:
        raise ConfigError(
            f"model.spec = {source.spec!r} adds weights ({shown}) that sluice's CPU engine cannot run: it serves "
            "the plain HF architecture, so its samples would come from a different policy than the one trained. "
            "Set model.engine_patch to a function that adds the same modules to the engine's transformers model, "
            "use engine.type = 'sglang' with servers whose model has them, or train offline (`sluice replay`)"
        )
    if engine.type == "cpu":
        return  # the patched CPU engines check every pushed name against their model before receiving it
    log.warning("model.spec adds weights %s: the SGLang servers must run a model that has them (a server that does "
                "not refuses the first weight push)", shown)


def _reader(run_dir: Path, queue: QueueConfig, fetch: FetchMode, lead_queue: SampleQueue | None
            ) -> tuple[ShareReader, RunHandle | None]:
    """This rank's part in reading each step's payloads (``pipeline.consumers.trainer.readers``), and the queue
    handle it opened for that, if any. Collective: with tensor parallelism, every rank makes the gloo group of every
    replica, over which the replica's first rank passes its payloads on."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from pipeline.consumers.trainer.readers import all_gather_msgpack

    peers = reader = None
    if ps.get_tensor_model_parallel_world_size() > 1:
        mine = sorted(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()))
        every = sorted({tuple(r) for r in all_gather_msgpack(mine, dist.new_group(backend="gloo"))})
        for ranks in every:
            group = dist.new_group(list(ranks), backend="gloo")  # every rank makes every group, in one order
            if list(ranks) == mine:
                peers = group
        reader = mine[0]
    reads = fetch == "readers" and (reader is None or reader == dist.get_rank())
    if not reads or lead_queue is not None:
        return ShareReader(lead_queue if reads else None, peers=peers, reader=reader), None
    from pipeline.queue.rundir import open_run

    handle = open_run(run_dir=run_dir, redis_url=queue.redis_url, capacity=queue.capacity, start_server=False)
    return ShareReader(handle.queue, peers=peers, reader=reader), handle


def _owners(sync: SyncConfig, megatron_model: Any, model_cfg: Any, *, quantize: bool = False) -> Owners | None:
    """Every rank's part in a push from every owner (``sync.sources = "owners"``), or None where rank 0 sends all.
    Collective: the control channel and the owner plan are made by every rank together. ``quantize``: each owner
    sends its tensors as FP8 engines take them (``pipeline.quant.fp8.quantize_named``)."""
    import torch.distributed as dist

    from pipeline.consumers.megatron.owners import OwnedExport
    from pipeline.producers.sglang_client import SGLangClient
    from pipeline.sync.share_sender import ShareSender
    from pipeline.sync.snapshot_pool import SnapshotPool
    from pipeline.sync.sources_push import ControlChannel, SourcesLead
    from pipeline.sync.weights import DEFAULT_BUCKET_BYTES

    if sync.sources != "owners" or dist.get_world_size() == 1:
        return None
    control = ControlChannel.create(sync.timeout_s)
    owned = OwnedExport(megatron_model, model_cfg)
    backend = _weight_backend(sync)
    device = _snapshot_device(sync, backend, owned.share_bytes)
    export: Callable[[], Iterable[tuple[str, torch.Tensor]]] = owned
    if quantize:
        from pipeline.quant.fp8 import quantize_named

        export = lambda: quantize_named(owned())  # noqa: E731
    pool = SnapshotPool(sync.bucket_mb * 2**20 if sync.bucket_mb else DEFAULT_BUCKET_BYTES[backend], device)
    if control.rank == 0:
        return Owners(export=export, lead=SourcesLead(control), pool=pool)
    sender = ShareSender(control, SGLangClient, master_address=os.environ.get("SLUICE_NODE_IP", "127.0.0.1"),
                         backend=backend, timeout_s=sync.timeout_s, options=_push_options(sync, None))
    return Owners(export=export, sender=sender, pool=pool)


def _snapshot_device(sync: SyncConfig, backend: str, share_bytes: int) -> torch.device:
    """Where this rank's snapshot lives (``sync.snapshot``): host memory for gloo, which sends from there; for NCCL
    the device, or pinned host memory sent up one bucket at a time. ``auto`` takes the device while twice the share
    is free there now (the plan of ``--dry-run`` makes the same choice from its estimate)."""
    if backend != "nccl" or sync.snapshot == "host":
        return torch.device("cpu")
    cuda = torch.device("cuda", torch.cuda.current_device())
    if sync.snapshot == "device":
        return cuda
    free, _total = torch.cuda.mem_get_info(cuda)
    return cuda if 2 * share_bytes < free else torch.device("cpu")


def _weight_backend(sync: SyncConfig) -> str:
    return sync.backend if sync.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")


def _push_options(sync: SyncConfig, dtype: str | None) -> PushOptions:
    return PushOptions(bucket_bytes=sync.bucket_mb * 2**20 if sync.bucket_mb else None, dtype=dtype,
                       flat=sync.wire == "flat", stall_timeout_s=sync.stall_timeout_s)


def _adapter_pusher(lora: LoRAConfig, sync: SyncConfig, engines: Sequence[WeightUpdateEngine], run_dir: Path,
                    model_dir: Path) -> WeightPush:
    """LoRA on SGLang: each push is a PEFT folder the engines load beside their base
    (``pipeline.sync.adapter_push``)."""
    from pipeline.sync.adapter_push import AdapterPush

    folder = Path(lora.adapter_dir) if lora.adapter_dir is not None else run_dir / "adapters"
    return AdapterPush(engines, folder, base_dir=model_dir, keep=lora.keep_loaded,  # type: ignore[arg-type]
                       timeout_s=sync.timeout_s, discover=_discover(run_dir))


def _discover(run_dir: Path) -> Callable[[list[Any]], list[Any]] | None:
    """The engines as engines.json lists them now (the launcher rewrites an engine's URL when a restart moved it),
    keeping the clients of those that stayed."""
    if not engines_path(run_dir).exists():
        return None

    def discover(known: list[Any]) -> list[Any]:
        from pipeline.producers.sglang_client import SGLangClient

        by_url = {e.name: e for e in known}
        urls = [u.rstrip("/") for u in json.loads(engines_path(run_dir).read_text())]
        return [by_url.get(url) or SGLangClient(url) for url in urls]

    return discover


async def _connect_pusher(sync: SyncConfig, engines: Sequence[WeightUpdateEngine], run_dir: Path,
                          model_dir: Path, sources: SourcesLead | None = None, fp8: bool = False) -> WeightPush:
    """The push to the engines, routed around one that fails and re-syncing one that comes back
    (``pipeline.sync.rotation``), in the engines' dtype (``sync.dtype``); ``fp8``: the push carries FP8 bytes and
    scales, which only engines serving FP8 may take (and they take nothing else)."""
    from pipeline.sync.pusher import WeightPusher, engines_dtype, engines_tp
    from pipeline.sync.rotation import EngineRotation
    from pipeline.sync.served_dtype import check_served_weights

    backend = _weight_backend(sync)
    port = sync.master_port  # 0: the pusher binds a port of the OS's choosing, then tells the engines
    # The engines connect to this rank's store: at the address its host reported, where other nodes reach it.
    address = os.environ.get("SLUICE_NODE_IP", "127.0.0.1")

    async def connect(members: list[WeightUpdateEngine]) -> WeightPusher:
        await check_served_weights(members, fp8)
        # Asked again at every rebuild: an engine that came back may have been started with another dtype.
        dtype = sync.dtype if sync.dtype != "auto" else await engines_dtype(members, model_dtype(model_dir))
        # Every TP rank of an engine joins the group: ranks 1 + sum(tp before it) on, world 1 + sum(tp).
        ranks = await engines_tp(members)
        return await WeightPusher.connect(
            members, master_address=address, master_port=port, backend=backend, timeout_s=sync.timeout_s,
            ranks_per_engine=ranks, options=_push_options(sync, dtype), sources=sources,
        )

    return await EngineRotation.start(engines, connect, _discover(run_dir))


def model_dtype(model_dir: Path) -> str | None:
    """The dtype an HF folder's config.json names (what an engine set to "auto" loads it in), if a float one."""
    config = json.loads((model_dir / "config.json").read_text())
    name = str(config.get("torch_dtype") or config.get("dtype") or "")
    return name if name in ("bfloat16", "float16", "float32") else None


def run_replay(model_dir: Path, source: Path, id_range: tuple[str | None, str | None] | None, out_dir: Path, *,
               run: RunConfig, model: ModelSource, trainer: TrainerConfig, staleness: StalenessConfig,
               filters: FilterConfig, metrics: MetricsConfig, hooks: HooksConfig) -> Path:
    """Train on a recording (archive or run stream) into ``out_dir``; returns the trained model's HF folder."""
    from megatron.core import parallel_state as ps

    from pipeline.consumers.megatron.checkpoint import read_checkpoint_meta
    from pipeline.consumers.megatron.model import shutdown_parallel
    from pipeline.consumers.trainer.loop import LocalClock
    from pipeline.consumers.trainer.replay import ReplaySource, first_version, open_records

    out_dir.mkdir(parents=True, exist_ok=True)
    model_cfg, megatron_model, optimizer, step = build_rank(model_dir, trainer=trainer, run=run, model=model)
    from pipeline.consumers.megatron.convert import check_exportable

    check_exportable(megatron_model, model_cfg)  # the trained model is exported at the end: refuse now, not later
    ledger = Ledger(ledger_dir(out_dir))
    latest = latest_checkpoint(out_dir)
    start = int(read_checkpoint_meta(latest)["policy_version"]) if latest else first_version(source, id_range)
    settings = TrainerSettings(steps=trainer.steps, batch_groups=trainer.batch_groups,
                               checkpoint_every=trainer.checkpoint_every,
                               keep_checkpoints=trainer.keep_checkpoints, run_dir=out_dir,
                               profile_steps=trainer.profile_steps)
    clock = LocalClock(start)
    lead = RankZero(source=ReplaySource(open_records(source, id_range), staleness, ledger, clock, filters=filters),
                    clock=clock, ledger=ledger, scalars=open_sinks(out_dir, "trainer", metrics, run.name),
                    hooks=HookRunner.from_config(hooks)) if torch.distributed.get_rank() == 0 else None
    driver = Trainer(settings, model=megatron_model, optimizer=optimizer, step_fn=step,
                     export_weights=lambda: iter(()), lead=lead,
                     dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size())
    try:
        driver.train()
        if driver.step == 0:
            raise ConfigError(f"replay of {source} trained nothing: no group passed both the staleness policy "
                              "(staleness.max_lag) and the group filters (filters.zero_variance among them)")
        export_hf_model(megatron_model, model_cfg, model_dir, base_model_dir(out_dir))
    finally:
        driver.close()
        shutdown_parallel()
    return base_model_dir(out_dir)


def export_hf_model(model: Any, model_cfg: Any, like: Path, out: Path) -> None:
    """Write the trained weights as an HF folder (the config and tokenizer of ``like``), servable by an engine."""
    import shutil

    import torch.distributed as dist
    from safetensors.torch import save_file

    from pipeline.consumers.megatron.convert import megatron_to_hf_state_dict
    from pipeline.consumers.megatron.lora import lora_linears
    from pipeline.consumers.megatron.lora_export import iter_hf_merged

    # With LoRA adapters the folder holds base + adapters merged: a plain model that serves what was trained.
    state = dict(iter_hf_merged(model, model_cfg)) if lora_linears(model) else megatron_to_hf_state_dict(model,
                                                                                                       model_cfg)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    tmp = out / "model.safetensors.tmp"
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp))
    tmp.replace(out / "model.safetensors")
