"""The faults ``sluice bench faults`` injects into a live ``sluice run``, each at a moment drawn from the trial's seed.

Every kind waits for the trainer to reach a drawn step (its rows in ``metrics/trainer.jsonl``), then waits a drawn
fraction of a second more and kills with SIGKILL. What each kind observes to hit its window:

- ``trainer-checkpoint``: the save's staging folder ``checkpoints/step-N.tmp`` appearing (``save_checkpoint`` renames
  it to ``step-N`` when every shard is written). The kill counts as landed if the staging folder is still there and
  the final one is not, right after the kill.
- ``trainer-push``: a push of the tiny CPU model lasts a few milliseconds, too short to hit by polling. So the harness
  holds it open: it stops the engine (SIGSTOP) at the drawn moment; the trainer's next push then waits on the engine's
  HTTP answer. The push is in flight when the newest trainer row's ``policy_version`` (set before the push is sent)
  has no ``weight_push`` event yet (logged once every engine confirmed). The trainer is killed then, and the engine
  continued (SIGCONT) right after. If the trainer blocks elsewhere first (no data left to drain), the kill lands
  outside the push and the trial says so.
- ``ray-node``: the node that holds the trainer is removed from the two-node cluster, and a new one added 3 s later.
- ``trainer-engine``: two faults at once: the engine and the trainer are killed together. The restarted trainer's
  resync push then meets an engine that is loading again.
- ``trainer-rank``: the trial trains with two expert-parallel ranks, and rank 1 is killed after a drawn step. Every
  collective of rank 0 then fails or times out, and the launcher must restart the two ranks as one group.
  ``trainer-rank0`` kills rank 0 of the two instead: the rank that hosts the group's store and pushes the weights.
- ``reader`` (on a Redis Cluster): the trial trains with two data-parallel replicas, each of whose first rank fetches
  its share of every step's payloads (``trainer.fetch = "readers"``), and data-parallel rank 1 is killed while it
  fetches. A fetch of the tiny CPU payloads takes milliseconds, so the harness holds it open: at the drawn moment it
  stops (SIGSTOP) every primary that holds payload shards but not the run's own tag (the stream, the version, the
  pacing keys), so rank 0 still decides the next step and sends its plan, and a reader whose share has a key on a
  stopped primary waits for the answer. The kill *lands* when rank 1 was seen waiting so: one of its TCP
  connections to a stopped primary holds a request the primary has not read (the primary's receive queue in
  ``/proc/net/tcp``). Rank 1 is killed then, and the primaries continued (SIGCONT) once it is gone. If rank 1's
  share of that step lies wholly on the running primary, the step goes on (or waits for rank 0's own fetch): the
  primaries are continued, and the next step is tried, three times in all; a kill after the third try is counted
  as not landed.

The victims are found by the ``SLUICE_RUN_DIR`` the launcher gives each process of the run and by their command line
(the process itself, never its reaper or Ray's workers).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from pipeline.benchmarks.fault_check import raw_client
from pipeline.rundir import TMP_SUFFIX, checkpoint_path, config_path, placements_path, redis_dir, trainer_metrics_path

KINDS = ("producer", "engine", "trainer-step", "trainer-checkpoint", "trainer-push", "archiver", "evaluator", "redis",
         "ray-node", "trainer-rank", "trainer-rank0", "trainer-engine", "reader")
#: Kinds that need the run's queue on a Redis Cluster (``sluice bench faults --redis cluster``).
CLUSTER_ONLY = ("reader",)
#: Kinds that need the run's embedded Redis: one kills it, the other brings a server of its own.
EMBEDDED_ONLY = ("redis", "ray-node")


@dataclass
class Injection:
    """Where a fault landed."""

    at: float | None = None
    """Wall-clock time of the kill (None: it never happened)."""
    step: int = 0
    """Trainer rows written when it happened."""
    landed: bool = False
    """Whether the kill hit the window the kind names."""
    victim: str = ""
    note: str = ""


@dataclass
class Target:
    """A live trial the injector acts on."""

    run_dir: Path
    steps: int
    checkpoint_every: int
    rng: random.Random
    launcher: subprocess.Popen[bytes]
    redis_url: Callable[[], str | None]
    prefix: str
    cluster: Any = None
    """The ``ray.cluster_utils.Cluster`` of the ray-node kind."""
    worker: Any = None
    redis_cluster: Any = None
    """The trial's ``pipeline.queue.local_cluster.LocalCluster`` when its queue is on one."""


