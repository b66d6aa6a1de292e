"""``sluice bench cluster-faults``: exactly once at queue level under Redis Cluster faults, one fault per trial.

A trial runs the queue's real parts against a real Redis Cluster (``pipeline.queue.local_cluster``: three primaries,
plus one replica each for the failover kinds, every node with ``appendfsync always``, which is what
``queue.durability = "safe"`` demands of every primary) in three processes under a small supervisor that restarts
whatever dies:

- a **producer** admits groups through the producers' own pacing scripts (a slot per group, the budget
  ``(version + max_lag + 1) * batch_groups``, the prompt taken from ``prompt_retry`` first), puts each group with
  ``SampleQueue.put`` (payload first, then the header script) and moves its slot record to ``group_slots``. Its
  samples are synthetic but well formed, of a realistic size (``payload_spread.synthetic_group``: 8 samples of 128
  prompt and 512 response tokens with top-4-of-64 routing over 8 layers, about 25 KB a sample), re-stamped with ids
  per group so that making them costs nothing. It writes what it is about to put, and what it put, to ``puts.jsonl``.
- a **trainer** runs the drain and commit loop: ``Drainer.recover``, ``Drainer.next_batch``, a ledger line per
  sample, the version advanced once a step through the run's version key (``RedisClock.advance``, as the trainer's
  push does), and every ``commit_every`` steps the commit: ledger segment, checkpoint folder renamed into place,
  ``Ledger.mark_committed``, ``Drainer.ack``.
- a **trimmer** calls ``SampleQueue.trim`` every ``trim_every_s``, as the launcher does.

The trial's fault (``FAULTS``) is injected at a moment drawn from the trial's seed. Then everything finishes: once
every prompt is trained (or progress stalls for ``stall_s``) the producer and the trimmer stop, the trainer drains
what is left, commits and acks, and the harness trims one last time. The checks, from the committed ledger,
``puts.jsonl``, the dead-letter stream and every primary's keys:

- trained twice: sample ids with more than one committed ledger line, and prompts trained in two groups;
- lost: prompts never trained, and acknowledged puts whose group is neither trained nor dead-lettered;
- every dead-lettered group's prompt handed back (taken again by the producer from ``prompt_retry``);
- the policy version never went back: a thread reads it every 20 ms throughout, and the trainer's advances must
  strictly increase;
- after the final trim: no payload key of the run on any primary (``SCAN``), the trash set empty, the stream empty,
  nothing pending; and ``sluice queue audit``'s trainer check (``audit_trainer``) before that trim.

Adding a kind (say, killing a data-parallel reader mid-fetch): subclass ``Fault``, name the replicas it needs, give
extra processes through ``extra_roles`` (a role is a function of ``RoleSpec`` in ``cluster_fault_roles.ROLES``, run as
``python -m pipeline.benchmarks.cluster_fault_roles --role NAME --spec FILE``), set a role's environment for its first
start in ``role_env`` (how ``trimmer`` opens its window), and implement ``inject``, which waits for its moment
(``Trial.wait_step``), strikes (``Trial.kill_role``, ``Trial.cluster``) and returns an ``Injection``; then register
it in ``FAULTS``. The checks apply unchanged.

See docs/faults.md, "Redis Cluster faults", and benchmarks/README.md for the counts measured.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from pipeline.benchmarks.cluster_fault_roles import (
    GROUP,
    TRIM_PAUSE_AT_ENV,
    TRIM_PAUSE_ENV,
    RoleSpec,
    TrialPaths,
    read_json,
    read_puts,
    write_json_atomic,
)
from pipeline.errors import QueueError, SluiceError

log = logging.getLogger(__name__)

class TrialError(SluiceError):
    """A trial could not be run (not: a check failed, which the trial's record says)."""


@dataclass
class ClusterFaultsParams:
    """What one ``sluice bench cluster-faults`` runs."""

    kind: str = "trimmer"
    """Comma-separated fault kinds: trimmer, master-kill, failover, failover-kill, trainer."""
    trials: int = 20
    """Trials per kind (seeds seed, seed+1, ...)."""
    seed: int = 0
    """The first trial's seed: the fault's moment and victim."""
    groups: int = 200
    """Prompts per trial; each is trained once (in one group of group_size samples)."""
    group_size: int = 8
    response_tokens: int = 512
    """Response length of the synthetic samples (sets their size: about 25 KB a sample at 512)."""
    batch_groups: int = 4
    """Groups per trainer step."""
    commit_every: int = 4
    """Steps per commit (ledger segment, checkpoint, acks)."""
    max_lag: int = 2
    """The producer's pacing: at most (version + max_lag + 1) * batch_groups groups admitted."""
    capacity: int = 64
    """The queue's capacity (undelivered entries before a put blocks)."""
    trim_every_s: float = 0.3
    stall_s: float = 30.0
    """A trial whose trainer commits no new prompt for this long (after the fault) is wound up and counted."""
    timeout_s: float = 240.0
    """Wall time one trial may take."""
    out: str = "benchmarks/results/cluster-faults.json"
    """The record; trials of the kinds run here replace that kind's trials in it ("" writes none)."""
    folder: str = ""
    """Where trials run ("": a temporary folder, removed after each trial unless keep)."""
    keep: bool = False
    """Keep each trial's folder (logs, ledger, cluster AOFs)."""


# ================================================================================================= the supervisor
class Supervisor:
    """Starts the role processes and restarts any that dies (as the launcher would), by the PIDs it started."""

    def __init__(self, paths: TrialPaths, env_first: dict[str, dict[str, str]], max_restarts: int = 30) -> None:
        self.paths = paths
        self.env_first = env_first
        self.max_restarts = max_restarts
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: Counter[str] = Counter()
        self.finished: set[str] = set()
        self._lock = threading.Lock()
        (paths.root / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, role: str) -> None:
        env = {**os.environ, **(self.env_first.get(role, {}) if role not in self.restarts else {})}
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(self.paths.log(role), "ab") as log_file:
            self.procs[role] = subprocess.Popen(
                [sys.executable, "-m", "pipeline.benchmarks.cluster_fault_roles", "--role", role, "--spec",
                 str(self.paths.spec)], stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)

    def poll(self) -> None:
        """Restart the roles that died (a non-zero exit or a signal); note those that finished (exit 0)."""
        with self._lock:
            for role, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None or role in self.finished:
                    continue
                if code == 0:
                    self.finished.add(role)
                    continue
                self.restarts[role] += 1
                if self.restarts[role] > self.max_restarts:
                    raise TrialError(f"{role} died {self.restarts[role]} times (last exit {code}); see "
                                     f"{self.paths.log(role)}")
                self.start(role)

    def kill(self, role: str) -> int:
        """SIGKILL a role's process; the next ``poll`` restarts it. Returns its PID."""
        with self._lock:
            proc = self.procs[role]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return proc.pid

    def alive(self, role: str) -> bool:
        return role in self.procs and self.procs[role].poll() is None

    def stop(self) -> None:
        """Kill every process still running, by its PID."""
        with self._lock:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                proc.wait()


class VersionSampler(threading.Thread):
    """Reads the run's policy version every ``every_s`` through a client of its own, and counts every reading below
    the highest one before it."""

    def __init__(self, url: str, key: str, every_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        from pipeline.queue.connection import connect

        self.client, self.key, self.every_s = connect(url), key, every_s
        self.readings = 0
        self.went_back = 0
        self.max_drop = 0
        self.highest = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            try:
                raw = self.client.get(self.key)
            except (redis.RedisError, RedisClusterException, QueueError):
                continue  # the node is down or moving; the next reading retries
            v = int(raw) if raw is not None else 0
            self.readings += 1
            if v < self.highest:
                self.went_back += 1
                self.max_drop = max(self.max_drop, self.highest - v)
            self.highest = max(self.highest, v)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


# ===================================================================================================== the trials
@dataclass
class Injection:
    """Where a fault landed."""

    landed: bool = False
    """Whether the fault hit the window its kind names (see each kind)."""
    victim: str = ""
    at_step: int = -1
    """The trainer's committed step when it struck."""
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)


class Trial:
    """One trial's cluster, queue handle, processes and files, for a fault to act on."""

    def __init__(self, params: ClusterFaultsParams, kind: str, seed: int, folder: Path, replicas: int) -> None:
        from pipeline.queue.local_cluster import LocalCluster

        self.params, self.kind, self.seed = params, kind, seed
        self.paths = TrialPaths(folder)
        self.run = f"cf-{kind}-{seed}"
        self.cluster = LocalCluster(masters=3, replicas=replicas, appendfsync="always", folder=folder / "cluster")
        self.queue: Any = None
        self.supervisor: Supervisor | None = None

    @property
    def sup(self) -> Supervisor:
        if self.supervisor is None:
            raise TrialError("the trial's processes have not been started")
        return self.supervisor

    def progress(self) -> dict[str, Any]:
        return read_json(self.paths.progress)

    def done(self) -> bool:
        return bool(self.progress().get("done"))

    def wait_step(self, step: int, timeout_s: float = 120.0) -> int:
        """Until the trainer has committed ``step`` (or everything); returns the committed step then."""
        deadline = time.monotonic() + timeout_s
        while True:
            p = self.progress()
            if p.get("committed_step", -1) >= step or p.get("done"):
                return int(p.get("committed_step", -1))
            if time.monotonic() > deadline:
                raise TrialError(f"the trainer did not commit step {step} within {timeout_s:.0f} s")
            time.sleep(0.05)

    def kill_role(self, role: str) -> int:
        return self.sup.kill(role)

    def control_primary(self) -> Any:
        """The primary that holds the run's own tag: the stream, the version, the pacing keys and the trash."""
        return self.cluster.primary_for(self.queue.keys.samples)

    def draw_primary(self, rng: random.Random) -> tuple[Any, bool]:
        """The victim of a node fault: the control tag's primary in trials of even seed, another (which holds only
        payload shards) in odd ones, so that both are covered whatever the number of trials."""
        control = self.control_primary()
        if self.seed % 2 == 0:
            return control, True
        others = [n for n in self.cluster.primaries() if n.port != control.port]
        return rng.choice(sorted(others, key=lambda n: n.port)), False

    def shards_on(self, node: Any) -> int:
        return sum(self.cluster.primary_for(f"{{{tag}}}").port == node.port for tag in self.queue.shard_tags())

    def draw_step(self, rng: random.Random) -> int:
        """A committed step to strike after: somewhere in the first 60% of the trial."""
        steps = max(1, self.params.groups // self.params.batch_groups)
        return rng.randint(0, max(0, int(0.6 * steps) - 1))


class Fault:
    """One kind of fault: the replicas it needs, any extra processes, and its injection."""

    name = ""
    replicas = 0
    extra_roles: tuple[str, ...] = ()
    hold_last = True
    """Whether the producer holds the last prompt until the strike, so that the trial's work is still in flight
    when it comes however fast the machine trains (a strike drawn after the last commit would find nothing)."""

    def role_env(self, trial: Trial, rng: random.Random) -> dict[str, dict[str, str]]:
        """Environment of each role's first start (not of its restarts)."""
        return {}

    def inject(self, trial: Trial, rng: random.Random) -> Injection:
        raise NotImplementedError


class TrimmerKill(Fault):
    """SIGKILL the trimmer between its two moves. It pauses at its k-th pass with a non-empty trash (k drawn from
    1-4, fewer in a trial of few commits), after the header script moved the dropped headers' payload keys to the
    trash and before it deletes the payloads. Landed: killed there with the trash non-empty, still so right after
    the kill."""

    name = "trimmer"
    hold_last = False  # its window is the trimmer's own pause, and the last commit's trim may be the one it needs

    def role_env(self, trial: Trial, rng: random.Random) -> dict[str, dict[str, str]]:
        p = trial.params
        commits = p.groups // (p.batch_groups * p.commit_every)  # a trim finds a non-empty trash about once each
        at = rng.randint(1, max(1, min(4, commits // 2)))
        return {"trimmer": {TRIM_PAUSE_ENV: str(trial.paths.trim_paused), TRIM_PAUSE_AT_ENV: str(at)}}

    def inject(self, trial: Trial, rng: random.Random) -> Injection:
        deadline = time.monotonic() + trial.params.timeout_s / 2
        # Not given up when the trial's work is done: the trimmer runs until the harness stops it, which waits for
        # this, and the last commit's acks give it a non-empty trash once more.
        while not trial.paths.trim_paused.exists():
            if time.monotonic() > deadline:
                return Injection(note="the trimmer never paused with a non-empty trash")
            time.sleep(0.02)
        paused = read_json(trial.paths.trim_paused)
        pid = trial.kill_role("trimmer")
        left = int(trial.queue.redis.scard(trial.queue.keys.payload_trash))
        return Injection(landed=paused.get("trash", 0) > 0 and left > 0, victim=f"trimmer pid {pid}",
                         at_step=int(trial.progress().get("committed_step", -1)),
                         note=f"killed between the moves with {paused.get('trash')} payload keys in the trash "
                              f"({left} still there after the kill)", details={"trash": paused.get("trash"),
                                                                               "trash_after_kill": left})


class MasterKill(Fault):
    """SIGKILL a primary (the control tag's in even seeds, a payload-only one in odd ones) after a drawn step, keep it
    down 0.5-3 s, restart it on its folder (its AOF and nodes.conf). Landed: killed while the trial's work was in
    flight. Its key counts before the kill and after the restart are recorded."""

    name = "master-kill"

    def inject(self, trial: Trial, rng: random.Random) -> Injection:
        victim, control = trial.draw_primary(rng)
        shards = trial.shards_on(victim)
        at = trial.wait_step(trial.draw_step(rng))
        time.sleep(rng.uniform(0.0, 0.5))
        in_flight = not trial.done()
        with victim.client() as c:
            keys_before = int(c.dbsize())
        trial.cluster.kill(victim)
        down = rng.uniform(0.5, 3.0)
        time.sleep(down)
        trial.cluster.restart(victim)
        with victim.client() as c:
            keys_after = int(c.dbsize())
        # Not "back with keys": a payload-only primary holds none once the trim has caught up with it.
        return Injection(landed=in_flight, victim=victim.name, at_step=at,
                         note=f"{'control-tag' if control else 'payload-only'} primary ({shards} shard tags) down "
                              f"{down:.1f} s; {keys_before} keys before the kill, {keys_after} after the restart",
                         details={"control": control, "shards": shards, "down_s": round(down, 2),
                                  "keys_before": keys_before, "keys_after": keys_after})


class Failover(Fault):
    """A primary's replica takes over (the control tag's primary in even seeds, a payload-only one in odd ones).
    ``kill=False``: ``CLUSTER FAILOVER`` on the replica, the coordinated manual failover (the primary stops writes
    until the replica has caught up). ``kill=True``: SIGKILL the primary, the replica is elected after the node
    timeout (2 s), and the old primary is restarted on its folder and rejoins as a replica. Landed: the replica
    served the slots while the trial's work was in flight. Records how many bytes of replication stream the replica
    lacked just before the strike (an upper bound: the primary's offset is read second)."""

    replicas = 1

    def __init__(self, kill: bool) -> None:
        self.kill = kill
        self.name = "failover-kill" if kill else "failover"

    def inject(self, trial: Trial, rng: random.Random) -> Injection:
        victim, control = trial.draw_primary(rng)
        shards = trial.shards_on(victim)
        replica = trial.cluster.replicas_of(victim)[0]
        at = trial.wait_step(trial.draw_step(rng))
        time.sleep(rng.uniform(0.0, 0.5))
        in_flight = not trial.done()
        # The replica's offset first: the difference is then at least what it lacked at the strike (an upper bound).
        replica_at = int(replica.info("replication").get("slave_repl_offset", 0))
        behind = int(victim.info("replication")["master_repl_offset"]) - replica_at
        began = time.monotonic()
        if self.kill:
            trial.cluster.kill(victim)
            trial.cluster.wait_promoted(replica)
            took = time.monotonic() - began
            trial.cluster.restart(victim)
        else:
            trial.cluster.failover(replica)
            took = time.monotonic() - began
        return Injection(landed=in_flight and replica.info("replication").get("role") == "master",
                         victim=victim.name, at_step=at,
                         note=f"{'control-tag' if control else 'payload-only'} primary ({shards} shard tags) "
                              f"{'killed' if self.kill else 'failed over'}; replica {replica.name} serving after "
                              f"{took:.1f} s; replica {behind} bytes behind at the strike",
                         details={"control": control, "shards": shards, "replica": replica.name,
                                  "takeover_s": round(took, 2), "replica_behind_bytes": behind,
                                  "control_now_on": trial.control_primary().name})


class TrainerKill(Fault):
    """SIGKILL the trainer after a drawn step with work not yet committed (at least one step since its last commit),
    so that its restart must recover: redo what was pending, ack what the ledger already holds. Not a Redis fault;
    it is what would catch a drain that acked before the commit. Landed: killed with steps uncommitted."""

    name = "trainer"

    def inject(self, trial: Trial, rng: random.Random) -> Injection:
        at = trial.wait_step(trial.draw_step(rng))
        deadline = time.monotonic() + 60
        # Until a step past the last commit is trained (versions.jsonl gets a line per step trained).
        while time.monotonic() < deadline and not trial.done():
            if self._last_step(trial) > int(trial.progress().get("committed_step", -1)) >= at:
                break
            time.sleep(0.01)
        in_flight = not trial.done()
        pid = trial.kill_role("trainer")
        trained, committed = self._last_step(trial), int(trial.progress().get("committed_step", -1))
        return Injection(landed=in_flight and trained > committed, victim=f"trainer pid {pid}", at_step=committed,
                         note=f"killed with {trained - committed} steps trained since the commit of step "
                              f"{committed}")

    @staticmethod
    def _last_step(trial: Trial) -> int:
        path = trial.paths.versions
        lines = path.read_text().splitlines() if path.exists() else []
        try:
            return int(json.loads(lines[-1])["step"]) if lines else -1
        except ValueError:
            return -1  # a line being written


FAULTS: dict[str, Fault] = {f.name: f for f in (TrimmerKill(), MasterKill(), Failover(kill=False),
                                                Failover(kill=True), TrainerKill())}
"""Every fault kind, by name (``--kind``)."""
KINDS = tuple(FAULTS)


def run_trial(params: ClusterFaultsParams, kind: str, seed: int, folder: Path) -> dict[str, Any]:
    """One trial: start everything, inject, let it finish, check. Returns its record."""
    from pipeline.queue.connection import check_fsync_always, connect
    from pipeline.queue.redis_streams import SampleQueue

    fault = FAULTS[kind]
    rng = random.Random(f"{kind}:{seed}")
    trial = Trial(params, kind, seed, folder, fault.replicas)
    began = time.monotonic()
    sampler: VersionSampler | None = None
    injected: dict[str, Any] = {}
    try:
        trial.cluster.start()
        client = connect(trial.cluster.url)
        # queue.durability = "safe" on a cluster: every primary must fsync before it answers.
        if not check_fsync_always(client, trial.cluster.url):
            raise TrialError("could not read the primaries' appendfsync to check it")
        trial.queue = SampleQueue(client, trial.run, capacity=params.capacity)
        trial.queue.create_group(GROUP, "0")
        trial.queue.shard_tags()  # chosen now, so that a fault can pick its victim by them
        spec = RoleSpec(url=trial.cluster.url, run=trial.run, folder=str(folder), groups=params.groups,
                        group_size=params.group_size, response_tokens=params.response_tokens,
                        batch_groups=params.batch_groups, commit_every=params.commit_every, max_lag=params.max_lag,
                        capacity=params.capacity, trim_every_s=params.trim_every_s, seed=seed,
                        hold_last=fault.hold_last)
        write_json_atomic(trial.paths.spec, asdict(spec))
        sampler = VersionSampler(trial.cluster.url, trial.queue.keys.policy_version)
        sampler.start()
        trial.supervisor = Supervisor(trial.paths, fault.role_env(trial, rng))
        for role in ("trainer", "producer", "trimmer", *fault.extra_roles):
            trial.sup.start(role)

        def strike() -> None:
            try:
                injected["injection"] = fault.inject(trial, rng)
            except Exception as e:  # reported in the trial's record, never swallowed
                injected["error"] = f"{type(e).__name__}: {e}"
                log.exception("the %s fault of seed %d failed", kind, seed)
            injected["ended"] = time.monotonic()
            trial.paths.struck.touch()

        injected["processes_started_s"] = round(time.monotonic() - began, 1)
        striker = threading.Thread(target=strike, daemon=True)
        striker.start()
        outcome = _supervise(trial, striker, began)
        striker.join(timeout=60)
        trial.cluster.wait_ok()
        record = _check(trial, sampler, outcome)
    except Exception as e:
        # A trial that could not run is recorded as such (and fails the bench), so that a run of 20 goes on.
        log.exception("trial %s/%d could not run", kind, seed)
        record = {"error": f"{type(e).__name__}: {e}", "ok": False}
    finally:
        if sampler is not None:
            sampler.stop()
        if trial.supervisor is not None:
            trial.supervisor.stop()
        trial.cluster.stop()
    inj = injected.get("injection") or Injection(note=injected.get("error", "no injection"))
    if "timeline" in record:
        record["timeline"]["processes_started_s"] = injected.get("processes_started_s")
        record["timeline"]["struck_s"] = round(injected["ended"] - began, 1) if "ended" in injected else None
    record.update(kind=kind, seed=seed, seconds=round(time.monotonic() - began, 1), landed=inj.landed,
                  victim=inj.victim, at_step=inj.at_step, note=inj.note, details=inj.details,
                  restarts=dict(trial.supervisor.restarts) if trial.supervisor is not None else {})
    if "error" in injected:
        record["fault_error"] = injected["error"]
        record["ok"] = False
    return record


def _supervise(trial: Trial, striker: threading.Thread, began: float) -> dict[str, Any]:
    """Restart what dies until every prompt is trained (or progress stalls), then wind the trial up: the producer
    and the trimmer stop, the trainer drains what is left, commits, acks and exits."""
    p = trial.params
    deadline = time.monotonic() + p.timeout_s
    phase, stalled, timed_out = "run", False, False
    seen, last_change = None, time.monotonic()
    timeline: dict[str, float] = {}
    while True:
        trial.sup.poll()
        now = time.monotonic()
        prog = trial.progress()
        if (mark := (prog.get("prompts"), prog.get("committed_step"))) != seen:
            seen, last_change = mark, now
            if prog.get("committed_step", -1) >= 0:
                timeline.setdefault("first_commit_s", round(now - began, 1))
        if phase == "run" and not striker.is_alive():
            stalled = now - last_change > p.stall_s
            if prog.get("done") or stalled:
                trial.paths.stop.touch()
                phase = "stopping"
                timeline["stop_s"] = round(now - began, 1)
        elif phase == "stopping" and {"producer", "trimmer"} <= trial.sup.finished:
            trial.paths.finish.touch()
            phase = "finishing"
            timeline["finish_s"] = round(now - began, 1)
        elif phase == "finishing" and "trainer" in trial.sup.finished:
            timeline["trainer_exit_s"] = round(now - began, 1)
            break
        if now > deadline:
            timed_out = True
            break
        time.sleep(0.1)
    return {"stalled": stalled, "timed_out": timed_out, "timeline": timeline}


def _check(trial: Trial, sampler: VersionSampler, outcome: dict[str, Any]) -> dict[str, Any]:
    """Every check of a finished trial (docs/faults.md, "Redis Cluster faults")."""
    from pipeline.consumers.trainer.audit import audit_trainer
    from pipeline.consumers.trainer.ledger import read_ledger
    from pipeline.queue.codec import decode_header
    from pipeline.rundir import latest_checkpoint, ledger_dir

    queue, paths, groups_wanted = trial.queue, trial.paths, trial.params.groups
    sampler.stop()
    audit = audit_trainer(queue, paths.run_dir, GROUP)  # what `sluice queue audit` says, before the final trim
    latest = latest_checkpoint(paths.run_dir)
    step = int(json.loads((latest / "meta.json").read_text())["step"]) if latest is not None else -1
    lines = list(read_ledger(ledger_dir(paths.run_dir), upto_step=step))
    per_sample = Counter(line.sample_id for line in lines)
    puts, group_of = read_puts(paths.puts)
    trained_groups = {group_of.get(line.sample_id, "?") for line in lines if line.fate == "trained"}
    trained_prompts = Counter(puts[g]["prompt"] for g in trained_groups if g in puts)
    dead: dict[str, str] = {}
    for row in queue.dead_letters():
        try:
            dead[decode_header(row["orig:head"])[0].group_id] = row["reason"]
        except (KeyError, SluiceError):
            dead[f"?{row['id']}"] = row.get("reason", "")
    # A dead-lettered group's prompt is handed back if the producer took that prompt again afterwards, as a retry.
    handed_back = sum(any(q["prompt"] == puts[g]["prompt"] and q["retry"] and q["order"] > puts[g]["order"]
                          for q in puts.values()) for g in dead if g in puts)
    acked = [g for g, q in puts.items() if q["acked"]]
    lost_groups = [g for g in acked if g not in trained_groups and g not in dead]
    lost_prompts = [i for i in range(groups_wanted) if not trained_prompts[i]]
    versions = [json.loads(x)["version"] for x in paths.versions.read_text().splitlines()] \
        if paths.versions.exists() else []
    queue.trim()  # the final trim
    k = queue.keys
    left = trial.cluster.scan(f"sluice:{{{trial.run}}}:payload:*")
    for node, keys in trial.cluster.scan(f"sluice:{{{trial.run}/*}}:payload:*").items():
        left[node] = left.get(node, []) + keys
    pending = queue.pending_ids(GROUP)
    rec = {
        "groups_put": len(acked), "intents": len(puts), "prompts": groups_wanted,
        "trained_samples": sum(1 for line in lines if line.fate == "trained"),
        "trained_twice": sum(1 for c in per_sample.values() if c > 1),
        "prompts_trained_twice": sum(1 for c in trained_prompts.values() if c > 1),
        "lost": len(lost_prompts) + len(lost_groups), "lost_prompts": lost_prompts[:20],
        "lost_groups": lost_groups[:20],
        "dead_lettered": len(dead), "dead_letter_reasons": sorted(set(dead.values()))[:5],
        "dead_lettered_handed_back": handed_back,
        "prompts_handed_back": sum(1 for q in puts.values() if q["retry"]),
        "prompt_retry_left": int(queue.redis.llen(k.prompt_retry)),
        "version_went_back": sampler.went_back, "version_max_drop": sampler.max_drop,
        "version_readings": sampler.readings,
        "trainer_versions_increasing": all(b > a for a, b in zip(versions, versions[1:])),
        "final_version": queue.policy_version(),
        "payload_keys_left": sum(len(v) for v in left.values()),
        "payload_keys_left_sample": [key for v in left.values() for key in v][:5],
        "trash_left": int(queue.redis.scard(k.payload_trash)),
        "unacked_left": len(pending), "stream_left": int(queue.redis.xlen(k.samples)),
        "undelivered_left": int(queue.lag(GROUP) or 0),
        "audit": {"duplicates": audit.duplicates, "lost": audit.lost, "pending": audit.pending,
                  "committed_step": audit.committed_step},
        **outcome,
    }
    rec["ok"] = (rec["trained_twice"] == 0 and rec["prompts_trained_twice"] == 0 and rec["lost"] == 0
                 and rec["dead_lettered_handed_back"] == len(dead) and rec["version_went_back"] == 0
                 and rec["trainer_versions_increasing"] and rec["payload_keys_left"] == 0 and rec["trash_left"] == 0
                 and rec["unacked_left"] == 0 and rec["stream_left"] == 0 and rec["undelivered_left"] == 0
                 and audit.duplicates == 0 and audit.lost == 0 and not outcome["timed_out"])
    return rec


# ======================================================================================================== the bench
SUMMED = ("trained_twice", "prompts_trained_twice", "lost", "version_went_back", "payload_keys_left", "trash_left",
          "unacked_left", "stream_left", "dead_lettered", "dead_lettered_handed_back", "prompts_handed_back")


def summarize(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind: trials, faults landed, passed, and each count summed over the trials."""
    out = []
    for kind in dict.fromkeys(t["kind"] for t in trials):
        mine = [t for t in trials if t["kind"] == kind]
        row: dict[str, Any] = {"kind": kind, "trials": len(mine), "landed": sum(bool(t.get("landed")) for t in mine),
                               "ok": sum(bool(t.get("ok")) for t in mine),
                               "errors": sum("error" in t or "fault_error" in t for t in mine)}
        row.update({name: sum(int(t.get(name, 0)) for t in mine) for name in SUMMED})
        row["version_max_drop"] = max((int(t.get("version_max_drop", 0)) for t in mine), default=0)
        out.append(row)
    return out


@contextmanager
def trial_folder(params: ClusterFaultsParams, kind: str, seed: int) -> Iterator[Path]:
    """A fresh folder for a trial, removed afterwards unless kept."""
    root = Path(params.folder) if params.folder else None
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"cf-{kind}-{seed}-", dir=root))
    try:
        yield folder
    finally:
        if not params.keep:
            shutil.rmtree(folder, ignore_errors=True)


def run_cluster_faults(params: ClusterFaultsParams, echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    kinds = [k.strip() for k in params.kind.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown or not kinds:
        raise TrialError(f"unknown fault kinds {unknown or params.kind!r}; choose from {', '.join(KINDS)}")
    trials = []
    for kind in kinds:
        for seed in range(params.seed, params.seed + params.trials):
            with trial_folder(params, kind, seed) as folder:
                rec = run_trial(params, kind, seed, folder)
                if params.keep:
                    rec["folder"] = str(folder)
            trials.append(rec)
            if echo is not None:
                echo(trial_line(rec))
    res = {"benchmark": "cluster-faults", "params": asdict(params), "redis_version": _redis_version(),
           "trials": trials, "summary": summarize(trials)}
    if params.out:
        res = _merge_into(Path(params.out), res, kinds)
    return res


def _redis_version() -> str:
    from pipeline.queue.local_cluster import cluster_binaries

    found = cluster_binaries()
    return subprocess.run([found[0], "--version"], capture_output=True, text=True).stdout.strip() if found else ""


def _merge_into(path: Path, res: dict[str, Any], kinds: list[str]) -> dict[str, Any]:
    """The record at ``path`` with this run's kinds replaced by its trials; written back."""
    old = read_json(path)
    trials = [t for t in old.get("trials", []) if t.get("kind") not in kinds] + res["trials"]
    params = {**old.get("params_by_kind", {}), **{k: res["params"] for k in kinds}}
    merged = {"benchmark": "cluster-faults", "redis_version": res["redis_version"], "params_by_kind": params,
              "summary": summarize(trials), "trials": trials}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    return {**res, "summary": merged["summary"], "written": str(path)}


def trial_line(t: dict[str, Any]) -> str:
    if "error" in t:
        return f"{t['kind']:13s} seed {t['seed']:3d}  ERROR {t['error']}"
    return (f"{t['kind']:13s} seed {t['seed']:3d}  {'ok  ' if t['ok'] else 'FAIL'} landed={int(t['landed'])} "
            f"twice={t['trained_twice']} lost={t['lost']} dead={t['dead_lettered']} back={t['prompts_handed_back']} "
            f"vback={t['version_went_back']} keys={t['payload_keys_left']} unacked={t['unacked_left']} "
            f"{t['seconds']:.0f}s  {t['note']}")


def summary_lines(res: dict[str, Any]) -> list[str]:
    head = ("kind", "trials", "landed", "ok", "twice", "lost", "v back", "keys left", "unacked", "dead-lettered",
            "handed back")
    rows = [" | ".join(head)]
    for s in res["summary"]:
        rows.append(" | ".join(str(x) for x in (s["kind"], s["trials"], s["landed"], s["ok"], s["trained_twice"],
                                                s["lost"], s["version_went_back"], s["payload_keys_left"],
                                                s["unacked_left"], s["dead_lettered"], s["prompts_handed_back"])))
    return rows


def cmd(args: Any) -> int:
    """``sluice bench cluster-faults``."""
    params = ClusterFaultsParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ClusterFaultsParams)})
    res = run_cluster_faults(params, echo=None if args.json else lambda line: print(line, flush=True))
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        print("\n".join(summary_lines(res)))
    return 0 if all(s["ok"] == s["trials"] for s in res["summary"]) else 1
