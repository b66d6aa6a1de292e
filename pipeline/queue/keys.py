"""The Redis key layout of one run. Every control key of a run shares the ``{run}`` hash tag, so a Redis Cluster keeps
them in one slot and the queue's Lua scripts may touch several of them atomically. Payloads are the one exception:
each sits under one of the run's shard tags (``{run/i}``, chosen when the run's first entry is put; docs/queue.md,
"Entries"), and no script or MULTI ever touches one."""

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
    def lineage(self) -> str:
        """Hash: first version a trainer pushed after restoring a checkpoint -> the version whose weights it holds
        (docs/versions.md)."""
        return f"{self.prefix}:lineage"

    @property
    def produced(self) -> str:
        """Entries ever added to ``samples``; each entry's ``seq`` field is its 1-based position in that count."""
        return f"{self.prefix}:produced"

    # ---- pacing slots and the prompt cursor (written by producers, given back by the trainer) ----------------------
    @property
    def groups_started(self) -> str:
        """Pacing slots held: groups admitted minus groups given back (see docs/queue.md, "Pacing slots")."""
        return f"{self.prefix}:groups_started"

    @property
    def slots_burned(self) -> str:
        """Hash step -> the slots a capped step left unused and spent anyway (see docs/queue.md, "Pacing slots")."""
        return f"{self.prefix}:slots_burned"

    @property
    def group_slots(self) -> str:
        """Hash group_id -> slot item of every queued group that still holds its pacing slot."""
        return f"{self.prefix}:group_slots"

    @property
    def prompt_cursor(self) -> str:
        """The next new prompt index; producers INCR it."""
        return f"{self.prefix}:prompt_cursor"

    @property
    def prompt_retry(self) -> str:
        """List of slot items handed back (a failed generation, a lost producer, a requeued group), taken first."""
        return f"{self.prefix}:prompt_retry"

    @property
    def producers(self) -> str:
        """Set of producer names that may hold in-flight groups."""
        return f"{self.prefix}:producers"

    def producer_inflight(self, name: str) -> str:
        """Hash group_id -> slot item of the groups producer ``name`` admitted and has not yet put."""
        return f"{self.prefix}:producer:{name}:inflight"

    def producer_lease(self, name: str) -> str:
        """Expiring key that says producer ``name`` is alive; once it is gone, anyone may reclaim its groups."""
        return f"{self.prefix}:producer:{name}:lease"

    @property
    def launcher(self) -> str:
        """The live launcher's lock: JSON host, PID, start time and token, with a TTL it renews (docs/launcher.md)."""
        return f"{self.prefix}:launcher"

    def producer_payloads(self, name: str) -> str:
        """Hash payload key -> group_id of the payloads a put by producer ``name`` may have written without their
        header yet; a reclaim of that producer deletes what it still lists."""
        return f"{self.prefix}:producer:{name}:payloads"

    @property
    def payload_shards(self) -> str:
        """JSON ``{"tags": [...]}``: the hash tags payloads are spread over, chosen once per run (set NX)."""
        return f"{self.prefix}:payload_shards"

    @property
    def payload_trash(self) -> str:
        """Set of payload keys whose headers a trim has removed and whose payloads it has yet to delete."""
        return f"{self.prefix}:payload_trash"

    @property
    def landed(self) -> str:
        """Hash payload key -> entry id of every header in the stream: a put resent after a lost reply (a restarted
        server that kept the first one) finds its header there and adds no second entry. Trimming drops the rows."""
        return f"{self.prefix}:landed"

    def extra(self, name: str) -> str:
        """A run-scoped key for other stages (prompt cursors, ledgers), inside the same hash slot."""
        return f"{self.prefix}:{name}"


def shard_tag(run: str, index: int) -> str:
    """A candidate shard tag of a run: ``run/index``. No run name holds a ``/``, so it never equals another run's
    own tag."""
    return f"{run}/{index}"


def payload_prefix(tag: str) -> str:
    """Payload keys under hash tag ``tag`` are this prefix plus the entry's ``seq``."""
    return f"sluice:{{{tag}}}:payload:"


def hash_tag(key: str) -> str:
    """The hash tag of a key, as Redis Cluster reads it: the text between the first ``{`` and the next ``}``, or the
    whole key when there is none (or it is empty)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1:end]
    return key


def slot_item(index: int, requeues: int = 0) -> str:
    """A slot item: a prompt cursor index and how many times the trainer has requeued that prompt, ``"index:n"``."""
    return f"{index}:{requeues}"


def parse_slot_item(raw: str | bytes) -> tuple[int, int]:
    """(cursor index, requeues) of a slot item; a bare index (an older writer) has been requeued 0 times."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    index, _, requeues = text.partition(":")
    return int(index), int(requeues or 0)
