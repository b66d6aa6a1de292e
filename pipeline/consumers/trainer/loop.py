"""The trainer: drains the queue, trains with megatron-core, pushes weights, and commits exactly once.

One process per rank. Rank 0 alone reads the stream and talks to the engines: it decides each step from the
entries' headers and sends every data-parallel replica the payload keys of its share (msgpack over a gloo group, never
pickle), which the replica's reader fetches (``readers``). The commit protocol (docs/architecture.md):

1. entries stay pending in the ``trainer`` group while their effect lives only in memory;
2. a commit writes the ledger segment, then the checkpoint (model, optimizer, policy version), whose rename is the
   commit point, and only then acks the entries consumed since the previous commit;
3. a restart loads the last checkpoint and the ledger up to it, acks pending entries already in the ledger, and
   trains the others again, which is right because the loaded model is from before them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from pipeline.consumers.trainer.checkpoints import prune_checkpoints
from pipeline.consumers.trainer.drain import Batch, Drainer
from pipeline.consumers.trainer.hooks import HookRunner
from pipeline.consumers.trainer.ledger import Ledger, LedgerLine
from pipeline.consumers.trainer.profiling import StepProfiler
from pipeline.consumers.trainer.push import Owners, PushSteps, close_pusher
from pipeline.consumers.trainer.readers import (
    GroupRef,
    SharePlanner,
    ShareReader,
    all_gather_msgpack,
    broadcast_msgpack_sized,
)
from pipeline.consumers.trainer.staleness import lag_histogram
from pipeline.queue.redis_streams import RESUME_EVENT, SampleQueue
from pipeline.queue.sample import Sample
from pipeline.rundir import checkpoint_name, checkpoints_dir, latest_checkpoint, trainer_metrics_path
from pipeline.sync.base import WeightPush
from pipeline.sync.sources_push import broadcast_msgpack as broadcast_msgpack  # the ranks' batch travels so too

if TYPE_CHECKING:
    from pipeline.consumers.trainer.snapshots import SnapshotWriter
    from pipeline.metrics import Sinks

log = logging.getLogger(__name__)


class StepFn(Protocol):
    """One optimizer step on this rank's share of prompt groups; returns metrics."""

    policy_version: int | None
    """Set before each step: the version the engines sample with on rank 0, None on the others (they never learn
    one), so that only rank 0's share is measured for the lag-0 mismatch."""

    def step(self, groups: list[list[Sample]]) -> dict[str, float]: ...
    # Called as step(groups, weights=[...]) (one group-filter weight per group) when a filter reweighted a group.

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


class BatchSource(Protocol):
    """Where a trainer's prompt groups come from: the live queue (``Drainer``) or a recording (``ReplaySource``)."""

    def recover(self) -> Any: ...

    def next_batch(self, batch_groups: int, step: int, version: Callable[[], int],
                   should_stop: Callable[[], bool] = ...) -> Batch: ...

    def ack(self, entry_ids: list[str]) -> None: ...


class VersionClock(Protocol):
    """The policy version: Redis's counter in a live run, a local one in replay."""

    def get(self) -> int: ...

    def advance(self, at_least: int = 0) -> int: ...

    def event(self, kind: str, **fields: str | float) -> None: ...

    def started_before(self) -> bool: ...

    def restored(self, version: int, base: int) -> None: ...


# INCR, then raise to ARGV[1] if that is still below it: one step up, never back, and never below the version that was
# pushed (Redis may have lost its last writes, e.g. under appendfsync everysec, while the checkpoint kept them).
_ADVANCE = """
local v = redis.call('INCR', KEYS[1])
local floor = tonumber(ARGV[1])
if v < floor then
  redis.call('SET', KEYS[1], floor)
  v = floor
end
return v
"""


class RedisClock:
    """The run's ``policy_version`` in Redis (it only goes up) and its events stream."""

    def __init__(self, queue: SampleQueue) -> None:
        self.queue = queue
        self._advance = queue.redis.register_script(_ADVANCE)

    def get(self) -> int:
        return self.queue.policy_version()

    def advance(self, at_least: int = 0) -> int:
        """Up by one, and to at least ``at_least`` (the version every engine just confirmed)."""
        return int(self._advance(keys=[self.queue.keys.policy_version], args=[at_least]))

    def event(self, kind: str, **fields: str | float) -> None:
        self.queue.log_event(kind, **fields)

    def started_before(self) -> bool:
        """Whether a trainer of this run got as far as its resume before (``SampleQueue.trainer_started_before``)."""
        return self.queue.trainer_started_before()

    def restored(self, version: int, base: int) -> None:
        """``version`` (the next push) holds the weights of ``base``: the drain judges lags along the lineage."""
        from pipeline.consumers.trainer.drain import record_restore

        record_restore(self.queue, version, base)


