"""The producer loop: prompts in, versioned sample groups out, onto the durable queue.

Plain asyncio, one process, any number of groups in flight. A producer holds no state the run needs: the prompt
cursor, the pacing slots and the record of its own in-flight groups live in Redis. Each admitted group is written to
``producer:{name}:inflight`` in the same script that admits it and takes its prompt, and moves to ``group_slots``
once it is on the queue. So a killed producer loses only the generations it was running: when it comes back under
the same name, or once its lease expires and another producer notices, those prompts go back to the cursor and their
pacing slots are released (docs/queue.md, "Pacing slots"). A generation that no engine could serve hands its prompt
back at once, so a prompt is never lost to an engine failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pipeline.config.producer import BUILTIN_ROLLOUT, ROLLOUT_SIGNATURE, ProducerConfig
from pipeline.config.prompts import PromptConfig
from pipeline.data.prompts import Prompt, PromptSource, setup_prompts
from pipeline.errors import ConfigError, EngineError, SampleError
from pipeline.producers.base import EngineClient
from pipeline.producers.cursor import PromptCursor
from pipeline.producers.engine_pool import EnginePool
from pipeline.producers.rewards import RewardFn, RewardOutcome, RewardScorer, SampleScorer, setup_scorer
from pipeline.producers.rollout import RolloutContext, RolloutEngine, RolloutFn, TextCodec, Trajectory, single_turn
from pipeline.producers.sglang_client import NO_RETRY, EngineRequestError, SGLangClient
from pipeline.queue.keys import RunKeys, parse_slot_item
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample, SampleStatus, SamplingInfo, compact_routing

log = logging.getLogger(__name__)

# AReaL-style admission, atomic across producers: a group may start only while
# (current_version + max_lag + 1) * batch_groups > slots held (groups_started). In the same step the group takes its
# prompt (a handed-back one first, else a new cursor index) and is recorded as in flight for this producer, so no
# crash can leave a slot taken that nothing knows about. ARGV[1] = 0 admits without the budget check (no pacing) but
# still counts the slot, so the trainer's give-backs stay balanced. Returns {slot item, 1 if a retry}, or -1.
# KEYS: policy_version, groups_started, prompt_retry, prompt_cursor, inflight; ARGV: paced, max_lag, batch, group_id
_TAKE = """
local started = tonumber(redis.call('GET', KEYS[2]) or '0')
if ARGV[1] == '1' then
  local v = tonumber(redis.call('GET', KEYS[1]) or '0')
  if (v + tonumber(ARGV[2]) + 1) * tonumber(ARGV[3]) <= started then
    return -1
  end
end
redis.call('INCR', KEYS[2])
local retry = 1
local item = redis.call('LPOP', KEYS[3])
if not item then
  item = tostring(redis.call('INCR', KEYS[4]) - 1) .. ':0'
  retry = 0
