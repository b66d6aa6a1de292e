"""The boundary between the trainer's weight push and the engines that receive it.

``pipeline.sync`` sits below ``pipeline.producers`` in the dependency order, so the pusher cannot import the SGLang
HTTP client. It states what it needs from an engine as the ``WeightUpdateEngine`` protocol instead; the client in
``pipeline.producers.sglang_client`` satisfies it structurally.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, runtime_checkable

from pipeline.errors import SyncError

if TYPE_CHECKING:
    import torch

    from pipeline.sync.lifecycle import Adoption
    from pipeline.sync.packing import PackedBucket
    from pipeline.sync.pusher import PushStats

# SGLang names dtypes by their ``torch`` attribute name (it does ``getattr(torch, name)`` on receipt), so these are the
# strings that travel in ``/update_weights_from_distributed``. Only the dtypes a policy's weights come in are listed.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "float8_e4m3fn": 1,
}


@dataclass(frozen=True)
class TensorMeta:
    """What the trainer announces about one tensor before broadcasting it: HF name, SGLang dtype string, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise SyncError(
                f"tensor {self.name!r} has dtype {self.dtype!r}, which the weight push does not carry; "
                f"use one of {sorted(DTYPE_ITEMSIZE)} (cast the tensor before pushing)"
            )
        if any(d < 0 for d in self.shape):
            raise SyncError(f"tensor {self.name!r} has a negative dimension in shape {list(self.shape)}")

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size on the wire in bytes."""
        return self.numel * DTYPE_ITEMSIZE[self.dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for an SGLang dtype string ("bfloat16", ...); SyncError for one the push does not carry."""
    if name not in DTYPE_ITEMSIZE:
        raise SyncError(f"dtype {name!r} is not one the weight push carries; use one of {sorted(DTYPE_ITEMSIZE)}")
    import torch  # here, not at the top: the engine clients use this module and need no torch

    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The SGLang dtype string for a torch dtype (``torch.bfloat16`` -> "bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise SyncError(f"dtype {dtype} is not one the weight push carries; cast to one of {sorted(DTYPE_ITEMSIZE)}")
    return name


def meta_of(name: str, tensor: torch.Tensor) -> TensorMeta:
    """The announcement for one named tensor."""
    return TensorMeta(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(int(d) for d in tensor.shape))


def check_announcement(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[TensorMeta]:
    """Validate the ``names``/``dtypes``/``shapes`` of an update request and return them as metas."""
    if not len(names) == len(dtypes) == len(shapes):
        raise SyncError(
            f"update announces {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; they must match"
        )
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if list(names).count(n) > 1})
        raise SyncError(f"update announces these tensor names more than once: {dupes}")
    return [TensorMeta(name=n, dtype=d, shape=tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)]


def validate_metas(
    metas: Iterable[TensorMeta], expected: Mapping[str, TensorMeta], *, match_dtype: bool = True
) -> None:
    """Raise SyncError listing every announced tensor that is unknown or differs in shape (or dtype) from ``expected``.

    Run this before any broadcast: gloo receiving into a tensor of the wrong size aborts the process.
    """
    problems: list[str] = []
    for meta in metas:
        want = expected.get(meta.name)
        if want is None:
            problems.append(f"{meta.name}: not a parameter of the engine's model")
        elif want.shape != meta.shape:
            problems.append(f"{meta.name}: shape {list(meta.shape)} but the model has {list(want.shape)}")
        elif match_dtype and want.dtype != meta.dtype:
            problems.append(f"{meta.name}: dtype {meta.dtype} but the model has {want.dtype}")
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise SyncError(
            f"weight update does not fit the model ({shown}). Check that trainer and engine load the same architecture "
            "and that the trainer's name mapping produces HF names"
        )


@dataclass(frozen=True)
class EngineReply:
    """The ``{"success", "message"}`` answer every SGLang weight endpoint returns."""

    success: bool
    message: str


