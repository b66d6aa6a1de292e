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
import redis

from pipeline.rundir import TMP_SUFFIX, checkpoint_path, placements_path, redis_dir, trainer_metrics_path

KINDS = ("producer", "engine", "trainer-step", "trainer-checkpoint", "trainer-push", "archiver", "evaluator", "redis",
         "ray-node", "trainer-rank", "trainer-rank0", "trainer-engine")


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
    client = redis.Redis.from_url(url, protocol=2, socket_timeout=2)
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
}

#: The process the supervisor restarts after each kind (its next line in placements.jsonl), if any.
RESTARTED = {"producer": "producer-0", "engine": "engine-0", "trainer-step": "trainer-0",
             "trainer-checkpoint": "trainer-0", "trainer-push": "trainer-0", "archiver": "archiver",
             "evaluator": "evaluator", "ray-node": "trainer-0", "trainer-rank": "trainer-1",
             "trainer-rank0": "trainer-0", "trainer-engine": "trainer-0"}


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
