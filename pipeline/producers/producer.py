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
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import ConfigError, EngineError
from pipeline.producers.base import EngineClient, GenerateResult
from pipeline.producers.prompts import Prompt, PromptConfig, PromptCursor, PromptSource, setup_prompts
from pipeline.producers.rewards import RewardFn, RewardOutcome, resolve_reward, score
from pipeline.producers.sglang_client import NO_RETRY, EnginePool, EngineRequestError, SGLangClient
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


class SamplingConfig(BaseModel):
    """Sampling parameters sent to the engine with every request."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    """Sampling temperature; the trainer must score log-probs at the same temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k cut-off; -1 disables it."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Longest response."""
    stop_token_ids: list[int] = []
    """Tokens that end a response besides EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use it to fix response lengths)."""
    seed: int | None = Field(default=None, ge=0)
    """Base sampling seed; prompt index i gets seed + i * group_size (+ j for sample j), so a retry repeats itself."""


class ProducerConfig(BaseModel):
    """One producer process."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(default=4, ge=1, le=1024)
    """Samples per prompt (the GRPO group)."""
    concurrency: int = Field(default=4, ge=1, le=4096)
    """Prompt groups in flight at once."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    return_routed_experts: bool = True
    """Ask engines for MoE routing (needed for R3); ignored for dense models."""
    reward: str = "exact_match"
    """Built-in reward name or 'package.module:function'."""
    reward_timeout_s: float = Field(default=30.0, gt=0)
    """A reward function running longer marks its sample failed."""
    put_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait on queue backpressure before failing."""
    admission_poll_s: float = Field(default=0.05, gt=0)
    """How often to re-check admission while paced."""
    engine_retry_s: float = Field(default=1.0, ge=0)
    """After no engine could serve a group, how long its slot stays idle before another group may start."""
    lease_ttl_s: float = Field(default=30.0, ge=0.5, le=3600.0)
    """A producer silent this long counts as dead: another producer hands its in-flight prompts back."""


@dataclass
class ProducerStats:
    """Counters of one producer's life."""

    groups_put: int = 0
    samples_put: int = 0
    samples_failed_reward: int = 0
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
        reward_fn: RewardFn,
        pacing: Pacing | None,
        num_experts: int | None,
    ) -> None:
        self.cfg, self.name = cfg, name
        self.queue, self.engine, self.prompts = queue, engine, prompts
        self.tokenize = tokenize
        self.reward_fn = reward_fn
        self.pacing = pacing
        self.num_experts = num_experts
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
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
        # Only a clean exit gives the lease up early; after a failure it expires, and whoever comes next reclaims.
        await asyncio.to_thread(self.end_lease)
        return self.stats

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
            results = await self.engine.generate_many(
                [prompt_ids], self.request_params(seed), return_logprob=True,
                return_routed_experts=self.cfg.return_routed_experts and self.num_experts is not None,
            )  # fmt: skip
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
        outcomes = await asyncio.gather(*(score(self.reward_fn, prompt, r.text, self.cfg.reward_timeout_s)
                                          for r in results))
        group = self.build_group(prompt, prompt_ids, results, outcomes, seed=seed, group_id=slot.group_id)
        placing = asyncio.ensure_future(asyncio.to_thread(self._place, group, slot))
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
        results: Sequence[GenerateResult],
        outcomes: Sequence[RewardOutcome],
        *,
        seed: int | None = None,
        group_id: str | None = None,
    ) -> list[Sample]:
        """Samples of one prompt group from the engine's results and their rewards (sample j used seed + j)."""
        group_id = group_id or uuid.uuid4().hex
        sp = self.cfg.sampling
        prompt_arr = np.asarray(prompt_ids, dtype=np.int32)
        out = []
        for i, (r, o) in enumerate(zip(results, outcomes, strict=True)):
            if r.output_logprobs is None:
                raise EngineError(f"engine {r.engine} returned no output logprobs; sluice needs return_logprob")
            routed = None
            if r.routed_experts is not None and self.num_experts is not None:
                routed = compact_routing(r.routed_experts, self.num_experts)
            sampling = SamplingInfo(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                    max_new_tokens=sp.max_new_tokens, seed=None if seed is None else seed + i)
            out.append(Sample(
                prompt_ids=prompt_arr,
                response_ids=np.asarray(r.output_ids, dtype=np.int32),
                rollout_logprobs=np.asarray(r.output_logprobs, dtype=np.float32),
                token_versions=_token_versions(r),
                routed_experts=routed,
                reward=o.reward,
                reward_info=o.info,
                status=SampleStatus.FAILED if o.failed else _STATUS.get(r.finish_reason, SampleStatus.ABORTED),
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


def _token_versions(result: GenerateResult) -> np.ndarray:
    try:
        return np.array([int(v) for v in result.token_versions()], dtype=np.int32)
    except ValueError:
        raise EngineError(
            f"engine {result.engine} reports non-integer weight versions "
            f"{[s.version for s in result.weight_versions]}; "
            "sluice pushes integer versions, so start the engine with an integer --weight-version"
        ) from None


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
    dense model. SGLang's /model_info does not report it; the model's config does."""
    if read_num_experts(model_dir) is None:
        return None
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return hf["num_hidden_layers"] - len(hf.get("mlp_only_layers") or []), int(hf["num_experts_per_tok"])


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


@asynccontextmanager
async def open_producer(spec: ProducerSpec) -> AsyncIterator[Producer]:
    """Connect to Redis and the engines and build the producer a spec describes; everything is released on exit."""
    from pipeline.queue.connection import connect

    reward_fn = resolve_reward(spec.producer.reward)  # first, so that a typo fails before any connection
    prompts = setup_prompts(spec.prompts)
    num_experts = read_num_experts(spec.model_dir)
    tokenize = load_tokenize(spec.model_dir)
    redis_client = connect(spec.redis_url)
    # No per-client retry: the pool fails over to another engine at once instead of waiting out a dead one.
    shape = routed_experts_shape(spec.model_dir)
    pool = EnginePool([SGLangClient(url, timeout=spec.request_timeout_s, retry=NO_RETRY, routed_experts_shape=shape)
                       for url in spec.engine_urls])
    try:
        pacing = None if spec.pacing is None else Pacing(spec.pacing.max_lag, spec.pacing.batch_groups)
        yield Producer(
            spec.producer, name=spec.name, queue=SampleQueue(redis_client, spec.run, capacity=spec.queue_capacity,
                                                       routing_codec=spec.routing_codec),
            engine=pool, prompts=prompts, tokenize=tokenize, reward_fn=reward_fn, pacing=pacing,
            num_experts=num_experts,
        )  # fmt: skip
    finally:
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
