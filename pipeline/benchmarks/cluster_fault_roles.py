"""The processes of a ``sluice bench cluster-faults`` trial (``pipeline.benchmarks.cluster_faults``): a producer, a
trainer and a trimmer, each ``python -m pipeline.benchmarks.cluster_fault_roles --role NAME --spec FILE``, and the
files through which they and the harness talk (``TrialPaths``). The harness's supervisor starts them and restarts
whichever dies; a fault kind may add a role of its own to ``ROLES``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import PutAbortedError

log = logging.getLogger(__name__)

PRODUCER = "producer-0"
TRAINER = "trainer-0"
GROUP = "trainer"
#: The trimmer pauses between its two moves when this names a file: it writes the file (JSON: the trash's size) and
#: sleeps until killed. Read by the trimmer role only, at its first start in a ``trimmer`` trial.
TRIM_PAUSE_ENV = "SLUICE_FAULT_TRIM_PAUSE"
#: Which pass with a non-empty trash pauses (1 = the first), drawn from the trial's seed.
TRIM_PAUSE_AT_ENV = "SLUICE_FAULT_TRIM_PAUSE_AT"


@dataclass
class RoleSpec:
    """What a role process needs: written to the trial folder as JSON, passed by path."""

    url: str
    run: str
    folder: str
    groups: int
    group_size: int
    response_tokens: int
    batch_groups: int
    commit_every: int
    max_lag: int
    capacity: int
    trim_every_s: float
    seed: int
    hold_last: bool = False
    """The producer holds the trial's last fresh prompt until the fault has struck (``TrialPaths.struck``)."""

    @property
    def paths(self) -> TrialPaths:
        return TrialPaths(Path(self.folder))


