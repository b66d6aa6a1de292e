"""``[sync]``: the weight push from the trainer to the engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.base import Strict


class SyncConfig(Strict):
    """Weight push from trainer to engines."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: NCCL on GPU, gloo on CPU."""
    bucket_mb: int | None = Field(None, ge=1, le=65536)
    """Bucket size; None: 256 MB on CPU, 512 MB on GPU."""
    master_port: int = Field(0, ge=0, le=65535)
    """Port of the trainer's weight-group store; 0: the trainer binds one the OS picks and tells the engines."""
    timeout_s: float = Field(300.0, gt=0)
    """Timeout of the weight group's collectives."""
    stall_timeout_s: float = Field(120.0, gt=0)
    """The longest a push may keep generation paused: one not done by then is abandoned (its update windows closed,
    generation continued if no weight had changed yet) and made again on a rebuilt group. Keep it under SGLang's
    --watchdog-timeout (300 s by default), which kills a server whose scheduler stayed paused that long, and above
    the time a whole push takes (big models on GPU: raise both)."""
    wire: Literal["flat", "tensors"] = "flat"
    """flat: one broadcast per bucket (SGLang's load_format "flattened_bucket"); tensors: one per tensor."""
    sources: Literal["owners", "rank0"] = "owners"
    """owners: every Hugging Face tensor the engines load has one owner rank (an expert: the expert-parallel rank
    holding it; a TP-sharded tensor: one rank of its TP group, which gathers it alone; a replicated one: a rank
    chosen to spread the bytes), and each owner sends its tensors over a weight group of its own; the engines take
    the new version once every source has landed. rank0: global rank 0 gathers every tensor and sends it alone."""
    snapshot: Literal["auto", "device", "host"] = "auto"
    """Where a push's snapshot (each source's share, cast to the wire dtype, sent while the next step trains) lives.
    device: accelerator memory, counted in the --dry-run plan; host: (pinned) host memory, copied off the device at
    once; auto: device when the plan says it fits, else host (on CPU the two are the same)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype the weights travel in. auto: the engines' own (their /model_info or /get_server_info, else the model's
    config.json), so an fp32 trainer sends a bf16 engine half the bytes; the engine casts on load either way."""