class LocalClock:
    """A version counter of this process alone (offline replay), starting where the recording starts."""

    def __init__(self, start: int = 0) -> None:
        self.version = start

    def get(self) -> int:
        return self.version

    def advance(self, at_least: int = 0) -> int:
        self.version = max(self.version + 1, at_least)
        return self.version

    def observe(self, version: int) -> None:
        """Catch up with a version seen in the data."""
        self.version = max(self.version, version)

    def event(self, kind: str, **fields: str | float) -> None:
        log.info("%s %s", kind, fields)

    def started_before(self) -> bool:
        """Offline replay starts afresh each time: it pushes to no engine."""
        return False

    def restored(self, version: int, base: int) -> None:
        """Offline replay keeps no lineage: its recording is one branch."""


@dataclass(frozen=True)
class TrainerSettings:
    """What the loop needs from the recipe (see ``pipeline.config.TrainerConfig``)."""

    steps: int
    batch_groups: int
    checkpoint_every: int
    keep_checkpoints: int
    run_dir: Path
    overlap_push: bool = False
    profile_steps: tuple[int, int] | None = None
    base: dict[str, Any] | None = None
    """With LoRA: the base the adapters belong to (``lora_export.base_identity``), written into every checkpoint; a
    resume from a checkpoint of another base is refused."""


@dataclass
class RankZero:
    """What rank 0 alone holds; the other ranks get their share of each batch and each decision from it (``_share``)."""

    source: BatchSource
    clock: VersionClock
    ledger: Ledger
    pusher: WeightPush | None = None
    """None: no engines to push to (offline replay)."""
    snapshots: SnapshotWriter | None = None
    """Set when held-out evaluation is on."""
    scalars: Sinks | None = None
    """TensorBoard (and W&B) mirror of the metrics lines (``pipeline.metrics``)."""
    hooks: HookRunner | None = None


