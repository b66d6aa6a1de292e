"""Opening a run's queue from a run folder or a Redis URL, the way every CLI command and process does.

A run folder holds ``run.json`` (run name, and the Redis URL when the server is external) and, for the embedded
server, ``redis/`` with its AOF and PID state. A password is never written to ``run.json``: for a protected external
server, pass the URL again with ``--redis`` or ``SLUICE_REDIS_URL``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pipeline.errors import ConfigError
from pipeline.queue.codec import RoutingCodec
from pipeline.queue.connection import connect, redact_url
from pipeline.queue.keys import check_run_name
from pipeline.queue.redis_server import AppendFsync, EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue

RUN_FILE = "run.json"


@dataclass
class RunHandle:
    """An open run: its queue, and the embedded server if this process found or started one."""

    run: str
    run_dir: Path | None
    url: str
    queue: SampleQueue
    server: EmbeddedRedis | None

    def close(self, stop_server: bool = False) -> None:
        self.queue.redis.close()
        if stop_server and self.server is not None and self.server.started_here:
            self.server.stop()


def write_run_file(run_dir: Path, run: str, redis_url: str | None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    stored = None
    if redis_url is not None:
        stored = redis_url if urlsplit(redis_url).password is None else redact_url(redis_url)
    tmp = run_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps({"run": run, "redis_url": stored}))
    os.replace(tmp, run_dir / RUN_FILE)


def open_run(
    *,
    run_dir: str | Path | None = None,
    redis_url: str | None = None,
    run: str | None = None,
    create: bool = False,
    appendfsync: AppendFsync = "everysec",
    capacity: int = 1024,
    routing_codec: RoutingCodec = "compact",
) -> RunHandle:
    """Open a run by folder (``--run-dir``) or by URL and name (``--redis URL --run NAME``).

    With ``create=True`` a missing run folder is initialised and the embedded server started; otherwise the folder
    must already hold a run.
    """
    redis_url = redis_url or os.environ.get("SLUICE_REDIS_URL") or None
    if run_dir is None:
        if not (redis_url and run):
            raise ConfigError("name the run: either --run-dir DIR, or --redis URL together with --run NAME")
        check_run_name(run)
        queue = SampleQueue(connect(redis_url), run, capacity=capacity, routing_codec=routing_codec)
        return RunHandle(run, None, redis_url, queue, None)

    folder = Path(run_dir)
    run_file = folder / RUN_FILE
    if run_file.exists():
        meta = json.loads(run_file.read_text())
        if run is not None and run != meta["run"]:
            raise ConfigError(f"{folder} holds run {meta['run']!r}, not {run!r}")
        run = str(meta["run"])
        stored_url = meta.get("redis_url")
        if stored_url and not redis_url:
            if "***" in stored_url:
                raise ConfigError(
                    f"run {run!r} uses a password-protected Redis ({stored_url}); pass its URL with --redis or "
                    "SLUICE_REDIS_URL"
                )
            redis_url = stored_url
    elif create:
        run = check_run_name(run or folder.name)
        write_run_file(folder, run, redis_url)
    else:
        raise ConfigError(f"{folder} is not a sluice run folder (no {RUN_FILE}); check the path, or start a run there")

    server = None
    if redis_url is None:
        server = EmbeddedRedis(folder / "redis", appendfsync=appendfsync)
        if not create and not (folder / "redis").exists():
            raise ConfigError(
                f"{folder} has no embedded Redis state (redis/); was the run started with an external URL?")
        server.start()
        redis_url = server.url
    queue = SampleQueue(connect(redis_url), run, capacity=capacity, routing_codec=routing_codec)
    return RunHandle(run, folder, redis_url, queue, server)
