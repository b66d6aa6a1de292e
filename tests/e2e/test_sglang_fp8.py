"""FP8 rollout on a real SGLang 0.5.23 server (CPU build, ``bash scripts/sglang-cpu.sh``; skipped without it).

The server starts from the FP8 checkpoint sluice writes (``pipeline.quant.checkpoint``) and takes FP8 pushes through
its own block-FP8 loader and ``update_weights_from_distributed`` path. Its FP8 GEMMs are the test build's stand-ins
(``tests/fixtures/sglang_cpu/sgl_kernel``: weight-only FP8, as SGLang's CPU kernels are, dequantized per block in plain
torch); everything else is SGLang's code. The model is sluice's tiny Qwen3-MoE widened to 128 (SGLang's block-FP8
layers need whole 128-wide blocks).

What would fail without FP8 (measured on this build, max |log-prob gap| over the scored tokens):
- served before any push: 0.014 from the dequantized FP8 reference, 0.14 from the unquantized weights;
- after pushing another model's quantized weights: 0.011 from its FP8 reference, 0.14-0.21 from its unquantized
  weights, 2.9 from the weights it served before; pushing the FP8 bytes without their scales: 0.27.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.models.tiny import init_tiny_model
from pipeline.producers.sglang_client import SGLangClient
from pipeline.quant.checkpoint import MARKER, write_fp8_checkpoint
from pipeline.sync.served_dtype import check_served_weights
from tests.helpers.sglang_server import (
    SGLangServer,
    assert_clean_run,
    require_sglang,
    sluice_run,
    start_server,
    weight_version,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

WIDE = {"hidden_size": 128, "head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "moe_intermediate_size": 128, "intermediate_size": 128, "num_experts": 4}
"""Every projection's output is whole 128-wide blocks: q 256, k and v 128, o 128, each expert's gate/up/down 128."""
SEQUENCES = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25], [30, 31, 7, 40, 41]]
STEPS = 6
RUN_TIMEOUT_S = 600.0


def _write(folder: Path, seed: int) -> Path:
    return init_tiny_model("qwen3-moe", folder, seed=seed, **WIDE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_sglang()
    return _write(tmp_path_factory.mktemp("sglang-fp8") / "model", seed=0)


@pytest.fixture(scope="module")
def fp8_dir(model_dir: Path) -> Path:
    return write_fp8_checkpoint(model_dir, model_dir.parent / "model-fp8")


@pytest.fixture(scope="module")
def server(fp8_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    python = require_sglang()
    started = start_server(fp8_dir, tmp_path_factory.mktemp("sglang-fp8-logs"), python=python)
    try:
        yield started
    finally:
        started.stop()
    assert not started.alive()


# ---------------------------------------------------------------------------------------------------- the reference
def _block_qdq(w: torch.Tensor) -> torch.Tensor:
    """``w`` [out, in] through FP8 with one scale per 128 x 128 block, written here apart from pipeline.quant."""
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], 128):
        for c in range(0, w.shape[1], 128):
            block = w[r:r + 128, c:c + 128].float()
            scale = block.abs().max().clamp(min=1e-12) / 448.0
            out[r:r + 128, c:c + 128] = (block / scale).to(torch.float8_e4m3fn).float() * scale
    return out


def _reference(folder: Path, *, fp8: bool) -> Any:
    """The HF model in float32, its projection weights through FP8 when ``fp8`` (what SGLang's CPU FP8 layers compute:
    weight-only FP8, activations unquantized)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if fp8:
        with torch.no_grad():
            for name, param in model.named_parameters():
                leaf = name.rsplit(".", 2)[-2]
                if param.dim() == 2 and leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    param.copy_(_block_qdq(param))
                elif param.dim() == 3 and "experts" in name:  # fused [experts, out, in]; gate/up split at 128
                    for e in range(param.shape[0]):
                        param[e] = _block_qdq(param[e])
    return model


