"""The FP8 checkpoint SGLang engines start from (``pipeline.quant.checkpoint``), and what refuses a model or a server
that could not serve it. The server itself is tests/e2e/test_sglang_fp8.py."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.models.tiny import init_tiny_model
from pipeline.quant.checkpoint import (
    MARKER,
    ensure_fp8_checkpoint,
    fp8_shape_problems,
    main,
    sglang_parallel,
    write_fp8_checkpoint,
)
from pipeline.quant.fp8 import dequantize_weight
from pipeline.sync.served_dtype import check_served_weights

WIDE = {"hidden_size": 128, "head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "moe_intermediate_size": 128, "intermediate_size": 128, "num_experts": 4}


def test_the_checkpoint_dequantizes_to_the_source_within_fp8_precision(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = init_tiny_model("qwen3-moe", tmp_path / "src", seed=0, **WIDE)
    dst = write_fp8_checkpoint(src, tmp_path / "fp8")
    source = load_file(str(src / "model.safetensors"))
    written = load_file(str(dst / "model.safetensors"))
    fp8 = [n for n, t in written.items() if t.dtype == torch.float8_e4m3fn]
    # 2 layers x (q, k, v, o + 4 experts x gate, up, down)
    assert len(fp8) == 2 * (4 + 4 * 3)
    for name in fp8:
        back = dequantize_weight(written[name], written[name + "_scale_inv"])
        error = (back - source[name]).abs().max() / source[name].abs().max()
        assert 0 < error < 2 ** -3, (name, error)  # e4m3 keeps 3 mantissa bits
    assert set(written) == set(source) | {n + "_scale_inv" for n in fp8}
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


def test_a_checkpoint_is_reused_for_the_same_source_and_rewritten_for_a_changed_one(tmp_path: Path) -> None:
    src = init_tiny_model("qwen3-moe", tmp_path / "src", seed=0, **WIDE)
    dst = ensure_fp8_checkpoint(src, tmp_path / "fp8")
    written = (dst / "model.safetensors").stat().st_mtime_ns
    assert ensure_fp8_checkpoint(src, dst) == dst
    assert (dst / "model.safetensors").stat().st_mtime_ns == written
    init_tiny_model("qwen3-moe", src, seed=1, **WIDE)  # the warm start rewrites the model folder
    os.utime(src / "model.safetensors", ns=(written + 10**9, written + 10**9))
    ensure_fp8_checkpoint(src, dst)
    assert (dst / "model.safetensors").stat().st_mtime_ns != written
    (dst / MARKER).unlink()  # an interrupted write is not taken for a finished one
    ensure_fp8_checkpoint(src, dst)
    assert (dst / MARKER).is_file()


def test_models_sglang_cannot_hold_in_block_fp8_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    narrow = init_tiny_model("qwen3-moe", tmp_path / "narrow", seed=0)  # hidden 64
    with pytest.raises(ConfigError, match="hidden_size = 64 is not a multiple of 128"):
        write_fp8_checkpoint(narrow, tmp_path / "out")
    assert main([str(narrow), str(tmp_path / "out")]) == 2
    assert "is not a multiple of 128" in capsys.readouterr().err
    src = init_tiny_model("qwen3-moe", tmp_path / "src", seed=0, **WIDE)
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8")
    with pytest.raises(ConfigError, match="already quantized"):
        write_fp8_checkpoint(fp8, tmp_path / "again")


def test_shape_rules_follow_sglangs_tensor_and_expert_parallel_split() -> None:
    qwen3_30b = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "moe_intermediate_size": 768}
    assert fp8_shape_problems(qwen3_30b) == []
    assert fp8_shape_problems(qwen3_30b, tp=4) == [
        "moe_intermediate_size = 768 / 4 ranks = 192 is not a multiple of 128"]
    assert fp8_shape_problems(qwen3_30b, tp=4, ep=4) == []  # experts whole on each rank
    assert fp8_shape_problems(qwen3_30b, tp=8, ep=8) == []  # 4 KV heads replicated, not split, over 8 ranks
    assert sglang_parallel(["--tp", "4", "--ep-size=4", "--port", "1"]) == (4, 4)
    assert sglang_parallel(["--tp-size=2"]) == (2, 1)


def test_the_dry_run_refuses_fp8_sglang_engines_split_below_whole_blocks() -> None:
    from pipeline.cli.train import sglang_args
    from pipeline.consumers.megatron.plan import dry_run_plan

    plain = load_config("recipes/gpu-qwen3-30b-a3b.toml", ["engine.weight_dtype=fp8"])
    with pytest.raises(ConfigError, match="768 / 4 ranks = 192 is not a multiple of 128.*--ep-size"):
        dry_run_plan(plain.trainer, plain.model, plain.hardware, plain.sync, fp8=True, sglang_args=sglang_args(plain))
    recipe = load_config("recipes/gpu-qwen3-30b-a3b-fp8.toml")
    text = dry_run_plan(recipe.trainer, recipe.model, recipe.hardware, recipe.sync, fp8=True,
                        sglang_args=sglang_args(recipe))
    assert "engine.weight_dtype = fp8: engine weights 29.03 GiB" in text and "FP8 / BF16 = 0.511" in text


class _Says:
    def __init__(self, served: str | None) -> None:
        self.name = f"engine-{served}"
        self.served = served

    async def served_weight_dtype(self) -> str | None:
        return self.served


def test_the_push_goes_only_to_engines_serving_its_format(caplog: pytest.LogCaptureFixture) -> None:
    asyncio.run(check_served_weights([_Says("fp8")], fp8=True))
    asyncio.run(check_served_weights([_Says("auto")], fp8=False))
    with pytest.raises(ConfigError, match="engine-auto serves unquantized weights.*pipeline.quant.checkpoint"):
        asyncio.run(check_served_weights([_Says("fp8"), _Says("auto")], fp8=True))
    with pytest.raises(ConfigError, match="engine-fp8 serves FP8 weights"):
        asyncio.run(check_served_weights([_Says("fp8")], fp8=False))
    with caplog.at_level("WARNING"):
        asyncio.run(check_served_weights([_Says(None)], fp8=False))
        assert "does not say" not in caplog.text  # floats to an engine that cannot tell: the ordinary case
        asyncio.run(check_served_weights([_Says(None)], fp8=True))
    assert "does not say whether it serves FP8" in caplog.text
