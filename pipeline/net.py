"""Network helpers below every stage: a free local port, and URLs that may carry a credential (a Redis URL's
password, a service's key in a query): whether one does, and the form of it that may be printed, logged or written
to a run's files.

A leaf (the standard library only): the recipe schema checks and redacts URLs with it without importing redis, and
the queue's connections use the same rules (``pipeline.queue.connection`` and ``credentials`` re-export them).
"""

from __future__ import annotations

import socket
from urllib.parse import parse_qsl, urlencode, urlsplit

#: Query parameters redis-py reads from a URL that hold a secret (``ssl_password`` unlocks an encrypted client key).
SECRET_QUERY_KEYS = frozenset({"password", "ssl_password"})
#: A Redis Cluster's URL scheme -> the scheme of each of its nodes. The host part of such a URL lists several nodes
#: (``redis+cluster://user:pass@h1:7000,h2:7001``), which urllib cannot read a port from.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def has_secret(url: str) -> bool:
    """Whether the URL carries a credential: a password in its user part or in its query."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return True  # unparseable: treat it as secret, it is never shown
    return parts.password is not None or any(k in SECRET_QUERY_KEYS for k, _ in parse_qsl(parts.query))


def redact_url(url: str) -> str:
    """The URL with every password (user part and query) replaced by '***', for logs, files and messages."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable redis url>"
    netloc = parts.netloc
    if password is not None:
        user = parts.username or ""
        # The host part as written: a cluster URL's list of nodes has no single port to parse, and an IPv6 address
        # keeps its brackets.
        host = netloc.rpartition("@")[2]
        netloc = f"{user}:***@{host}" if user else f":***@{host}"
    query = parts.query
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k in SECRET_QUERY_KEYS for k, _ in pairs):
        query = urlencode([(k, "***" if k in SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*/:")
    # Rebuilt by hand: urlunsplit drops the '//' of a URL with an empty host part (``unix:///path``).
    tail = (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    return f"{parts.scheme}://{netloc}{parts.path}{tail}"


def is_redacted(url: str) -> bool:
    """Whether the URL is one ``redact_url`` produced from a URL with a secret (so the secret must come from
    elsewhere)."""
    try:
        parts = urlsplit(url)
        return parts.password == "***" or any(
            k in SECRET_QUERY_KEYS and v == "***" for k, v in parse_qsl(parts.query))
    except ValueError:
        return False


def public_url(url: str | None) -> str | None:
    """What may be written to a run's files: the URL with its secrets redacted."""
    return None if url is None else (redact_url(url) if has_secret(url) else url)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS's choice). Another process may take it before the caller binds
    it, so a caller that can should let its server bind port 0 and report the port instead."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