class Trainer(PushSteps):
    """The driver loop and its step methods. Collective: every rank constructs one and calls ``train``."""

    def __init__(
        self,
        settings: TrainerSettings,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step_fn: StepFn,
        export_weights: Any,
        lead: RankZero | None,
        export_full: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        owners: Owners | None = None,
        reader: ShareReader | None = None,
        planner: SharePlanner | None = None,
    ) -> None:
        self.s = settings
        self.owners = owners
        self.model, self.optimizer, self.step_fn = model, optimizer, step_fn
        self.export_weights = export_weights
        self.export_full = export_full
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if (lead is not None) != (self.rank == 0):
            raise ValueError(f"rank 0 alone holds the RankZero collaborators; this is rank {self.rank}")
        self.lead = lead
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # By default rank 0 reads with its drain's queue; without one a reader takes inline groups only (replay).
        lead_queue = lead.source.queue if lead is not None and isinstance(lead.source, Drainer) else None
        self.reader = reader or ShareReader(lead_queue)
        self.planner = planner if planner is not None or lead is None else SharePlanner(max(dp_size, 1))
        self._reading: dict[str, float] = {}
        self.profiler = StepProfiler(settings.profile_steps, settings.run_dir, self.rank)
        self.ckpt_root = checkpoints_dir(settings.run_dir)
        self.metrics_path = trainer_metrics_path(settings.run_dir)
        self.step = 0
        self.version = 0
        self._uncommitted: list[str] = []
        self._committed_step = 0
        self._rank0_batch: Batch | None = None
        # A stop asked of this rank (a signal, ``request_stop``) versus the stop all ranks agreed on: only the
        # agreed one may steer a collective, or the ranks would part ways (see ``_agree_to_stop``).
        self._stop_requested = False
        self._stop = False
        self._push_thread: threading.Thread | None = None
        self._push_error: BaseException | None = None
        # The pusher's HTTP clients live on one event loop; every push runs on it (one push at a time).
        self._loop = loop or asyncio.new_event_loop()
        self._bytes_group = dist.new_group(backend="gloo") if dist.is_initialized() else None

    # ----------------------------------------------------------------------------------------------------- loop
    def train(self) -> None:
        """Resume, then drain, train, push and commit until ``steps`` steps are done or a stop is requested."""
        self._install_signal_handlers()
        self.resume()
        commit_s = 0.0
        while self.step < self.s.steps:
            self.profiler.start_step(self.step + 1)
            t0 = time.perf_counter()
            batch = self.drain()
            if batch is None:
                break
            t1 = time.perf_counter()
            metrics = self.train_step(batch)
            self.step += 1
            self._stop = self._agree_to_stop()
            push_wait = self.finish_push()
            t2 = time.perf_counter()
            self.push_weights()
            # Waiting for data is the trainer's idle time; the commit is charged to the step after it. With the push
            # in the background, push_s is the export alone and push_wait_s what the previous push still took.
            metrics.update({"time/drain_s": t1 - t0, "time/push_s": time.perf_counter() - t2,
                            "time/push_wait_s": push_wait, "time/commit_s": commit_s, **self._push_counters()})
            self.record(batch, metrics)
            commit_s = 0.0
            if self.step % self.s.checkpoint_every == 0 or self.step == self.s.steps or self._stop:
                t3 = time.perf_counter()
                self.commit()
                commit_s = time.perf_counter() - t3
            if self._stop:
                break
        self.finish_push()
        # Every rank knows the step, so all of them take this commit or none does (rank 0's uncommitted entries
        # alone would lead it into the collective save without its peers).
        if self.step > self._committed_step:
            self.commit()
        self.profiler.finish()

    # ---------------------------------------------------------------------------------------------------- steps
    def resume(self) -> None:
        latest = latest_checkpoint(self.s.run_dir)
        meta: dict[str, Any] = {}
        checkpoint_version = 0
        if latest is not None:
            from pipeline.consumers.megatron.checkpoint import check_base, load_checkpoint

            check_base(latest, self.s.base)
            meta = load_checkpoint(latest, self.model, self.optimizer)
            self.step = self._committed_step = int(meta["step"])
            checkpoint_version = int(meta.get("policy_version", 0))
            if "train_step" in meta:
                self.step_fn.load_state_dict(meta["train_step"])
        if (lead := self.lead) is not None:
            lead.ledger.load(self.step if latest is not None else -1)
            recovery = lead.source.recover()
            self.version = self._resume_version(lead.clock, checkpoint_version)
            # A trainer that started before in this run may have died in the middle of its first push, before any
            # checkpoint or version: the engines then hold a mix of old and new weights, still labelled 0, and must
            # be held and re-synced like a resumed run's, not kept.
            fresh = latest is None and self.version == 0 and not lead.clock.started_before()
            # A resumed run's engines may hold weights trained on data this checkpoint has not seen, and engines
            # sluice did not start may hold another run's: give them ours before they serve (sync.lifecycle).
            held = self._adopt_engines(lead.pusher, fresh)
            needs_resync = not fresh or held > 0
            if needs_resync:
                # The resync push below is version self.version + 1, and it holds the restored weights: the
                # checkpoint's version, or 0 (the starting weights). Samples are judged by their distance from those,
                # not by the counter (docs/versions.md).
                lead.clock.restored(self.version + 1, checkpoint_version)
            lead.clock.event(RESUME_EVENT, step=self.step, version=self.version, recovered=str(recovery), held=held)
        else:
            needs_resync = False
        needs_resync = bool(self._share({"resync": needs_resync})["resync"])
        if needs_resync:
            self.push_weights(background=False)

    def _resume_version(self, clock: VersionClock, checkpoint_version: int) -> int:
        """max(Redis, checkpoint): the version never goes back, even when Redis lost what the checkpoint kept. The
        resync push that follows sends ``version + 1`` and raises Redis to it (``RedisClock.advance``)."""
        counter = clock.get()
        if checkpoint_version > counter:
            log.warning("the policy version in Redis (%d) is behind the checkpoint's (%d): Redis lost its last writes "
                        "(appendfsync everysec, or a restore). The run continues from %d, and the next push brings "
                        "Redis and every engine past it", counter, checkpoint_version, checkpoint_version)
        return max(counter, checkpoint_version)

    def _adopt_engines(self, pusher: WeightPush | None, fresh: bool) -> int:
        """Label, reload or hold each engine as ``pipeline.sync.lifecycle`` says; returns how many are held."""
        if pusher is None:
            return 0
        adoptions = self._loop.run_until_complete(pusher.adopt(self.version, fresh=fresh))
        return sum(a.action == "held" for a in adoptions)

    def drain(self) -> Batch | None:
        """Rank 0 decides a batch from headers; every rank gets its data-parallel share from its replica's reader
        (``readers``). None means stop."""
        batch: Batch | None = None
        if (lead := self.lead) is not None:
            batch = self._draw(self.s.batch_groups)
            # Rank 0's own request decides here, and the broadcast below tells every rank, so they stop together.
            if batch is not None and len(batch.groups) < max(self.dp_size, 1):
                # A partial batch is not trained; its entries stay pending and are redone after a restart.
                batch = None
        self._rank0_batch = batch
        loads = [0] * max(self.dp_size, 1)
        todo = None if batch is None else list(range(len(batch.groups)))
        mine: list[tuple[GroupRef, list[Sample]]] = []
        lost_all: list[tuple[int, str]] = []
        plan_bytes = fetched_bytes = 0
        while True:
            shares: list[list[Any]] | None = None
            lost_here: list[tuple[int, str]] = []
            if batch is not None and todo is not None:
                assert self.planner is not None
                planned, lost_here = self.planner.plan(batch, todo, loads)
                shares = [[r.pack() for r in share] for share in planned]
            shared: dict[str, Any] = {"shares": shares}
            if self._distributed:
                shared, sent = broadcast_msgpack_sized(shared if self.rank == 0 else None, 0, self._bytes_group)
                plan_bytes += sent
            if shared["shares"] is None:
                self._stop = True
                return None
            got, lost = self.reader.read([GroupRef.unpack(r) for r in shared["shares"][self.dp_rank]])
            mine += got
            reports = [[*lost, *lost_here], self.reader.take_stats().fetched_bytes]
            gathered = all_gather_msgpack(reports, self._bytes_group) if self._distributed else [reports]
            fetched_bytes += sum(int(g[1]) for g in gathered)
            lost_now = sorted({(int(i), str(why)) for g in gathered for i, why in g[0]})
            if not lost_now:
                break
            lost_indices = {i for i, _ in lost_now}
            mine = [(ref, g) for ref, g in mine if ref.index not in lost_indices]
            lost_all += lost_now
            todo = None
            if lead is not None and batch is not None:
                assert isinstance(lead.source, Drainer)
                lead.source.lose(batch, lost_now)
                log.warning("step %d: %d payloads lost (%s); drawing replacements", self.step + 1, len(lost_now),
                            "; ".join(why for _, why in lost_now[:3]))
                more = self._draw(len(lost_now))
                if more is None or len(more.groups) < len(lost_now):
                    batch = None  # stopped while drawing: nothing is trained, the pending entries are redone
                else:
                    first = len(batch.groups)
                    batch.extend(more)
                    todo = list(range(first, len(batch.groups)))
        if batch is not None:
            for index in sorted({i for i, _ in lost_all}, reverse=True):
                batch.take_out(index)
            self._rank0_batch = batch
            self._reading = {"drain/plan_bytes": float(plan_bytes), "drain/payload_bytes": float(fetched_bytes),
                             "drain/groups_lost": float(len(lost_all)),
                             "drain/reader_tokens_max_over_mean": max(loads) / max(sum(loads) / len(loads), 1e-9)}
        mine.sort(key=lambda x: x[0].index)
        return Batch(groups=[g for _, g in mine], group_weights=[ref.weight for ref, _ in mine])

    def _draw(self, groups: int) -> Batch | None:
        """Rank 0: up to ``groups`` groups from the source, or None when a stop cut the draw short."""
        lead = self.lead
        assert lead is not None
        clock = lead.clock

        def version() -> int:
            # While a push is in flight its engines may already sample with the new weights before the clock
            # moves: judge against the version being pushed, so no token can look newer than the trainer.
            return max(self.version, clock.get())

        batch = lead.source.next_batch(groups, self.step, version, should_stop=lambda: self._stop_requested)
        if self._stop_requested and len(batch.groups) < groups:
            return None
        return batch

    def train_step(self, batch: Batch) -> dict[str, float]:
        start = time.perf_counter()
        self.step_fn.policy_version = self.version if self.rank == 0 else None
        weights = batch.weights()
        # Weights only when a filter reweighted a group, so a step function without the argument still works.
        metrics = dict(self.step_fn.step(batch.groups) if weights is None
                       else self.step_fn.step(batch.groups, weights=weights))  # type: ignore[call-arg]
        metrics["time/step_s"] = time.perf_counter() - start
        return metrics

    def record(self, batch: Batch, metrics: dict[str, float]) -> None:
        if (lead := self.lead) is None:
            return
        full = self._rank0_batch
        assert full is not None
        trained = [LedgerLine(s.sample_id, entry_id, "trained", self.step, self.version)
                   for entry_id, group in zip(full.group_entries, full.groups) for s in group]
        lead.ledger.record([*full.lines, *trained])
        self._uncommitted.extend(full.consumed)
        rewards = [s.reward for g in full.groups for s in g]
        sampled = full.sampled_rewards or rewards
        row = {
            "step": self.step, "policy_version": self.version, "time": time.time(),
            # The policy's reward as sampled (filtered groups included); the trained groups' apart.
            "reward_mean": sum(sampled) / max(len(sampled), 1),
            "reward_mean_trained": sum(rewards) / max(len(rewards), 1), "groups": len(full.groups),
            "samples": len(rewards), "lag_max": max(full.lags, default=0),
            **full.counts.as_metrics(), **full.drain_metrics(), **lag_histogram(full.lags, num_buckets=4),
            **self._reading,
            # The step's own reward_mean is the trained groups' (reward_mean_trained above).
            **{k: v for k, v in metrics.items() if k != "reward_mean"},
        }
        if lead.hooks is not None:  # before the line is written, so that it counts this step's hook failures
            row.update(lead.hooks.on_step(self.step, {"policy_version": self.version, "samples": len(rewards),
                                                      "groups": len(full.groups)}, row))
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if lead.scalars is not None:
            lead.scalars.add(row, self.step)
        log.info("step %d version %d reward %.3f loss %.4f", self.step, self.version, row["reward_mean"],
                 metrics.get("loss", float("nan")))

    def commit(self) -> None:
        """Ledger segment, then checkpoint (the commit point), then acks; collective."""
        from pipeline.consumers.megatron.checkpoint import save_checkpoint

        self.finish_push()  # the checkpoint records a version every engine has confirmed
        directory = self.ckpt_root / checkpoint_name(self.step)
        if directory.exists():
            raise RuntimeError(f"checkpoint {directory} exists already: a step number was reused, which would "
                               "break the ledger's exactly-once accounting")
        if self.lead is not None:
            self.lead.ledger.write_segment(self.step)
        state = self.step_fn.state_dict()
        seconds = save_checkpoint(directory, self.model, self.optimizer,
                                  meta={"step": self.step, "policy_version": self.version, "train_step": state,
                                        **({"lora_base": self.s.base} if self.s.base is not None else {})})
        self._committed_step = self.step
        if (lead := self.lead) is not None:
            lead.ledger.mark_committed(self.step)
            lead.source.ack(self._uncommitted)
            lead.clock.event("checkpoint", step=self.step, version=self.version, acked=len(self._uncommitted),
                             seconds=round(seconds, 3))
            self._uncommitted = []
            prune_checkpoints(self.ckpt_root, self.s.keep_checkpoints)
            if lead.hooks is not None:
                lead.hooks.on_commit(self.step, str(directory))

    # -------------------------------------------------------------------------------------------------- helpers
    @property
    def _distributed(self) -> bool:
        return self._bytes_group is not None and dist.get_world_size() > 1

    def _share(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's ``obj`` on every rank, as msgpack over gloo."""
        if not self._distributed:
            return obj
        return broadcast_msgpack(obj if self.rank == 0 else None, self._bytes_group)

    def request_stop(self) -> None:
        """Ask this rank to stop at the next step boundary, after a commit; safe from a signal handler or a thread.

        Asking rank 0 alone is enough (its drain stops, and the step boundary's vote tells the others); the launcher
        asks every rank.
        """
        self._stop_requested = True

    def _agree_to_stop(self) -> bool:
        """Whether any rank was asked to stop, answered identically on every rank at this step boundary.

        A rank that acted on its own request would enter the collective commit alone while its peers wait in the next
        drain's broadcast, and both would sit there until SIGKILL (a Ctrl-C once took 67 s that way). So the ranks vote:
        an all-reduce (MAX) of one integer over the gloo group they already share. Every rank gets the same answer at
        the same step, whichever rank got the signal and whenever it landed, and it costs a round trip of a few bytes
        per step. A stop key in Redis would cost every rank a Redis connection, and two ranks reading it a moment
        apart can still read different values, so they would need this vote anyway.
        """
        if not self._distributed:
            return self._stop_requested
        flag = torch.tensor([int(self._stop_requested)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._bytes_group)
        return bool(flag.item())

    def _install_signal_handlers(self) -> None:
        def on_signal(signum: int, _frame: object) -> None:
            log.warning("signal %d: finishing the current step, committing, then exiting", signum)
            self.request_stop()

        try:
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
        except ValueError:
            pass  # not the main thread (tests); no handler, the caller stops us

    def close(self) -> None:
        if self._push_thread is not None:
            self._push_thread.join()
        if self.lead is not None and self.lead.pusher is not None:
            self._loop.run_until_complete(close_pusher(self.lead.pusher))
        if self.owners is not None and self.owners.sender is not None:
            self.owners.sender.close(self._loop)
        self._loop.close()
        if self.lead is not None and self.lead.scalars is not None:
            self.lead.scalars.close()
