"""Random but well-formed samples and prompt groups, for tests of the queue, the codec and the trainer's drain."""

from __future__ import annotations

import uuid

import numpy as np

from pipeline.queue.sample import Sample, compact_routing


def make_sample(
    rng: np.random.Generator,
    *,
    prompt_len: int = 5,
    response_len: int = 7,
    version: int | tuple[int, int] = 0,
    layers: int = 2,
    topk: int = 2,
    num_experts: int | None = 8,
    group_id: str = "g",
    index: int = 0,
    reward: float = 1.0,
) -> Sample:
    lo, hi = (version, version) if isinstance(version, int) else version
    versions = np.sort(rng.integers(lo, hi + 1, response_len)).astype(np.int32)
    routed = None
    if num_experts:
        routed = compact_routing(
            rng.integers(0, num_experts, (prompt_len + response_len - 1, layers, topk)), num_experts
        )
    return Sample(
        prompt_ids=rng.integers(0, 1000, prompt_len),
        response_ids=rng.integers(0, 1000, response_len),
        rollout_logprobs=-rng.random(response_len).astype(np.float32),
        token_versions=versions,
        routed_experts=routed,
        reward=reward,
        reward_info={"pass": bool(reward > 0)},
        group_id=group_id,
        prompt_id=group_id,
        index=index,
        producer="test",
        engine="none",
    )


def make_group(rng: np.random.Generator, n: int = 4, **kw: object) -> list[Sample]:
    gid = uuid.uuid4().hex[:8]
    return [make_sample(rng, group_id=gid, index=i, **kw) for i in range(n)]  # type: ignore[arg-type]
