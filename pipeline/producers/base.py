"""The boundary between producers and rollout engines: what a generation returns and what an engine client offers.

``SGLangClient`` (one engine, ``pipeline.producers.sglang_client``) and ``EnginePool`` (several, least-loaded first,
``pipeline.producers.engine_pool``) both satisfy ``EngineClient``; the producer loop depends only on this protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` were produced by weights of ``version``."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class GenerateResult:
    """One generated sequence, decoded from SGLang's ``/generate`` answer and checked for consistency."""

    output_ids: np.ndarray
    """int32[R], the generated tokens (a stop token is included)."""
    text: str
    """Detokenized output."""
    output_logprobs: np.ndarray | None
    """float32[R], the log-probability of each output token under the engine's sampling distribution."""
    finish_reason: str
    """``length``, ``stop`` or ``abort``."""
    finish_detail: Mapping[str, Any]
    """SGLang's whole ``finish_reason`` object (it may name the matched stop token)."""
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    """The engine's version when the request finished."""
    weight_versions: tuple[VersionSpan, ...]
    """Contiguous spans covering every output token."""
    routed_experts: np.ndarray | None
    """int32[P + R - 1 - start_len, layers, topk]: the experts each token that went through the model was routed to."""
    rid: str | None
    engine: str
    """Base URL of the engine that produced it."""

    def token_versions(self) -> list[str]:
        """The version of every output token, expanded from the spans."""
        versions: list[str] = []
        for span in self.weight_versions:
            versions.extend([span.version] * (span.end - span.start))
        return versions


@runtime_checkable
class EngineClient(Protocol):
    """What a producer needs from an engine, or from a pool of them."""

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
        """One sequence for one prompt."""
        ...

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
        """``n`` sequences for each prompt, prompt-major (result ``i * n + j`` is sample ``j`` of prompt ``i``)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