@runtime_checkable
class WeightUpdateEngine(Protocol):
    """The weight endpoints of one rollout engine, as the pusher drives them (SGLang 0.5.23's protocol)."""

    @property
    def name(self) -> str:
        """A label for error messages (the engine's base URL)."""
        ...

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
        """Make the engine join the weight group at ranks ``rank_offset + tp_rank``; returns once it has joined."""
        ...

    async def begin_weight_update(self) -> EngineReply:
        """Open the update window (``{"selector": "all"}``); updates outside it are refused."""
        ...

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
        """Receive the announced tensors and load them; returns when loaded. One ``broadcast(src=0)`` per tensor in
        order, or with ``load_format="flattened_bucket"`` one flat uint8 broadcast of all their bytes.

        The rest only go to an engine that takes announcements in order (``ordered_updates``): ``bucket_index`` and
        ``push_id``, the bucket's place in the window and the push it belongs to; ``begin_window`` on bucket 0,
        which then first pauses generation in place and opens the window for that push."""
        ...

    async def end_weight_update(self, *, push_id: str | None = None, buckets: int | None = None,
                                continue_generation: bool = False) -> EngineReply:
        """Close the update window. The keywords only go to an engine that takes announcements in order: wait first
        until push ``push_id``'s ``buckets`` buckets are received, so it may be posted before their answers; then,
        with ``continue_generation``, continue as ``continue_generation`` does."""
        ...

    async def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> EngineReply:
        """Stop running forward passes; ``in_place`` keeps every request and its KV cache to continue later."""
        ...

    async def continue_generation(self) -> EngineReply:
        """Resume after ``pause_generation``."""
        ...

    async def destroy_weights_update_group(self, group_name: str) -> EngineReply:
        """Leave the weight group (SGLang refuses to join a group name it already holds)."""
        ...

    async def close(self) -> None:
        """Release the client's connections."""
        ...


WeightSource: TypeAlias = (
    "Sequence[PackedBucket] | Sequence[tuple[str, torch.Tensor]] | Callable[[], Iterable[tuple[str, torch.Tensor]]]"
)
"""What one push attempt may be handed: packed buckets, named tensors, or a call that exports them afresh (an attempt
that must be made again needs the weights a second time, and an exporter is a one-shot iterator)."""


@runtime_checkable
class WeightPush(Protocol):
    """What the trainer's rank 0 drives to send its weights: ``WeightPusher`` over one weight group, or
    ``EngineRotation`` over engines that fail and come back (``pipeline.sync.rotation``). Both have every member, so
    the trainer never asks which one it holds."""

    @property
    def engines(self) -> Sequence[WeightUpdateEngine]:
        """The engines the next push goes to."""
        ...

    @property
    def all(self) -> Sequence[WeightUpdateEngine]:
        """Every engine client this push was given, in the group or not: the ones to close at the end."""
        ...

    @property
    def dtype(self) -> str | None:
        """The dtype floats travel in (None: each tensor's own); the other sources of a push pack theirs so."""
        ...

    async def push(self, weights: Sequence[PackedBucket] | Sequence[tuple[str, torch.Tensor]],
                   weight_version: str | int) -> PushStats:
        """Push every weight to the engines and set their version; raises SyncError when it cannot."""
        ...

    async def push_once(self, weights: WeightSource, weight_version: str | int) -> PushStats | None:
        """One attempt; None when it failed because an engine did and the caller should send the weights again."""
        ...

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[PackedBucket]:
        """Every weight cast and packed now, copied, for a push later."""
        ...

    async def adopt(self, version: int, *, fresh: bool, model_path: str | None = None) -> list[Adoption]:
        """Label, reload or hold each engine at the start of a run (``pipeline.sync.lifecycle.adopt_engines``)."""
        ...

    def counters(self) -> dict[str, float]:
        """Running totals of the push's trouble, by name (``flush_refused``, ``stalls``): the trainer's metrics."""
        ...

    async def close(self) -> None:
        """Have the engines leave the weight group; the engine clients stay open (``all``)."""
        ...