@dataclass(frozen=True)
class TrialPaths:
    """The files through which the harness and its processes talk (all in the trial folder)."""

    root: Path

    @property
    def spec(self) -> Path:
        return self.root / "spec.json"

    @property
    def stop(self) -> Path:
        """Exists: the producer and the trimmer exit."""
        return self.root / "stop"

    @property
    def finish(self) -> Path:
        """Exists: the trainer drains what is left, commits, acks and exits."""
        return self.root / "finish"

    @property
    def puts(self) -> Path:
        return self.root / "puts.jsonl"

    @property
    def run_dir(self) -> Path:
        """The trainer's run folder: ``ledger/`` and ``checkpoints/`` as a real run lays them out."""
        return self.root / "run"

    @property
    def progress(self) -> Path:
        return self.root / "progress.json"

    @property
    def versions(self) -> Path:
        return self.root / "versions.jsonl"

    @property
    def struck(self) -> Path:
        """Exists: the fault has been injected (or failed to be); a held last prompt may go."""
        return self.root / "struck"

    @property
    def trim_paused(self) -> Path:
        return self.root / "trim-paused.json"

    def log(self, role: str) -> Path:
        return self.root / "logs" / f"{role}.log"


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def read_puts(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``puts.jsonl``: group id -> {prompt, retry, samples, acked, order}, and sample id -> group id."""
    groups: dict[str, dict[str, Any]] = {}
    samples: dict[str, str] = {}
    if not path.exists():
        return groups, samples
    for n, line in enumerate(path.read_text().splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if row["event"] == "intent":
            groups[row["gid"]] = {"prompt": row["prompt"], "retry": row["retry"], "samples": row["samples"],
                                  "acked": False, "order": n}
            samples.update((s, row["gid"]) for s in row["samples"])
        elif row["event"] == "put" and row["gid"] in groups:
            groups[row["gid"]]["acked"] = True
    return groups, samples


# ====================================================================================================== the roles
def _queue(spec: RoleSpec, cls: type | None = None) -> Any:
    from pipeline.queue.connection import connect
    from pipeline.queue.redis_streams import SampleQueue

    return (cls or SampleQueue)(connect(spec.url), spec.run, capacity=spec.capacity)


def _templates(spec: RoleSpec) -> list[list[Any]]:
    from pipeline.benchmarks.payload_spread import synthetic_group

    rng = np.random.default_rng(spec.seed)
    return [synthetic_group(rng, f"template{i}", size=spec.group_size, prompt=128, response=spec.response_tokens,
                            layers=8, topk=4, experts=64) for i in range(2)]


def run_producer(spec: RoleSpec) -> int:
    """Admit, generate (re-stamp a template) and put groups until told to stop."""
    import uuid

    # The producers' own pacing scripts: the harness must admit and record groups exactly as producers do, or the
    # hand-back of a lost payload's prompt (which looks for those records) would not be what is tested.
    from pipeline.producers.producer import _PUT_DONE, _RECLAIM, _RETURN, _TAKE
    from pipeline.queue.keys import parse_slot_item

    paths = spec.paths
    queue = _queue(spec)
    k = queue.keys
    take, put_done = queue.redis.register_script(_TAKE), queue.redis.register_script(_PUT_DONE)
    give_back, reclaim = queue.redis.register_script(_RETURN), queue.redis.register_script(_RECLAIM)
    inflight = k.producer_inflight(PRODUCER)
    # A restarted producer hands back what its previous life left in flight, as Producer.start_lease does.
    reclaim(keys=[inflight, k.groups_started, k.prompt_retry, k.producer_lease(PRODUCER), k.producers],
            args=[PRODUCER, 1])
    queue.discard_unqueued_payloads(PRODUCER)
    templates = _templates(spec)
    with open(paths.puts, "a") as out:
        while not paths.stop.exists():
            gid = uuid.uuid4().hex
            got = take(keys=[k.policy_version, k.groups_started, k.prompt_retry, k.prompt_cursor, inflight],
                       args=[1, spec.max_lag, spec.batch_groups, gid])
            if got == -1:
                time.sleep(0.05)
                continue
            item, retry = got
            index, _ = parse_slot_item(item)
            if index >= spec.groups:
                # No such prompt: the trial's prompts are all out. Wait for one handed back, or for the stop.
                give_back(keys=[inflight, k.groups_started, k.prompt_retry], args=[gid, 0])
                time.sleep(0.2)
                continue
            if spec.hold_last and not retry and index == spec.groups - 1:
                # The trial cannot finish before its fault: the last step waits for this group, with the steps
                # before it trained and not yet committed, their entries pending and their payloads live.
                while not (paths.struck.exists() or paths.stop.exists()):
                    time.sleep(0.05)
            group = [dataclasses.replace(s, sample_id=f"{gid}-{i}", group_id=gid, prompt_id=f"p{index}",
                                         producer=PRODUCER)
                     for i, s in enumerate(templates[index % len(templates)])]
            # Written before the put, so that a group that lands although its put raised is still known.
            out.write(json.dumps({"event": "intent", "gid": gid, "prompt": index, "retry": bool(retry),
                                  "samples": [s.sample_id for s in group]}) + "\n")
            out.flush()
            try:
                entry = queue.put(group, abort=paths.stop.exists)
            except PutAbortedError:
                give_back(keys=[inflight, k.groups_started, k.prompt_retry], args=[gid, 1])
                break
            out.write(json.dumps({"event": "put", "gid": gid, "entry": entry}) + "\n")
            out.flush()
            put_done(keys=[inflight, k.group_slots], args=[gid])
    return 0


def _pausing_queue_class() -> type:
    from pipeline.queue.redis_streams import SampleQueue

    class PausingQueue(SampleQueue):
        """A SampleQueue whose trim can stop between its two moves: after the header script put the dropped
        headers' payload keys in the trash, before the payloads are deleted on their shards. ``_empty_trash`` is that
        second move; a trial that never reaches it reports its fault as not landed."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            marker, at = os.environ.get(TRIM_PAUSE_ENV), os.environ.get(TRIM_PAUSE_AT_ENV, "1")
            self._marker = Path(marker) if marker else None
            self._pause_at, self._passes = int(at), 0

        def _empty_trash(self) -> int:
            if self._marker is not None and (n := int(self.redis.scard(self.keys.payload_trash))) > 0:
                self._passes += 1
                if self._passes >= self._pause_at:
                    write_json_atomic(self._marker, {"trash": n, "pid": os.getpid()})
                    while True:  # until the harness's SIGKILL
                        time.sleep(3600)
            return super()._empty_trash()

    return PausingQueue


def run_trimmer(spec: RoleSpec) -> int:
    """Trim every ``trim_every_s`` until told to stop."""
    queue = _queue(spec, _pausing_queue_class())
    while not spec.paths.stop.exists():
        queue.trim()
        time.sleep(spec.trim_every_s)
    return 0


class _Prompts:
    """Group id -> prompt index, read from ``puts.jsonl`` as it grows (the producer writes a group's line before its
    put, so any group the trainer drains is there)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.of: dict[str, int] = {}
        self._offset = 0

    def get(self, gid: str) -> int:
        if gid not in self.of:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            cut = data.rfind(b"\n") + 1
            self._offset += cut
            for line in data[:cut].splitlines():
                row = json.loads(line)
                if row["event"] == "intent":
                    self.of[row["gid"]] = row["prompt"]
        return self.of[gid]


def run_trainer(spec: RoleSpec) -> int:
    """The drain and commit loop; exits 0 once told to finish and nothing is left."""
    from pipeline.config.staleness import StalenessConfig
    from pipeline.consumers.trainer.drain import Drainer
    from pipeline.consumers.trainer.ledger import Ledger, LedgerLine, read_ledger
    from pipeline.consumers.trainer.loop import RedisClock
    from pipeline.rundir import checkpoint_path, latest_checkpoint, ledger_dir

    paths = spec.paths
    queue = _queue(spec)
    latest = latest_checkpoint(paths.run_dir)
    meta = json.loads((latest / "meta.json").read_text()) if latest is not None else {"step": -1, "version": 0}
    ledger = Ledger(ledger_dir(paths.run_dir))
    ledger.load(meta["step"])
    # Every group trains: the trial is about what the queue delivers, not about staleness.
    drainer = Drainer(queue, ledger, StalenessConfig(max_lag=1_000_000), group=GROUP, consumer=TRAINER, block_ms=200)
    drainer.recover()
    clock = RedisClock(queue)
    version = max(clock.get(), meta["version"])
    prompts = _Prompts(paths.puts)
    # Sample ids are "<group id>-<i>" (the producer's stamp), so the committed prompts follow from the ledger.
    trained = {prompts.get(line.sample_id.rsplit("-", 1)[0])
               for line in read_ledger(ledger_dir(paths.run_dir), upto_step=meta["step"]) if line.fate == "trained"}
    step, since_commit, held, uncommitted = meta["step"] + 1, 0, set(), []
    wind_up_rounds = 0

    def progress(committed: int) -> None:
        write_json_atomic(paths.progress, {"committed_step": committed, "version": version, "pid": os.getpid(),
                                            "prompts": len(trained), "done": len(trained) >= spec.groups})

    def commit(at: int) -> None:
        nonlocal since_commit, uncommitted
        ledger.write_segment(at)
        final = checkpoint_path(paths.run_dir, at)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "meta.json").write_text(json.dumps({"step": at, "version": version}))
        os.replace(tmp, final)  # the commit point, as save_checkpoint's rename is
        ledger.mark_committed(at)
        drainer.ack(uncommitted)
        trained.update(held)
        held.clear()
        since_commit, uncommitted = 0, []
        progress(at)

    progress(meta["step"])
    while True:
        finishing = paths.finish.exists()
        began = time.monotonic()
        # A batch waits at most a second to fill: the trial's tail (and a prompt handed back late) trains in
        # partial batches rather than never.
        batch = drainer.next_batch(spec.batch_groups, step, lambda v=version: v,
                                   should_stop=lambda t=began: time.monotonic() - t > 1.0)
        if batch.consumed:
            lines = [LedgerLine(item.sample_id, entry_id, "trained", step, version)
                     for entry_id, group in zip(batch.group_entries, batch.groups) for item in group]
            ledger.record([*batch.lines, *lines])
            uncommitted += batch.consumed
            held.update(prompts.get(group[0].group_id) for group in batch.groups)
            version = clock.advance(at_least=version + 1)  # this step's push
            with open(paths.versions, "a") as f:
                f.write(json.dumps({"step": step, "version": version, "pid": os.getpid(), "time": time.time()})
                        + "\n")
            since_commit += 1
            if since_commit >= spec.commit_every:
                commit(step)
            step += 1
        elif since_commit:
            # Idle for a second: commit what was trained, so that the trial's tail is committed (and acked) too.
            commit(step - 1)
        elif finishing:
            drainer.ack_leftovers()
            wind_up_rounds += 1
            # Entries still pending or undelivered after a minute of this are left for the checks to count.
            if (not queue.pending_ids(GROUP) and not queue.lag(GROUP)) or wind_up_rounds > 60:
                return 0


ROLES: dict[str, Callable[[RoleSpec], int]] = {"producer": run_producer, "trainer": run_trainer,
                                               "trimmer": run_trimmer}
"""The processes of a trial, by name. A fault kind may add its own (``Fault.extra_roles``)."""


def main(argv: list[str] | None = None) -> int:
    """A role process of a trial: ``--role NAME --spec FILE``."""
    p = argparse.ArgumentParser(prog="python -m pipeline.benchmarks.cluster_fault_roles", description=main.__doc__)
    p.add_argument("--role", required=True, choices=sorted(ROLES))
    p.add_argument("--spec", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role} %(levelname)s %(name)s: %(message)s")
    spec = RoleSpec(**json.loads(Path(args.spec).read_text()))
    return ROLES[args.role](spec)


if __name__ == "__main__":
    raise SystemExit(main())
