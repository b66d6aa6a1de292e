"""Capture of the experts the router picked for every token, during generation (for R3 router replay).

A wrapper around each MoE block's router keeps the ``[tokens, topk]`` expert ids of the forward passes that ran.
Which modules are the routers, and where their output holds the ids, is the model family's knowledge
(``pipeline.models.families``: Qwen3-MoE's and DeepSeek-V3's ``mlp.gate`` return ``(logits, weights, indices)``).
The generator moves decode steps' ids into its ``RoutingBuffer`` many steps at a time; that buffer is laid out like
the KV cache, and each sequence's rows, without padding, are cut out of it once, when the sequence leaves the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.models.families import ModelFamily, family_for_hf


def _family(model: nn.Module) -> ModelFamily:
    return family_for_hf(getattr(getattr(model, "config", None), "model_type", None))


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router module of every MoE layer, in layer order (empty for a dense model)."""
    return _family(model).routers(model)


class RoutingRecorder:
    """Keeps the top-k expert ids of every MoE layer from the forward passes since they were last taken.

    Each router's ``forward`` is wrapped on the instance rather than given a forward hook: a hook sends every call
    through ``nn.Module``'s slow path, about 4 us per router, which was over 1% of a decode step of the tiny model.
    The wrapper only keeps a reference; copying happens in ``take`` or ``take_steps``, once for many layers and steps,
    because each small tensor op costs several microseconds however little it moves.
    """

    def __init__(self, model: nn.Module) -> None:
        self._routers = moe_routers(model)
        self._index = _family(model).router_indices
        # In call order: layer by layer, forward after forward. Emptied in place, never rebound: the wrappers hold it.
        self._captured: list[torch.Tensor] = []
        self.active = True
        """Whether router outputs are kept now. The generator turns it on only around its own forward passes, so
        that other forwards of the same model (a test's reference pass) leave nothing behind."""
        # A router's own instance-level forward (another wrapper) if it had one, to put back on close.
        self._previous: list[Any] = [router.__dict__.get("forward") for router in self._routers]
        for router in self._routers:
            router.forward = self._wrap(router)
        self._closed = False

    @property
    def num_layers(self) -> int:
        """Number of MoE layers."""
        return len(self._routers)

    @property
    def pending(self) -> int:
        """Router outputs kept and not yet taken (one per MoE layer per forward)."""
        return len(self._captured)

    def _wrap(self, router: nn.Module) -> Callable[..., Any]:
        original = router.forward
        captured = self._captured
        index = self._index

        def forward(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            # A router that returns only logits leaves the engine unable to know the tie-breaking the block used,
            # so it is refused rather than re-derived.
            if not isinstance(output, tuple) or len(output) <= index:
                raise TypeError(f"router {type(router).__name__} does not return expert indices; cannot record routing")
            if self.active:
                captured.append(output[index])
            return output

        return forward

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """Expert ids of the one forward kept as ``[batch, seq, layers, topk]`` int32, and forget them."""
        if len(self._captured) != self.num_layers:
            raise RuntimeError(
                f"expected the routing of one forward pass ({self.num_layers} MoE layers), have {len(self._captured)} "
                "router outputs; was exactly one forward run with this recorder attached since the last take?"
            )
        # The router flattens hidden states batch-major, so [tokens, topk] is [batch, seq, topk] (a view).
        stacked = torch.stack([t.reshape(batch, seq, -1) for t in self._captured], dim=2)
        self._captured.clear()
        return stacked.to(torch.int32)

    def take_steps(self, batch: int) -> torch.Tensor:
        """Expert ids of every one-token forward kept, over the same ``batch`` rows, as ``[batch, steps, layers,
        topk]`` in the router's dtype (a view), and forget them."""
        layers = self.num_layers
        steps, partial = divmod(len(self._captured), layers)
        if partial:
            raise RuntimeError(
                f"{len(self._captured)} router outputs kept: not a whole number of {layers}-layer passes"
            )
        stacked = torch.stack(self._captured).view(steps, layers, batch, -1)
        self._captured.clear()
        return stacked.permute(2, 0, 1, 3)

    def forget(self, keep: int = 0) -> None:
        """Drop the outputs kept after the first ``keep`` (those of a forward pass that failed part way)."""
        del self._captured[keep:]

    def close(self) -> None:
        """Give the routers their own ``forward`` back (once; later calls do nothing)."""
        if self._closed:
            return
        for router, previous in zip(self._routers, self._previous, strict=True):
            if previous is None:
                del router.forward
            else:
                router.forward = previous
        self._closed = True


class RoutingBuffer:
    """Expert ids of every cached position of the running batch, ``[batch, columns, layers, topk]`` int32.

    Columns line up with the generator's attention mask, padding included, so merging, trimming and evicting rows
    are the same operations as on the KV cache, and a sequence's routing is its row at the mask's real columns.
    Decode steps arrive many columns at a time (``extend``) into spare room that grows by doubling. Slicing and
    cloning a row per sequence per step, as the engine once did, cost about 5% of decode time on a tiny model.
    """

    def __init__(self, ids: torch.Tensor) -> None:
        self._data = _with_room(ids, 0)
        self.width = ids.shape[1]
        """Columns in use; the rest of ``_data`` is room for later decode steps."""

    @property
    def rows(self) -> int:
        """Rows (sequences) held."""
        return self._data.shape[0]

    @property
    def live(self) -> torch.Tensor:
        """The columns in use, ``[batch, width, layers, topk]`` (a view)."""
        return self._data[:, : self.width]

    def extend(self, columns: torch.Tensor) -> None:
        """Append ``columns``, ``[batch, steps, layers, topk]`` of any integer dtype, after the columns in use."""
        steps = columns.shape[1]
        if self.width + steps > self._data.shape[1]:
            self._data = _with_room(self.live, steps)
        # Under inference mode, the buffer may be an inference tensor (made in the engine's loop) whoever calls.
        with torch.inference_mode():
            self._data[:, self.width : self.width + steps] = columns
        self.width += steps

    def trim(self, first: int) -> None:
        """Drop the first ``first`` columns (padding in every row)."""
        self._data = self._data[:, first:]
        self.width -= first

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index``, in that order."""
        self._data = self._data[index]

    def merged(self, other: torch.Tensor, old_pad: int, new_pad: int) -> RoutingBuffer:
        """This buffer's rows left-padded by ``old_pad`` columns, then the rows of ``other`` left-padded by
        ``new_pad``; both sides come out equally wide, as the KV cache does in a merge."""
        live = self.live
        width = live.shape[1] + old_pad
        if other.shape[1] + new_pad != width:
            raise ValueError(f"cannot merge routing of width {other.shape[1]}+{new_pad} into {live.shape[1]}+{old_pad}")
        ids = torch.zeros((live.shape[0] + other.shape[0], width, *live.shape[2:]), dtype=live.dtype)
        ids[: live.shape[0], old_pad:] = live
        ids[live.shape[0] :, new_pad:] = other
        return RoutingBuffer(ids)

    def rows_of(self, row: int, mask: torch.Tensor) -> torch.Tensor:
        """Routing of the real (``mask`` 1) positions of ``row``, ``[positions, layers, topk]`` (a copy)."""
        return self.live[row][mask.bool()]


def _with_room(ids: torch.Tensor, more: int) -> torch.Tensor:
    """``ids`` ``[batch, width, ...]`` int32 copied into a tensor with room for ``more`` columns and as many again
    as it holds (at least 64), so that appending column after column copies each one O(1) times."""
    room = torch.empty((ids.shape[0], 2 * ids.shape[1] + more + 64, *ids.shape[2:]), dtype=torch.int32)
    room[:, : ids.shape[1]] = ids
    return room
