"""Opening a run's queue from a run folder or a Redis URL, the way every CLI command and process does.

A run folder holds ``run.json`` (run name, and the Redis URL when the server is external) and, for the embedded
server, ``redis/`` with its AOF and PID state. A password is never written to ``run.json``: a protected external
server's URL is resolved as ``pipeline.queue.credentials`` says (``--redis``, ``SLUICE_REDIS_URL``, or the live
launcher's private credential file).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.queue.codec import RoutingCodec
from pipeline.queue.connection import check_access, connect
from pipeline.queue.credentials import ENV_URL, public_url, resolve_url
from pipeline.queue.keys import check_run_name
from pipeline.queue.redis_server import AppendFsync, EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue
from pipeline.rundir import RUN_FILE, redis_dir


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
    stored = public_url(redis_url)
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
    start_server: bool = True,
) -> RunHandle:
    """Open a run by folder (``--run-dir``) or by URL and name (``--redis URL --run NAME``).

    With ``create=True`` a missing run folder is initialised and the embedded server started; otherwise the folder
    must already hold a run. ``start_server=False`` (the processes of a live run) never starts the embedded server:
    it uses the one the folder's state names, which the run's launcher owns and restarts if it dies.
    """
    redis_url = redis_url or os.environ.get(ENV_URL) or None
    if redis_url is not None:  # a redacted URL (from a run's config.json) stands for the one the launcher holds
        redis_url = resolve_url(None if run_dir is None else Path(run_dir), redis_url)
    if run_dir is None:
        if not (redis_url and run):
            raise ConfigError("name the run: either --run-dir DIR, or --redis URL together with --run NAME")
        check_run_name(run)
        return RunHandle(run, None, redis_url, _queue(redis_url, run, capacity, routing_codec), None)

    folder = Path(run_dir)
    run_file = folder / RUN_FILE
    queue: SampleQueue | None = None
    if run_file.exists():
        meta = json.loads(run_file.read_text())
        if run is not None and run != meta["run"]:
            raise ConfigError(f"{folder} holds run {meta['run']!r}, not {run!r}")
        run = str(meta["run"])
        stored_url = meta.get("redis_url")
        if stored_url and not redis_url:
            redis_url = resolve_url(folder, stored_url)
    elif create:
        run = check_run_name(run or folder.name)
        if redis_url is not None:
            queue = _queue(redis_url, run, capacity, routing_codec)
            _refuse_a_foreign_run(queue, folder)
        write_run_file(folder, run, redis_url)
    else:
        raise ConfigError(f"{folder} is not a sluice run folder (no {RUN_FILE}); check the path, or start a run there")

    server = None
    if redis_url is None:
        server = EmbeddedRedis(redis_dir(folder), appendfsync=appendfsync)
        if not create and not redis_dir(folder).exists():
            raise ConfigError(
                f"{folder} has no embedded Redis state (redis/); was the run started with an external URL?")
        if start_server or create:
            server.start()
        else:
            server.attach()
        redis_url = server.url
    return RunHandle(run, folder, redis_url, queue or _queue(redis_url, run, capacity, routing_codec), server)


def _refuse_a_foreign_run(queue: SampleQueue, folder: Path) -> None:
    """A new run folder on an external Redis that already holds a run of the same name would take that run's queue,
    version counter and pacing for its own: it would train another run's samples and push weights labelled with its
    versions. Refused before anything starts."""
    k = queue.keys
    # An empty stream is no run: a side consumer (an evaluator, a harness's tap) may attach its group before the run
    # starts, which creates the stream.
    if not queue.redis.exists(k.policy_version, k.produced) and not queue.redis.xlen(k.samples):
        return
    raise ConfigError(
        f"the Redis at queue.redis_url already holds a run named {queue.run!r} (policy version "
        f"{queue.policy_version()}, {queue.redis.xlen(k.samples)} stream entries) that the new run folder {folder} "
        "did not start: resume it from its own run folder, or give this run another run.name")


def _queue(url: str, run: str, capacity: int, routing_codec: RoutingCodec) -> SampleQueue:
    queue = SampleQueue(connect(url), run, capacity=capacity, routing_codec=routing_codec)
    try:
        check_access(queue.redis, url, queue.keys.samples)
    except BaseException:
        queue.redis.close()
        raise
    return queue
