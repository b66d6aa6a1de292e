"""Async HTTP client for SGLang 0.5.23's native API (and sluice's CPU engine, which speaks the same protocol).

``SGLangClient`` talks to one engine (``pipeline.producers.engine_pool.EnginePool`` spreads generations over several).
Retries go through an explicit ``Retry`` object, never an implicit loop.

Field names and formats follow SGLang 0.5.23's ``http_server.py``/``io_struct.py`` (docs/sglang.md):
``output_token_logprobs`` is a list of ``[logprob, token_id, text]``, ``weight_versions`` spans have an exclusive
``end``, and ``routed_experts`` is base64 of little-endian int32 shaped ``[P + R - 1 - start_len, layers, topk]``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar

import aiohttp
import numpy as np

from pipeline.errors import EngineError
from pipeline.producers.base import GenerateResult, VersionSpan
from pipeline.sync.base import EngineReply
from pipeline.sync.lifecycle import Adoption, adopt_engines
from pipeline.sync.lora_names import adapter_name, base_label

_T = TypeVar("_T")
log = logging.getLogger(__name__)
# Attempts of one request whose cache key the engine's version overtook; more than one push in a row would be needed
# to use them up.
_KEY_ATTEMPTS = 4


class EngineUnavailableError(EngineError):
    """The engine did not answer: connection refused or reset, timed out, or a 5xx status. Worth retrying elsewhere."""


class EngineRequestError(EngineError):
    """The engine refused the request (a 4xx status); sending it again, anywhere, gives the same answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------------------------------------------------
# Retry policy (redis-py style: a backoff object, a retry count, and the errors that are worth retrying)
# --------------------------------------------------------------------------------------------------------------------


class Backoff(Protocol):
    """How long to wait before the next attempt, given how many attempts have failed so far."""

    def compute(self, failures: int) -> float:
        """Seconds to sleep after ``failures`` consecutive failures (``failures >= 1``)."""
        ...


@dataclass(frozen=True)
class ExponentialBackoff:
    """``base * 2**(failures-1)`` seconds, capped, with jitter so that many clients do not retry in lockstep."""

    base: float = 0.05
    cap: float = 5.0
    jitter: bool = True

    def compute(self, failures: int) -> float:
        """Seconds to sleep after ``failures`` consecutive failures."""
        delay = min(self.cap, self.base * 2.0 ** max(0, failures - 1))
        return delay * random.uniform(0.5, 1.0) if self.jitter else delay


