"""The producer loop: prompts in, versioned sample groups out, onto the durable queue.

Plain asyncio, one process, any number of groups in flight. A producer holds no state the run needs: the prompt
cursor and the admission counter live in Redis, so a killed producer loses at most its in-flight generations, and a
restarted one simply continues. A generation that no engine could serve hands its prompt back to the cursor, so a
prompt is never lost to an engine failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import ConfigError, EngineError
from pipeline.producers.base import EngineClient, GenerateResult
from pipeline.producers.prompts import Prompt, PromptConfig, PromptCursor, PromptSource, setup_prompts
from pipeline.producers.rewards import RewardFn, RewardOutcome, resolve_reward, score
from pipeline.producers.sglang_client import NO_RETRY, EnginePool, EngineRequestError, SGLangClient
from pipeline.queue.keys import RunKeys
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample, SampleStatus, SamplingInfo, compact_routing

log = logging.getLogger(__name__)

# AReaL-style admission, atomic across producers: a group may start only while
# (current_version + max_lag + 1) * batch_groups > groups started so far. Returns the new count, or -1 to wait.
_ADMIT = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local started = tonumber(redis.call('GET', KEYS[2]) or '0')
if (v + tonumber(ARGV[1]) + 1) * tonumber(ARGV[2]) > started then
  return redis.call('INCR', KEYS[2])
end
return -1
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


@dataclass
class ProducerStats:
    """Counters of one producer's life."""

    groups_put: int = 0
    samples_put: int = 0
    samples_failed_reward: int = 0
    engine_errors: int = 0
    prompts_retried: int = 0
    prompts_refused: int = 0
    paced_waits: int = 0


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
        self.started_key = RunKeys(queue.run).extra("groups_started")
        """Groups admitted so far by every producer of the run (what pacing compares with the budget)."""
        self._admit = queue.redis.register_script(_ADMIT)
        self.stats = ProducerStats()

    # ---- the loop ---------------------------------------------------------------------------------------------------

    async def run(self, max_groups: int | None = None, stop: asyncio.Event | None = None) -> ProducerStats:
        """Produce until ``stop`` is set or ``max_groups`` groups are on the queue; waits for groups in flight.

        A group whose generation failed on every engine does not count: its prompt goes back and is tried again. Any
        other error (Redis gone, queue full past its timeout, an engine answer that breaks the Sample's invariants)
        cancels the groups in flight, hands their prompts back, and propagates.
        """
        tasks: set[asyncio.Task[None]] = set()
        try:
            while not self._finished(max_groups, stop):
                if not self._has_room(len(tasks), max_groups):
                    await self._reap(tasks, None)
                elif await asyncio.to_thread(self._try_admit):
                    tasks.add(asyncio.create_task(self._one_group()))
                else:
                    self.stats.paced_waits += 1
                    await self._reap(tasks, self.cfg.admission_poll_s)
            while tasks:
                await self._reap(tasks, None)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
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

    def _try_admit(self) -> bool:
        if self.pacing is None:
            return True
        n = int(self._admit(keys=[self.queue.keys.policy_version, self.started_key],
                            args=[self.pacing.max_lag, self.pacing.batch_groups]))
        return n >= 0

    def _unadmit(self) -> None:
        # The admitted group produced nothing, so it must not use up the staleness budget.
        if self.pacing is not None:
            self.queue.redis.decr(self.started_key)

    # ---- one group --------------------------------------------------------------------------------------------------

    async def _one_group(self) -> None:
        index, is_retry = await asyncio.to_thread(self.cursor.next)
        self.stats.prompts_retried += int(is_retry)
        try:
            served = await self._produce(index)
        except BaseException:
            # Cancelled or failed before the group was on the queue: another try (here or in another producer) must
            # see this prompt. Synchronous on purpose, so that a cancellation cannot skip it.
            self._hand_back(index)
            raise
        if not served:
            await asyncio.to_thread(self._hand_back, index)
            # Keep this slot idle for a while, so that a run with every engine down does not spin through retries.
            await asyncio.sleep(self.cfg.engine_retry_s)

    def _hand_back(self, index: int) -> None:
        self.cursor.give_back(index)
        self._unadmit()

    async def _produce(self, index: int) -> bool:
        """Generate, score and put the group of prompt ``index``; False if no engine served it (try again later)."""
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
            await asyncio.to_thread(self._unadmit)
            return True
        except (TimeoutError, EngineError, OSError) as e:
            self.stats.engine_errors += 1
            log.warning("producer %s: no engine served prompt %s (%s); handing it back", self.name,
                        prompt.prompt_id, e)
            return False
        outcomes = await asyncio.gather(*(score(self.reward_fn, prompt, r.text, self.cfg.reward_timeout_s)
                                          for r in results))
        group = self.build_group(prompt, prompt_ids, results, outcomes, seed=seed)
        await asyncio.to_thread(self.queue.put, group, self.cfg.put_timeout_s)
        self.stats.groups_put += 1
        self.stats.samples_put += len(group)
        self.stats.samples_failed_reward += sum(o.failed for o in outcomes)
        return True

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
    ) -> list[Sample]:
        """Samples of one prompt group from the engine's results and their rewards (sample j used seed + j)."""
        group_id = uuid.uuid4().hex
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
    pool = EnginePool([SGLangClient(url, timeout=spec.request_timeout_s, retry=NO_RETRY) for url in spec.engine_urls])
    try:
        pacing = None if spec.pacing is None else Pacing(spec.pacing.max_lag, spec.pacing.batch_groups)
        yield Producer(
            spec.producer, name=spec.name, queue=SampleQueue(redis_client, spec.run, capacity=spec.queue_capacity),
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
