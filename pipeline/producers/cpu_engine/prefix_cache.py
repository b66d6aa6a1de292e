"""The CPU engine's prefix cache, in namespaces, as SGLang's radix cache behaves where sluice can tell.

SGLang keys its radix cache by ``(extra_key, token prefix)`` (``cache_salt`` too): requests with different keys never
share cached KV, requests with the same key do, and a hit reuses the KV computed when the prefix was first seen,
under whatever weights were loaded then. A weight update does not touch the cache; only ``/flush_cache`` empties it,
and only on an idle engine. That is why a push that pauses requests in place leaves the old weights' prefixes behind,
and why sluice's client salts its requests with the weight version.

Here an entry is one whole prompt under one namespace: its KV (every layer, every position, computed under the
weights of that moment) and the routing rows of those positions. A new prompt hits the longest entry of its namespace
that is a prefix of it; the last prompt position is always computed (it samples the first token), so at most
``P - 1`` positions are reused, and fewer when the request wants input logprobs from an earlier position (as SGLang
limits its match to ``logprob_start_len``). Matching whole entries, not any common prefix, is a simplification of
the radix tree that changes nothing for the requests sluice sends: a prompt sent again, the ``n`` samples of one
prompt, a prompt that extends an earlier one. Finished outputs are not inserted (SGLang inserts them too; a
multi-turn follow-up therefore misses here where it would hit there).

The cache is bounded in bytes and evicts the least recently used entries. It is touched only by the scheduler
thread (lookups and inserts when sequences are admitted, flushes as control actions between forward passes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Namespace = tuple[str, str]
"""``(cache_salt, extra_key)`` of a request, ``("", "")`` when it gives neither."""
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class CacheEntry:
    """One cached prompt: per layer keys and values ``[heads, P, head_dim]``, and routing rows ``[P, layers,
    topk]`` int32 (None when the engine records no routing)."""

    namespace: Namespace
    tokens: tuple[int, ...]
    kv: LayerKV
    routing: torch.Tensor | None
    nbytes: int


@dataclass(frozen=True)
class CacheHit:
    """The first ``length`` positions of ``entry`` are reused."""

    entry: CacheEntry
    length: int


class PrefixCache:
    """Whole-prompt entries by namespace, least recently used evicted beyond ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[Namespace, tuple[int, ...]], CacheEntry] = OrderedDict()
        # Lengths of the entries of each namespace, with their counts: a lookup tries each length once, longest
        # first, instead of comparing the prompt with every entry.
        self._lengths: dict[Namespace, dict[int, int]] = {}
        self.nbytes = 0
        self.hits = 0
        """Lookups that reused something, since start."""
        self.cached_tokens = 0
        """Prompt positions reused, since start."""

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, namespace: Namespace, prompt: Sequence[int], limit: int) -> CacheHit | None:
        """The longest entry of ``namespace`` that is a prefix of ``prompt``, of which at most ``limit`` positions
        may be reused; None on a miss or when nothing may be reused."""
        if not self.enabled or limit <= 0:
            return None
        lengths = self._lengths.get(namespace)
        if not lengths:
            return None
        for length in sorted(lengths, reverse=True):
            if length > len(prompt):
                continue
            entry = self._entries.get((namespace, tuple(prompt[:length])))
            if entry is not None:
                self._entries.move_to_end((namespace, entry.tokens))
                used = min(length, limit)
                self.hits += 1
                self.cached_tokens += used
                return CacheHit(entry, used)
        return None

    def insert(self, namespace: Namespace, prompt: Sequence[int], kv: LayerKV, routing: torch.Tensor | None) -> None:
        """Keep ``prompt``'s KV and routing (tensors of this entry's own, not views of a batch). An entry already
        there is kept as it is, as a radix tree keeps the KV it has for a prefix: only its recency changes."""
        if not self.enabled:
            return
        key = (namespace, tuple(prompt))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if routing is not None:
            nbytes += routing.numel() * routing.element_size()
        if nbytes > self.capacity_bytes:
            return  # larger than the whole cache: it would evict everything else, then itself
        self._entries[key] = CacheEntry(namespace, key[1], kv, routing, nbytes)
        counts = self._lengths.setdefault(namespace, {})
        counts[len(prompt)] = counts.get(len(prompt), 0) + 1
        self.nbytes += nbytes
        while self.nbytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> int:
        """Drop every entry; how many there were."""
        count = len(self._entries)
        self._entries.clear()
        self._lengths.clear()
        self.nbytes = 0
        return count

    def _drop(self, key: tuple[Namespace, tuple[int, ...]]) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        counts = self._lengths[entry.namespace]
        counts[len(entry.tokens)] -= 1
        if not counts[len(entry.tokens)]:
            del counts[len(entry.tokens)]
        if not counts:
            del self._lengths[entry.namespace]


