"""The CPU engine's state behind its HTTP handlers (``server.py`` and ``weight_routes.py``): the model and its
tokenizer, the scheduler that owns the model, the prefix cache, the weight group and update window, and SGLang's
pause and model-update lock (``update_lock.py``), which the handlers share through it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import EngineError
from pipeline.producers.cpu_engine.config import CpuEngineConfig
from pipeline.producers.cpu_engine.generator import BatchGenerator, Sequence, StopStrings
from pipeline.producers.cpu_engine.prefix_cache import PrefixCache, flush_refused
from pipeline.producers.cpu_engine.protocol import GenerateRequest, PromptSpec, SequenceResult
from pipeline.producers.cpu_engine.sampling import SamplingSettings
from pipeline.producers.cpu_engine.scheduler import Scheduler
from pipeline.producers.cpu_engine.tp_group import TpWeightGroup
from pipeline.producers.cpu_engine.update_lock import ModelUpdateLock, PauseGate
from pipeline.producers.cpu_engine.update_turns import UpdateTurns
from pipeline.producers.cpu_engine.weight_loader import WeightLoader

log = logging.getLogger(__name__)


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
    from pipeline.config.model import ENGINE_PATCH_SIGNATURE
    from pipeline.models.spec import ENGINE_PATCH_FIELD

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
        self.weights = WeightLoader(self.model, cfg.lora, fp8=cfg.weight_dtype == "fp8")
        self.groups: dict[str, TpWeightGroup] = {}
        self.update_window_open = False
        self.updated_in_window = False
        self.load_failed_in_window = False
        """A bucket of the open window failed to load: the label may not move, whichever bucket carries it."""
        self.pending_loads: list[Future[None]] = []
        """Buckets received and queued for loading between forward passes; ``/end_weight_update`` waits for them."""
        self.update_lock = asyncio.Lock()
        """Taken by whole loads from disk, which also take every group's ``receive_lock`` (not SGLang's lock: that is
        the next)."""
        self.receive_locks: dict[str, asyncio.Lock] = {}
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
            "weight_dtype": self.cfg.weight_dtype,
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
            # A push from several sources (every trainer rank sending the tensors it owns, each over its own group)
            # may reach this engine at once: each group's receives are serialized on their own, not behind others'.
            "concurrent_sources": True,
            "weight_groups": {name: [m.rank for m in g.members] for name, g in self.groups.items()},
        }

    def receive_lock(self, group_name: str) -> asyncio.Lock:
        """The lock that orders one weight group's receives (gloo matches a receive with the group's next broadcast).
        Groups are independent: a receive on one never waits behind another's, so several sources pushing at once
        cannot wait on each other through this engine (a wait another engine could take in the other order)."""
        return self.receive_locks.setdefault(group_name, asyncio.Lock())

    def all_receive_locks(self) -> list[asyncio.Lock]:
        """Every joined group's ``receive_lock``, in group-name order."""
        return [self.receive_lock(name) for name in sorted(self.groups)]

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
