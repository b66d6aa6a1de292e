"""``sluice bench faults``: SIGKILL a part of a live ``sluice run`` at a random moment, let the run recover, and check
from the raw data that nothing was lost or trained twice.

A trial is one short ``sluice run`` of the CPU recipe (``recipes/cpu-moe.toml`` cut down: no warm start, 4 groups a
step, a checkpoint every 4 steps, the archiver and the stream evaluator on) under a seed. The kind's injector
(``pipeline.benchmarks.fault_kinds``) kills its victim at a moment drawn from that seed. The launcher's supervisor
restarts what died; if the launcher itself gives up (a non-zero exit), the same command is run again, which resumes
the run, and the trial counts a resume. Afterwards ``pipeline.benchmarks.fault_check`` checks, from Redis, the ledger
and the archive and without sluice's own readers:

- lost: samples that reached the stream (the harness's own consumer group saw them) and are neither in the committed
  ledger (trained, stale, invalid, filtered), nor dead-lettered, nor still waiting for the trainer (pending or not yet
  delivered);
- duplicated: samples with more than one committed ledger line;
- versions: ``weight_push`` events strictly increasing and ending at Redis's ``policy_version``; the newest
  checkpoint's version at most that and matching its ``checkpoint`` event; ledger versions increasing with the step;
- archive: every entry that reached the stream is archived exactly once with the same samples, except those the
  archiver had not read yet;
- finished: the launcher exited 0 with the newest checkpoint at the last step.

It also checks what a finished run leaves behind (no payload key that no stream entry names, on any server, an empty
trash, nothing delivered and never acked in any group) and records what ``sluice queue audit`` says of the trainer.

The queue is the run's embedded Redis, or (``redis = "cluster"``) a fresh three-primary Redis Cluster per trial
(``pipeline.queue.local_cluster``, ``appendfsync always`` on every node, checked by ``queue.durability = "safe"``).

It also measures: wasted (stale drops beyond those of a no-fault baseline trial of the same seed, which trains the
same steps), time to recover (from the kill to the next trained step) and the victim's restart (from the
kill to its next placement). See docs/faults.md, "The fault-injection harness".
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.benchmarks.fault_kinds import (
    CLUSTER_ONLY,
    EMBEDDED_ONLY,
    INJECTORS,
    KINDS,
    RESTARTED,
    Injection,
    Target,
    environ_for_run,
    restarted_at,
    rows,
)
from pipeline.rundir import redis_dir

BASELINE = "none"
REDIS_MODES = ("embedded", "cluster")
#: A trial's cluster notices a silent node only after this long. The reader kind stops primaries (SIGSTOP) for a
#: few seconds to hold a fetch open; with the 2 s a failover test wants, the remaining primary would count itself
#: in a minority and refuse every command until the others are back, which is a different fault.
CLUSTER_NODE_TIMEOUT_MS = 15000


@dataclass
class FaultsBenchParams:
    """What one ``sluice bench faults`` runs."""

    kinds: str = "all"
    """Comma-separated fault kinds: producer, engine, trainer-step, trainer-checkpoint, trainer-push, archiver,
    evaluator, redis, ray-node, trainer-rank, trainer-rank0, trainer-engine (embedded Redis only: redis,
    ray-node), reader (Redis Cluster only); "all": every kind the chosen Redis runs."""
    trials: int = 2
    """Trials per kind (seeds seed, seed+1, ...)."""
    seed: int = 0
    """The first trial's seed: the recipe's run.seed and the draw of the kill's moment."""
    steps: int = 24
    """Trainer steps per trial."""
    checkpoint_every: int = 4
    """trainer.checkpoint_every of each trial."""
    baseline: bool = True
    """Run one trial without a fault per seed, to count the stale drops a fault adds (wasted)."""
    recipe: str = "recipes/cpu-moe.toml"
    """The recipe the trials cut down."""
    timeout_s: float = 480.0
    """Wall time one launch of a trial may take before it counts as hung."""
    resumes: int = 1
    """How many times a trial whose launcher gave up is run again."""
    out: str = "runs/bench-faults"
    """Folder of the trials' run folders (each is replaced when its trial runs)."""
    redis: str = "embedded"
    """The run's queue: "embedded" (the launcher's own redis-server) or "cluster" (a fresh local Redis Cluster of
    three primaries per trial, appendfsync always, stopped after it)."""
    archive_processes: int = 1
    """queue.archive.processes of each trial (the archive's groups are archive-i-of-M when above 1)."""


