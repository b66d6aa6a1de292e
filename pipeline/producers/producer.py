"""The producer loop: prompts in, versioned sample groups out, onto the durable queue.

Plain asyncio, one process, any number of groups in flight. A producer holds no state the run needs: the prompt
cursor and the admission counter live in Redis, so a killed producer loses at most its in-flight generations
(their prompts are handed back when the failure is seen, and a restarted producer simply continues).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import ConfigError, EngineError
from pipeline.producers.base import EngineClient, GenerateResult
from pipeline.producers.prompts import Prompt, PromptCursor, PromptSource
from pipeline.producers.rewards import RewardFn, RewardOutcome, score
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

_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class SamplingConfig(BaseModel):
    """Sampling parameters sent to the engine with every request."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature; the trainer must score log-probs at the same temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k cut-off; -1 disables it."""
    max_new_tokens: int = Field(32, ge=1)
    """Longest response."""
    stop_token_ids: list[int] = []
    """Tokens that end a response besides EOS."""


class ProducerConfig(BaseModel):
    """One producer process."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(4, ge=1, le=1024)
    """Samples per prompt (the GRPO group)."""
    concurrency: int = Field(4, ge=1, le=4096)
    """Prompt groups in flight at once."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    return_routed_experts: bool = True
    """Ask engines for MoE routing (needed for R3); ignored for dense models."""
    reward: str = "exact_match"
    """Built-in reward name or 'package.module:function'."""
    reward_timeout_s: float = Field(30.0, gt=0)
    """A reward function running longer marks its sample failed."""
    put_timeout_s: float = Field(600.0, gt=0)
    """How long to wait on queue backpressure before failing."""
    admission_poll_s: float = Field(0.05, gt=0)
    """How often to re-check admission while paced."""


@dataclass
class ProducerStats:
    """Counters of one producer's life."""

    groups_put: int = 0
    samples_put: int = 0
    samples_failed_reward: int = 0
    engine_errors: int = 0
    prompts_retried: int = 0
    paced_waits: int = 0


@dataclass(frozen=True)
class Pacing:
    """The staleness budget producers respect: at most ``max_lag`` versions behind, ``batch_groups`` per step."""

    max_lag: int
    batch_groups: int


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
        tokenize: Any,
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
        keys = RunKeys(queue.run)
        self._started_key = keys.extra("groups_started")
        self._admit = queue.redis.register_script(_ADMIT)
        self.stats = ProducerStats()

    async def run(self, max_groups: int | None = None, stop: asyncio.Event | None = None) -> ProducerStats:
        """Produce until ``stop`` is set or ``max_groups`` groups were admitted; waits for in-flight groups."""
        slots = asyncio.Semaphore(self.cfg.concurrency)
        tasks: set[asyncio.Task[None]] = set()
        admitted = 0
        while (max_groups is None or admitted < max_groups) and not (stop and stop.is_set()):
            await slots.acquire()
            if not await asyncio.to_thread(self._try_admit):
                slots.release()
                self.stats.paced_waits += 1
                await asyncio.sleep(self.cfg.admission_poll_s)
                continue
            admitted += 1
            task = asyncio.create_task(self._one_group())
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), slots.release()))
        if tasks:
            await asyncio.gather(*tasks)
        return self.stats

    def _try_admit(self) -> bool:
        if self.pacing is None:
            return True
        n = int(self._admit(keys=[self.queue.keys.policy_version, self._started_key],
                            args=[self.pacing.max_lag, self.pacing.batch_groups]))
        return n >= 0

    def _unadmit(self) -> None:
        if self.pacing is not None:
            self.queue.redis.decr(self._started_key)

    async def _one_group(self) -> None:
        index, is_retry = await asyncio.to_thread(self.cursor.next)
        self.stats.prompts_retried += int(is_retry)
        prompt = self.prompts[index % len(self.prompts)]
        prompt_ids = list(prompt.input_ids) if prompt.input_ids is not None else list(self.tokenize(prompt.text))
        params: dict[str, Any] = {**self.cfg.sampling.model_dump(), "n": self.cfg.group_size}
        try:
            results = await self.engine.generate_many(
                [prompt_ids], params, return_logprob=True,
                return_routed_experts=self.cfg.return_routed_experts and self.num_experts is not None,
            )
        except (EngineError, asyncio.TimeoutError, OSError) as e:
            # No sample was produced: the prompt goes back for another producer and the admission slot is freed.
            self.stats.engine_errors += 1
            log.warning("producer %s: generation for prompt %s failed (%s); handing it back", self.name,
                        prompt.prompt_id, e)
            await asyncio.to_thread(self.cursor.give_back, index)
            await asyncio.to_thread(self._unadmit)
            return
        outcomes = await asyncio.gather(*(score(self.reward_fn, prompt, r.text, self.cfg.reward_timeout_s)
                                          for r in results))
        group = self.build_group(prompt, prompt_ids, results, outcomes)
        await asyncio.to_thread(self.queue.put, group, self.cfg.put_timeout_s)
        self.stats.groups_put += 1
        self.stats.samples_put += len(group)
        self.stats.samples_failed_reward += sum(o.failed for o in outcomes)

    def build_group(self, prompt: Prompt, prompt_ids: Sequence[int], results: Sequence[GenerateResult],
                    outcomes: Sequence[RewardOutcome]) -> list[Sample]:
        """Samples of one prompt group from the engine's results and their rewards."""
        group_id = uuid.uuid4().hex
        sp = self.cfg.sampling
        sampling = SamplingInfo(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                max_new_tokens=sp.max_new_tokens, seed=None)
        out = []
        for i, (r, o) in enumerate(zip(results, outcomes)):
            if r.output_logprobs is None:
                raise EngineError(f"engine {r.engine} returned no output logprobs; sluice needs return_logprob")
            try:
                versions = np.array([int(v) for v in r.token_versions()], dtype=np.int32)
            except ValueError:
                raise EngineError(f"engine {r.engine} reports non-integer weight versions "
                                  f"{[s.version for s in r.weight_versions]}; sluice pushes integer versions") from None
            routed = None
            if r.routed_experts is not None and self.num_experts is not None:
                routed = compact_routing(r.routed_experts, self.num_experts)
            status = SampleStatus.FAILED if o.failed else _STATUS.get(r.finish_reason, SampleStatus.COMPLETED)
            out.append(Sample(
                prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
                response_ids=np.asarray(r.output_ids, dtype=np.int32),
                rollout_logprobs=np.asarray(r.output_logprobs, dtype=np.float32),
                token_versions=versions,
                routed_experts=routed,
                reward=o.reward,
                reward_info=o.info,
                status=status,
                finish_reason=r.finish_reason,
                group_id=group_id,
                prompt_id=prompt.prompt_id,
                index=i,
                producer=self.name,
                engine=r.engine,
                created_at=time.time(),
                sampling=sampling,
            ))
        return out


def read_num_experts(model_dir: str | Path) -> int | None:
    """The expert count from an HF config.json (None for a dense model)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no config.json; is it an HF model folder?")
    cfg = json.loads(path.read_text())
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    return int(n) if n else None


def stats_dict(stats: ProducerStats) -> dict[str, Any]:
    return asdict(stats)

