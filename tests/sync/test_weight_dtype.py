"""The push travels in the engine's dtype: the trainer asks its engines, so an fp32 trainer sends a bf16 engine half
the bytes. Real CPU engines (fp32 and bf16) count the bytes they take off the weight group."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from pipeline.config import SluiceConfig
from pipeline.consumers.trainer.main import _connect_pusher
from pipeline.models.tiny import init_tiny_model
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from tests.helpers.engines import start_engine

pytestmark = pytest.mark.slow


def test_the_push_casts_to_the_engines_dtype_and_halves_the_bytes_for_bf16(model_dir: Path, tmp_path: Path) -> None:
    trained = init_tiny_model("qwen3-moe", tmp_path / "trained", seed=1)
    weights = sorted(load_file(str(trained / "model.safetensors")).items())  # fp32, as the trainer holds them
    param_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    cfg = SluiceConfig.model_validate({"sync": {"backend": "gloo"}})
    engines = [start_engine(model_dir, tmp_path, None, "--dtype", dtype) for dtype in ("float32", "bfloat16")]

    async def push(url: str) -> tuple[Any, float, str]:
        client = SGLangClient(url, retry=NO_RETRY)
        rotation = await _connect_pusher(cfg.sync, [client], tmp_path, model_dir)
        try:
            before = (await client.get_load()).total("weight_bytes_received")
            stats = await rotation.push(weights, 1)
            received = (await client.get_load()).total("weight_bytes_received") - before
            return stats, received, await client.weight_version()
        finally:
            await rotation.close()
            await client.close()

    try:
        (fp32, fp32_received, v32), (bf16, bf16_received, v16) = [asyncio.run(push(e.url)) for e in engines]
    finally:
        for e in engines:
            e.stop()
    assert v32 == v16 == "1"
    assert fp32.bytes == fp32_received == param_bytes  # fp32 engine: every byte as the trainer holds it
    assert bf16.bytes == bf16_received == param_bytes // 2  # bf16 engine: half of them on the wire