@dataclass
class TrialResult:
    """One trial: where the fault landed, what recovered it, and what the checks found."""

    kind: str
    seed: int
    injection: dict[str, Any]
    exit_codes: list[int | None] = field(default_factory=list)
    finished: bool = False
    recovered: bool = False
    """Finished without being run again: the launcher's supervision recovered the run by itself."""
    resumes: int = 0
    hung: bool = False
    samples: int = 0
    trained: int = 0
    stale: int = 0
    wasted: int | None = None
    """Stale drops beyond those of the same seed's no-fault baseline (None: no baseline)."""
    lost: int = 0
    duplicated: int = 0
    phantom: int = 0
    version_problems: list[str] = field(default_factory=list)
    archive_problems: list[str] = field(default_factory=list)
    lost_ids: list[str] = field(default_factory=list)
    recover_s: float | None = None
    restart_s: float | None = None
    tap_attached_empty: bool | None = None
    payload_keys_left: int | None = None
    """Payload keys no stream entry names, on every server, after the run (None: not checked, as in trials recorded
    before this check)."""
    unacked_left: int | None = None
    """Entries delivered to a consumer group and never acked, after the run (None: not checked)."""
    leftover_problems: list[str] = field(default_factory=list)
    audit: dict[str, Any] = field(default_factory=dict)
    """What ``sluice queue audit`` reports of the trainer (``audit_trainer``): duplicates, lost, pending."""
    redis: str = "embedded"
    wall_s: float = 0.0
    log_tail: str = ""


def trainer_shape(kind: str) -> list[str]:
    """The trainer ranks a kind needs: two expert-parallel ranks (as tests/e2e/test_run_e2e.py), two data-parallel
    replicas each reading its own share (ep stays 1, so data parallelism is the whole world), or one rank."""
    if kind in ("trainer-rank", "trainer-rank0"):
        return ["trainer.world_size=2", "trainer.ep=2"]
    if kind == "reader":
        return ["trainer.world_size=2", "trainer.fetch=readers"]
    return []


def baseline_shape(kinds: list[str]) -> list[str]:
    """The baseline trains like the kinds it is compared with when they share one trainer shape (a wasted count
    compares like with like), else with one rank."""
    shapes = {tuple(trainer_shape(k)) for k in kinds}
    return list(shapes.pop()) if len(shapes) == 1 else []


def overrides(p: FaultsBenchParams, seed: int, kind: str, shape: list[str] | None = None) -> list[str]:
    sets = [f"run.seed={seed}", f"trainer.checkpoint_every={p.checkpoint_every}", "trainer.batch_groups=4",
            "producer.concurrency=2", "warmstart.enabled=false", "eval.heldout.enabled=false", "eval.enabled=true",
            "filters.zero_variance=false", "queue.archive.enabled=true", "queue.archive.flush_interval_s=2"]
    if p.archive_processes != 1:
        sets.append(f"queue.archive.processes={p.archive_processes}")
    if p.redis == "cluster":
        sets.append("queue.durability=safe")  # checks appendonly yes / appendfsync always on every primary
    # the trainer alone on the worker node; the rest on the head (tests/launch/test_run_cluster.py)
    if kind == "ray-node":
        sets += ["ray.engine.resources={rollout=1}", "ray.producer.resources={rollout=1}",
                 "ray.archiver.resources={rollout=1}", "ray.evaluator.resources={rollout=1}",
                 "ray.trainer.resources={train=1}"]
    return sets + (trainer_shape(kind) if shape is None else shape)


class _Cluster:
    """A two-node ``ray.cluster_utils.Cluster`` and an external redis-server, for the ray-node kind."""

    def __init__(self, folder: Path) -> None:
        from ray.cluster_utils import Cluster

        from pipeline.queue.redis_server import EmbeddedRedis

        self.server = EmbeddedRedis(folder / "redis", appendfsync="everysec").start()
        self.tmp = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))  # Ray's socket paths must fit in 107 bytes
        self._old_tmp = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = str(self.tmp)
        (self.tmp / "ray").mkdir()
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 4, "resources": {"rollout": 8}, "include_dashboard": False,
                "temp_dir": str(self.tmp / "ray")})
            self.worker = self.cluster.add_node(num_cpus=2, resources={"train": 2})
            self.cluster.wait_for_nodes()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if getattr(self, "cluster", None) is not None:
            self.cluster.shutdown()
        self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._old_tmp is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._old_tmp


