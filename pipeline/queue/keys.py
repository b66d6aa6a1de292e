"""The Redis key layout of one run. Every key of a run shares the ``{run}`` hash tag, so a Redis Cluster keeps them in
one slot and the queue's Lua scripts may touch several of them atomically."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.errors import ConfigError

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_name(run: str) -> str:
    if not _RUN_NAME.match(run):
        raise ConfigError(
            f"run name {run!r} is invalid: use 1-128 characters of letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return run


@dataclass(frozen=True)
class RunKeys:
    """Names of a run's keys: ``sluice:{run}:samples`` and its siblings."""

    run: str

    def __post_init__(self) -> None:
        check_run_name(self.run)

    @property
    def prefix(self) -> str:
        return f"sluice:{{{self.run}}}"

    @property
    def samples(self) -> str:
        return f"{self.prefix}:samples"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}:deadletter"

    @property
    def policy_version(self) -> str:
        return f"{self.prefix}:policy_version"

    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    @property
    def produced(self) -> str:
        """Entries ever added to ``samples``; each entry's ``seq`` field is its 1-based position in that count."""
        return f"{self.prefix}:produced"

    def extra(self, name: str) -> str:
        """A run-scoped key for other stages (prompt cursors, ledgers), inside the same hash slot."""
        return f"{self.prefix}:{name}"
