"""The HTTP face of the CPU engine: SGLang 0.5.23's endpoints on aiohttp.

Endpoints (bodies and answers in SGLang's field names; see ``protocol.py`` for ``/generate``):

- ``POST /generate``; it waits while generation is paused, then holds the model-update lock as a reader until it
  answers (``update_lock.py``), and reuses cached prompt prefixes of its ``extra_key`` (``prefix_cache.py``).
- ``POST /abort_request`` ``{rid, abort_all}``.
- The weight endpoints (joining the weight group, updates from the group or from disk, setting the weight version,
  pausing and continuing generation, ``/flush_cache``, ``/weight_group_probe``): see ``weight_routes.py``.
- ``GET /model_info`` (weight_version, model_path, MoE shape), ``GET /get_weight_version``, ``GET /health``,
  ``GET /health_generate``.
- ``GET /v1/loads``: SGLang 0.5.23's load report, ``{"timestamp", "version", "dp_rank_count", "loads": [...],
  "aggregate": {...}}`` with one entry in ``loads`` (this engine is one data-parallel rank): SGLang's
  ``dp_rank``, ``num_running_reqs``, ``num_waiting_reqs``, ``num_total_reqs``, ``num_used_tokens`` and
  ``max_running_requests``, plus the CPU engine's own ``paused``, ``forward_passes``, ``tokens_generated``,
  ``weight_bytes_received`` and ``weight_bytes_received_in_place`` (the part of it received straight into the model;
  counters since start), and the prefix cache's ``prefix_cache_entries``, ``prefix_cache_bytes``,
  ``prefix_cache_hits`` and ``cached_tokens`` (since start), and the model-update lock's
  ``model_update_readers`` (generations holding it) and ``model_update_writers_waiting``. A client picking the
  least-loaded engine compares ``num_total_reqs``.
- ``GET /get_load``: the same numbers as one flat object (the older name, kept for scripts and tests that read it).

``/abort_request`` and every weight endpoint answer ``{"success": bool, "message": str}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from pydantic import ValidationError

from pipeline import __version__
from pipeline.errors import EngineError
from pipeline.producers.cpu_engine.config import CpuEngineConfig
from pipeline.producers.cpu_engine.generator import BatchGenerator, Sequence, StopStrings
from pipeline.producers.cpu_engine.http_io import json_body, reply
from pipeline.producers.cpu_engine.prefix_cache import PrefixCache, flush_refused
from pipeline.producers.cpu_engine.protocol import (
    GenerateRequest,
    PromptSpec,
    SequenceResult,
    build_response,
    split_prompts,
)
from pipeline.producers.cpu_engine.sampling import SamplingSettings
from pipeline.producers.cpu_engine.scheduler import Scheduler
from pipeline.producers.cpu_engine.tp_group import TpWeightGroup
from pipeline.producers.cpu_engine.update_lock import ModelUpdateLock, PauseGate
from pipeline.producers.cpu_engine.update_turns import UpdateTurns
from pipeline.producers.cpu_engine.weight_loader import WeightLoader
from pipeline.producers.cpu_engine.weight_routes import WeightRoutes

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _load_model(cfg: CpuEngineConfig) -> Any:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    model, info = AutoModelForCausalLM.from_pretrained(
        cfg.model_path, dtype=dtype, attn_implementation=cfg.attn_implementation, output_loading_info=True
    )
    if cfg.patch is not None:
        _patch_model(model, cfg, sorted(info.get("unexpected_keys") or []))
    model.eval()
    model.requires_grad_(False)
    return model


def _patch_model(model: Any, cfg: CpuEngineConfig, unexpected: list[str]) -> None:
    """Run the recipe's ``model.engine_patch`` on the model, then load the folder's tensors that only the patched
    model has (a folder a ``model.spec`` model exported); a plain folder leaves the patch's own initial values."""
    from safetensors import safe_open

    from pipeline import plugins
    from pipeline.models.spec import ENGINE_PATCH_FIELD, ENGINE_PATCH_SIGNATURE

    assert cfg.patch is not None
    patch = plugins.resolve(cfg.patch, field=ENGINE_PATCH_FIELD, signature=ENGINE_PATCH_SIGNATURE,
                            paths=cfg.plugin_paths)
    patch(model)
    if not unexpected:
        return
    state = model.state_dict()
    unknown = [n for n in unexpected if n not in state]
    if unknown:
        raise EngineError(f"{cfg.model_path} holds tensors the model does not have even after {ENGINE_PATCH_FIELD} = "
                          f"{cfg.patch!r}: {unknown[:4]}; the patch and the model.spec that wrote them disagree")
    wanted = set(unexpected)
    with torch.no_grad():
        for file in sorted(Path(cfg.model_path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in wanted.intersection(f.keys()):
                    state[name].copy_(f.get_tensor(name))
    log.info("loaded %d tensors added by %s", len(wanted), cfg.patch)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


class Engine:
    """Model, scheduler and weight-group state behind the HTTP handlers."""

    def __init__(self, cfg: CpuEngineConfig) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.model_path = cfg.model_path
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.model = _load_model(cfg)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_context_len = cfg.max_context_len or int(getattr(config, "max_position_embeddings", 4096))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.prefix_cache = PrefixCache(int(cfg.prefix_cache_mb * 2**20), enabled=not cfg.disable_radix_cache)
        """Touched by the scheduler thread only (admissions, and ``/flush_cache`` as a control action)."""
        self.generator = BatchGenerator(
            self.model,
            eos_ids=_eos_ids(self.model, self.tokenizer),
            pad_id=int(pad),
            logprob_mode=cfg.logprob_mode,
            record_routing=cfg.enable_return_routed_experts,
            max_context_len=self.max_context_len,
            version=cfg.initial_weight_version,
            prefix_cache=self.prefix_cache,
        )
        if cfg.enable_return_routed_experts and self.generator.recorder is None:
            log.warning("--enable-return-routed-experts is ignored: the model has no MoE layers")
        self.scheduler = Scheduler(self.generator, cfg.max_batch)
        self.weights = WeightLoader(self.model)
        self.groups: dict[str, TpWeightGroup] = {}
        self.update_window_open = False
        self.updated_in_window = False
        self.load_failed_in_window = False
        """A bucket of the open window failed to load: the label may not move, whichever bucket carries it."""
        self.pending_loads: list[Future[None]] = []
        """Buckets received and queued for loading between forward passes; ``/end_weight_update`` waits for them."""
        self.update_lock = asyncio.Lock()
        """Serializes receives on the weight group and whole loads from disk (not SGLang's lock: that is the next)."""
        self.model_update_lock = ModelUpdateLock()
        """SGLang's model-update lock: generations read, weight updates that come while not paused write."""
        self.gate = PauseGate()
        """SGLang's ``is_pause``; ``set_paused`` keeps it and the scheduler's flag together."""
        self.turns = UpdateTurns()
        """The order of a window's indexed announcements (``ordered_updates``)."""
        self.receiving: set[asyncio.Future[Any]] = set()
        """Indexed in-place receives whose bytes are still coming after they gave up ``update_lock`` (the next
        bucket's receives start behind them); whoever else needs the group or the weights waits for them too."""
        self.window_serial = 0
        """Counts ``/begin_weight_update`` calls: a receive that outlived its window must not load or label."""
        self.weight_bytes_received = 0
        """Bytes taken off the weight group since start (what the trainer's push put on the wire)."""
        self.rank_bytes_received = [0] * cfg.tp
        """The same, per rank the engine holds in the group (``--tp``)."""
        self.held = cfg.hold_until_update
        if self.held:
            self.set_paused(True)
        # Unseeded requests draw from the process RNG, seeded once here: a per-sequence generator for them would
        # force row-by-row sampling, which costs a sixth of a decode step on a small model.
        torch.manual_seed(cfg.seed)

    def set_paused(self, paused: bool) -> None:
        """Pause generation in place (the scheduler stops between two forward passes, requests keep their place and
        KV; new ones wait at the gate) or continue it. Call on the event loop."""
        self.gate.set_paused(paused)
        self.scheduler.set_paused(paused)

    @property
    def paused(self) -> bool:
        """SGLang's ``is_pause``: weight updates run without the writer lock while it is set."""
        return self.gate.paused

    def flush_prefix_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache if the engine is fully idle, as SGLang does: nothing waiting, nothing running,
        nothing paused in place. Run by the scheduler thread (``Scheduler.call``), between forward passes."""
        waiting, running = self.scheduler.pending_in_loop()
        if waiting or running:
            return False, flush_refused(waiting, running)
        dropped = self.prefix_cache.clear()
        return True, f"Cache flushed ({dropped} cached prompts dropped)."

    def flush_after_update(self) -> None:
        """The flush a weight update asks for (its ``flush_cache``), from the scheduler thread: done if the engine
        is idle; otherwise the cache, with the old weights' prefixes, is kept, as SGLang keeps it."""
        flushed, message = self.flush_prefix_cache()
        if not flushed:
            log.info("prefix cache kept after a weight update: %s", message)

    @property
    def moe_layers(self) -> int:
        """Number of MoE layers (0 for a dense model)."""
        from pipeline.producers.cpu_engine.routing import moe_routers

        return len(moe_routers(self.model))

    def model_info(self) -> dict[str, Any]:
        """The ``/model_info`` answer."""
        config = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.cfg.model_path,
            "is_generation": True,
            "weight_version": self.generator.version,
            "dtype": self.cfg.dtype,
            "architectures": list(getattr(config, "architectures", None) or []),
            "vocab_size": self.vocab_size,
            "max_context_len": self.max_context_len,
            "num_hidden_layers": int(config.num_hidden_layers),
            "num_moe_layers": self.moe_layers,
            # transformers 5 names the routed-expert count num_local_experts in every MoE family.
            "num_experts": int(getattr(config, "num_local_experts", 0) or 0),
            "num_experts_per_tok": int(getattr(config, "num_experts_per_tok", 0) or 0),
            "enable_return_routed_experts": self.cfg.enable_return_routed_experts and self.moe_layers > 0,
            "eos_token_ids": sorted(self.generator.eos_ids),
            "pad_token_id": self.generator.pad_id,
            "logprob_mode": self.cfg.logprob_mode,
            "max_batch": self.cfg.max_batch,
            "tp_size": self.cfg.tp,
            # A pusher skips /flush_cache (a round trip per push) for an engine that says it has no prefix cache.
            "prefix_cache": self.prefix_cache.enabled,
            # A pusher may announce the next bucket before this one is answered: each waits for its bucket_index.
            "ordered_updates": True,
            "weight_groups": {name: [m.rank for m in g.members] for name, g in self.groups.items()},
        }

    def prompts_of(self, req: GenerateRequest) -> tuple[list[list[int]], bool]:
        """The request's prompts as token ids, and whether it was a batch (a list of prompts)."""
        if req.input_ids is not None:
            ids = req.input_ids
            if ids and isinstance(ids[0], list):
                return [list(p) for p in ids], True
            return [list(ids)], False  # type: ignore[arg-type]
        texts = [req.text] if isinstance(req.text, str) else list(req.text or [])
        return [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], not isinstance(req.text, str)

    def check_spec(self, index: int, spec: PromptSpec) -> None:
        """Raise EngineError for a prompt the engine cannot serve, naming the prompt and the fix."""
        bad = [t for t in spec.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"prompt {index} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(spec.prompt_ids) >= self.max_context_len:
            raise EngineError(
                f"prompt {index} has {len(spec.prompt_ids)} tokens; the context holds {self.max_context_len} "
                "(prompt plus output), so shorten it or start the engine with a larger --max-context-len"
            )
        if spec.return_routed_experts and not (self.cfg.enable_return_routed_experts and self.moe_layers):
            raise EngineError(
                "return_routed_experts needs an MoE model and an engine started with --enable-return-routed-experts"
            )
        if spec.routed_experts_start_len < 0:
            raise EngineError(f"routed_experts_start_len must be >= 0, got {spec.routed_experts_start_len}")
        if spec.return_logprob and spec.logprob_start_len >= len(spec.prompt_ids):
            raise EngineError(
                f"logprob_start_len {spec.logprob_start_len} is not inside prompt {index} of "
                f"{len(spec.prompt_ids)} tokens; use -1 for output logprobs only"
            )

    def new_sequence(self, spec: PromptSpec, sample: int) -> Sequence:
        """Sequence ``sample`` of ``spec``; sample j of a seeded request uses sampling_seed + j."""
        params = spec.params
        settings = SamplingSettings(params.temperature, params.top_p, params.top_k)
        generator = None
        if not settings.greedy and params.sampling_seed is not None:
            generator = torch.Generator().manual_seed(params.sampling_seed + sample)
        return Sequence(
            prompt_ids=spec.prompt_ids,
            max_new_tokens=params.max_new_tokens,
            settings=settings,
            stop_ids=frozenset(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos,
            generator=generator,
            input_logprob_start=spec.logprob_start_len if spec.return_logprob else -1,
            rid=spec.rid,
            stop_strings=StopStrings(strings, self._decode_tail) if (strings := params.stop_strings()) else None,
            namespace=spec.namespace,
            shares_prefill=params.n > 1 and self.prefix_cache.enabled,
        )

    def _decode_tail(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def text_of(self, seq: Sequence) -> str:
        """The output's text; as SGLang does, cut before a stop string that ended it (its tokens stay in
        output_ids)."""
        text = str(self.tokenizer.decode(seq.output_ids, skip_special_tokens=True))
        matched = (seq.finish_reason or {}).get("matched")
        if isinstance(matched, str) and (cut := text.find(matched)) >= 0:
            return text[:cut]
        return text

    def result_of(self, seq: Sequence) -> SequenceResult:
        """A finished sequence as the protocol layer wants it."""
        routing = seq.routed_experts()
        now = time.monotonic()
        timings = {"e2e_latency": now - seq.created_at}
        return SequenceResult(
            prompt_ids=seq.prompt_ids,
            output_ids=seq.output_ids,
            output_logprobs=seq.output_logprobs,
            token_versions=seq.token_versions,
            finish_reason=seq.finish_reason or {"type": "abort", "message": "unfinished"},
            current_version=self.generator.version,
            routed_experts=routing.numpy() if routing is not None else None,
            input_logprobs=seq.input_logprobs,
            timings=timings,
            cached_tokens=seq.cached_tokens,
        )

    def abort(self, predicate: Callable[[Sequence], bool], message: str) -> int:
        """Abort waiting and running sequences matching ``predicate``; call from the scheduler thread."""
        return self.scheduler.abort_in_loop(predicate, message)


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application serving ``engine``."""
    app = web.Application(client_max_size=256 * 1024 * 1024)
    routes = _Routes(engine)
    weights = WeightRoutes(engine)
    app.router.add_post("/generate", routes.generate)
    app.router.add_post("/init_weights_update_group", weights.init_group)
    app.router.add_post("/destroy_weights_update_group", weights.destroy_group)
    app.router.add_post("/begin_weight_update", weights.begin_update)
    app.router.add_post("/end_weight_update", weights.end_update)
    app.router.add_post("/update_weights_from_distributed", weights.update_from_distributed)
    app.router.add_post("/update_weights_from_disk", weights.update_from_disk)
    app.router.add_post("/update_weight_version", weights.update_version)
    app.router.add_post("/pause_generation", weights.pause)
    app.router.add_post("/continue_generation", weights.resume)
    app.router.add_post("/flush_cache", weights.flush_cache)
    app.router.add_get("/flush_cache", weights.flush_cache)  # SGLang serves both methods
    app.router.add_post("/weight_group_probe", weights.weight_group_probe)
    app.router.add_post("/abort_request", routes.abort_request)
    app.router.add_get("/model_info", routes.model_info)
    app.router.add_get("/get_model_info", routes.model_info)
    app.router.add_get("/get_weight_version", routes.weight_version)
    app.router.add_get("/v1/loads", routes.loads)
    app.router.add_get("/get_load", routes.get_load)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/health_generate", routes.health_generate)

    async def on_startup(_: web.Application) -> None:
        engine.scheduler.start()

    async def on_cleanup(_: web.Application) -> None:
        engine.scheduler.stop()
        for group in engine.groups.values():
            group.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


class _Routes:
    """Generation and inspection handlers (the weight-update ones are ``WeightRoutes``); each one parses, validates and
    hands the work to the engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._warned: set[str] = set()

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /generate``."""
        engine = self.engine
        try:
            req = GenerateRequest.model_validate(await json_body(request))
            prompts, batched = engine.prompts_of(req)
            specs = split_prompts(req, prompts, uuid.uuid4().hex)
            for i, spec in enumerate(specs):
                engine.check_spec(i, spec)
        except (ValidationError, EngineError, ValueError) as exc:
            return _error(f"invalid /generate request: {exc}")
        self._warn_ignored(req.ignored_fields() + [f for s in specs for f in s.params.ignored_fields()])
        # SGLang's order: a paused engine holds new requests here, before they take the reader lock, so that a
        # weight update that came while paused (and so took no writer lock) never waits for them.
        await engine.gate.wait_until_continued()
        async with engine.model_update_lock.reading():
            seqs, owners, done = self._start(specs)
            try:
                await done
            except asyncio.CancelledError:
                # The client went away: free the rows instead of generating for nobody.
                for seq in seqs:
                    seq.abort_requested = True
                wanted = set(map(id, seqs))
                engine.scheduler.abort_waiting(lambda s: id(s) in wanted, "the client went away")
                raise
        answers = [
            build_response(spec, engine.result_of(seq), engine.text_of(seq))
            for spec, seq in zip(owners, seqs, strict=False)
        ]
        return web.json_response(answers if batched or len(answers) > 1 else answers[0])

    def _warn_ignored(self, fields: list[str]) -> None:
        for name in fields:
            if name not in self._warned:
                self._warned.add(name)
                log.warning("/generate field %r is not implemented by the CPU engine and is ignored", name)

    def _start(self, specs: list[PromptSpec]) -> tuple[list[Sequence], list[PromptSpec], asyncio.Future[None]]:
        """Create ``n`` sequences per prompt, in prompt-major order, and queue them; return them with one future that
        settles once all of them have finished."""
        loop = asyncio.get_running_loop()
        seqs: list[Sequence] = []
        owners: list[PromptSpec] = []
        for spec in specs:
            for j in range(spec.params.n):
                seqs.append(self.engine.new_sequence(spec, j))
                owners.append(spec)
        done: asyncio.Future[None] = loop.create_future()
        on_finish = _countdown(loop, done, len(seqs))
        for seq in seqs:
            seq.on_finish = on_finish
        self.engine.scheduler.submit(seqs)
        return seqs, owners, done

    async def abort_request(self, request: web.Request) -> web.Response:
        """``POST /abort_request`` ``{rid, abort_all}``: aborts by request id (rids of the request body)."""
        body = await json_body(request)
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not rid:
            return reply(False, "abort_request needs rid or abort_all=true")
        count = await asyncio.wrap_future(
            self.engine.scheduler.call(
                lambda: self.engine.abort(lambda s: abort_all or s.rid == rid, "aborted by abort_request")
            )
        )
        return reply(True, f"aborted {count} sequences")

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /model_info``."""
        return web.json_response(self.engine.model_info())

    async def weight_version(self, request: web.Request) -> web.Response:
        """``GET /get_weight_version``."""
        return web.json_response({"weight_version": self.engine.generator.version})

    async def get_load(self, request: web.Request) -> web.Response:
        """``GET /get_load``: the load as one flat object."""
        return web.json_response(dataclasses.asdict(self.engine.scheduler.load()))

    async def loads(self, request: web.Request) -> web.Response:
        """``GET /v1/loads``: SGLang's shape, one data-parallel rank."""
        load = self.engine.scheduler.load()
        rank = {
            "dp_rank": 0,
            "num_running_reqs": load.num_running_reqs,
            "num_waiting_reqs": load.num_waiting_reqs,
            "num_total_reqs": load.num_running_reqs + load.num_waiting_reqs,
            "num_used_tokens": load.num_tokens,
            "max_running_requests": load.max_batch,
            "paused": load.paused,
            "forward_passes": load.forward_passes,
            "tokens_generated": load.tokens_generated,
            "weight_bytes_received": self.engine.weight_bytes_received,
            "weight_bytes_received_in_place": self.engine.weights.bytes_in_place,
            "weight_bytes_received_per_tp_rank": list(self.engine.rank_bytes_received),
            "prefix_cache_entries": len(self.engine.prefix_cache),
            "prefix_cache_bytes": self.engine.prefix_cache.nbytes,
            "prefix_cache_hits": self.engine.prefix_cache.hits,
            "cached_tokens": self.engine.prefix_cache.cached_tokens,
            "model_update_readers": self.engine.model_update_lock.readers,
            "model_update_writers_waiting": self.engine.model_update_lock.writers_waiting,
        }
        aggregate = {k: rank[k] for k in ("num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens")}
        return web.json_response({
            "timestamp": datetime.now(UTC).isoformat(), "version": f"sluice-cpu-engine {__version__}",
            "dp_rank_count": 1, "loads": [rank], "aggregate": aggregate,
        })  # fmt: skip

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``: the process is up and the scheduler thread alive."""
        return (
            web.Response(text="OK")
            if self.engine.scheduler.alive
            else web.Response(status=503, text="scheduler stopped")
        )

    async def health_generate(self, request: web.Request) -> web.Response:
        """``GET /health_generate``: one greedy token through the whole path."""
        pad = self.engine.generator.pad_id
        seq = Sequence([pad], 1, SamplingSettings(0.0, 1.0, -1), frozenset(), True, None, rid="health_generate")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        seq.on_finish = _countdown(asyncio.get_running_loop(), done, 1)
        self.engine.scheduler.submit([seq])
        await done
        return web.Response(text="OK")


def _countdown(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], count: int) -> Callable[[Sequence], None]:
    """The ``on_finish`` callback of a request's ``count`` sequences: settles ``future`` in the event loop once the
    last of them has finished. One wake-up of the loop per request, not per sequence: each costs a write to the loop's
    self-pipe and a pass of the loop while the scheduler thread holds the GIL."""
    left = count
    lock = threading.Lock()  # sequences finish in the scheduler thread, and abort in the event loop's

    def settle() -> None:
        if not future.done():
            future.set_result(None)

    def on_finish(seq: Sequence) -> None:
        nonlocal left
        with lock:
            left -= 1
            last = left == 0
        if last:
            loop.call_soon_threadsafe(settle)

    return on_finish


def run_server(cfg: CpuEngineConfig) -> None:
    """Load the model and serve until SIGINT/SIGTERM."""
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(cfg)
    info = engine.model_info()
    sock = _bind(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    if cfg.port_file:
        # Bound before the file appears, so a reader never learns a port nobody holds yet; the rename makes the
        # file appear whole.
        partial = Path(f"{cfg.port_file}.tmp")
        partial.write_text(str(port))
        partial.rename(cfg.port_file)
    log.info(
        "CPU engine serving %s on http://%s:%d (dtype %s, %d MoE layers, max_batch %d)",
        cfg.model_path,
        cfg.host,
        port,
        cfg.dtype,
        info["num_moe_layers"],
        cfg.max_batch,
    )
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its sequences.
    web.run_app(build_app(engine), sock=sock, print=None, access_log=None, handler_cancellation=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise EngineError(f"cannot listen on {host}:{port}: {e}; pick another --port, or 0 for a free one") from None
    sock.listen(128)
    return sock