def _embedded_url(run_dir: Path) -> str | None:
    try:
        state = json.loads((redis_dir(run_dir) / "redis.json").read_text())
    except (OSError, ValueError):
        return None
    return None if state.get("unix_socket") else f"redis://127.0.0.1:{state['port']}/0"


def _launch(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=environ_for_run())


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """The launcher's exit code; None if it hung (then it is stopped: SIGTERM, then SIGKILL of its group)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return None


def _start_cluster(folder: Path) -> Any:
    """A fresh three-primary Redis Cluster whose nodes keep their AOFs (``appendfsync always``) under ``folder``."""
    from pipeline.queue.local_cluster import LocalCluster

    cluster = LocalCluster(masters=3, appendfsync="always", node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS, folder=folder)
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise


def run_trial(p: FaultsBenchParams, kind: str, seed: int, shape: list[str] | None = None) -> TrialResult:
    """One trial of ``kind`` (or ``"none"``: the baseline) under ``seed``; ``shape`` overrides the trainer ranks the
    kind asks for (``trainer_shape``)."""
    from pipeline.benchmarks.fault_check import StreamTap

    run_dir = (Path(p.out) / f"{kind}-{seed}").resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir.parent / f"{kind}-{seed}.log"
    log.unlink(missing_ok=True)
    cluster_dir = run_dir.parent / f"{kind}-{seed}-cluster"
    shutil.rmtree(cluster_dir, ignore_errors=True)  # its Redis's AOF would bring an earlier trial's run back
    queue_dir = run_dir.parent / f"{kind}-{seed}-redis"
    shutil.rmtree(queue_dir, ignore_errors=True)
    redis_cluster = _start_cluster(queue_dir) if p.redis == "cluster" else None
    cluster: _Cluster | None = None
    result = TrialResult(kind=kind, seed=seed, injection={}, redis=p.redis)
    started = time.monotonic()
    proc: subprocess.Popen[bytes] | None = None
    tap: Any = None
    try:
        cluster = _Cluster(cluster_dir) if kind == "ray-node" else None
        external = redis_cluster.url if redis_cluster is not None else cluster.server.url if cluster else None
        cmd = [sys.executable, "-m", "pipeline.cli", "run", p.recipe, "--run-dir", str(run_dir), "--steps",
               str(p.steps)]
        if cluster is not None:
            cmd += ["--ray-address", cluster.cluster.address]
        if external is not None:
            cmd += ["--set", f"queue.redis_url={json.dumps(external)}"]
        for s in overrides(p, seed, kind, shape):
            cmd += ["--set", s]
        url = (lambda: external) if external is not None else (lambda: _embedded_url(run_dir))
        prefix = "sluice:{cpu-moe}"
        tap = StreamTap(url, f"{prefix}:samples").start()
        proc = _launch(cmd, log)
        inj = Injection(note="baseline: no fault")
        if kind != BASELINE:
            target = Target(run_dir=run_dir, steps=p.steps, checkpoint_every=p.checkpoint_every,
                            rng=random.Random(f"{kind}:{seed}"), launcher=proc, redis_url=url, prefix=prefix,
                            cluster=None if cluster is None else cluster.cluster,
                            worker=None if cluster is None else cluster.worker, redis_cluster=redis_cluster)
            inj = INJECTORS[kind](target)
        result.injection = asdict(inj)
        code = _wait_exit(proc, p.timeout_s)
        result.exit_codes.append(code)
        while code != 0 and result.resumes < p.resumes:
            result.resumes += 1  # the launcher gave up (or hung): the same command resumes the run
            proc = _launch(cmd, log)
            code = _wait_exit(proc, p.timeout_s)
            result.exit_codes.append(code)
        result.hung = None in result.exit_codes
        tap.stop()
        _check_into(result, run_dir, external, tap, inj, p)
        result.finished = code == 0 and result.finished
        result.recovered = result.finished and result.resumes == 0
    finally:
        if tap is not None:
            tap.stop()
        if proc is not None and proc.poll() is None:  # the harness itself failed: the run under test must not
            _wait_exit(proc, 0)                       # outlive its trial, nor share the machine with the next one
        if cluster is not None:
            cluster.close()
        if redis_cluster is not None:
            redis_cluster.stop()
    result.wall_s = round(time.monotonic() - started, 1)
    if not result.finished or result.lost or result.duplicated or result.leftover_problems:
        result.log_tail = log.read_text(errors="replace")[-2000:]
    return result


def _check_into(result: TrialResult, run_dir: Path, external: str | None, tap: Any, inj: Injection,
                p: FaultsBenchParams) -> None:
    from pipeline.benchmarks.fault_check import check, collect, raw_client
    from pipeline.consumers.trainer.audit import audit_trainer
    from pipeline.queue.rundir import open_run

    handle = open_run(run_dir=run_dir, redis_url=external)
    try:
        client = raw_client(handle.url)
        try:
            record = collect(client, "sluice:{cpu-moe}", run_dir, tap, archive_on=True)
        finally:
            client.close()
        # What `sluice queue audit` says of the trainer, beside the harness's own count: both must find nothing.
        audit = audit_trainer(handle.queue, run_dir)
        result.audit = {"duplicates": audit.duplicates, "lost": audit.lost, "pending": audit.pending,
                        "committed_step": audit.committed_step}
    finally:
        handle.close(stop_server=True)
    v = check(record)
    result.samples, result.trained, result.stale = v.samples, v.trained, v.stale
    result.lost, result.duplicated, result.phantom = v.lost, v.duplicated, v.phantom
    result.version_problems, result.archive_problems, result.lost_ids = v.version_problems, v.archive_problems, \
        v.lost_ids
    result.payload_keys_left, result.unacked_left = v.payload_keys_left, v.unacked_left
    result.leftover_problems = v.leftover_problems + [
        f"sluice queue audit: {result.audit[k]} {k}" for k in ("duplicates", "lost") if result.audit[k]]
    result.finished = v.committed_step == p.steps
    result.tap_attached_empty = tap.attached_empty
    if inj.at is not None:
        result.recover_s, result.restart_s = recovery(run_dir, result.kind, inj.at)


def recovery(run_dir: Path, kind: str, at: float) -> tuple[float | None, float | None]:
    """(kill -> next trained step, kill -> the victim's restart). When the victim is a trainer rank, the next trained
    step is the restarted trainer's first: a row the dying one still wrote (a removed node's processes die a moment
    after the node, rank 0 may finish a row after rank 1 died) is no recovery."""
    name = RESTARTED.get(kind)
    again = restarted_at(run_dir, name, at) if name else None
    since = again if again is not None and name is not None and name.startswith("trainer-") else at
    after = [r["time"] for r in rows(run_dir) if r["time"] > since]
    return (round(min(after) - at, 2) if after else None), (round(again - at, 2) if again else None)


def summarize(kind: str, trials: list[TrialResult]) -> dict[str, Any]:
    def stats(xs: list[float | None]) -> dict[str, float | None]:
        got = [x for x in xs if x is not None]
        return {"median": statistics.median(got) if got else None, "max": max(got) if got else None}

    def total(xs: list[int | None]) -> int | None:
        got = [x for x in xs if x is not None]
        return sum(got) if got else None

    wasted = [t.wasted for t in trials if t.wasted is not None]
    return {
        "kind": kind, "trials": len(trials), "landed": sum(bool(t.injection.get("landed")) for t in trials),
        "finished": sum(t.finished for t in trials), "recoveries": sum(t.recovered for t in trials),
        "resumes": sum(t.resumes for t in trials), "lost": sum(t.lost for t in trials),
        "duplicated": sum(t.duplicated for t in trials),
        "other_problems": sum(len(t.version_problems) + len(t.archive_problems) + len(t.leftover_problems)
                              + t.phantom for t in trials),
        "payload_keys_left": total([t.payload_keys_left for t in trials]),
        "unacked_left": total([t.unacked_left for t in trials]),
        "wasted": sum(wasted) if wasted else None, "stale": sum(t.stale for t in trials),
        "recover_s": stats([t.recover_s for t in trials]), "restart_s": stats([t.restart_s for t in trials]),
    }


def run_faults_bench(p: FaultsBenchParams, echo: Any = None) -> dict[str, Any]:
    """Every kind's trials one after another (never two runs at once); the baseline of a seed first when on."""
    if p.redis not in REDIS_MODES:
        from pipeline.errors import ConfigError

        raise ConfigError(f"--redis {p.redis!r}: choose from {list(REDIS_MODES)}")
    wrong_redis = EMBEDDED_ONLY if p.redis == "cluster" else CLUSTER_ONLY
    kinds = [k for k in KINDS if k not in wrong_redis] if p.kinds.strip() == "all" else \
        [k.strip() for k in p.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        from pipeline.errors import ConfigError

        raise ConfigError(f"unknown fault kinds {unknown}; choose from {list(KINDS)}")
    if clash := [k for k in kinds if k in wrong_redis]:
        from pipeline.errors import ConfigError

        raise ConfigError(
            f"kinds {clash} need the run's embedded Redis; drop them with --redis cluster (the cluster's own faults "
            "are `sluice bench cluster-faults`)" if p.redis == "cluster" else
            f"kinds {clash} need the run's queue on a Redis Cluster: add --redis cluster")
    shape = baseline_shape(kinds)
    seeds = [p.seed + i for i in range(p.trials)]
    baselines: dict[int, TrialResult] = {}
    results: dict[str, list[TrialResult]] = {k: [] for k in kinds}

    def report() -> dict[str, Any]:
        return {"params": asdict(p), "summary": [summarize(k, results[k]) for k in kinds if results[k]],
                "baselines": [asdict(b) for b in baselines.values()],
                "trials": {k: [asdict(t) for t in v] for k, v in results.items()}}

    for seed in seeds:
        if p.baseline:
            baselines[seed] = _guarded(p, BASELINE, seed, shape)
            if echo:
                echo(_trial_line(baselines[seed]))
        for kind in kinds:
            r = _guarded(p, kind, seed)
            if p.baseline and baselines[seed].finished and r.finished:
                # Both runs train the same steps: what the fault added is the difference. Counting only drops at
                # steps after the kill would miss the steps a rolled-back trainer trains again under the same
                # numbers.
                r.wasted = r.stale - baselines[seed].stale
            results[kind].append(r)
            if echo:
                echo(_trial_line(r))
            # Written after every trial: a long run that is cut short keeps what it measured.
            (Path(p.out) / "faults.json").write_text(json.dumps(report(), indent=1, default=str))
    return report()


def _guarded(p: FaultsBenchParams, kind: str, seed: int, shape: list[str] | None = None) -> TrialResult:
    """A trial; an error of the harness itself is a failed trial with its message, not the end of the benchmark."""
    try:
        return run_trial(p, kind, seed, shape)
    except Exception as e:  # reported in the trial's row and counted as not finished
        return TrialResult(kind=kind, seed=seed, injection={"note": f"harness error: {type(e).__name__}: {e}"},
                           log_tail=f"{type(e).__name__}: {e}")


def _trial_line(t: TrialResult) -> str:
    inj = t.injection
    return (f"  {t.kind:18s} seed {t.seed}: {'finished' if t.finished else 'NOT FINISHED'}"
            f"{'' if not t.resumes else f' after {t.resumes} resume(s)'}, lost {t.lost}, duplicated {t.duplicated}, "
            f"stale {t.stale} (wasted {t.wasted}), payload keys left {t.payload_keys_left}, unacked left "
            f"{t.unacked_left}, recover {t.recover_s} s, restart {t.restart_s} s; "
            f"{'landed' if inj.get('landed') else 'not landed'}: {inj.get('note', '')}; {t.wall_s} s"
            + "".join(f"\n    ! {x}" for x in [*t.version_problems, *t.archive_problems, *t.leftover_problems]))


def _dash(x: int | None) -> str:
    return "-" if x is None else str(x)


def table_lines(res: dict[str, Any]) -> list[str]:
    """One table per fault kind."""
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    out = []
    for s in res["summary"]:
        out += [f"{s['kind']}", "  | trials | landed | finished | recoveries | resumes | lost | duplicated | "
                "other problems | payload keys left | unacked left | wasted | recover s (median/max) | "
                "restart s (median/max) |",
                "  |---|---|---|---|---|---|---|---|---|---|---|---|---|",
                f"  | {s['trials']} | {s['landed']} | {s['finished']} | {s['recoveries']} | {s['resumes']} | "
                f"{s['lost']} | {s['duplicated']} | {s['other_problems']} | {_dash(s.get('payload_keys_left'))} | "
                f"{_dash(s.get('unacked_left'))} | "
                f"{'-' if s['wasted'] is None else s['wasted']} | {f(s['recover_s']['median'])} / "
                f"{f(s['recover_s']['max'])} | {f(s['restart_s']['median'])} / {f(s['restart_s']['max'])} |", ""]
    return out


def cmd(args: Any) -> int:
    """``sluice bench faults``."""
    from dataclasses import fields

    params = FaultsBenchParams(**{f.name: getattr(args, f.name) for f in fields(FaultsBenchParams)})
    res = run_faults_bench(params, echo=None if args.json else lambda line: print(line, flush=True))
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        print("\n".join(table_lines(res)))
    bad = any(s["lost"] or s["duplicated"] or s["other_problems"] or s["finished"] < s["trials"]
              for s in res["summary"])
    return 1 if bad else 0
