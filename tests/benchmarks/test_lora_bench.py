"""``sluice bench lora`` on the LoRA CPU recipe, one round on small batches: the ratios it reports come from the two
real trainers (LoRA would show 1.0 or more where it froze nothing, or pushed every weight)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from pipeline.benchmarks.lora import LoRABenchParams, run_lora_bench, summary_lines  # noqa: E402


def test_the_lora_bench_measures_both_trainers_on_one_batch() -> None:
    res = run_lora_bench(LoRABenchParams(rounds=1, groups=2, rank=2))
    print("\n".join(summary_lines(res)))
    full, lora = res["full"], res["lora"]
    assert len(full["step_seconds"]) == len(lora["step_seconds"]) == 1 and res["step_time_ratio"] > 0
    # Rank 2 on the tiny model's attention and experts: about a sixteenth of its parameters train.
    assert 0.01 < res["trainable_params_ratio"] < 0.2
    # Adam keeps two fp32 moments per trained parameter (and a step count per tensor), for the adapters alone.
    for kind in (full, lora):
        assert 8 * kind["trainable_params"] <= kind["optimizer_bytes"] < 8.1 * kind["trainable_params"]
    assert res["push_bytes_ratio"] < 0.25