def wait_for(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return False


def rows(run_dir: Path) -> list[dict[str, Any]]:
    path = trainer_metrics_path(run_dir)
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                break  # a line being written
    return out


def find_process(run_dir: Path, role: str, rank: int | None = None) -> psutil.Process | None:
    """The run's process of ``role`` (producer, trainer, evaluator, archiver, engine), not its reaper; of a trainer,
    the one of ``rank`` if given."""
    want = str(run_dir.resolve())
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("SLUICE_RUN_DIR") != want or (rank is not None and env.get("RANK") != str(rank)):
                continue
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "pipeline.launch.reaper" in cmd:
            continue
        if role == "engine" and "pipeline.producers.cpu_engine" in cmd:
            return p
        if "pipeline.launch.processes" in cmd and cmd[cmd.index("pipeline.launch.processes") + 1:][:1] == [role]:
            return p
    return None


def _wait_step(t: Target, k: int, timeout_s: float = 400) -> bool:
    return wait_for(lambda: len(rows(t.run_dir)) >= k or t.launcher.poll() is not None, timeout_s, 0.05) \
        and t.launcher.poll() is None


def _kill(p: psutil.Process | None, step: int, victim: str, note: str = "") -> Injection:
    if p is None:
        return Injection(step=step, victim=victim, note=f"no live {victim} process found")
    try:
        p.send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        return Injection(step=step, victim=victim, note=f"{victim} exited before the kill")
    return Injection(at=time.time(), step=step, landed=True, victim=victim, note=note)


def _draw_step(t: Target) -> int:
    return t.rng.randint(2, max(2, t.steps - 4))


def _after_random_step(t: Target, max_delay_s: float) -> tuple[int, float, bool]:
    """Wait for a seeded step k of the run, then a seeded delay: (k, delay, False if the run ended before step k)."""
    k = _draw_step(t)
    delay = t.rng.uniform(0.0, max_delay_s)
    if not _wait_step(t, k):
        return k, delay, False
    time.sleep(delay)
    return k, delay, True


def _in_training(t: Target, inj: Injection) -> Injection:
    """A kill after the trainer's last row hit a run with nothing left to train: it did not land."""
    if inj.landed and inj.step >= t.steps:
        inj.landed = False
        inj.note += "; after the last step (nothing left to train)"
    return inj


def kill_role(role: str, rank: int | None = None) -> Callable[[Target], Injection]:
    victim = role if rank is None else f"{role} rank {rank}"

    def inject(t: Target) -> Injection:
        k, delay, reached = _after_random_step(t, 1.0)
        if not reached:
            return Injection(note=f"the run ended before step {k}")
        return _in_training(t, _kill(find_process(t.run_dir, role, rank), len(rows(t.run_dir)), victim,
                                     f"after step {k} + {delay:.2f}s"))
    return inject


def kill_trainer_and_engine(t: Target) -> Injection:
    k, delay, reached = _after_random_step(t, 1.0)
    if not reached:
        return Injection(note=f"the run ended before step {k}")
    engine, trainer = find_process(t.run_dir, "engine"), find_process(t.run_dir, "trainer", rank=0)
    step = len(rows(t.run_dir))
    first = _kill(engine, step, "engine")
    second = _kill(trainer, step, "trainer")
    notes = [i.note for i in (first, second) if i.note]
    return _in_training(t, Injection(at=first.at or second.at, step=step, landed=first.landed and second.landed,
                                     victim="engine and trainer",
                                     note="; ".join([f"after step {k} + {delay:.2f}s", *notes])))


def kill_in_checkpoint(t: Target) -> Injection:
    commits = [s for s in range(t.checkpoint_every, t.steps, t.checkpoint_every)]
    step = t.rng.choice(commits[:-1] or commits)
    delay = t.rng.uniform(0.0, 0.1)  # a save after the first takes 0.2-1 s here: 0.3 s missed one in six
    final = checkpoint_path(t.run_dir, step)
    staging = final.with_name(final.name + TMP_SUFFIX)
    if not wait_for(lambda: staging.exists() or t.launcher.poll() is not None, 400, 0.01) or not staging.exists():
        return Injection(note=f"no save of step {step} seen")
    time.sleep(delay)
    inj = _kill(find_process(t.run_dir, "trainer"), len(rows(t.run_dir)), "trainer",
                f"save of step {step} + {delay:.2f}s")
    inj.landed = inj.landed and staging.exists() and not final.exists()
    return inj


def _push_in_flight(t: Target) -> bool:
    got = rows(t.run_dir)
    url = t.redis_url()
    if not got or url is None:
        return False
    client = raw_client(url, socket_timeout=2)
    try:
        events = client.xrange(f"{t.prefix}:events")
    finally:
        client.close()
    pushed = [int(f[b"version"]) for _, f in events if f.get(b"kind") == b"weight_push"]
    return max(pushed, default=-1) < int(got[-1]["policy_version"])


def kill_in_push(t: Target) -> Injection:
    k, delay, reached = _after_random_step(t, 0.5)
    if not reached:
        return Injection(note=f"the run ended before step {k}")
    engine = find_process(t.run_dir, "engine")
    if engine is None:
        return Injection(note="no engine to hold the push with")
    engine.send_signal(signal.SIGSTOP)
    try:
        in_flight = wait_for(lambda: _push_in_flight(t), 8.0, 0.1)
        inj = _kill(find_process(t.run_dir, "trainer"), len(rows(t.run_dir)), "trainer",
                    f"after step {k} + {delay:.2f}s, engine held")
        inj.landed = inj.landed and in_flight
        if not in_flight:
            inj.note += "; the trainer was not pushing (it waited for data)"
    finally:
        try:
            engine.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass
    return inj


def kill_redis(t: Target) -> Injection:
    k, delay, reached = _after_random_step(t, 1.0)
    if not reached:
        return Injection(note=f"the run ended before step {k}")
    state = json.loads((redis_dir(t.run_dir) / "redis.json").read_text())
    p = psutil.Process(int(state["pid"]))
    if "redis" not in p.name():
        return Injection(note=f"pid {p.pid} in redis.json is {p.name()}, not a redis-server")
    return _in_training(t, _kill(p, len(rows(t.run_dir)), "redis", f"after step {k} + {delay:.2f}s"))


def remove_node(t: Target) -> Injection:
    k, delay, reached = _after_random_step(t, 1.0)
    if not reached:
        return Injection(note=f"the run ended before step {k}")
    t.cluster.remove_node(t.worker)
    at = time.time()
    time.sleep(3.0)  # the supervisor sees its trainer lost and waits for a place to restart it
    t.worker = t.cluster.add_node(num_cpus=2, resources={"train": 2})
    return _in_training(t, Injection(at=at, step=len(rows(t.run_dir)), landed=True, victim="trainer node",
                                     note=f"after step {k} + {delay:.2f}s; a new node 3 s later"))


def requests_unanswered(proc: psutil.Process, ports: set[int]) -> list[int]:
    """The ports among ``ports`` (servers on 127.0.0.1) to which ``proc`` sent a request the server has not read:
    the server's end of one of ``proc``'s connections holds bytes in its receive queue. A stopped server reads
    nothing, so that is a request waiting on it. Read from ``/proc/net/tcp``, which lists both ends of every local
    connection with their queues; psutil names ``proc``'s own ends."""
    try:
        mine = {(c.laddr.port, c.raddr.port) for c in proc.net_connections(kind="tcp4")
                if c.raddr and c.raddr.port in ports}
    except psutil.Error:
        return []
    waiting: set[int] = set()
    with open("/proc/net/tcp") as table:
        next(table)  # the header line
        for line in table:
            cols = line.split()
            local, remote, queues = cols[1], cols[2], cols[4]
            server, client = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
            if int(queues.split(":")[1], 16) > 0 and (client, server) in mine:
                waiting.add(server)
    return sorted(waiting)


def _payload_primaries(t: Target) -> tuple[Any, list[Any]]:
    """(the primary of the run's own tag, the other primaries that hold payload shards) of the trial's cluster."""
    cluster = t.redis_cluster
    control = cluster.primary_for(f"{t.prefix}:samples")
    with control.client() as c:
        raw = c.get(f"{t.prefix}:payload_shards")
    tags = json.loads(raw)["tags"] if raw else []
    held = {n.port: n for n in (cluster.primary_for(f"{{{tag}}}") for tag in tags) if n.port != control.port}
    return control, list(held.values())


def _batch_waiting(t: Target, control: Any, batch_groups: int) -> bool:
    """Whether a whole batch waits in the stream, not yet delivered to the trainer: then rank 0's next drain needs
    no new put (which a held primary would stop) and its plan goes out at once."""
    try:
        with control.client() as c:
            groups = c.xinfo_groups(f"{t.prefix}:samples")
    except Exception:  # the run's primary busy or restarting: not now
        return False
    lag = next((g.get("lag") for g in groups if g.get("name") in ("trainer", b"trainer")), None)
    return lag is not None and int(lag) >= batch_groups


def _signal_nodes(nodes: list[Any], sig: int) -> None:
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(sig)


def kill_reader_in_fetch(t: Target, tries: int = 3, hold_s: float = 4.0) -> Injection:
    """SIGKILL data-parallel rank 1 while its fetch waits on a stopped primary (module docstring, ``reader``)."""
    if t.redis_cluster is None:
        return Injection(note="the reader kind needs the queue on a Redis Cluster (--redis cluster)")
    k, delay, reached = _after_random_step(t, 0.5)
    if not reached:
        return Injection(note=f"the run ended before step {k}")
    control, held = _payload_primaries(t)
    if not held:
        return Injection(note="no payload shard lies off the run's own primary: nothing to hold a fetch with")
    ports = {n.port for n in held}
    batch = int(json.loads(config_path(t.run_dir).read_text())["trainer"]["batch_groups"])
    for attempt in range(1, tries + 1):
        reader = find_process(t.run_dir, "trainer", rank=1)
        if reader is None:
            return Injection(note="no live trainer rank 1 found")
        # Held while the trainer waits for data, the primaries would stop the puts it waits for, and no plan (so no
        # fetch) would come until they are continued.
        wait_for(lambda: _batch_waiting(t, control, batch) or t.launcher.poll() is not None, 30, 0.05)
        before = len(rows(t.run_dir))
        _signal_nodes(held, signal.SIGSTOP)
        try:
            blocked = wait_for(lambda r=reader: bool(requests_unanswered(r, ports)) or t.launcher.poll() is not None,
                               hold_s, 0.02) and t.launcher.poll() is None
            if blocked or attempt == tries:
                on = requests_unanswered(reader, ports)
                inj = _kill(reader, len(rows(t.run_dir)), "trainer rank 1 (reader)",
                            f"after step {k} + {delay:.2f}s, try {attempt}, {len(held)} primaries held; "
                            + (f"rank 1 waiting on {sorted(on)}" if on else "rank 1 not waiting on a held primary"))
                inj.landed = inj.landed and bool(on)
                try:
                    reader.wait(5)  # gone before the primaries answer: the fetch it sent never returns to it
                except psutil.Error:
                    pass
                return _in_training(t, inj)
        finally:
            _signal_nodes(held, signal.SIGCONT)
        # Its share of this step lay on the running primary: let the step finish and try the next one.
        wait_for(lambda b=before: len(rows(t.run_dir)) > b or t.launcher.poll() is not None, 60, 0.05)
    return Injection(note="unreachable")  # the last try always kills


INJECTORS: dict[str, Callable[[Target], Injection]] = {
    "producer": kill_role("producer"),
    "engine": kill_role("engine"),
    "trainer-step": kill_role("trainer"),
    "trainer-checkpoint": kill_in_checkpoint,
    "trainer-push": kill_in_push,
    "archiver": kill_role("archiver"),
    "evaluator": kill_role("evaluator"),
    "redis": kill_redis,
    "ray-node": remove_node,
    "trainer-rank": kill_role("trainer", rank=1),
    "trainer-rank0": kill_role("trainer", rank=0),
    "trainer-engine": kill_trainer_and_engine,
    "reader": kill_reader_in_fetch,
}

#: The process the supervisor restarts after each kind (its next line in placements.jsonl), if any.
RESTARTED = {"producer": "producer-0", "engine": "engine-0", "trainer-step": "trainer-0",
             "trainer-checkpoint": "trainer-0", "trainer-push": "trainer-0", "archiver": "archiver",
             "evaluator": "evaluator", "ray-node": "trainer-0", "trainer-rank": "trainer-1",
             "trainer-rank0": "trainer-0", "trainer-engine": "trainer-0", "reader": "trainer-1"}


def restarted_at(run_dir: Path, name: str, after: float) -> float | None:
    path = placements_path(run_dir)
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if d["name"] == name and float(d["at"]) > after:
            return float(d["at"])
    return None


def environ_for_run() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1")
