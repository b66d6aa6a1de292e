"""The prepared GPU check (``scripts/gpu-check.sh``, ``pipeline/benchmarks/gpu_check.py``): its CPU mode end to end on
the tiny models, so the path a GPU session runs cannot rot unseen, its bookkeeping (resume after a death, the memory
plan comparison, FLOP counting), and the CUDA mode where a GPU exists."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from pipeline.benchmarks.gpu_check import (  # noqa: E402
    PARTS,
    Context,
    GpuCheckParams,
    forward_flops,
    memory_figures,
    memory_part,
    model_config,
    run_gpu_check,
    sizes_for,
    synthetic_groups,
)

ROOT = Path(__file__).resolve().parents[2]


def _check(out: Path, device: str, *extra: str, timeout: float) -> tuple[int, str, dict[str, Any]]:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(out), "--device", device, *extra],
                          env=env, capture_output=True, text=True, timeout=timeout)
    parts = {p: json.loads((out / f"{p}.json").read_text()) for p in PARTS if (out / f"{p}.json").exists()}
    return proc.returncode, proc.stdout + proc.stderr, parts


def _assert_figures(summary: dict[str, Any], parts: dict[str, Any], *, k3_limit: float) -> None:
    assert summary["failed"] == {} and summary["not_run"] == []
    assert set(parts) == set(PARTS) and all(p["ok"] for p in parts.values())
    for name in ("trainer", "dense"):
        losses = [row["loss"] for row in parts[name]["steps"]]
        assert parts[name]["headline"]["loss_fell"] and losses[-1] < losses[0], (name, losses)
        assert all(math.isfinite(row["step_s"]) and row["tokens_per_s"] > 0 for row in parts[name]["steps"])
    assert parts["trainer"]["headline"]["r3_agreement_train"] == 1.0
    r3 = parts["r3"]["headline"]
    assert r3["agreement_replay"] == 1.0 and r3["agreement_perturbed_replay"] == 1.0
    assert r3["agreement_perturbed_free"] < 1.0
    assert r3["k3_perturbed_replay"] < r3["k3_perturbed_free"]
    engine = parts["engine"]["headline"]
    assert math.isfinite(engine["k3_replay"]) and 0.0 <= engine["k3_replay"] < k3_limit
    assert engine["decode_tokens_per_s"] > 0


@pytest.mark.slow
def test_cpu_mode_writes_every_part_and_its_figures_hold(tmp_path: Path) -> None:
    rc, output, parts = _check(tmp_path, "cpu", timeout=240)
    assert rc == 0, output[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "running" not in summary
    print(output)
    assert parts["memory"]["headline"] == {"skipped": "cpu"}
    assert parts["trainer"]["headline"]["optimizer"] == "LocalUpdater"
    # fp32 engine and fp32 trainer with the same weights: the log-probs agree to rounding.
    _assert_figures(summary, parts, k3_limit=1e-6)


def test_a_part_the_process_died_in_is_recorded_and_the_resumed_run_goes_past_it(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"running": "r3"}))
    summary = run_gpu_check(GpuCheckParams(out=str(tmp_path), device="cpu", parts="memory,r3", resume=True))
    died = json.loads((tmp_path / "r3.json").read_text())
    assert not died["ok"] and "died" in died["error"]
    assert set(summary["failed"]) == {"r3"} and summary["headline"] == {"memory": {"skipped": "cpu"}}
    assert "running" not in json.loads((tmp_path / "summary.json").read_text())


def test_memory_part_sets_each_measured_term_against_the_dry_run_plan(tmp_path: Path) -> None:
    from pipeline.consumers.megatron.plan import Layout, plan_memory

    _, cfg = model_config("qwen3-moe", {"vocab_size": 128}, "bfloat16")
    plan = plan_memory(cfg, Layout(world_size=1, tp=1, ep=1), device="cuda", tokens=64, kl_reference=False)
    measured = {"params": plan.params, "grads": plan.grads, "optimizer": 2 * plan.optimizer,
                "activations": plan.activations // 2, "peak_total": plan.training, "micro_batch_tokens": 64}
    (tmp_path / "trainer.json").write_text(json.dumps({"ok": True, "model_config": cfg.model_dump(),
                                                       "memory": measured}))
    result = memory_part(Context(out=tmp_path, device="cuda", sizes=sizes_for("cpu")))
    ratios = result["headline"]["measured_over_plan"]["trainer"]
    assert ratios == {"params": 1.0, "grads": 1.0, "optimizer": 2.0, "activations": 0.5, "peak_total": 1.0}
    assert "error" in result["models"]["dense"]  # not run: said, not invented


def test_memory_figures_split_the_allocations_into_the_plans_terms() -> None:
    sizes = sizes_for("cpu")
    _, cfg = model_config("qwen3-moe", sizes.moe, "float32")
    groups = synthetic_groups(cfg, sizes, seed=0)
    marks = {"start": 100, "model": 1100, "optimizer_built": 4100, "after_first_step": 7100}
    figures = memory_figures(marks, [9000, 500, 700], grads=2000, groups=groups, cfg=_StepCfg(sizes))
    assert (figures["params"], figures["grads"], figures["optimizer"]) == (1000, 2000, 4000)
    assert figures["activations"] == 700 and figures["peak_total"] == 9000 + 7000
    longest = max(s.num_prompt_tokens + s.num_response_tokens for g in groups for s in g)
    assert figures["micro_batch_tokens"] <= sizes.micro_batch_samples * longest


class _StepCfg:
    def __init__(self, sizes: Any) -> None:
        self.micro_batch_samples = sizes.micro_batch_samples
        self.micro_batch_tokens = sizes.micro_batch_tokens


def test_forward_flops_count_each_weight_a_token_passes_through_and_causal_attention() -> None:
    _, dense = model_config("qwen3", {"vocab_size": 100}, "float32")
    h, layers, d = dense.hidden_size, dense.num_layers, dense.head_dim
    heads, kv, ffn = dense.num_attention_heads, dense.num_kv_heads, dense.ffn_hidden_size
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * ffn + 2 * h + 2 * d  # qkv, out, MLP, norms
    weights = layers * per_layer + h + 100 * h  # final norm, output layer (the embedding is a lookup)
    assert forward_flops(dense, [5, 3]) == 2 * weights * 8 + 4 * heads * d * layers * (15 + 6)
    _, moe = model_config("qwen3-moe", {"vocab_size": 100}, "float32")
    more = model_config("qwen3-moe", {"vocab_size": 100, "num_experts": 64}, "float32")[1]
    # Only the top-k experts count: more experts add router weights, not expert FLOPs.
    assert forward_flops(more, [4]) - forward_flops(moe, [4]) == 2 * 4 * layers * (64 - moe.num_experts) * h


@pytest.mark.gpu
def test_cuda_mode_measures_every_part(tmp_path: Path) -> None:
    rc, output, parts = _check(tmp_path, "cuda", "--steps", "6", timeout=900)
    print(output)
    assert rc == 0, output[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    # bf16 engine and bf16 trainer through different kernels: close, not equal.
    _assert_figures(summary, parts, k3_limit=0.05)
    assert parts["trainer"]["headline"]["optimizer"] == "MegatronUpdater"
    assert 0 < parts["trainer"]["headline"]["mfu"] < 1
    ratios = parts["memory"]["headline"]["measured_over_plan"]["trainer"]
    # Parameters, gradients and optimizer state are counted exactly by the plan; activations are its estimate.
    for term in ("params", "grads", "optimizer"):
        assert 0.9 < ratios[term] < 1.1, (term, ratios)
