"""The HTTP face of the CPU engine: SGLang 0.5.23's endpoints on aiohttp.

Endpoints (bodies and answers in SGLang's field names; see ``protocol.py`` for ``/generate``); the state they share
is the ``Engine``'s (``engine.py``):

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
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from pipeline import __version__
from pipeline.errors import EngineError
from pipeline.producers.cpu_engine.config import CpuEngineConfig
from pipeline.producers.cpu_engine.engine import Engine
from pipeline.producers.cpu_engine.generator import Sequence
from pipeline.producers.cpu_engine.http_io import json_body, reply
from pipeline.producers.cpu_engine.protocol import (
    GenerateRequest,
    PromptSpec,
    build_response,
    split_prompts,
)
from pipeline.producers.cpu_engine.sampling import SamplingSettings
from pipeline.producers.cpu_engine.weight_routes import WeightRoutes

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


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