@dataclass(frozen=True)
class Retry:
    """Retry ``retries`` more times on the ``retry_on`` errors, sleeping ``backoff.compute(n)`` after failure n."""

    backoff: Backoff = field(default_factory=ExponentialBackoff)
    retries: int = 3
    retry_on: tuple[type[BaseException], ...] = (EngineUnavailableError,)

    async def call(
        self,
        attempt: Callable[[], Awaitable[_T]],
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> _T:
        """Run ``attempt`` until it succeeds, fails with an error outside ``retry_on``, or the retries run out."""
        failures = 0
        while True:
            try:
                return await attempt()
            except self.retry_on as exc:
                failures += 1
                if on_failure is not None:
                    on_failure(exc)
                if failures > self.retries:
                    raise
                await asyncio.sleep(self.backoff.compute(failures))


NO_RETRY = Retry(retries=0)


# --------------------------------------------------------------------------------------------------------------------
# Typed results
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What ``/model_info`` says about the served model."""

    model_path: str | None
    weight_version: str
    moe_layers: int | None
    """Number of MoE layers, when the engine reports it (sluice's CPU engine does; SGLang does not)."""
    topk: int | None
    """Experts per token, when the engine reports it."""
    raw: Mapping[str, Any]


@dataclass(frozen=True)
class EngineLoad:
    """What ``/v1/loads`` says: requests running and waiting over the engine's data-parallel ranks, and each rank's
    raw report (SGLang adds token usage and queue details; the CPU engine its counters)."""

    num_running_reqs: int
    num_waiting_reqs: int
    ranks: tuple[Mapping[str, Any], ...]

    @property
    def num_total_reqs(self) -> int:
        """Running plus waiting: what least-loaded routing compares."""
        return self.num_running_reqs + self.num_waiting_reqs

    def total(self, key: str) -> float:
        """A numeric field summed over the ranks that report it (0 when none does)."""
        return sum(float(r[key]) for r in self.ranks if isinstance(r.get(key), (int, float)))

    @classmethod
    def parse(cls, engine: str, body: Any) -> EngineLoad:
        """Read a ``/v1/loads`` answer; EngineError naming the engine if it is not one."""
        loads = body.get("loads") if isinstance(body, Mapping) else None
        try:
            if not isinstance(loads, list):
                raise ValueError("no 'loads' list")
            ranks = tuple(dict(r) for r in loads)
            return cls(sum(int(r["num_running_reqs"]) for r in ranks), sum(int(r["num_waiting_reqs"]) for r in ranks),
                       ranks)
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"engine {engine} sent a /v1/loads answer sluice cannot read ({exc!r}): "
                              f"{_short(body)}; is it SGLang >= 0.5.23 or sluice's CPU engine?") from exc


# Keys under which an engine may report its MoE shape in /model_info; the first present wins.
_LAYER_KEYS = ("num_moe_layers", "moe_layers")
_TOPK_KEYS = ("topk", "moe_topk", "num_experts_per_tok")


@dataclass
class _Response:
    status: int
    body: Any


# --------------------------------------------------------------------------------------------------------------------
# One engine
# --------------------------------------------------------------------------------------------------------------------


class SGLangClient:
    """Async client of one SGLang-protocol engine at ``base_url``.

    ``retry`` applies to reads and generations. Weight endpoints are never retried: each one is half of a collective
    with the trainer, and repeating it would leave the engine waiting for a broadcast that is not coming.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 5.0,
        health_timeout: float = 5.0,
        weight_timeout: float = 1800.0,
        retry: Retry | None = None,
        routed_experts_shape: tuple[int, int] | None = None,
        adapters: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.adapters = adapters
        """LoRA on SGLang (``pipeline.sync.adapter_push``): each request names the adapter of the engine's label as
        read just before it, and all its tokens carry that version."""
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.health_timeout = health_timeout
        self.weight_timeout = weight_timeout
        self.retry = retry if retry is not None else Retry()
        self._moe_shape = routed_experts_shape
        self._session: aiohttp.ClientSession | None = None
        self._keyed: bool | None = None  # whether the engine keeps a prefix cache (asked at the first generation)
        self._label = ""  # the engine's weight version as last seen: the prefix-cache key of the next request
        self.key_retries = 0
        """Requests sent again because the engine prefilled them under another version than their cache key."""
        self.in_flight = 0
        """Generations sent and not yet answered (counted here, client-side, for least-loaded routing)."""

    @property
    def name(self) -> str:
        """The engine's base URL, used in error messages."""
        return self.base_url

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r}, in_flight={self.in_flight})"

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- generation -------------------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rid: str | None = None,
    ) -> GenerateResult:
        """Generate one sequence for one prompt (``sampling_params["n"]`` must be 1; use ``generate_many`` for more)."""
        if int(sampling_params.get("n", 1)) != 1:
            raise EngineRequestError("generate() returns one sequence; call generate_many() for n > 1")
        results = await self.generate_many(
            [input_ids],
            sampling_params,
            return_logprob=return_logprob,
            return_routed_experts=return_routed_experts,
            routed_experts_start_len=routed_experts_start_len,
            rids=None if rid is None else [rid],
        )
        return results[0]

    async def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Mapping[str, Any],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        rids: Sequence[str] | None = None,
    ) -> list[GenerateResult]:
        """Generate ``n`` sequences for each prompt in one request; results are prompt-major (``i * n + j``)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise EngineRequestError("every prompt needs at least one token")
        body: dict[str, Any] = {
            "input_ids": [list(map(int, p)) for p in prompts],
            "sampling_params": dict(sampling_params),
            "return_logprob": return_logprob,
            "logprob_start_len": -1,
            "return_routed_experts": return_routed_experts,
        }
        if return_routed_experts:
            body["routed_experts_start_len"] = routed_experts_start_len
        if rids is not None:
            body["rid"] = list(rids)
        self.in_flight += 1  # from the start: least-loaded routing must see this request while it asks anything
        try:
            return await self._generate_keyed(prompts, body, sampling_params, return_logprob, return_routed_experts,
                                              routed_experts_start_len)
        finally:
            self.in_flight -= 1

    async def _generate_keyed(self, prompts: Sequence[Sequence[int]], body: dict[str, Any],
                              sampling_params: Mapping[str, Any], return_logprob: bool, return_routed_experts: bool,
                              routed_experts_start_len: int) -> list[GenerateResult]:
        shape = await self.routed_experts_shape() if return_routed_experts else None
        n = int(sampling_params.get("n", 1))
        keyed = await self._keys_prefix_cache()
        if keyed or self.adapters:
            # The engine's version now, one cheap round trip before a generation of seconds: the last answer's would
            # be a push behind for the first request after every push (in a sync run, every group of a step).
            self._label = (await self.model_info()).weight_version
        for attempt in range(_KEY_ATTEMPTS):
            if keyed:
                body["extra_key"] = self._cache_key()
            label = self._label
            if self.adapters:
                body.pop("lora_path", None)
                if not base_label(label):
                    body["lora_path"] = adapter_name(label)
            try:
                answer = await self._post_generate(body)
            except EngineRequestError as exc:
                if not (self.adapters and "lora" in str(exc).lower() and attempt + 1 < _KEY_ATTEMPTS):
                    raise
                # The adapter was unloaded between the label's read and the request (two pushes went by): ask again.
                self.key_retries += 1
                self._label = (await self.model_info()).weight_version
                continue
            if not isinstance(answer, (list, Mapping)):  # an HTML error page from a proxy, say
                raise EngineError(f"engine {self.name} answered /generate with {_short(answer)[:200]!r}, not a JSON "
                                  "object; is it an SGLang-protocol engine?")
            items = answer if isinstance(answer, list) else [answer]
            if len(items) != len(prompts) * n:
                raise EngineError(
                    f"engine {self.name} answered {len(items)} sequences for {len(prompts)} prompts x n={n}; "
                    "is it an SGLang-protocol engine?"
                )
            results = [
                self._decode(
                    item, len(prompts[i // n]), shape, routed_experts_start_len, return_logprob, return_routed_experts
                )
                for i, item in enumerate(items)
            ]
            if self.adapters:
                results = [_under_adapter(result, label) for result in results]
            if not keyed or self._keyed_right(body["extra_key"], results):
                return results
            self.key_retries += 1
            if attempt + 1 < _KEY_ATTEMPTS:
                log.debug("engine %s started a request keyed %s under version %s; sending it again",
                          self.name, body["extra_key"], self._label)
        raise EngineError(f"engine {self.name} changed weights under {_KEY_ATTEMPTS} attempts of one request in a row "
                          "(each was prefilled under another version than its cache key); are pushes back to back?")

    def _cache_key(self) -> str:
        """The request's prefix-cache namespace (SGLang's ``extra_key``): the engine's weight version as it said just
        before the request, so a request shares cached prefixes only with requests made under the same weights."""
        return f"sluice-w{self._label}"

    def _keyed_right(self, key: str, results: Sequence[GenerateResult]) -> bool:
        """Whether every sequence was prefilled under the version its key names (its first token's version). A
        request keyed to an older version that the engine ran after a push could have reused that version's
        cached prefix under the new label: it is sent again, keyed to the version the engine now has. A sequence
        that started under its key and spanned a push is right: it was in flight (docs/weight-push.md)."""
        newest = self._label
        right = True
        for result in results:
            if result.weight_version:
                newest = result.weight_version  # the engine's version when it answered: never older than a span
            if result.weight_versions and key != f"sluice-w{result.weight_versions[0].version}":
                right = False
        self._label = newest
        return right

    async def _keys_prefix_cache(self) -> bool:
        """Whether requests need a version key: the engine keeps a prefix cache (asked once, with its version)."""
        if self._keyed is None:
            info = await self.model_info()
            self._label = info.weight_version
            self._keyed = await self.prefix_cache()
        return self._keyed

    async def generate_raw(self, body: Mapping[str, Any]) -> Any:
        """POST ``body`` to ``/generate`` as is and return the decoded JSON (retried per ``self.retry``)."""
        self.in_flight += 1
        try:
            return await self._post_generate(body)
        finally:
            self.in_flight -= 1

    async def _post_generate(self, body: Mapping[str, Any]) -> Any:
        response = await self.retry.call(lambda: self._request("POST", "/generate", body, self.timeout))
        return response.body

    def _decode(
        self,
        item: Mapping[str, Any],
        prompt_len: int,
        shape: tuple[int, int] | None,
        routed_start: int,
        want_logprobs: bool,
        want_routing: bool,
    ) -> GenerateResult:
        try:
            meta = item["meta_info"]
            output_ids = np.asarray(item["output_ids"], dtype=np.int32)
            if int(meta.get("prompt_tokens", prompt_len)) != prompt_len:
                # Results of a batched request are matched to prompts by position (prompt-major, as SGLang's
                # tokenizer manager sends them); a length that disagrees means that order does not hold.
                raise ValueError(f"prompt_tokens is {meta['prompt_tokens']} but the prompt has {prompt_len} tokens")
            finish = meta.get("finish_reason") or {}
            logprobs = _decode_logprobs(meta, output_ids) if want_logprobs else None
            spans = _decode_spans(meta, len(output_ids))
            experts = None
            if want_routing:
                routed = meta.get("routed_experts")
                if routed is None:
                    raise ValueError("routed_experts is missing; start SGLang with --enable-return-routed-experts")
                rows = prompt_len + len(output_ids) - 1 - routed_start
                experts = _decode_routed_experts(routed, rows, shape)
            return GenerateResult(
                output_ids=output_ids,
                text=str(item.get("text", "")),
                output_logprobs=logprobs,
                finish_reason=str(finish.get("type", "unknown")) if isinstance(finish, Mapping) else str(finish),
                finish_detail=dict(finish) if isinstance(finish, Mapping) else {"type": str(finish)},
                prompt_tokens=prompt_len,
                completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
                weight_version=str(meta.get("weight_version", "")),
                weight_versions=spans,
                routed_experts=experts,
                rid=meta.get("id"),
                engine=self.name,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"engine {self.name} sent a /generate answer sluice cannot read: {exc!r}") from exc

    # ---- model / health ---------------------------------------------------------------------------------------------

    async def health(self) -> bool:
        """True when ``/health`` answers 200 within ``health_timeout``; never raises."""
        try:
            response = await self._request("GET", "/health", None, self.health_timeout)
        except EngineError:
            return False
        return response.status == 200

    async def model_info(self) -> ModelInfo:
        """``/model_info`` (``/get_model_info`` on SGLang releases that only have the old name)."""
        try:
            response = await self.retry.call(lambda: self._request("GET", "/model_info", None, self.timeout))
        except EngineRequestError as exc:
            if exc.status != 404:
                raise
            response = await self.retry.call(lambda: self._request("GET", "/get_model_info", None, self.timeout))
        raw = response.body if isinstance(response.body, Mapping) else {}
        return ModelInfo(
            model_path=raw.get("model_path"),
            weight_version=str(raw.get("weight_version", "")),
            moe_layers=_first_int(raw, _LAYER_KEYS),
            topk=_first_int(raw, _TOPK_KEYS),
            raw=raw,
        )

    async def weight_version(self) -> str:
        """The engine's current ``weight_version``."""
        return (await self.model_info()).weight_version

    async def weight_dtype(self) -> str | None:
        """The dtype the engine holds its weights in ("bfloat16", ...), when it says: ``/model_info``'s ``dtype`` (the
        CPU engine), else ``/get_server_info``'s (SGLang); None when it does not, or says "auto"."""
        found = _dtype_name((await self.model_info()).raw.get("dtype"))
        if found is None:
            found = _dtype_name((await self._server_info()).get("dtype"))
        return found

    async def served_weight_dtype(self) -> str | None:
        """"fp8" when the engine serves FP8 weights, "auto" when it serves unquantized ones, None when it cannot tell.
        The CPU engine says so in ``/model_info``; SGLang by its ``--quantization``, else by the ``quantization_config``
        of the checkpoint it serves, read where that folder is visible from here."""
        info = await self.model_info()
        said = info.raw.get("weight_dtype")
        if isinstance(said, str):
            return said
        method = (await self._server_info()).get("quantization")
        if method is None and info.model_path:
            config = Path(info.model_path) / "config.json"
            try:
                method = (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method", "")
            except (OSError, ValueError):
                return None
        if method is None:
            return None
        return "fp8" if str(method).startswith("fp8") else "auto" if not method else str(method)

    async def tp_size(self) -> int:
        """How many tensor-parallel ranks the engine has, each of which joins the weight group (1 if it does not
        say): ``/model_info``'s ``tp_size`` (the CPU engine), else ``/get_server_info``'s (SGLang)."""
        size = _first_int((await self.model_info()).raw, ("tp_size",))
        if size is None:
            size = _first_int(await self._server_info(), ("tp_size",))
        return size or 1

    async def prefix_cache(self) -> bool:
        """Whether the engine keeps a prefix cache that a weight update makes stale: ``/model_info``'s
        ``prefix_cache`` (the CPU engine: false), else not ``/get_server_info``'s ``disable_radix_cache`` (SGLang);
        true when it says neither, so that such an engine is flushed."""
        said = (await self.model_info()).raw.get("prefix_cache")
        if isinstance(said, bool):
            return said
        return not bool((await self._server_info()).get("disable_radix_cache", False))

    async def ordered_updates(self) -> bool:
        """Whether the engine takes a window's ``/update_weights_from_distributed`` calls in the order of their
        ``bucket_index``, whatever order they arrive in, so that a pusher may announce the next bucket before this
        one is answered: ``/model_info``'s ``ordered_updates`` (the CPU engine). SGLang does not say so, and gets one
        announcement at a time."""
        return (await self.model_info()).raw.get("ordered_updates") is True

    async def concurrent_sources(self) -> bool:
        """Whether the engine receives on several weight groups at once (``/model_info``'s ``concurrent_sources``,
        the CPU engine). SGLang's scheduler runs one ``/update_weights_from_distributed`` at a time, so sources
        pushing to it take turns (docs/weight-push.md)."""
        return (await self.model_info()).raw.get("concurrent_sources") is True

    async def _server_info(self) -> Mapping[str, Any]:
        try:
            response = await self.retry.call(lambda: self._request("GET", "/get_server_info", None, self.timeout))
        except EngineRequestError as exc:
            if exc.status != 404:
                raise
            return {}
        return response.body if isinstance(response.body, Mapping) else {}

    async def routed_experts_shape(self) -> tuple[int, int]:
        """``(layers, topk)`` of ``routed_experts``: from the constructor, else from ``/model_info`` (asked once)."""
        if self._moe_shape is None:
            info = await self.model_info()
            if info.moe_layers is None or info.topk is None:
                raise EngineError(
                    f"engine {self.name} does not report its MoE shape in /model_info (real SGLang does not); "
                    "pass routed_experts_shape=(num_moe_layers, topk) to SGLangClient"
                )
            self._moe_shape = (info.moe_layers, info.topk)
        return self._moe_shape

    async def get_load(self) -> EngineLoad:
        """``GET /v1/loads`` (SGLang 0.5.23's load report; its older ``/get_load`` answers 404 there)."""
        response = await self.retry.call(lambda: self._request("GET", "/v1/loads", None, self.timeout))
        return EngineLoad.parse(self.name, response.body)

    async def flush_cache(self) -> EngineReply:
        """Drop the prefix cache (SGLang refuses while requests are running)."""
        response = await self._request("POST", "/flush_cache", None, self.timeout, accept_4xx=True)
        return _reply(response)

    async def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> EngineReply:
        """Stop scheduling: ``abort`` ends in-flight requests, ``retract``/``in_place`` keep them to continue later."""
        response = await self._request("POST", "/pause_generation", {"mode": mode}, self.timeout, accept_4xx=True)
        return _reply(response)

    async def continue_generation(self) -> EngineReply:
        """Resume after ``pause_generation``."""
        response = await self._request("POST", "/continue_generation", {}, self.timeout, accept_4xx=True)
        return _reply(response)

    # ---- weight endpoints (pipeline.sync.base.WeightUpdateEngine) ---------------------------------------------------

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> EngineReply:
        """Make the engine join the weight group; returns once it has joined (the trainer must be joining too)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._weight_call("/init_weights_update_group", body)

    async def begin_weight_update(self) -> EngineReply:
        """Open the update window."""
        return await self._weight_call("/begin_weight_update", {"selector": "all"})

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool,
        weight_version: str | None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        bucket_index: int | None = None,
        push_id: str | None = None,
        begin_window: bool = False,
    ) -> EngineReply:
        """Announce one bucket; the engine answers after receiving and loading every tensor in it. ``bucket_index``,
        ``push_id`` and ``begin_window`` are sent only when given (to an engine with ``ordered_updates``; SGLang
        knows none of them)."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": weight_version,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if bucket_index is not None:
            body["bucket_index"] = bucket_index
            body["push_id"] = push_id
        if begin_window:
            body["begin_window"] = True
        return await self._weight_call("/update_weights_from_distributed", body)

    async def end_weight_update(self, *, push_id: str | None = None, buckets: int | None = None,
                                continue_generation: bool = False) -> EngineReply:
        """Close the update window. The rest is sent only when given (to an engine with ``ordered_updates``; SGLang
        knows none of it): wait for push ``push_id``'s ``buckets`` first, then also continue generation."""
        body: dict[str, Any] = {}
        if buckets is not None:
            body["push_id"], body["buckets"] = push_id, buckets
        if continue_generation:
            body["continue_generation"] = True
        return await self._weight_call("/end_weight_update", body)

    async def destroy_weights_update_group(self, group_name: str) -> EngineReply:
        """Leave the weight group ``group_name``."""
        return await self._weight_call("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | int | None = None, abort_all_requests: bool = False
    ) -> EngineReply:
        """Load a whole HF model folder (a path on the engine's machine) and label it ``weight_version``.

        SGLang's ``/update_weights_from_disk``; requests in flight continue on the new weights unless
        ``abort_all_requests``. Not retried, like every weight endpoint: a refusal says why in its message.
        """
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._weight_call("/update_weights_from_disk", body)

    async def update_weight_version(self, new_version: str | int, *, abort_all_requests: bool = False) -> EngineReply:
        """Relabel the engine's weights; SGLang's default would abort in-flight requests, so ours is ``False``."""
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return await self._weight_call("/update_weight_version", body)

    async def load_lora_adapter(self, name: str, path: str) -> EngineReply:
        """SGLang's ``/load_lora_adapter``: load the PEFT folder ``path`` (on the engine's machine) as ``name``."""
        response = await self._request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                       self.weight_timeout, accept_4xx=True)
        return _lora_reply(response)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> EngineReply:
        """SGLang's ``/unload_lora_adapter``; it answers once the requests running under ``name`` have finished."""
        response = await self._request("POST", "/unload_lora_adapter", {"lora_name": name},
                                       timeout or self.weight_timeout, accept_4xx=True)
        return _lora_reply(response)

    async def weight_group_probe(self, group_name: str, nbytes: int, *, prepare: bool = False) -> EngineReply:
        """sluice's CPU engine only (``sluice bench sync``): prepare a buffer of ``nbytes``, or receive one bare
        broadcast of that many bytes on the weight group and drop it."""
        body = {"group_name": group_name, "nbytes": nbytes, "prepare": prepare}
        return await self._weight_call("/weight_group_probe", body)

    async def _weight_call(self, path: str, body: Mapping[str, Any]) -> EngineReply:
        return _reply(await self._request("POST", path, body, self.weight_timeout, accept_4xx=True))

    # ---- transport --------------------------------------------------------------------------------------------------

    def _session_for_loop(self) -> aiohttp.ClientSession:
        # A session is bound to the event loop it was made in; make it lazily, inside the caller's loop.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def _request(
        self, method: str, path: str, body: Mapping[str, Any] | None, timeout: float, *, accept_4xx: bool = False
    ) -> _Response:
        url = self.base_url + path
        client_timeout = aiohttp.ClientTimeout(total=timeout, connect=min(timeout, self.connect_timeout))
        try:
            async with self._session_for_loop().request(method, url, json=body, timeout=client_timeout) as resp:
                raw = await resp.read()
                status = resp.status
                is_json = resp.content_type == "application/json"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise EngineUnavailableError(
                f"engine {self.name} did not answer {method} {path} within {timeout:g}s: {exc!r}"
            ) from exc
        parsed = _parse_body(raw, is_json)
        if status >= 500:
            raise EngineUnavailableError(f"engine {self.name} answered {status} to {path}: {_short(parsed)}")
        # Weight endpoints answer a refusal as 400 + {"success": false, "message"}; a 404 means no such endpoint.
        if status >= 400 and not (accept_4xx and status != 404):
            raise EngineRequestError(f"engine {self.name} refused {path} with {status}: {_short(parsed)}", status)
        return _Response(status, parsed)


