"""Batched generation over one shared, left-padded KV cache.

All running sequences form one batch. Each scheduler iteration does at most one prefill forward of the sequences
that join (padded together), a second one for those of them whose prompts begin with a prefix in the prefix cache
(``prefix_cache.py``: only the positions not cached are computed, over the cached keys and values, with padding
between the two where prompts differ), and one decode forward (one token for every running sequence). Prompts not
cached are prefilled exactly as without a cache, and their KV is then kept in it. Joining sequences are merged into
the running batch by left-padding whichever cache is shorter; finished ones are removed, and columns that have become
padding for every row are trimmed. Padding never reaches a real token: the attention mask hides it, and position ids
count real tokens only, so a sequence's numbers do not depend on what it is batched with (up to float rounding of
differently shaped matmuls).

Routing (the experts each fed token was sent to) costs no tensor op per decode step: the recorder keeps the routers'
outputs, and they are moved into a ``RoutingBuffer`` shaped like the cache only when rows change (or every
``ROUTING_FLUSH_STEPS`` steps); a sequence gets its rows when it leaves the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from pipeline.producers.cpu_engine.prefix_cache import CacheHit, PrefixCache, row_kv, stack_hits
from pipeline.producers.cpu_engine.routing import RoutingBuffer, RoutingRecorder
from pipeline.producers.cpu_engine.sampling import LogprobMode, select_tokens, token_logprobs
from pipeline.producers.cpu_engine.sequence import Sequence, StopStrings

__all__ = ["KV", "BatchGenerator", "Sequence", "StopStrings"]  # the sequence types are imported from here too

KV = list[tuple[torch.Tensor, torch.Tensor]]

# Decode steps whose routing the recorder may hold before it is moved into the batch's buffer in one copy. Any row
# change (a sequence finishing or joining) moves it sooner; this only bounds what is held between.
ROUTING_FLUSH_STEPS = 64


@dataclass
class _Forward:
    """What one forward pass gives back."""

    logits: torch.Tensor  # [batch, kept positions, vocab] float32
    kv: KV
    routing: torch.Tensor | None  # [batch, seq, layers, topk] int32; None when left with the recorder


class BatchGenerator:
    """Runs prefill and decode steps for a changing set of sequences; not thread-safe (the scheduler owns it)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_ids: frozenset[int],
        pad_id: int,
        logprob_mode: LogprobMode,
        record_routing: bool,
        max_context_len: int,
        version: str,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.model = model
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.logprob_mode = logprob_mode
        self.max_context_len = max_context_len
        self.version = version
        self.recorder = RoutingRecorder(model) if record_routing else None
        if self.recorder is not None and self.recorder.num_layers == 0:
            self.recorder.close()  # a dense model has nothing to record
            self.recorder = None
        if self.recorder is not None:
            self.recorder.active = False  # on only around this generator's own forward passes
        self.rows: list[Sequence] = []
        self._kv: KV = []
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._pos = torch.zeros(0, dtype=torch.long)
        self._next = torch.zeros(0, dtype=torch.long)
        self._routing: RoutingBuffer | None = None
        self.tokens_generated = 0
        self.forward_passes = 0

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens held in the KV cache."""
        return int(self._mask.sum()) if self.rows else 0

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        kv: KV,
        keep_all: bool,
        take_routing: bool,
    ) -> _Forward:
        """One forward pass. With ``take_routing`` its routing comes back in ``_Forward.routing`` (the recorder
        must hold nothing else); without, the recorder keeps it for ``_flush_routing``."""
        cache = DynamicCache(ddp_cache_data=kv) if kv else DynamicCache(config=self.model.config)
        self.forward_passes += 1
        recorder = self.recorder
        kept = recorder.pending if recorder is not None else 0
        routing = None
        try:
            if recorder is not None:
                recorder.active = True
            # Routing is read inside inference mode too: ops on its inference tensors cost more outside it.
            with torch.inference_mode():
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=0 if keep_all else 1,
                )
                if recorder is not None and take_routing:
                    routing = recorder.take(ids.shape[0], ids.shape[1])
        except BaseException:
            if recorder is not None:
                recorder.forget(kept)  # a pass that failed part way must not leave some layers' ids behind
            raise
        finally:
            if recorder is not None:
                recorder.active = False
        new_kv = [_layer_kv(layer) for layer in cache.layers]
        return _Forward(out.logits.float(), new_kv, routing)

    def _finish_reason(self, seq: Sequence, token: int) -> dict[str, Any] | None:
        if token in seq.stop_ids or (not seq.ignore_eos and token in self.eos_ids):
            return {"type": "stop", "matched": token}
        if seq.stop_strings is not None and (matched := seq.stop_strings.matched(seq.output_ids)) is not None:
            return {"type": "stop", "matched": matched}
        if len(seq.output_ids) >= seq.max_new_tokens:
            return {"type": "length", "length": len(seq.output_ids)}
        if len(seq.prompt_ids) + len(seq.output_ids) >= self.max_context_len:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def _emit_all(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Sample one token for each of ``seqs`` from its row of float32 logits ``[len(seqs), vocab]``."""
        picks = select_tokens(logits, [s.settings for s in seqs], [s.generator for s in seqs], self.logprob_mode)
        return [self._record(seq, token, logprob) for seq, (token, logprob) in zip(seqs, picks, strict=True)]

    def _record(self, seq: Sequence, token: int, logprob: float) -> int:
        """Append one sampled token to ``seq`` under the current version."""
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        seq.token_versions.append(self.version)
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        self.tokens_generated += 1
        seq.finish_reason = self._finish_reason(seq, token)
        return token

    def _input_logprobs(self, seq: Sequence, logits: torch.Tensor, first: int = 0) -> list[float | None]:
        """Logprobs of prompt tokens ``first + 1``.. from the prefill logits of this row's positions ``first``.. (token
        0 has none; the ``first`` positions before came from the prefix cache and have none either)."""
        prompt = torch.tensor(seq.prompt_ids[first + 1 :], dtype=torch.long)
        values = token_logprobs(logits[:-1], prompt, seq.settings.temperature, self.logprob_mode)
        return [None] * (first + 1) + values.tolist()

    def _reusable(self, seq: Sequence) -> int:
        """How many prompt positions may come from the cache: never the last (it samples the first token), and none
        from which input logprobs are wanted (their logits must be computed)."""
        limit = len(seq.prompt_ids) - 1
        if seq.input_logprob_start >= 0:
            limit = min(limit, seq.input_logprob_start - 1)
        return max(limit, 0)

    def admit(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill ``seqs``, sample their first token and add the unfinished ones to the batch; returns the sequences
        that finished on their first token. Those whose prompt begins with a cached prefix of their namespace are
        prefilled apart, from the cache; the others as without a cache, and then cached."""
        self._flush_routing()  # the prefill's routing is taken alone, and the merge needs the buffer up to date
        cache = self.prefix_cache
        hits = [None if cache is None else cache.lookup(s.namespace, s.prompt_ids, self._reusable(s)) for s in seqs]
        fresh = [s for s, h in zip(seqs, hits, strict=True) if h is None]
        finished = self._prefill(fresh) if fresh else []
        cached = [(s, h) for s, h in zip(seqs, hits, strict=True) if h is not None]
        if cached:
            finished += self._prefill_cached([s for s, _ in cached], [h for _, h in cached])  # type: ignore[misc]
        return finished

    def _prefill(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill ``seqs`` in one forward from their first token.

        Sequences with the same prompt (the ``n`` samples of one request, a GRPO group) share one prefill row: the
        forward sees each distinct prompt once, and its logits, cache and routing rows are copied to every sequence
        of that prompt, exactly as if each had been prefilled alone.
        """
        rows: dict[tuple[int, ...], int] = {}
        source = [rows.setdefault(tuple(s.prompt_ids), len(rows)) for s in seqs]
        prompts = list(rows)
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - lengths[i] :] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - lengths[i] :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        keep_all = any(s.input_logprob_start >= 0 for s in seqs)
        fwd = self._forward(ids, mask, pos, [], keep_all, take_routing=True)
        expand = torch.tensor(source, dtype=torch.long)
        logits = fwd.logits[expand]
        routing = None if fwd.routing is None else fwd.routing[expand]
        next_tokens = self._emit_all(seqs, logits[:, -1])
        for i, seq in enumerate(seqs):
            offset = width - lengths[source[i]]
            if seq.shares_prefill:
                seq.cached_tokens = self._reusable(seq)
            if seq.input_logprob_start >= 0:
                seq.input_logprobs = self._input_logprobs(seq, logits[i, offset:])
            if seq.finished and routing is not None:
                seq.routing = routing[i, offset:].clone()  # the others' rows travel in the batch's buffer
        if self.prefix_cache is not None:
            for row, prompt in enumerate(prompts):
                columns = torch.arange(width - lengths[row], width)
                kv = row_kv(fwd.kv, row, columns)
                rows_routing = None if fwd.routing is None else fwd.routing[row, columns].clone()
                for namespace in {s.namespace for s, r in zip(seqs, source, strict=True) if r == row}:
                    self.prefix_cache.insert(namespace, prompt, kv, rows_routing)
        alive = [i for i, s in enumerate(seqs) if not s.finished]
        if alive:
            index = torch.tensor(alive, dtype=torch.long)
            row = expand[index]
            kv = [(k[row], v[row]) for k, v in fwd.kv]
            self._merge(
                [seqs[i] for i in alive],
                kv,
                mask[row],
                torch.tensor([lengths[source[i]] for i in alive]),
                torch.tensor([next_tokens[i] for i in alive]),
                None if routing is None else routing[index],
            )
        return [s for s in seqs if s.finished]

    def _prefill_cached(self, seqs: list[Sequence], hits: list[CacheHit]) -> list[Sequence]:
        """Prefill ``seqs`` in one forward over their cached prefixes: only the positions after each hit are
        computed, attending to the cached keys and values (computed under whichever weights were loaded when they
        were cached). Sequences with the same prompt and the same hit share a row, as in ``_prefill``."""
        assert self.prefix_cache is not None
        rows: dict[tuple[int, int, tuple[int, ...]], int] = {}
        source = [rows.setdefault((id(h.entry), h.length, tuple(s.prompt_ids)), len(rows))
                  for s, h in zip(seqs, hits, strict=True)]
        first_of_row = {r: i for i, r in reversed(list(enumerate(source)))}
        row_hits = [hits[first_of_row[r]] for r in range(len(rows))]
        prompts = [seqs[first_of_row[r]].prompt_ids for r in range(len(rows))]
        layout = stack_hits(row_hits, prompts, self.pad_id)
        new_width = layout.ids.shape[1]
        keep_all = any(s.input_logprob_start >= 0 for s in seqs)
        fwd = self._forward(layout.ids, layout.mask, layout.pos, layout.past, keep_all, take_routing=True)
        expand = torch.tensor(source, dtype=torch.long)
        logits = fwd.logits[expand]
        full_routing = None  # [rows, past + new, layers, topk], aligned with the mask
        if fwd.routing is not None and layout.past_routing is not None:
            full_routing = torch.cat([layout.past_routing, fwd.routing.to(torch.int32)], dim=1)
        routing = None if full_routing is None else full_routing[expand]
        next_tokens = self._emit_all(seqs, logits[:, -1])
        real = layout.mask.bool()
        for i, (seq, hit) in enumerate(zip(seqs, hits, strict=True)):
            seq.cached_tokens = hit.length
            if seq.input_logprob_start >= 0:
                computed = len(seq.prompt_ids) - hit.length
                seq.input_logprobs = self._input_logprobs(seq, logits[i, new_width - computed :], hit.length)
            if seq.finished and routing is not None:
                seq.routing = routing[i][real[source[i]]].clone()
        for row, (hit, prompt) in enumerate(zip(row_hits, prompts, strict=True)):
            if hit.entry.tokens != tuple(prompt):  # a longer prompt over a cached one: cached too, old KV and all
                columns = real[row].nonzero().squeeze(-1)
                rows_routing = None if full_routing is None else full_routing[row, columns].clone()
                self.prefix_cache.insert(hit.entry.namespace, prompt, row_kv(fwd.kv, row, columns), rows_routing)
        alive = [i for i, s in enumerate(seqs) if not s.finished]
        if alive:
            index = torch.tensor(alive, dtype=torch.long)
            row = expand[index]
            self._merge(
                [seqs[i] for i in alive],
                [(k[row], v[row]) for k, v in fwd.kv],
                layout.mask[row],
                torch.tensor([len(seqs[i].prompt_ids) for i in alive]),
                torch.tensor([next_tokens[i] for i in alive]),
                None if routing is None else routing[index],
            )
        return [s for s in seqs if s.finished]

    def _merge(
        self,
        seqs: list[Sequence],
        kv: KV,
        mask: torch.Tensor,
        pos: torch.Tensor,
        nxt: torch.Tensor,
        routing: torch.Tensor | None,
    ) -> None:
        if not self.rows:
            self.rows, self._kv, self._mask, self._pos, self._next = list(seqs), kv, mask, pos, nxt
            self._routing = None if routing is None else RoutingBuffer(routing)
            self._trim()
            return
        width = max(self._mask.shape[1], mask.shape[1])
        old_pad, new_pad = width - self._mask.shape[1], width - mask.shape[1]
        self._kv = [
            (torch.cat([_pad_left(ko, old_pad), _pad_left(kn, new_pad)]),
             torch.cat([_pad_left(vo, old_pad), _pad_left(vn, new_pad)]))
            for (ko, vo), (kn, vn) in zip(self._kv, kv, strict=True)
        ]  # fmt: skip
        self._mask = torch.cat([F.pad(self._mask, (old_pad, 0)), F.pad(mask, (new_pad, 0))])
        if self._routing is not None and routing is not None:
            self._routing = self._routing.merged(routing, old_pad, new_pad)
        self._pos = torch.cat([self._pos, pos])
        self._next = torch.cat([self._next, nxt])
        self.rows.extend(seqs)
        self._trim()

    def _trim(self) -> None:
        """Drop leading cache columns that are padding in every row (left after the longest sequence finished)."""
        if not self.rows:
            return
        first = int(self._mask.any(dim=0).to(torch.int8).argmax())
        if first > 0:
            self._mask = self._mask[:, first:]
            self._kv = [(k[:, :, first:], v[:, :, first:]) for k, v in self._kv]
            if self._routing is not None:
                self._routing.trim(first)

    def _evict(self) -> list[Sequence]:
        """Remove finished rows from the batch and return them."""
        done = [s for s in self.rows if s.finished]
        if not done:
            return []
        self._flush_routing()
        self._hand_over_routing([i for i, s in enumerate(self.rows) if s.finished])
        keep = [i for i, s in enumerate(self.rows) if not s.finished]
        index = torch.tensor(keep, dtype=torch.long)
        self.rows = [self.rows[i] for i in keep]
        self._kv = [(k[index], v[index]) for k, v in self._kv]
        self._mask, self._pos, self._next = self._mask[index], self._pos[index], self._next[index]
        if self._routing is not None:
            self._routing.keep_rows(index)
        self._trim()
        return done

    def _flush_routing(self) -> None:
        """Move the routing of the decode steps run since the last flush into the batch's buffer; needed before
        rows change or are read."""
        if self.recorder is None or not self.recorder.pending:
            return
        if self._routing is None:
            raise RuntimeError("decode steps recorded routing but the batch has no routing buffer")
        self._routing.extend(self.recorder.take_steps(self._routing.rows))

    def _routing_matches_mask(self) -> bool:
        """Whether the buffer plus the steps the recorder holds cover exactly the mask's rows and columns."""
        if self.recorder is None or self._routing is None:
            return False
        steps, partial = divmod(self.recorder.pending, self.recorder.num_layers)
        return not partial and (self._routing.rows, self._routing.width + steps) == tuple(self._mask.shape)

    def _hand_over_routing(self, rows: list[int]) -> None:
        """Give the sequences at batch ``rows`` their routing rows, cut from the batch's buffer."""
        if self._routing is None:
            return
        for i in rows:
            self.rows[i].routing = self._routing.rows_of(i, self._mask[i])

    def abort(self, predicate: Callable[[Sequence], bool], message: str) -> list[Sequence]:
        """Finish every running sequence that matches ``predicate`` with reason ``abort``; return them."""
        for seq in self.rows:
            if not seq.finished and predicate(seq):
                seq.finish_reason = {"type": "abort", "message": message}
        return self._evict()

    def reset(self) -> list[Sequence]:
        """Drop the whole batch (after a failed step left it in an unknown state); return the unfinished sequences."""
        dropped = [s for s in self.rows if not s.finished]
        if self._routing_matches_mask() and len(self.rows) == self._mask.shape[0]:
            # Only when the failed step left the routing in step with the mask; otherwise these rows are unknown.
            self._flush_routing()
            self._hand_over_routing([i for i, s in enumerate(self.rows) if not s.finished])
        if self.recorder is not None:
            self.recorder.forget()
        self.rows = []
        self._routing = None
        self._kv = []
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._pos = torch.zeros(0, dtype=torch.long)
        self._next = torch.zeros(0, dtype=torch.long)
        return dropped

    def step(self) -> list[Sequence]:
        """Decode one token for every running sequence in one forward; return the sequences that finished."""
        finished = self.abort(lambda s: s.abort_requested, "the client went away or the request was aborted")
        if not self.rows:
            return finished
        mask = torch.cat([self._mask, torch.ones(len(self.rows), 1, dtype=torch.long)], dim=1)
        fwd = self._forward(self._next[:, None], mask, self._pos[:, None], self._kv, keep_all=False, take_routing=False)
        self._kv, self._mask = fwd.kv, mask
        if self.recorder is not None and self.recorder.pending >= ROUTING_FLUSH_STEPS * self.recorder.num_layers:
            self._flush_routing()
        self._pos = self._pos + 1
        self._next = torch.tensor(self._emit_all(self.rows, fwd.logits[:, -1]), dtype=torch.long)
        return finished + self._evict()


def _layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one cache layer; only full-attention dynamic layers are expected (no sliding window)."""
    if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
        raise TypeError(
            f"unexpected KV cache layer {type(layer).__name__}; the CPU engine supports full attention only"
        )
    return layer.keys, layer.values


def _pad_left(cache: torch.Tensor, columns: int) -> torch.Tensor:
    """Left-pad the sequence axis of a ``[batch, heads, seq, head_dim]`` cache tensor with ``columns`` zeros."""
    return F.pad(cache, (0, 0, columns, 0)) if columns else cache
