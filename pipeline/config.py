"""Typed configuration: one pydantic model per component, nested under ``SluiceConfig``, loaded from TOML.

Recipes are data (``recipes/*.toml``); ``--set a.b=v`` overrides any field. Everything is validated before anything
starts, and unknown keys are errors, so a typo in a recipe never silently falls back to a default.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ArchiveConfig(_Strict):
    """The archive consumer: Parquet segments of every entry, for offline replay."""

    enabled: bool = True
    """Run an archiver (its group then holds entries until they are on disk)."""
    segment_samples: int = Field(4096, ge=1, le=10_000_000)
    """Samples per Parquet segment."""
    flush_interval_s: float = Field(30.0, gt=0)
    """Write a partial segment after this many seconds without filling one."""


class QueueConfig(_Strict):
    """The Redis-Streams sample queue."""

    redis_url: str | None = None
    """redis://, rediss:// (TLS) or unix:// URL of an external server; None starts an embedded one in the run folder."""
    appendfsync: Literal["always", "everysec"] = "everysec"
    """AOF fsync policy of the embedded server: 'always' survives a machine crash, 'everysec' a process crash."""
    capacity: int = Field(1024, ge=1)
    """Entries (prompt groups) the trainer may lag behind before producers block."""
    put_timeout_s: float = Field(600.0, gt=0)
    """How long a producer waits for room before failing with QueueFullError."""
    claim_idle_ms: int = Field(60_000, ge=1000)
    """A pending entry idle this long belongs to a dead consumer and may be claimed."""
    archive: ArchiveConfig = ArchiveConfig()
    """The archive consumer."""


class RunConfig(_Strict):
    """Identity and location of a run."""

    name: str = Field("sluice", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name; namespaces every Redis key (sluice:{name}:...)."""
    run_dir: Path = Path("runs/sluice")
    """Folder for the embedded Redis, archive, checkpoints and logs."""
    seed: int = Field(0, ge=0)
    """Global seed."""


class SluiceConfig(_Strict):
    """The root of a recipe."""

    run: RunConfig = RunConfig()
    """Identity and location of the run."""
    queue: QueueConfig = QueueConfig()
    """The sample queue."""


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word is a string


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=v`` overrides (v parsed as a TOML value, else a string) to a nested dict."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set queue.capacity=256")
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> SluiceConfig:
    """Load a recipe, apply overrides and validate; raises ConfigError listing every problem."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe {p} not found")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"recipe {p} is not valid TOML: {e}") from None
    apply_overrides(data, overrides or [])
    try:
        return SluiceConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ConfigError(f"invalid recipe{f' {path}' if path else ''}:\n" + "\n".join(lines)) from None


def dump_config(cfg: SluiceConfig) -> str:
    return json.dumps(cfg.model_dump(mode="json"), indent=2)
