"""The base of the root's own sections (``run``, ``model``, ``engine``, ``sync``, ``queue``, ``ray``, ...): unknown keys
are errors, and an assignment is validated like a loaded value."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
