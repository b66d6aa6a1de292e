"""``[queue]``: the Redis-Streams sample queue and its archive consumer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Strict

_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


class ArchiveConfig(Strict):
    """The archive consumer: Parquet segments of every entry, for offline replay."""

    enabled: bool = True
    """Run an archiver (its group then holds entries until they are on disk)."""
    segment_samples: int = Field(4096, ge=1, le=10_000_000)
    """Samples per Parquet segment."""
    flush_interval_s: float = Field(30.0, gt=0)
    """Write a partial segment after this many seconds without filling one."""
    processes: int = Field(1, ge=1, le=64)
    """Archiver processes: each reads every header in a consumer group of its own (``archive-i-of-M``; ``archive``
    when 1) and fetches and writes only the entries it owns (crc32 of the group id mod M). Fixed for a run's life: a
    run continued with another value is refused (docs/queue.md, "Archive")."""


class QueueConfig(Strict):
    """The Redis-Streams sample queue."""

    redis_url: str | None = None
    """redis://, rediss:// (TLS) or unix:// URL of an external server, or redis+cluster:// / rediss+cluster:// naming
    one or more nodes of a Redis Cluster (``host:port,host:port``); None starts an embedded one in the run folder."""
    durability: Literal["standard", "safe"] = "standard"
    """'safe': no acknowledged write is ever lost, even in a machine crash (the embedded server fsyncs its AOF
    before each reply: appendfsync = 'always'; an external server is checked for it at start). 'standard': the
    appendfsync below (docs/faults.md says what each promises)."""
    appendfsync: Literal["always", "everysec"] = "everysec"
    """AOF fsync policy of the embedded server: 'always' survives a machine crash, 'everysec' a process crash."""
    capacity: int = Field(1024, ge=1)
    """Entries (prompt groups) the trainer may lag behind before producers block."""
    routing_codec: Literal["compact", "plain"] = "compact"
    """How producers write MoE routing: 'compact' (one lossless block per group, about a third of the bytes) or
    'plain' (a uint8/uint16 array per sample). Consumers read both."""
    put_timeout_s: float = Field(600.0, gt=0)
    """How long a producer waits for room before failing with QueueFullError."""
    claim_idle_ms: int = Field(60_000, ge=1000)
    """A pending entry idle this long belongs to a dead consumer and may be claimed."""
    archive: ArchiveConfig = ArchiveConfig()
    """The archive consumer."""

    @model_validator(mode="before")
    @classmethod
    def _safe_means_always(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("durability") != "safe":
            return data
        if data.get("appendfsync", "always") != "always":
            raise ValueError(f"queue.durability = 'safe' fsyncs every write (appendfsync = 'always'), but "
                             f"queue.appendfsync = {data['appendfsync']!r}; drop one of the two")
        return {**data, "appendfsync": "always"}

    @field_validator("redis_url")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        # The message names the scheme only: pydantic's own errors would echo the whole URL, password included.
        if url is not None and not url.startswith(_SCHEMES):
            scheme = url.split(":", 1)[0] if ":" in url else "(none)"
            raise ValueError(f"scheme {scheme!r} is not a Redis URL scheme; use redis://, rediss:// (TLS), unix://, "
                             "or redis+cluster:// / rediss+cluster:// for a Redis Cluster")
        return url
