"""The ``/generate`` request and response, in SGLang 0.5.23's field names.

Only the fields sluice uses are modelled; other SGLang fields are accepted and reported as ignored (a warning in the
engine log), except the ones whose silent omission would change results (``stream``, ``min_p``), which are refused
with a 400 that says what to use instead.

Conventions this engine fixes, and that the client and trainer rely on:

- A batched request (``input_ids`` a list of lists) with ``n`` samples per prompt answers with a flat list of
  ``len(input_ids) * n`` results in prompt-major order: result ``i * n + j`` is sample ``j`` of prompt ``i``. A single
  prompt with ``n == 1`` answers with one object, otherwise a list.
- ``weight_versions`` spans cover the output tokens, ``end`` EXCLUSIVE: ``output_ids[start:end]`` were produced by
  ``version``. Spans are contiguous, non-empty, in order, and the last one ends at ``completion_tokens``.
- ``output_token_logprobs[i] = [logprob, output_ids[i], None]``. See ``sampling.py`` for the distribution.
- ``extra_key`` (and ``cache_salt``), one string or one per prompt, name the prefix-cache namespace a prompt may
  reuse and fill (``prefix_cache.py``); ``meta_info.cached_tokens`` counts the prompt positions reused.
- ``routed_experts`` is base64 of little-endian int32, C-order ``[P + R - 1 - start_len, num_moe_layers, topk]``:
  one row per token that went through the model (all prompt tokens, then every output token except the last).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import EngineError

# SGLang fields this engine accepts but has nothing to do for (they do not change tokens or logprobs).
_HARMLESS_FIELDS = frozenset(
    {"return_text_in_logprobs", "log_metrics", "top_logprobs_num", "custom_logit_processor", "lora_path", "modalities"}
)


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params``: how one prompt is sampled."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: int = Field(default=128, ge=1)
    """Most output tokens; the request finishes with reason ``length`` when it reaches them."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = Field(default=-1, ge=-1)
    """Keep only the k most likely tokens; -1 (or 0) keeps all."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Accepted for compatibility; only 0 is supported."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the sequence (the stop token is part of output_ids)."""
    stop: str | list[str] | None = None
    """Strings that end the sequence, as in SGLang: the tokens that spell one stay in output_ids (the model made
    them), the text is cut before it, and finish_reason is ``{"type": "stop", "matched": "<the string>"}``."""
    n: int = Field(default=1, ge=1, le=256)
    """Samples per prompt."""
    ignore_eos: bool = False
    """Keep generating after the eos token."""
    sampling_seed: int | None = Field(default=None, ge=0)
    """Seed for this request's sampling; sample j of n uses sampling_seed + j."""

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingParams:
        if any(not s for s in self.stop_strings()):
            raise ValueError("stop strings must not be empty")
        if self.min_p > 0.0:
            raise ValueError("min_p sampling is not supported by the CPU engine; use top_p or top_k")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (SGLang takes one string or a list)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def ignored_fields(self) -> list[str]:
        """Names of SGLang sampling fields this engine does not implement."""
        return sorted(self.model_extra or {})


class GenerateRequest(BaseModel):
    """SGLang's ``/generate`` body (``GenerateReqInput``), restricted to what the CPU engine implements."""

    model_config = ConfigDict(extra="allow")

    input_ids: list[int] | list[list[int]] | None = None
    """Prompt token ids, or a list of prompts."""
    text: str | list[str] | None = None
    """Prompt text (tokenized by the model's tokenizer), or a list of prompts; used when input_ids is absent."""
    sampling_params: SamplingParams | list[SamplingParams] = Field(default_factory=lambda: SamplingParams())
    """One set for every prompt, or one per prompt."""
    return_logprob: bool | list[bool] = False
    """Return output_token_logprobs."""
    logprob_start_len: int | list[int] = -1
    """-1: output logprobs only. k >= 0: also input_token_logprobs for prompt positions k.. (first one null)."""
    return_routed_experts: bool | list[bool] = False
    """Return meta_info.routed_experts (needs --enable-return-routed-experts)."""
    routed_experts_start_len: int | list[int] = 0
    """Skip this many leading rows of routed_experts."""
    rid: str | list[str] | None = None
    """Request id, echoed as meta_info.id."""
    extra_key: str | list[str] | None = None
    """Prefix-cache namespace, as SGLang's: cached prefixes are shared only between requests with the same key."""
    cache_salt: str | list[str] | None = None
    """A second part of the namespace (SGLang's ``cache_salt``); the pair must match for a prefix to be shared."""
    stream: bool = False
    """Streaming is not supported by the CPU engine."""

    @model_validator(mode="after")
    def _check_input(self) -> GenerateRequest:
        if self.stream:
            raise ValueError("stream=true is not supported by the CPU engine; send a plain request")
        if self.input_ids is None and self.text is None:
            raise ValueError("give input_ids (a list of token ids, or a list of lists) or text")
        return self

    def ignored_fields(self) -> list[str]:
        """Names of SGLang request fields this engine does not implement (harmless ones excluded)."""
        return sorted(set(self.model_extra or {}) - _HARMLESS_FIELDS)