end
redis.call('HSET', KEYS[5], ARGV[4], item)
return {item, retry}
"""

# The group is on the queue: its record moves from this producer's in-flight hash to group_slots, where the trainer
# finds it (to release the slot of a group it will not train, or to requeue the prompt). A record that is gone was
# taken already: by the trainer, which may drain the group before this runs and looks in the in-flight hash too, or by
# a peer that reclaimed it after this producer's lease expired. Either way its slot was released, so nothing may be
# recorded again. KEYS: inflight, group_slots; ARGV: group_id. Returns 1 or 0.
_PUT_DONE = """
local item = redis.call('HGET', KEYS[1], ARGV[1])
if not item then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], item)
return 1
"""

# Nothing was put: release the slot, and hand the prompt back unless ARGV[2] = 0 (the engine refused the prompt).
# KEYS: inflight, groups_started, prompt_retry; ARGV: group_id, hand_back. Returns 1, or 0 if already reclaimed.
_RETURN = """
local item = redis.call('HGET', KEYS[1], ARGV[1])
if not item then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DECR', KEYS[2])
if ARGV[2] == '1' then redis.call('RPUSH', KEYS[3], item) end
return 1
"""

# Hand every in-flight group of a producer back to the cursor and release its slots: the producer's own leftovers
# when it restarts (ARGV[2] = 1), or a peer's once its lease has expired (ARGV[2] = 0; refused while the lease lives).
# KEYS: inflight, groups_started, prompt_retry, lease, producers; ARGV: name, own. Returns the count, or -1.
_RECLAIM = """
if ARGV[2] ~= '1' and redis.call('EXISTS', KEYS[4]) == 1 then return -1 end
local items = redis.call('HVALS', KEYS[1])
for _, item in ipairs(items) do redis.call('RPUSH', KEYS[3], item) end
if #items > 0 then redis.call('DECRBY', KEYS[2], #items) end
redis.call('DEL', KEYS[1])
if ARGV[2] ~= '1' then redis.call('SREM', KEYS[5], ARGV[1]) end
return #items
"""

# SGLang's finish_reason.type -> the sample's status. Anything else (a newer engine's reason) is not trainable.
_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}

Tokenize = Callable[[str], Sequence[int]]


@dataclass
class ProducerStats:
    """Counters of one producer's life."""

    groups_put: int = 0
    samples_put: int = 0
    samples_failed_reward: int = 0
    samples_failed_version: int = 0  # samples whose engine reported a weight version that is not an integer
    rollouts_failed: int = 0  # groups whose rollout function raised, timed out or returned nonsense (prompt skipped)
    engine_errors: int = 0
    prompts_retried: int = 0
    prompts_requeued: int = 0  # taken prompts the trainer had requeued (a subset of prompts_retried)
    prompts_refused: int = 0
    paced_waits: int = 0
    prompts_reclaimed: int = 0  # in-flight prompts of a dead incarnation or peer handed back to the cursor
    leases_lost: int = 0  # renewals that found the lease expired (this producer stalled past lease_ttl_s)


@dataclass(frozen=True)
class Slot:
    """An admitted group: its id (chosen at admission), its prompt's cursor index and the trainer's requeues of it."""

    group_id: str
    index: int
    requeues: int
    is_retry: bool


@dataclass(frozen=True)
class Pacing:
    """The staleness budget producers respect: at most ``max_lag`` versions behind, ``batch_groups`` per step."""

    max_lag: int
    batch_groups: int

    def __post_init__(self) -> None:
        if self.max_lag < 0 or self.batch_groups < 1:
            raise ConfigError(
                f"pacing needs max_lag >= 0 and batch_groups >= 1, got max_lag={self.max_lag}, "
                f"batch_groups={self.batch_groups}"
            )


