"""Synthetic prompt groups and the tiny model shared by the train-step tests (also imported by their 2-rank
subprocesses, which run from this folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeline.consumers.megatron.config import ModelConfig
from pipeline.models.tiny import init_tiny_model
from pipeline.queue.sample import Sample, SampleStatus, SamplingInfo, compact_routing


def synthetic_groups(
    model_cfg: ModelConfig,
    sizes: list[int],
    seed: int,
    *,
    min_response: int = 2,
    equal_rewards: bool = False,
    failed: tuple[tuple[int, int], ...] = (),
) -> list[list[Sample]]:
    """Deterministic groups with random tokens and random (not the model's own) routing; sample (1, 0) has no
    routing, and the (group, index) pairs in ``failed`` are failed generations."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, size in enumerate(sizes):
        prompt = rng.integers(4, model_cfg.vocab_size, int(rng.integers(3, 7))).tolist()
        group = []
        for i in range(size):
            r = int(rng.integers(min_response, 9))
            scores = rng.random((len(prompt) + r - 1, model_cfg.num_layers, model_cfg.num_experts))
            routing = np.argsort(-scores, axis=-1)[..., : model_cfg.moe_topk].astype(np.uint8)
            if not model_cfg.is_moe:
                routing = None
            group.append(
                Sample(
                    prompt_ids=np.array(prompt, dtype=np.int32),
                    response_ids=rng.integers(4, model_cfg.vocab_size, r).astype(np.int32),
                    rollout_logprobs=-rng.uniform(2.0, 5.0, r).astype(np.float32),
                    token_versions=np.zeros(r, dtype=np.int32),
                    routed_experts=None if (g, i) == (1, 0) else routing,
                    reward=1.0 if equal_rewards else float(rng.random()),
                    status=SampleStatus.FAILED if (g, i) in failed else SampleStatus.COMPLETED,
                    sampling=SamplingInfo(temperature=0.8),
                )
            )
        groups.append(group)
    return groups


def tiny_moe(folder: Path) -> tuple[Path, ModelConfig]:
    """A tiny Qwen3-MoE in ``folder`` and its megatron model config (fp32)."""
    path = init_tiny_model("qwen3-moe", folder, seed=0)
    return path, ModelConfig.from_hf(json.loads((path / "config.json").read_text()), dtype="float32")


def routed_groups(rng: np.random.Generator, n: int, group_size: int, vocab: int, layers: int, topk: int,
                  experts: int) -> list[list[Sample]]:
    """``n`` groups of random samples with random routing, for tests that run a real trainer process on them."""
    out = []
    for g in range(n):
        group = []
        for i in range(group_size):
            p, r = int(rng.integers(4, 9)), int(rng.integers(3, 8))
            group.append(Sample(
                prompt_ids=rng.integers(4, vocab, p), response_ids=rng.integers(4, vocab, r),
                rollout_logprobs=-rng.random(r).astype(np.float32) - 2.0, token_versions=np.zeros(r, np.int32),
                routed_experts=compact_routing(
                    np.stack([rng.permutation(experts)[:topk] for _ in range((p + r - 1) * layers)]).reshape(
                        p + r - 1, layers, topk), experts),
                reward=float(rng.random()), group_id=f"g{g}", prompt_id=f"p{g}", index=i, producer="test",
            ))  # fmt: skip
        out.append(group)
    return out


def start_ranks(script: str, args: list[str], world: int = 2) -> list[subprocess.Popen[bytes]]:
    """``python SCRIPT RANK *ARGS`` once per rank, with this repository importable and one thread each."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    # faulthandler: a rank that dies of a signal still prints where it was.
    return [subprocess.Popen([sys.executable, "-X", "faulthandler", script, str(rank), *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(world)]


def finish_ranks(procs: list[subprocess.Popen[bytes]], timeout_s: float = 240) -> None:
    """Wait for every rank (killing the rest when one hangs) and fail with the output of any rank that failed."""
    try:
        outputs = [p.communicate(timeout=timeout_s)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f"rank {rank} failed (exit {p.returncode}):\n{text[-4000:]}"
              for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)) if p.returncode != 0]
    # A rank killed by a signal is the cause; the others' connection errors are its echo.
    failed.sort(key=lambda t: "exit -" not in t)
    assert not failed, "\n".join(failed)
