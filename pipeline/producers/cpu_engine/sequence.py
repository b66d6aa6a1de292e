"""One sample as the CPU engine generates it: its options, and what it has produced so far (``generator.py`` runs
the batch it is part of)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.producers.cpu_engine.prefix_cache import Namespace
from pipeline.producers.cpu_engine.sampling import SamplingSettings


@dataclass(frozen=True)
class StopStrings:
    """A sequence's stop strings and the detokenizer that looks for them, the way SGLang does: after each token, the
    decoded tail of the output (as many tokens as the longest string has characters, plus one) is searched."""

    strings: tuple[str, ...]
    decode: Callable[[list[int]], str]

    def matched(self, output_ids: list[int]) -> str | None:
        """The stop string the output now contains, or None."""
        longest = max(len(s) for s in self.strings)
        tail = self.decode(output_ids[-(longest + 1) :])
        return next((s for s in self.strings if s in tail), None)


@dataclass(eq=False)
class Sequence:
    """One sample being generated: its options, and the tokens, logprobs, versions and routing produced so far."""

    prompt_ids: list[int]
    max_new_tokens: int
    settings: SamplingSettings
    stop_ids: frozenset[int]
    ignore_eos: bool
    generator: torch.Generator | None
    input_logprob_start: int = -1
    rid: str = ""
    stop_strings: StopStrings | None = None
    namespace: Namespace = ("", "")
    """The request's ``(cache_salt, extra_key)``: only entries of the prefix cache made under it are reused."""
    shares_prefill: bool = False
    """One of the ``n > 1`` samples of one prompt, which SGLang prefills once, caches, and then serves from that
    cache: the samples report the prompt as cached (this engine shares the prefill row, to the same effect)."""
    cached_tokens: int = 0
    """Prompt positions whose KV came from the prefix cache (``meta_info.cached_tokens``)."""
    on_finish: Callable[[Sequence], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    token_versions: list[str] = field(default_factory=list)
    routing: torch.Tensor | None = None
    """``[P + R - 1, layers, topk]`` int32, set when the sequence leaves the batch (the batch holds it until then)."""
    input_logprobs: list[float | None] | None = None
    finish_reason: dict[str, Any] | None = None
    abort_requested: bool = False
    notified: bool = False
    created_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    @property
    def finished(self) -> bool:
        """Whether the sequence has a finish reason."""
        return self.finish_reason is not None

    def routed_experts(self) -> torch.Tensor | None:
        """All recorded routing rows ``[P + R - 1, layers, topk]``, or None when routing was not recorded."""
        return self.routing
