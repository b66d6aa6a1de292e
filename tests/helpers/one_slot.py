"""The one-slot check: every Lua script call (EVAL, EVALSHA) and every MULTI/EXEC pipeline a client sends must touch
keys of one Redis Cluster hash slot, or a cluster refuses it (and a single server takes it, so a single-server test
alone would never notice).

``SlotChecker`` wraps a client in place (a single-server ``redis.Redis`` or a ``RedisCluster``): it asserts before
anything is sent, and records what it saw, so that a test can also assert that the check was not vacuous.

The fixtures run a test module's queue tests against both kinds of server: a test marked with ``ON_BOTH`` runs once
on the session's single server and once on a 3-primary cluster, and the ``redis_client`` it gets (and the conftest's
``queue`` built on it) is checked. A test module takes them by name (an import would read to linters as an unused
name that a test's argument redefines)::

    redis_kind, redis_url, redis_client = one_slot.redis_kind, one_slot.redis_url, one_slot.redis_client
    redis_cluster = tests.helpers.redis_cluster.redis_cluster
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from redis.cluster import ClusterPipeline, RedisCluster
from redis.crc import key_slot

from pipeline.queue.connection import RedisClient, connect

ON_BOTH = pytest.mark.parametrize("redis_kind", ["single", "cluster"], indirect=True)
"""Runs the marked test on a single server and on a cluster. (The parameter goes to a fixture of its own: given to
``redis_url`` itself, it would reach the conftest's session-scoped ``redis_url`` too, and start a server per value.)"""

_SCRIPT_COMMANDS = ("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO")


def _b(x: Any) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


@dataclass
class Touch:
    """One script call or transaction: what it was, and the slots of its keys."""

    kind: str  # "script" or "transaction"
    what: str  # the script's SHA1, or the transaction's commands
    slots: set[int]


@dataclass
class SlotChecker:
    """Asserts, before it is sent, that each script call and MULTI/EXEC of ``client`` touches one slot."""

    client: RedisClient
    touches: list[Touch] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._execute = self.client.execute_command
        self._pipeline = self.client.pipeline
        # Instance attributes shadow the class's methods: redis-py's command methods, and Script objects registered
        # on this client, all send through ``self.execute_command``.
        self.client.execute_command = self._on_command  # type: ignore[method-assign]
        self.client.pipeline = self._on_pipeline  # type: ignore[method-assign]

    @property
    def scripts(self) -> set[str]:
        return {t.what for t in self.touches if t.kind == "script"}

    @property
    def transactions(self) -> list[Touch]:
        return [t for t in self.touches if t.kind == "transaction"]

    def _on_command(self, *args: Any, **options: Any) -> Any:
        name = str(args[0]).upper()
        if name in _SCRIPT_COMMANDS:
            numkeys = int(args[2])
            keys = [_b(k) for k in args[3:3 + numkeys]]
            sha = hashlib.sha1(_b(args[1])).hexdigest() if name in ("EVAL", "EVAL_RO") else str(args[1])
            self._check("script", sha, keys)
        return self._execute(*args, **options)

    def _on_pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self._pipeline(*args, **kwargs)
        run = pipe.execute

        def execute(*a: Any, **kw: Any) -> Any:
            if _is_transaction(pipe):
                queued = _queued(pipe)
                keys = [k for cmd in queued for k in self._keys(cmd)]
                self._check("transaction", " ".join(str(c[0]) for c in queued), keys)
            return run(*a, **kw)

        pipe.execute = execute
        return pipe

    def _keys(self, command: tuple[Any, ...]) -> list[bytes]:
        """The keys of one command, as the server reads them (``COMMAND GETKEYS``), so that no key position is
        guessed here."""
        if str(command[0]).upper() in ("MULTI", "EXEC"):
            return []
        args = [*str(command[0]).split(), *command[1:]]  # "XGROUP CREATE" is two words to the server
        try:
            if isinstance(self.client, RedisCluster):
                reply = self.client.get_default_node().redis_connection.execute_command("COMMAND GETKEYS", *args)
            else:
                reply = self._execute("COMMAND GETKEYS", *args)
        except redis.ResponseError as e:
            if "no key" in str(e).lower():
                return []
            raise
        return [_b(k) for k in reply]

    def _check(self, kind: str, what: str, keys: list[bytes]) -> None:
        slots = {key_slot(k) for k in keys}
        assert len(slots) <= 1, (f"a {kind} ({what}) touches keys of {len(slots)} hash slots, which a Redis Cluster "
                                 f"refuses: {sorted(k.decode(errors='replace') for k in keys)}")
        self.touches.append(Touch(kind, what, slots))


def _is_transaction(pipe: Any) -> bool:
    if isinstance(pipe, ClusterPipeline):
        return type(pipe._execution_strategy).__name__ == "TransactionStrategy"
    return bool(pipe.transaction)


def _queued(pipe: Any) -> list[tuple[Any, ...]]:
    if isinstance(pipe, ClusterPipeline):
        return [tuple(c.args) for c in pipe._execution_strategy.command_queue]
    return [tuple(args) for args, _options in pipe.command_stack]


@pytest.fixture
def redis_kind(request: pytest.FixtureRequest) -> str:
    """ "single" or "cluster": what ``ON_BOTH`` gives the test, "single" for a test without it."""
    return str(getattr(request, "param", "single"))


@pytest.fixture
def redis_url(request: pytest.FixtureRequest, redis_kind: str, redis_url: str) -> str:
    """The session's single server, or (for a test marked ``ON_BOTH``, its "cluster" run) the module's cluster."""
    if redis_kind == "cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    return redis_url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[RedisClient]:
    """A client of ``redis_url`` under the one-slot check."""
    client = connect(redis_url)
    checker = SlotChecker(client)
    client.slot_checker = checker  # type: ignore[union-attr]
    yield client
    client.close()
