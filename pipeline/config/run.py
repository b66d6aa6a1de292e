"""``[run]`` (the run's identity and folder) and ``[plugins]`` (the folders user code is imported from)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from pipeline.config.base import Strict


class PluginsConfig(Strict):
    """Where user code comes from (``pipeline.plugins``; docs/plugins.md)."""

    paths: list[Path] = []
    """Folders user modules are imported from, relative to the working directory (made absolute when the recipe
    loads). A plug-in whose module lies anywhere else, installed packages aside, is refused."""

    @field_validator("paths")
    @classmethod
    def _folders(cls, paths: list[Path]) -> list[Path]:
        missing = [str(p) for p in paths if not Path(p).is_dir()]
        if missing:
            raise ValueError(f"{', '.join(missing)}: not a folder; plugins.paths lists folders holding user modules")
        return [Path(p).resolve() for p in paths]


class RunConfig(Strict):
    """Identity and location of a run."""

    name: str = Field("sluice", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name; namespaces every Redis key (sluice:{name}:...)."""
    run_dir: Path = Path("runs/sluice")
    """Folder for the embedded Redis, archive, checkpoints and logs."""
    seed: int = Field(0, ge=0)
    """Global seed."""
