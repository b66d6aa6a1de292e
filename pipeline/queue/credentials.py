"""How a run's processes get the Redis credential without it ever landing in a file others may read.

``run.json`` and ``config.json`` hold the Redis URL redacted (``redis://user:***@host``). The launcher hands the
full URL to the run's processes in ``RUN_DIR/.redis-url``, a file created with mode 0600 (only its owner can read
it) and deleted when the launcher stops. It does not go through the processes' environment: that travels through
Ray (actor specs in its control store, the hosts' environment), and every child process inherits it.

A process or command that opens a run whose stored URL is redacted looks, in order, at the URL it was given
(``--redis``), ``SLUICE_REDIS_URL``, then that file (present while the run's launcher lives). See docs/security.md.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.net import public_url as public_url
from pipeline.queue.connection import is_redacted

SECRET_FILE = ".redis-url"
ENV_URL = "SLUICE_REDIS_URL"


def secret_path(run_dir: Path) -> Path:
    return Path(run_dir) / SECRET_FILE


def write_secret_url(run_dir: Path, url: str) -> Path:
    """Write the full URL for the run's processes, readable by this user only; atomic (written, fsynced, renamed)."""
    path = secret_path(run_dir)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    # O_EXCL and the mode at creation: the file is never, not even for an instant, readable by others.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, url.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def remove_secret_url(run_dir: Path) -> None:
    secret_path(run_dir).unlink(missing_ok=True)


def read_secret_url(run_dir: Path) -> str | None:
    """The URL the launcher left for the run's processes, or None; refuses a file others could read."""
    path = secret_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:  # a symlink put in its place, say
        raise ConfigError(f"{path}: cannot read the run's Redis credential safely ({e}); delete the file and run "
                          "`sluice run` again") from None
    try:
        mode = os.fstat(fd).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO) or os.fstat(fd).st_uid != os.getuid():
            raise ConfigError(f"{path} holds the run's Redis credential but is not private to this user (mode "
                              f"{stat.filemode(mode)}); delete it (the launcher writes it again, mode 0600) or "
                              f"`chmod 600 {path}`")
        return os.read(fd, 1 << 16).decode().strip() or None
    finally:
        os.close(fd)


def resolve_url(run_dir: Path | None, url: str | None, given: str | None = None) -> str | None:
    """The usable URL for a stored one (``url``, maybe redacted): ``given``, else ``SLUICE_REDIS_URL``, else the
    launcher's private file. A redacted URL with none of these is a ConfigError saying where to pass it."""
    if given:
        return given
    if url is None or not is_redacted(url):
        return url
    from_env = os.environ.get(ENV_URL)
    if from_env:
        return from_env
    if run_dir is not None and (secret := read_secret_url(run_dir)) is not None:
        return secret
    where = f" in {run_dir}" if run_dir is not None else ""
    raise ConfigError(f"the run{where} uses a password-protected Redis ({url}); its launcher's credential file "
                      f"({SECRET_FILE}) exists only while `sluice run` runs, so pass the URL with --redis or "
                      f"{ENV_URL}")


#: The commands sluice's processes and `sluice queue`/`sluice eval` send, found by running a whole `sluice run`
#: (evaluator, archiver, a trainer restart) against a server that counted them (`INFO commandstats`), then checked
#: by running with exactly these (tests/queue/test_security.py). Commands a Lua script calls are checked against the
#: calling user's ACL too, and the lag script would swallow a refused XINFO in its pcall, so it is listed.
#: SELECT is needed only with a database other than 0 in the URL. SCRIPT EXISTS: redis-py asks it before it sends a
#: pipeline that holds a script call (a put's headers ride in the same pipeline as its payloads). CLUSTER SLOTS and
#: COMMAND only on a Redis Cluster: the cluster client reads the slot map and the command table (to find the keys of
#: what it routes), and the queue reads the slot map to spread a run's payload shards over the primaries.
ACL_COMMANDS: tuple[str, ...] = (
    "ping", "select",
    "get", "set", "del", "exists", "mget", "incr", "incrby", "decr", "decrby", "pexpire", "pttl",
    "hget", "hset", "hsetnx", "hdel", "hgetall", "hmget", "hkeys", "hincrby", "hincrbyfloat", "hvals",
    "sadd", "srem", "smembers",
    "rpush", "lpop", "lrange",
    "xadd", "xlen", "xrange", "xrevrange", "xread", "xreadgroup", "xack", "xpending", "xautoclaim", "xtrim",
    "xinfo|groups", "xgroup|create", "xgroup|destroy",
    "eval", "evalsha", "script|load", "script|exists", "multi", "exec",
    "cluster|slots", "command",
)


def acl_rule(user: str = "sluice", password: str = "PASSWORD") -> str:
    """An ``ACL SETUSER``/users.acl rule for a user that may run sluice and touch nothing but ``sluice:*`` keys (and
    no Pub/Sub channel)."""
    return (f"user {user} on >{password} resetchannels ~sluice:* -@all "
            + " ".join(f"+{c}" for c in ACL_COMMANDS))
