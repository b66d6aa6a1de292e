"""Next-token selection and the logprob that goes back to the trainer.

Which distribution the logprob comes from (the trainer must recompute exactly this):

- ``temperature == 0`` (greedy): ``log_softmax(logits)[token]``, the model's own distribution.
- ``temperature > 0``, mode ``"temperature"`` (default, as SGLang 0.5.23 without SGLANG_RETURN_ORIGINAL_LOGPROB):
  ``log_softmax(logits / temperature)[token]`` over the FULL vocabulary, i.e. after temperature scaling but before
  top-k / top-p truncation and renormalisation (SGLang also takes it from the un-truncated probabilities).
- mode ``"original"`` (SGLANG_RETURN_ORIGINAL_LOGPROB=1): ``log_softmax(logits)[token]`` whatever the temperature.

Logits are float32 here even when the model runs in bfloat16, so the recomputation should also upcast before the
softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LogprobMode = Literal["temperature", "original"]


@dataclass(frozen=True)
class SamplingSettings:
    """Resolved sampling options of one sequence."""

    temperature: float
    top_p: float
    top_k: int

    @property
    def greedy(self) -> bool:
        """Temperature 0 and top-k 1 both reduce to argmax."""
        return self.temperature == 0.0 or self.top_k == 1


def _truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero out tokens outside top-k and the top-p nucleus; the result is unnormalised (multinomial does not care)."""
    if 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        # A token stays if the mass of strictly more likely tokens is still below top_p; the most likely always stays.
        keep_sorted = mass_before < top_p * sorted_probs.sum()
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs


def select_token(
    logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None, mode: LogprobMode
) -> tuple[int, float]:
    """Pick the next token from one row of float32 logits ``[vocab]``; return it with its logprob (see module doc)."""
    if settings.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    scaled_logprobs = torch.log_softmax(logits / settings.temperature, dim=-1)
    probs = _truncate(scaled_logprobs.exp(), settings.top_k, settings.top_p)
    token = int(torch.multinomial(probs, 1, generator=generator))
    if mode == "original":
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    return token, float(scaled_logprobs[token])


def select_tokens(
    logits: torch.Tensor, settings: list[SamplingSettings], generators: list[torch.Generator | None],
    mode: LogprobMode,
) -> list[tuple[int, float]]:
    """``select_token`` for every row of ``logits`` ``[n, vocab]``, in one pass where the rows allow it.

    Rows without a seed of their own and with plain temperature sampling (no top-k / top-p) share one softmax and one
    multinomial draw per temperature: the same distribution as row by row, at a fraction of the per-row overhead that
    otherwise dominates a decode step of a small model. Seeded rows keep their own generator, so a seeded request
    repeats itself whatever it is batched with.
    """
    out: list[tuple[int, float] | None] = [None] * len(settings)
    plain: dict[float, list[int]] = {}
    for i, (st, gen) in enumerate(zip(settings, generators, strict=True)):
        if gen is None and not st.greedy and st.top_k <= 0 and st.top_p >= 1.0:
            plain.setdefault(st.temperature, []).append(i)
        else:
            out[i] = select_token(logits[i], st, gen, mode)
    for temperature, rows in plain.items():
        index = torch.tensor(rows, dtype=torch.long)
        scaled = torch.log_softmax(logits[index] / temperature, dim=-1)
        tokens = torch.multinomial(scaled.exp(), 1).squeeze(-1)
        source = scaled if mode == "temperature" else torch.log_softmax(logits[index], dim=-1)
        chosen = source.gather(-1, tokens[:, None]).squeeze(-1)
        for row, token, logprob in zip(rows, tokens.tolist(), chosen.tolist(), strict=True):
            out[row] = (int(token), float(logprob))
    return out  # type: ignore[return-value]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, mode: LogprobMode) -> torch.Tensor:
    """Logprobs of ``targets`` under ``logits`` ``[n, vocab]`` by the rule of ``select_token`` (for prompt tokens)."""
    scale = temperature if (mode == "temperature" and temperature > 0.0) else 1.0
    logprobs = torch.log_softmax(logits.float() / scale, dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
