"""Crash safety of the queue's storage: kill -9 of the Redis server, then a restart from its AOF."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil

from pipeline.queue.redis_server import STATE_FILE, EmbeddedRedis
from pipeline.queue.redis_streams import SampleQueue
from tests.helpers.samples import make_group


def test_kill_9_of_redis_loses_no_entry_and_no_pending_state(tmp_path: Path) -> None:
    n_acked, m_unacked, n_undelivered = 7, 5, 4
    rng = np.random.default_rng(0)
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    try:
        q = SampleQueue(server.client(), "crash")
        q.create_group("trainer")
        groups = [make_group(rng, 2) for _ in range(n_acked + m_unacked + n_undelivered)]
        ids = q.put_many(groups)
        delivered = q.read("trainer", "w0", count=n_acked + m_unacked)
        q.ack("trainer", [e.id for e in delivered[:n_acked]])
        last_delivered = delivered[-1].id
        old_pid = server.pid

        server.kill()  # SIGKILL: no shutdown, no final fsync
        assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE

        server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
        assert server.pid != old_pid
        q = SampleQueue(server.client(), "crash")
        assert [i for i, _ in q.scan()] == ids  # all N+M (+ undelivered) entries survived
        assert [e.samples for _, e in q.scan()] == groups  # byte-exact payloads
        (g,) = q.stats().groups
        assert g.pending == m_unacked and g.last_delivered_id == last_delivered
        assert q.pending_ids("trainer") == ids[n_acked : n_acked + m_unacked]
        # The dead consumer's entries are recovered by XAUTOCLAIM, and the undelivered ones read normally.
        claimed = q.claim_stale("trainer", "w1", min_idle_ms=0)
        assert [e.id for e in claimed] == ids[n_acked : n_acked + m_unacked]
        assert [e.samples for e in claimed] == groups[n_acked : n_acked + m_unacked]
        assert [e.id for e in q.read("trainer", "w1", count=100)] == ids[n_acked + m_unacked :]
        assert q.stats().produced == len(ids)  # the sequence counter survived too
    finally:
        server.stop()


def test_launcher_reuses_a_live_server_for_the_same_folder_and_stops_by_pid(tmp_path: Path) -> None:
    a = EmbeddedRedis(tmp_path / "r").start()
    try:
        state = json.loads((tmp_path / "r" / STATE_FILE).read_text())
        assert state["pid"] == a.pid and a.started_here
        b = EmbeddedRedis(tmp_path / "r").start()
        assert b.pid == a.pid and b.port == a.port and not b.started_here
        b.client().set("k", "v")
        assert a.client().get("k") == b"v"
        appendonly = a.client().config_get("appendonly")["appendonly"]
        assert appendonly == "yes"
    finally:
        a.stop()
    assert not (tmp_path / "r" / STATE_FILE).exists()
    assert not psutil.pid_exists(a.pid or -1) or a.pid is None


def test_stale_state_file_from_a_dead_server_starts_a_new_one(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    folder.mkdir()
    # A PID that is certainly not a redis-server: a process this test starts and reaps.
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    (folder / STATE_FILE).write_text(json.dumps({"pid": p.pid, "port": 1, "unix_socket": False}))
    server = EmbeddedRedis(folder).start()
    try:
        assert server.started_here and server.pid != p.pid and server.client().ping()
    finally:
        server.stop()


def test_unix_socket_server(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "s", unix_socket=True).start()
    try:
        assert server.url.startswith("unix://") and server.client().ping()
        assert os.path.exists(server.socket_path)
    finally:
        server.stop()
    assert server.pid is None and not os.path.exists(server.socket_path)
