"""The bodies of the CPU engine's weight-update endpoints (``weight_routes.py``), in SGLang's field names plus
sluice's own for ordered announcements (``update_turns.py``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class InitGroupRequest(BaseModel):
    """Body of ``/init_weights_update_group``."""

    model_config = ConfigDict(extra="ignore")
    master_address: str
    """Host of the trainer's TCPStore (rank 0)."""
    master_port: int = Field(ge=1, le=65535)
    """Port of the trainer's TCPStore."""
    rank_offset: int = Field(ge=1)
    """This engine's rank in the group (the trainer is rank 0)."""
    world_size: int = Field(ge=2)
    """Trainer plus all engine ranks."""
    group_name: str = "weight_update_group"
    """Name the later updates refer to."""
    backend: str = "gloo"
    """Only gloo exists on CPU."""
    timeout_s: float = Field(default=300.0, gt=0)
    """How long to wait for the other members."""


class UpdateFromDistributedRequest(BaseModel):
    """Body of ``/update_weights_from_distributed``."""

    model_config = ConfigDict(extra="ignore")
    names: list[str]
    """HF parameter names, in the order they are broadcast."""
    dtypes: list[str]
    """SGLang dtype strings ("float32", "bfloat16", ...), one per name."""
    shapes: list[list[int]]
    """Shapes, one per name."""
    group_name: str = "weight_update_group"
    """The group the tensors arrive on."""
    flush_cache: bool = True
    """Empty the prefix cache once the bucket is loaded, if the engine is idle then (SGLang's rule); a busy engine
    keeps it. sluice's pusher sends false: its engines are paused in place, never idle."""
    abort_all_requests: bool = False
    """Abort running and waiting requests before loading."""
    weight_version: str | None = None
    """Version to report once these weights are loaded; None keeps the current one."""
    load_format: str | None = None
    """None: one broadcast per tensor; "flattened_bucket": one flat uint8 broadcast of all the bucket's bytes."""
    bucket_index: int | None = None
    """sluice's own: the bucket's place in the window, from a pusher that announces the next bucket before this one
    is answered (the engine says ``ordered_updates`` in ``/model_info``). Received only on its turn
    (``update_turns.py``); None: received as it comes, as SGLang does."""
    push_id: str | None = None
    """sluice's own, with ``bucket_index``: the push the bucket belongs to."""
    begin_window: bool = False
    """sluice's own, on bucket 0 of a push with ``push_id``: pause generation in place and open the window for that
    push first, as ``/pause_generation`` ``in_place`` and ``/begin_weight_update`` do: a round trip less per push.
    The push's later announcements and its end may arrive before it; they wait for the window."""


class EndUpdateRequest(BaseModel):
    """Body of ``/end_weight_update`` (SGLang sends none of these fields)."""

    model_config = ConfigDict(extra="ignore")
    push_id: str | None = None
    """sluice's own: the push whose buckets to wait for."""
    buckets: int | None = Field(default=None, ge=1)
    """sluice's own, with ``push_id``: how many buckets that push announced."""
    continue_generation: bool = False
    """sluice's own: continue generation once the whole push is loaded. Only a pusher with this one engine asks:
    with several, generation continues only once every engine has the whole push."""


class UpdateFromDiskRequest(BaseModel):
    """Body of ``/update_weights_from_disk``."""

    model_config = ConfigDict(extra="ignore")
    model_path: str = Field(min_length=1)
    """An HF model folder on the engine's machine, of the served architecture."""
    load_format: str | None = None
    """Accepted for compatibility; the CPU engine reads safetensors only."""
    abort_all_requests: bool = False
    """Abort running and waiting requests before loading (otherwise they continue on the new weights)."""
    weight_version: str | int | None = None
    """Version to report once these weights are loaded; None keeps the current one."""
    flush_cache: bool = True
    """Empty the prefix cache once loaded, if the engine is idle then."""