class Producer:
    """Turns prompts into sample groups with one engine client (or pool) and puts them on the queue."""

    def __init__(
        self,
        cfg: ProducerConfig,
        *,
        name: str,
        queue: SampleQueue,
        engine: EngineClient,
        prompts: PromptSource,
        tokenize: Tokenize | None,
        reward_fn: RewardFn | None = None,
        pacing: Pacing | None,
        num_experts: int | None,
        scorer: RewardScorer | None = None,
        rollout_fn: RolloutFn = single_turn,
        codec: TextCodec | None = None,
    ) -> None:
        self.cfg, self.name = cfg, name
        self.queue, self.engine, self.prompts = queue, engine, prompts
        self.tokenize = tokenize
        if (reward_fn is None) == (scorer is None):
            raise ConfigError("a Producer scores with reward_fn or with scorer: pass exactly one")
        self.scorer = scorer or SampleScorer(reward_fn, timeout_s=cfg.reward_timeout_s,  # type: ignore[arg-type]
                                             concurrency=cfg.reward_concurrency)
        self.pacing = pacing
        self.num_experts = num_experts
        self.rollout_fn = rollout_fn
        self.codec = codec
        self.cursor = PromptCursor(queue.redis, queue.run)
        self.keys = RunKeys(queue.run)
        self.started_key = self.keys.groups_started
        """Pacing slots held by every producer of the run (what pacing compares with the budget)."""
        self.inflight_key = self.keys.producer_inflight(name)
        self.lease_key = self.keys.producer_lease(name)
        self._take_script = queue.redis.register_script(_TAKE)
        self._put_done = queue.redis.register_script(_PUT_DONE)
        self._return = queue.redis.register_script(_RETURN)
        self._reclaim = queue.redis.register_script(_RECLAIM)
        self.stats = ProducerStats()
        self._stopping = threading.Event()  # set on stop: puts waiting for room give up (nothing written)
        self._placed: set[str] = set()  # group ids whose put landed; a cancel after it must not release their slot
        # Puts block while the queue is full; on asyncio's default executor (cores + 4 threads) they would take every
        # thread and starve the loop's own short calls (taking a slot, handing one back), the stop included.
        self._put_pool: ThreadPoolExecutor | None = None
        self._version_warned: set[tuple[str | None, tuple[str, ...]]] = set()

    # ---- the loop ---------------------------------------------------------------------------------------------------

    async def run(self, max_groups: int | None = None, stop: asyncio.Event | None = None) -> ProducerStats:
        """Produce until ``stop`` is set (groups in flight then hand their prompts back) or ``max_groups`` groups are
        on the queue (groups in flight are waited for).

        A group whose generation failed on every engine does not count: its prompt goes back and is tried again. Any
        other error (Redis gone, queue full past its timeout, an engine answer that breaks the Sample's invariants)
        cancels the groups in flight, hands their prompts back, and propagates.
        """
        await asyncio.to_thread(self.start_lease)
        await asyncio.to_thread(self.reclaim_dead_peers)  # a peer that died while none of us ran
        tasks: set[asyncio.Task[None]] = set()
        heartbeat = asyncio.create_task(self._heartbeat())
        # The puts' threads learn of a stop at once, not when this loop next looks: it may be waiting on them.
        mirror = asyncio.create_task(self._mirror_stop(stop)) if stop is not None else None
        self._put_pool = ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix=f"{self.name}-put")
        try:
            while not self._finished(max_groups, stop):
                if heartbeat.done():
                    heartbeat.result()  # re-raise what stopped it (Redis gone)
                if not self._has_room(len(tasks), max_groups):
                    # Bounded, so that a stop is seen while every slot is busy.
                    await self._reap(tasks, self.cfg.admission_poll_s)
                elif (slot := await asyncio.to_thread(self._take)) is not None:
                    tasks.add(asyncio.create_task(self._one_group(slot)))
                else:
                    self.stats.paced_waits += 1
                    await self._reap(tasks, self.cfg.admission_poll_s)
            if stop is not None and stop.is_set():
                self._stopping.set()
                # Stopping: the groups in flight hand their prompts back (cancellation runs _one_group's hand-back)
                # rather than make the run's shutdown wait for generations nobody will train.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                tasks.clear()
            while tasks:
                await self._reap(tasks, None)
        except BaseException:
            self._stopping.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            self._stopping.clear()  # a later run() (a Ray actor's) puts normally
            self._put_pool.shutdown(wait=False)
            self._put_pool = None
            background = [t for t in (heartbeat, mirror) if t is not None]
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        # Only a clean exit gives the lease up early; after a failure it expires, and whoever comes next reclaims.
        await asyncio.to_thread(self.end_lease)
        return self.stats

    async def _mirror_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._stopping.set()

    def _finished(self, max_groups: int | None, stop: asyncio.Event | None) -> bool:
        return (stop is not None and stop.is_set()) or (max_groups is not None and self.stats.groups_put >= max_groups)

    def _has_room(self, in_flight: int, max_groups: int | None) -> bool:
        if in_flight >= self.cfg.concurrency:
            return False
        return max_groups is None or self.stats.groups_put + in_flight < max_groups

    @staticmethod
    async def _reap(tasks: set[asyncio.Task[None]], timeout: float | None) -> None:
        """Wait for a group to finish (or ``timeout``), forget finished ones, and re-raise what one raised."""
        if not tasks:
            await asyncio.sleep(timeout or 0.0)
            return
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            tasks.discard(task)
            task.result()

    def _take(self) -> Slot | None:
        """Admit a group under pacing and take its prompt, atomically; None: wait for a push or a slot given back."""
        group_id = uuid.uuid4().hex
        pacing = self.pacing or Pacing(max_lag=0, batch_groups=1)  # unpaced: the numbers are not looked at
        got = self._take_script(
            keys=[self.keys.policy_version, self.started_key, self.keys.prompt_retry, self.keys.prompt_cursor,
                  self.inflight_key],
            args=[int(self.pacing is not None), pacing.max_lag, pacing.batch_groups, group_id],
        )  # fmt: skip
        if got == -1:
            return None
        item, retry = got
        index, requeues = parse_slot_item(item)
        return Slot(group_id, index, requeues, bool(retry))

    def _release(self, slot: Slot, hand_back: bool) -> None:
        # The admitted group produced nothing, so it must not use up the staleness budget.
        self._return(keys=[self.inflight_key, self.started_key, self.keys.prompt_retry],
                     args=[slot.group_id, int(hand_back)])

    def _mark_put(self, slot: Slot) -> None:
        self._put_done(keys=[self.inflight_key, self.keys.group_slots], args=[slot.group_id])

    # ---- the lease: who may reclaim whose in-flight groups ---------------------------------------------------------

    def start_lease(self) -> int:
        """Take this producer's lease and hand back what a previous incarnation under this name left in flight."""
        pipe = self.queue.redis.pipeline(transaction=True)
        pipe.set(self.lease_key, "1", px=int(self.cfg.lease_ttl_s * 1000))
        pipe.sadd(self.keys.producers, self.name)
        pipe.execute()
        n = self._reclaim_from(self.name, own=True)
        if n:
            log.warning("producer %s: handed back %d prompts a previous run of this producer left in flight",
                        self.name, n)
        return n

    def end_lease(self) -> None:
        """Give the lease up after a clean stop (nothing is in flight any more)."""
        pipe = self.queue.redis.pipeline(transaction=True)
        pipe.delete(self.lease_key)
        pipe.srem(self.keys.producers, self.name)
        pipe.execute()
        # Anything still recorded (a hand-back that failed) goes back now rather than waiting for a peer.
        self._reclaim_from(self.name, own=True)

    def reclaim_dead_peers(self) -> int:
        """Hand back the in-flight prompts of every producer whose lease has expired; returns how many."""
        total = 0
        for raw in self.queue.redis.smembers(self.keys.producers):
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if name == self.name:
                continue
            n = self._reclaim_from(name, own=False)
            if n > 0:
                log.warning("producer %s: producer %s stopped renewing its lease; handed back its %d in-flight "
                            "prompts", self.name, name, n)
                total += n
        return total

    def _reclaim_from(self, name: str, *, own: bool) -> int:
        n = int(self._reclaim(
            keys=[self.keys.producer_inflight(name), self.started_key, self.keys.prompt_retry,
                  self.keys.producer_lease(name), self.keys.producers],
            args=[name, int(own)],
        ))  # fmt: skip
        if n >= 0:
            # Payloads it wrote whose headers never landed: nothing will ever read them, and on a cluster they sit
            # on other primaries than the run's, out of any trim's reach. A put landed but not yet recorded keeps
            # its payload, since its header took it off the listing in the same step.
            dropped = self.queue.discard_unqueued_payloads(name)
            if dropped:
                log.warning("producer %s: deleted %d payloads producer %s wrote without their headers", self.name,
                            dropped, name)
        self.stats.prompts_reclaimed += max(n, 0)
        return n

    def _renew_lease(self) -> None:
        pipe = self.queue.redis.pipeline(transaction=True)
        pipe.set(self.lease_key, "1", px=int(self.cfg.lease_ttl_s * 1000), get=True)
        pipe.sadd(self.keys.producers, self.name)
        previous, _ = pipe.execute()
        if previous is None:
            # A peer may have handed back what this producer had in flight: those prompts will be generated twice.
            self.stats.leases_lost += 1
            log.warning("producer %s: its lease (%.1fs) had expired before this renewal; if a peer reclaimed its "
                        "in-flight groups, their prompts are generated twice. Raise producer.lease_ttl_s if this "
                        "producer stalls that long", self.name, self.cfg.lease_ttl_s)

    async def _heartbeat(self) -> None:
        # Three renewals per TTL: one late renewal (a GC pause, a slow Redis) does not make this producer look dead.
        while True:
            await asyncio.sleep(self.cfg.lease_ttl_s / 3)
            await asyncio.to_thread(self._renew_lease)
            await asyncio.to_thread(self.reclaim_dead_peers)

    # ---- one group --------------------------------------------------------------------------------------------------

    async def _one_group(self, slot: Slot) -> None:
        self.stats.prompts_retried += int(slot.is_retry)
        self.stats.prompts_requeued += int(slot.requeues > 0)
        try:
            served = await self._produce(slot)
        except BaseException:
            if slot.group_id in self._placed:
                self._placed.discard(slot.group_id)  # cancelled after the put landed: the group holds the slot
                raise
            # Cancelled or failed before the group was on the queue: another try (here or in another producer) must
            # see this prompt. Synchronous on purpose, so that a cancellation cannot skip it.
            self._release(slot, hand_back=True)
            raise
        self._placed.discard(slot.group_id)
        if not served:
            await asyncio.to_thread(self._release, slot, True)
            # Keep this slot idle for a while, so that a run with every engine down does not spin through retries.
            await asyncio.sleep(self.cfg.engine_retry_s)

    async def _produce(self, slot: Slot) -> bool:
        """Generate, score and put the group of ``slot``'s prompt; False if no engine served it (try again later)."""
        index = slot.index
        prompt = self.prompts[index % len(self.prompts)]
        prompt_ids = self.prompt_ids(prompt)
        seed = None if self.cfg.sampling.seed is None else self.cfg.sampling.seed + index * self.cfg.group_size
        try:
            results = await self._rollout(prompt, prompt_ids, seed)
        except EngineRequestError as e:
            # The engine refused this prompt (too long, say); every engine would, so it is skipped, not retried.
            self.stats.prompts_refused += 1
            log.error("producer %s: engines refuse prompt %s, skipping it: %s", self.name, prompt.prompt_id, e)
            await asyncio.to_thread(self._release, slot, False)
            return True
        except (TimeoutError, EngineError, OSError) as e:
            self.stats.engine_errors += 1
            log.warning("producer %s: no engine served prompt %s (%s); handing it back", self.name,
                        prompt.prompt_id, e)
            return False
        except _RolloutFailed as e:
            # User code failed on this prompt: retrying it would most likely fail the same way, so it is skipped
            # (like a prompt the engines refuse), counted, and logged with the traceback.
            self.stats.rollouts_failed += 1
            log.error("producer %s: rollout function %s failed on prompt %s, skipping it: %s", self.name,
                      self.cfg.rollout, prompt.prompt_id, e.reason, exc_info=e.__cause__)
            await asyncio.to_thread(self._release, slot, False)
            return True
        outcomes = await self.scorer.score_group(prompt, [r.text for r in results])
        group = self.build_group(prompt, prompt_ids, results, outcomes, seed=seed, group_id=slot.group_id)
        loop = asyncio.get_running_loop()
        placing = asyncio.ensure_future(loop.run_in_executor(self._put_pool, self._place, group, slot))
        try:
            # A cancel (a stop) must not race the put: the thread goes on, so the group may land after the
            # coroutine is told to stop, and releasing its slot then would queue it twice over (slot and prompt).
            await asyncio.shield(placing)
        except asyncio.CancelledError:
            await asyncio.wait([placing])
            if placing.exception() is None:
                self._count_put(group, outcomes)
            raise
        self._count_put(group, outcomes)
        return True

    async def _rollout(self, prompt: Prompt, prompt_ids: list[int], seed: int | None) -> list[Trajectory]:
        """The group's trajectories from the rollout function. Engine errors propagate as they are (the caller hands
        the prompt back or skips it); anything else the function does wrong raises _RolloutFailed."""
        params = self.request_params(seed)
        del params["n"]  # the context adds n and the seeds per call
        params.pop("sampling_seed", None)
        engine = RolloutEngine(self.engine, self.codec,
                               routing=self.cfg.return_routed_experts and self.num_experts is not None)
        ctx = RolloutContext(prompt=prompt, prompt_ids=tuple(prompt_ids), n=self.cfg.group_size, engine=engine,
                             codec=self.codec, sampling=params, seed=seed)
        try:
            async with asyncio.timeout(self.cfg.rollout_timeout_s) as deadline:
                trajectories = await self.rollout_fn(ctx)
        except Exception as e:
            if deadline.expired():
                raise _RolloutFailed(f"took longer than producer.rollout_timeout_s = "
                                     f"{self.cfg.rollout_timeout_s}s") from e
            if engine.raised(e) and isinstance(e, (EngineRequestError, EngineError, OSError)):
                raise  # the engines' failure, not the function's: handled as for the built-in path
            raise _RolloutFailed(f"{type(e).__name__}: {e}") from e
        if not isinstance(trajectories, list) or len(trajectories) != self.cfg.group_size \
                or not all(isinstance(t, Trajectory) for t in trajectories):
            got = f"{len(trajectories)} items" if isinstance(trajectories, list) else type(trajectories).__name__
            raise _RolloutFailed(f"returned {got}; it must return a list of producer.group_size = "
                                 f"{self.cfg.group_size} Trajectory objects")
        for traj in trajectories:
            try:
                traj.flatten()  # a turn appended by hand from the wrong prefix shows here, not in the put
            except SampleError as e:
                raise _RolloutFailed(str(e)) from e
        return trajectories

    def _place(self, group: list[Sample], slot: Slot) -> None:
        """Put the group on the queue and clear its in-flight record (runs in a thread)."""
        self.queue.put(group, self.cfg.put_timeout_s, abort=self._stopping.is_set)
        self._placed.add(slot.group_id)
        # Killed between the put and this: a restart hands the prompt back although its group is queued, so it is
        # generated twice (never lost), and that group holds no slot record (its slot was released by the restart).
        self._mark_put(slot)

    def _count_put(self, group: list[Sample], outcomes: Sequence[RewardOutcome]) -> None:
        self.stats.groups_put += 1
        self.stats.samples_put += len(group)
        self.stats.samples_failed_reward += sum(o.failed for o in outcomes)

    def _warn_version(self, engine: str, versions: Sequence[str]) -> None:
        self.stats.samples_failed_version += 1
        key = (engine, tuple(sorted(set(versions))))
        if key not in self._version_warned:
            self._version_warned.add(key)
            log.warning(
                "producer %s: engine %s reports weight versions %s, which sluice never pushed (SGLang says "
                "'default' before its first update); its samples are marked failed until the run labels or updates "
                "the engine (sluice does so as it starts; start SGLang with --weight-version 0 to avoid it)",
                self.name, engine, list(key[1]))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, tokenizing its text if it has no ids."""
        if prompt.input_ids is not None:
            return list(prompt.input_ids)
        if self.tokenize is None:
            raise ConfigError(f"prompt {prompt.prompt_id!r} is text but the producer has no tokenizer; pass tokenize=")
        return [int(t) for t in self.tokenize(prompt.text or "")]

    def request_params(self, seed: int | None) -> dict[str, Any]:
        """SGLang ``sampling_params`` for one group (``n`` samples of one prompt)."""
        sp = self.cfg.sampling
        params: dict[str, Any] = {
            "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
            "max_new_tokens": sp.max_new_tokens, "n": self.cfg.group_size,
        }  # fmt: skip
        if sp.stop_token_ids:
            params["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.ignore_eos:
            params["ignore_eos"] = True
        if seed is not None:
            params["sampling_seed"] = seed
        return params

    def build_group(
        self,
        prompt: Prompt,
        prompt_ids: Sequence[int],
        results: Sequence[Trajectory],
        outcomes: Sequence[RewardOutcome],
        *,
        seed: int | None = None,
        group_id: str | None = None,
    ) -> list[Sample]:
        """Samples of one prompt group from its trajectories and their rewards (sample j used seed + j)."""
        group_id = group_id or uuid.uuid4().hex
        sp = self.cfg.sampling
        prompt_arr = np.asarray(prompt_ids, dtype=np.int32)
        out = []
        for i, (r, o) in enumerate(zip(results, outcomes, strict=True)):
            flat = r.flatten()
            versions = _token_versions(flat.versions)
            status = SampleStatus.FAILED if o.failed else _STATUS.get(r.finish_reason, SampleStatus.ABORTED)
            info = {**r.info, **o.info} if r.info else o.info
            if versions is None:
                # Not trainable: nobody knows which weights made these tokens. The sample is queued as failed (the
                # trainer's ledger records it invalid) and the producer goes on; the engine's adoption or the next
                # push gives it a real version.
                self._warn_version(r.engine, flat.versions)
                versions = np.zeros(len(flat.response_ids), dtype=np.int32)  # placeholders: never trained
                status = SampleStatus.FAILED
                info = {**info, "error": f"engine {r.engine} reported weight versions {sorted(set(flat.versions))}, "
                                         "not integers"}
            routed = None
            if flat.routing is not None and self.num_experts is not None:
                routed = compact_routing(flat.routing, self.num_experts)
            sampling = SamplingInfo(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                    max_new_tokens=sp.max_new_tokens, seed=None if seed is None else seed + i)
            out.append(Sample(
                prompt_ids=prompt_arr,
                response_ids=flat.response_ids,
                rollout_logprobs=flat.logprobs,
                loss_mask=flat.loss_mask,
                token_versions=versions,
                routed_experts=routed,
                reward=o.reward,
                reward_info=info,
                status=status,
                finish_reason=r.finish_reason,
                group_id=group_id,
                prompt_id=prompt.prompt_id,
                index=i,
                producer=self.name,
                engine=r.engine,
                created_at=time.time(),
                sampling=sampling,
            ))  # fmt: skip
        return out


class _RolloutFailed(Exception):
    """The rollout function raised (anything but an engine error), timed out, or returned something unusable."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _token_versions(labels: Sequence[str]) -> np.ndarray | None:
    """The per-token versions as integers, or None when the engine reports one that is not a version sluice pushed
    (SGLang's "default" before any update, a negative or free-form label)."""
    try:
        versions = np.array([int(v) for v in labels], dtype=np.int64)
    except ValueError:
        return None
    if len(versions) and (versions.min() < 0 or versions.max() > np.iinfo(np.int32).max):
        return None
    return versions.astype(np.int32)