def flush_refused(waiting: int, running: int) -> str:
    """Why ``/flush_cache`` did nothing, in SGLang's words: an engine flushes only when fully idle."""
    return f"Cache not flushed because there are pending requests. #queue-req: {waiting}, #running-req: {running}"


@dataclass
class CachedPrefill:
    """The inputs of one forward pass over prompts whose first positions come from the cache.

    Row ``r`` holds its reused positions at the right end of the past block (``width - new_width`` columns), then
    its positions still to compute at the right end of the new block; padding on the left of each block is masked.
    The mask and routing cover both blocks, so the batch merges these rows as it merges any."""

    ids: torch.Tensor
    """``[rows, new_width]`` tokens to compute."""
    mask: torch.Tensor
    """``[rows, past_width + new_width]``."""
    pos: torch.Tensor
    """``[rows, new_width]`` position ids of the tokens to compute."""
    past: LayerKV
    """Per layer ``[rows, heads, past_width, head_dim]``."""
    past_routing: torch.Tensor | None
    """``[rows, past_width, layers, topk]`` int32: the reused positions' routing rows."""


def stack_hits(hits: Sequence[CacheHit], prompts: Sequence[Sequence[int]], pad_id: int) -> CachedPrefill:
    """Lay out ``prompts``, each with its cache hit, for one forward that computes only what was not cached."""
    reused = [h.length for h in hits]
    fresh = [len(p) - m for p, m in zip(prompts, reused, strict=True)]
    past_width, new_width = max(reused), max(fresh)
    rows = len(prompts)
    ids = torch.full((rows, new_width), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, past_width + new_width, dtype=torch.long)
    first = hits[0].entry
    past = [
        (k.new_zeros((rows, k.shape[0], past_width, k.shape[2])), v.new_zeros((rows, v.shape[0], past_width,
                                                                                 v.shape[2])))
        for k, v in first.kv
    ]
    past_routing = None
    if first.routing is not None:
        past_routing = torch.zeros((rows, past_width, *first.routing.shape[1:]), dtype=torch.int32)
    for r, (hit, prompt, m, n) in enumerate(zip(hits, prompts, reused, fresh, strict=True)):
        for (pk, pv), (k, v) in zip(past, hit.entry.kv, strict=True):
            pk[r, :, past_width - m :] = k[:, :m]
            pv[r, :, past_width - m :] = v[:, :m]
        if past_routing is not None and hit.entry.routing is not None:
            past_routing[r, past_width - m :] = hit.entry.routing[:m]
        ids[r, new_width - n :] = torch.tensor(list(prompt[m:]), dtype=torch.long)
        mask[r, past_width - m : past_width] = 1
        mask[r, past_width + new_width - n :] = 1
    # Position ids count real tokens only, so a reused prefix and the padding between the blocks change nothing.
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, past_width:]
    return CachedPrefill(ids, mask, pos, past, past_routing)


def row_kv(kv: LayerKV, row: int, columns: torch.Tensor) -> LayerKV:
    """Row ``row``'s keys and values at ``columns`` (its real positions), copied out of the batch's tensors so that
    a cache entry does not keep a whole batch alive."""
    return [(k[row][:, columns].clone(), v[row][:, columns].clone()) for k, v in kv]