def _parse_body(raw: bytes, is_json: bool) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        if is_json:
            raise EngineError(f"engine sent malformed JSON: {raw[:200]!r}") from None
        return raw.decode("utf-8", "replace")


def _short(body: Any) -> str:
    text = body.get("message", body) if isinstance(body, Mapping) else body
    return str(text)[:500]


def _reply(response: _Response) -> EngineReply:
    body = response.body
    if isinstance(body, Mapping):
        success = bool(body.get("success", response.status == 200))
        message = str(body.get("message", ""))
    else:
        success = response.status == 200
        message = "" if body is None else str(body).strip()
    return EngineReply(success=success and response.status == 200, message=message)


def _lora_reply(response: _Response) -> EngineReply:
    """SGLang's LoRA routes answer ``{"success", "error_message", "loaded_adapters"}``."""
    body = response.body
    if isinstance(body, Mapping):
        message = str(body.get("error_message") or body.get("message") or "")
        return EngineReply(success=bool(body.get("success")) and response.status == 200, message=message)
    return _reply(response)


def _under_adapter(result: GenerateResult, label: str) -> GenerateResult:
    """Every token of a request that named an adapter came from that adapter's version (or the base's, version 0),
    whatever the engine's label was when it answered."""
    version = "0" if base_label(label) else label
    length = len(result.output_ids)
    spans = (VersionSpan(version, 0, length),) if length else ()
    return dataclasses.replace(result, weight_versions=spans)


_DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16",
                "fp16": "float16", "float32": "float32", "float": "float32", "fp32": "float32"}


def _dtype_name(value: Any) -> str | None:
    """An engine's dtype setting as the weight push names it; None for "auto" or anything unknown."""
    return _DTYPE_NAMES.get(str(value).removeprefix("torch.").lower()) if value is not None else None


def _first_int(raw: Mapping[str, Any], keys: Sequence[str]) -> int | None:
    for key in keys:
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _decode_logprobs(meta: Mapping[str, Any], output_ids: np.ndarray) -> np.ndarray:
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ValueError("output_token_logprobs is missing although return_logprob was set")
    if len(entries) != len(output_ids):
        raise ValueError(f"{len(entries)} output_token_logprobs for {len(output_ids)} output_ids")
    tokens = np.asarray([e[1] for e in entries], dtype=np.int64)
    if len(tokens) and not np.array_equal(tokens, output_ids):
        raise ValueError("the token ids in output_token_logprobs differ from output_ids")
    return np.asarray([e[0] for e in entries], dtype=np.float32)


def _decode_spans(meta: Mapping[str, Any], length: int) -> tuple[VersionSpan, ...]:
    raw = meta.get("weight_versions")
    if raw is None:
        # Engines without per-token versions: the whole output is attributed to the final version.
        version = str(meta.get("weight_version", ""))
        return (VersionSpan(version, 0, length),) if length else ()
    spans = tuple(VersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in raw)
    position = 0
    for span in spans:
        if span.start != position or span.end <= span.start:
            raise ValueError(f"weight_versions spans {raw} do not tile the output in order")
        position = span.end
    if position != length:
        raise ValueError(f"weight_versions spans cover {position} tokens but the output has {length}")
    return spans


def _decode_routed_experts(encoded: str, rows: int, shape: tuple[int, int] | None) -> np.ndarray:
    try:
        flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype="<i4")
    except binascii.Error as exc:
        raise ValueError(f"routed_experts is not valid base64: {exc}") from exc
    if shape is None:
        raise ValueError("routed_experts arrived but its (layers, topk) shape is unknown")
    layers, topk = shape
    if flat.size != rows * layers * topk:
        raise ValueError(
            f"routed_experts holds {flat.size} ids, expected {rows} rows x {layers} layers x {topk} topk "
            "(rows = prompt + output - 1 - routed_experts_start_len)"
        )
    return flat.astype(np.int32, copy=False).reshape(rows, layers, topk)


def adopt_engine_urls(urls: Sequence[str], *, version: int, fresh: bool, model_path: str | None) -> list[Adoption]:
    """``pipeline.sync.lifecycle.adopt_engines`` over the engines at ``net`` (the launcher runs it before any
    producer starts); logs what it did to each."""

    async def adopt() -> list[Adoption]:
        clients = [SGLangClient(url) for url in urls]
        try:
            return await adopt_engines(list(clients), version=version, fresh=fresh, model_path=model_path)
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    return asyncio.run(adopt())