def read_num_experts(model_dir: str | Path) -> int | None:
    """The expert count from an HF config.json (None for a dense model)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no config.json; is it an HF model folder?")
    cfg = json.loads(path.read_text())
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    return int(n) if n else None


def routed_experts_shape(model_dir: str | Path) -> tuple[int, int] | None:
    """(MoE layers, top-k) of an HF MoE model, which SGLang's flat routed_experts must be reshaped to; None for a
    dense model. SGLang's /model_info does not report it; the model's config does, read by its family (which layers
    are MoE is family knowledge: DeepSeek-V3's first layers are dense)."""
    from pipeline.models.config import ModelConfig

    if read_num_experts(model_dir) is None:
        return None
    model = ModelConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
    return model.num_moe_layers, model.moe_topk


class HFTextCodec:
    """The model folder's HF tokenizer as a rollout's ``TextCodec``: no special tokens added, none shown."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))


def load_codec(model_dir: str | Path) -> HFTextCodec:
    """Text <-> ids with the model folder's tokenizer (what the producer tokenizes prompts and rollouts with)."""
    return HFTextCodec(model_dir)


def resolve_rollout(ref: str) -> RolloutFn:
    """The rollout function ``producer.rollout`` names (checked: async, one argument)."""
    if ref == BUILTIN_ROLLOUT:
        return single_turn
    from pipeline import plugins

    return plugins.resolve(ref, field="producer.rollout", signature=ROLLOUT_SIGNATURE)  # type: ignore[return-value]


def load_tokenize(model_dir: str | Path) -> Tokenize:
    """Text -> token ids with the model folder's HF tokenizer, without special tokens (as the engine does for text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return tokenize


class PacingConfig(BaseModel):
    """The staleness budget as a config section (see ``Pacing``)."""

    model_config = ConfigDict(extra="forbid")

    max_lag: int = Field(default=1, ge=0)
    """Versions a sample may lag behind the trainer when it is trained on."""
    batch_groups: int = Field(default=8, ge=1)
    """Groups the trainer consumes per step."""


class ProducerSpec(BaseModel):
    """Everything one producer process needs to start on its own (what a launcher or a Ray actor is handed)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    """Producer name, recorded in every sample."""
    run: str = Field(min_length=1)
    """Run name (the Redis namespace)."""
    redis_url: str
    """The run's Redis."""
    engine_urls: list[str] = Field(min_length=1)
    """Base URLs of the engines, used least-loaded first."""
    model_dir: Path
    """The served model's HF folder: its tokenizer and its expert count."""
    producer: ProducerConfig = Field(default_factory=ProducerConfig)
    """The producer loop."""
    prompts: PromptConfig = Field(default_factory=lambda: PromptConfig.model_validate({}))
    """Where prompts come from."""
    pacing: PacingConfig | None = None
    """The staleness budget; None admits without limit."""
    queue_capacity: int = Field(default=1024, ge=1)
    """Entries the trainer group may lag behind before ``put`` blocks."""
    routing_codec: Literal["compact", "plain"] = "compact"
    """How ``put`` writes MoE routing (``pipeline.queue.codec``)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one /generate answer."""
    adapters: bool = False
    """LoRA on SGLang engines: each request names the adapter of the engine's version (``SGLangClient``)."""


@asynccontextmanager
async def open_producer(spec: ProducerSpec) -> AsyncIterator[Producer]:
    """Connect to Redis and the engines and build the producer a spec describes; everything is released on exit."""
    from pipeline.queue.connection import connect

    scorer = setup_scorer(spec.producer)  # first, so that a typo fails before any connection
    rollout_fn = resolve_rollout(spec.producer.rollout)
    prompts = setup_prompts(spec.prompts)
    num_experts = read_num_experts(spec.model_dir)
    codec = load_codec(spec.model_dir)
    redis_client = connect(spec.redis_url)
    # No per-client retry: the pool fails over to another engine at once instead of waiting out a dead one.
    shape = routed_experts_shape(spec.model_dir)
    pool = EnginePool([SGLangClient(url, timeout=spec.request_timeout_s, retry=NO_RETRY, routed_experts_shape=shape,
                                    adapters=spec.adapters)
                       for url in spec.engine_urls])
    try:
        pacing = None if spec.pacing is None else Pacing(spec.pacing.max_lag, spec.pacing.batch_groups)
        yield Producer(
            spec.producer, name=spec.name, queue=SampleQueue(redis_client, spec.run, capacity=spec.queue_capacity,
                                                       routing_codec=spec.routing_codec),
            engine=pool, prompts=prompts, tokenize=codec.encode, scorer=scorer, pacing=pacing,
            num_experts=num_experts, rollout_fn=rollout_fn, codec=codec,
        )  # fmt: skip
    finally:
        await scorer.close()
        await pool.close()
        redis_client.close()


async def serve_producer(
    spec: ProducerSpec, max_groups: int | None = None, stop: asyncio.Event | None = None
) -> ProducerStats:
    """Build the producer a spec describes, run it until ``stop`` or ``max_groups``, and release everything."""
    async with open_producer(spec) as producer:
        return await producer.run(max_groups=max_groups, stop=stop)


def stats_dict(stats: ProducerStats) -> dict[str, Any]:
    """The counters as a plain dict (for logs, JSON and Ray)."""
    return asdict(stats)