@dataclass
class PromptSpec:
    """One prompt of a request with its per-prompt options resolved."""

    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    return_routed_experts: bool
    routed_experts_start_len: int
    rid: str
    namespace: tuple[str, str] = ("", "")
    """``(cache_salt, extra_key)``."""


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """SGLang lets each per-request option be a scalar (for every prompt) or a list with one value per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise EngineError(
                f"{name} has {len(value)} entries but the request has {count} prompts; give one per prompt"
            )
        return value
    return [value] * count


def split_prompts(req: GenerateRequest, prompts: list[list[int]], rid_default: str) -> list[PromptSpec]:
    """Resolve scalar-or-list options into one ``PromptSpec`` per prompt."""
    count = len(prompts)
    if isinstance(req.rid, list):
        rids = _per_prompt(req.rid, count, "rid")
    else:
        base = req.rid or rid_default
        rids = [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
    params = _per_prompt(req.sampling_params, count, "sampling_params")
    want_lp = _per_prompt(req.return_logprob, count, "return_logprob")
    lp_start = _per_prompt(req.logprob_start_len, count, "logprob_start_len")
    want_re = _per_prompt(req.return_routed_experts, count, "return_routed_experts")
    re_start = _per_prompt(req.routed_experts_start_len, count, "routed_experts_start_len")
    salts = _per_prompt(req.cache_salt or "", count, "cache_salt")
    keys = _per_prompt(req.extra_key or "", count, "extra_key")
    specs = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise EngineError(f"prompt {i} is empty; every prompt needs at least one token")
        specs.append(
            PromptSpec(
                ids, params[i], bool(want_lp[i]), int(lp_start[i]), bool(want_re[i]), int(re_start[i]), str(rids[i]),
                (str(salts[i] or ""), str(keys[i] or "")),
            )
        )
    return specs


@dataclass
class SequenceResult:
    """What the generator hands back for one finished sequence."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    token_versions: list[str]
    finish_reason: dict[str, Any]
    current_version: str
    routed_experts: np.ndarray | None = None
    input_logprobs: list[float | None] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0


def version_spans(token_versions: list[str]) -> list[dict[str, Any]]:
    """Run-length encode per-token versions into ``{"version", "start", "end"}`` spans (``end`` exclusive)."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(token_versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def encode_routed_experts(rows: np.ndarray) -> str:
    """base64 of the little-endian int32 bytes of ``rows`` in C order, as SGLang sends it."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")


def build_response(spec: PromptSpec, result: SequenceResult, text: str) -> dict[str, Any]:
    """The JSON object SGLang returns for one sequence."""
    meta: dict[str, Any] = {
        "id": spec.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": result.cached_tokens,
        "weight_version": result.current_version,
        "weight_versions": version_spans(result.token_versions),
        **result.timings,
    }
    if spec.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(result.output_logprobs, result.output_ids, strict=False)
        ]
        if result.input_logprobs is not None:
            start = spec.logprob_start_len
            meta["input_token_logprobs"] = [
                [lp, tok, None]
                for lp, tok in zip(result.input_logprobs[start:], result.prompt_ids[start:], strict=False)
            ]
    if spec.return_routed_experts and result.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(result.routed_experts[spec.routed_experts_start_len :])
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}