def _reference_logprobs(model: Any, seq: list[int]) -> np.ndarray:
    with torch.no_grad():
        scores = model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    return scores[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()


def _served_logprobs(url: str, seq: list[int]) -> np.ndarray:
    """The server's log-prob of each token of ``seq`` after the first (a prefill with input log-probs)."""
    body = json.dumps({"input_ids": seq, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                       "return_logprob": True, "logprob_start_len": 0}).encode()
    request = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        meta = json.loads(reply.read())["meta_info"]
    return np.array([entry[0] for entry in meta["input_token_logprobs"][1:]])


def _gap(url: str, model: Any) -> float:
    return max(float(np.abs(_served_logprobs(url, s) - _reference_logprobs(model, s)).max()) for s in SEQUENCES)


async def _ask(url: str, name: str) -> Any:
    async with SGLangClient(url) as client:
        return await getattr(client, name)()


# --------------------------------------------------------------------------------------------------------------- tests
def test_the_checkpoint_holds_fp8_weights_and_block_scales_and_says_so(model_dir: Path, fp8_dir: Path) -> None:
    from safetensors.torch import load_file

    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    source = load_file(str(model_dir / "model.safetensors"))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 128)
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 1)
    assert tensors["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    # The router, norms, embeddings and head stay as they were.
    for name in ("model.layers.0.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(tensors[name], source[name]), name
    assert (fp8_dir / MARKER).is_file() and (fp8_dir / "tokenizer.json").is_file()


def test_sglang_serves_the_fp8_checkpoint_as_its_dequantized_weights(server: SGLangServer, model_dir: Path) -> None:
    if weight_version(server.url) != "default":
        pytest.skip("another test pushed into the server first")
    fp8_gap = _gap(server.url, _reference(model_dir, fp8=True))
    float_gap = _gap(server.url, _reference(model_dir, fp8=False))
    print(f"served vs FP8 reference {fp8_gap:.4f}, vs unquantized {float_gap:.4f}")
    assert fp8_gap < 0.04, fp8_gap
    assert float_gap > 3 * fp8_gap, (fp8_gap, float_gap)
    assert asyncio.run(_ask(server.url, "served_weight_dtype")) == "fp8"


def test_the_push_check_refuses_floats_for_an_fp8_server(server: SGLangServer) -> None:
    async def check(fp8: bool) -> None:
        async with SGLangClient(server.url) as client:
            await check_served_weights([client], fp8)

    asyncio.run(check(True))
    with pytest.raises(ConfigError, match="serves FP8 weights, but engine.weight_dtype is not 'fp8'"):
        asyncio.run(check(False))


def test_a_quantized_push_lands_in_sglang_as_the_new_fp8_weights(server: SGLangServer, model_dir: Path,
                                                                  tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from pipeline.quant.fp8 import quantize_named
    from pipeline.sync.pusher import PushOptions, WeightPusher

    new_dir = _write(tmp_path / "new", seed=1)
    pushed = list(quantize_named(sorted(load_file(str(new_dir / "model.safetensors")).items())))
    assert any(t.dtype == torch.float8_e4m3fn for _, t in pushed)

    async def push() -> int:
        async with SGLangClient(server.url) as client:
            pusher = await WeightPusher.connect([client], master_address="127.0.0.1", backend="gloo", timeout_s=60,
                                                options=PushOptions(dtype="bfloat16"))
            try:
                return (await pusher.push(pushed, 1)).bytes
            finally:
                await pusher.close()

    sent = asyncio.run(push())
    floats = sum(t.numel() * 2 for _, t in load_file(str(new_dir / "model.safetensors")).items())
    print(f"push bytes FP8 / BF16 on this model: {sent / floats:.3f}")
    assert weight_version(server.url) == "1"
    fp8_gap = _gap(server.url, _reference(new_dir, fp8=True))
    float_gap = _gap(server.url, _reference(new_dir, fp8=False))
    before_gap = _gap(server.url, _reference(model_dir, fp8=True))
    print(f"after the push: vs its FP8 reference {fp8_gap:.4f}, unquantized {float_gap:.4f}, old {before_gap:.2f}")
    assert fp8_gap < 0.04, fp8_gap
    assert float_gap > 3 * fp8_gap and before_gap > 0.5, (fp8_gap, float_gap, before_gap)


def test_a_sync_fp8_run_on_sglang_pushes_fp8_each_step_and_samples_under_it(
    server: SGLangServer, model_dir: Path, tmp_path: Path
) -> None:
    # The server may hold another test's push (version "1"): adoption then reloads the run's starting weights from
    # the FP8 checkpoint the run writes of model.path.
    started = time.monotonic()
    run = sluice_run(tmp_path / "run", [
        "mode=sync", "engine.type=sglang", f'engine.urls=["{server.url}"]', "engine.weight_dtype=fp8",
        f"model.path={json.dumps(str(model_dir))}",
        "warmstart.enabled=false", "eval.heldout.enabled=false",
        "trainer.batch_groups=4", "filters.zero_variance=false", "trainer.checkpoint_every=4",
        "producer.concurrency=4", "trainer.lr=2e-2", "trainer.measure_r3=true",
        'plugins.paths=["tests/fixtures"]', "producer.reward=user_rewards:length_reward",
    ], steps=STEPS, timeout=RUN_TIMEOUT_S, log=tmp_path / "launcher.log")
    print(f"sluice run: {time.monotonic() - started:.1f} s, audit {run.ledger}")
    assert_clean_run(run, STEPS, RUN_TIMEOUT_S)
    assert (tmp_path / "run" / "engine-model-fp8" / MARKER).is_file()
    # On-policy, the gap between the trainer's float32 log-probs and the server's is FP8's alone, and it stays
    # bounded at every step: each push landed as FP8 weights with their scales.
    k3 = [m["mismatch_k3"] for m in run.metrics if "mismatch_k3" in m]
    agreement = [m["r3/agreement_train"] for m in run.metrics if "r3/agreement_train" in m]
    free = [round(m["r3/agreement_no_replay"], 3) for m in run.metrics if "r3/agreement_no_replay" in m]
    print(f"k3 per step {[round(k, 5) for k in k3]}, R3 agreement {agreement}, without replay {free}")
    assert len(k3) == STEPS and max(k3) < 0.02, k3
    assert agreement and min(agreement) == 1.0, agreement
    assert len(free) == STEPS and min(free) > 0.8, free  # measured every step; FP8 moves some routing choices
    assert weight_version(server.url) == str(STEPS)
