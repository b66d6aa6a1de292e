"""The CPU engine with FP8 weights (``--weight-dtype fp8``): what it stores, what it computes, and what a push lands.

The reference here is written apart from ``pipeline.quant.fp8``: block scales and activation groups by explicit loops,
a model whose projection weights are those dequantized values, input quantization in pre-hooks, and the routed
experts computed token by token. The engine must sample what that model computes.
"""

from __future__ import annotations

import asyncio
import json
import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from pipeline.consumers.megatron.fp8_plan import fp8_bytes
from pipeline.models.config import ModelConfig
from pipeline.models.tiny import init_tiny_model
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.quant.fp8 import FP8, quantize_named
from pipeline.sync.pusher import PushOptions, WeightPusher
from tests.helpers.engines import ServedEngine

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------------ the independent reference
def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 128 blocks by explicit loops: each block scaled so that its largest magnitude becomes 448."""
    out, inp = w.shape
    rows, cols = math.ceil(out / 128), math.ceil(inp / 128)
    q = torch.empty(out, inp, dtype=FP8)
    scales = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            block = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128].float()
            amax = float(block.abs().max())
            scale = amax / 448.0 if amax > 0 else 1.0
            scales[r, c] = scale
            q[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] = (block / scale).clamp(-448, 448).to(FP8)
    return q, scales


def block_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    w = q.float().clone()
    for r in range(scales.shape[0]):
        for c in range(scales.shape[1]):
            w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] *= scales[r, c]
    return w


def act_qdq(x: torch.Tensor) -> torch.Tensor:
    """Per token, per group of 128 features: scale to 448, round to e4m3, scale back."""
    y = x.float().clone()
    for start in range(0, x.shape[-1], 128):
        group = y[..., start:start + 128]
        amax = group.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        y[..., start:start + 128] = (group / scale).clamp(-448, 448).to(FP8).float() * scale
    return y


def _experts_by_token(self: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                      ) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    inter = self.gate_up_proj.shape[1] // 2
    for t in range(hidden.shape[0]):
        x = act_qdq(hidden[t])
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            gate = x @ self.gate_up_proj[e, :inter].T
            up = x @ self.gate_up_proj[e, inter:].T
            inner = act_qdq(torch.nn.functional.silu(gate) * up)
            out[t] += top_k_weights[t, k] * (inner @ self.down_proj[e].T)
    return out


def fp8_reference(model_dir: Path, others: torch.dtype = torch.float32) -> Any:
    """The HF model as an FP8 engine must compute it; the tensors that are not FP8 rounded through ``others``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)) and "experts" not in name:
                param.copy_(param.to(others).float())
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
                module.weight.copy_(block_dequantize(*block_quantize(module.weight)))
                module.register_forward_pre_hook(lambda mod, args: (act_qdq(args[0]),))
            elif hasattr(module, "gate_up_proj") and isinstance(getattr(module, "down_proj", None), nn.Parameter):
                inter = module.gate_up_proj.shape[1] // 2
                for e in range(module.gate_up_proj.shape[0]):
                    for part in (slice(0, inter), slice(inter, 2 * inter)):
                        module.gate_up_proj[e, part] = block_dequantize(*block_quantize(module.gate_up_proj[e, part]))
                    module.down_proj[e] = block_dequantize(*block_quantize(module.down_proj[e]))
                module.forward = types.MethodType(_experts_by_token, module)
    return model


def logprobs_of(model: Any, prompt: list[int], output: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    scores = logits[len(prompt) - 1:-1].log_softmax(-1)
    return scores.gather(-1, torch.tensor(output)[:, None])[:, 0].numpy()


# ------------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model("qwen3-moe", tmp_path_factory.mktemp("fp8") / "model", seed=0)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[ServedEngine]:
    engine = ServedEngine(model_dir, weight_dtype="fp8", enable_return_routed_experts=True)
    try:
        yield engine
    finally:
        engine.stop()


async def _greedy(url: str) -> list[Any]:
    async with SGLangClient(url, retry=NO_RETRY) as client:
        return await client.generate_many(PROMPTS, GREEDY)


# --------------------------------------------------------------------------------------------------------------- tests
def test_the_engine_stores_projection_weights_as_fp8_with_block_scales(served: ServedEngine, model_dir: Path) -> None:
    from safetensors.torch import load_file

    fp8 = served.engine.weights.fp8
    assert fp8 is not None
    original = load_file(str(model_dir / "model.safetensors"))
    projections = [n for n in original if n.rsplit(".", 2)[-2] in PROJECTIONS]
    assert sorted(fp8.q) == sorted(projections)  # every projection, the experts' included
    for name in projections:
        q, scales = block_quantize(original[name])
        assert fp8.q[name].dtype == FP8
        assert torch.equal(fp8.q[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(fp8.scales[name + "_scale_inv"], scales), name
    # The router, embeddings, norms and LM head are not FP8.
    assert not any(n.endswith(("mlp.gate.weight", "embed_tokens.weight", "norm.weight")) or n == "lm_head.weight"
                   for n in fp8.q)
    model_bytes = sum(t.numel() * 4 for n, t in original.items() if n in fp8.q)
    assert fp8.nbytes() < 0.26 * model_bytes  # one byte per weight and a float per block, against four bytes


def test_fp8_log_probs_equal_an_independent_fp8_forward_and_differ_from_fp32_by_a_bounded_amount(
    served: ServedEngine, model_dir: Path
) -> None:
    results = asyncio.run(_greedy(served.url))
    reference = fp8_reference(model_dir)
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps, drifts = [], []
    for prompt, result in zip(PROMPTS, results):
        output = result.output_ids.tolist()
        gaps.append(np.abs(logprobs_of(reference, prompt, output) - result.output_logprobs).max())
        drifts.append(np.abs(logprobs_of(plain, prompt, output) - result.output_logprobs).mean())
    print(f"FP8 engine against the FP8 reference: max gap {max(gaps):.2e}; against fp32: mean drift "
          f"{np.mean(drifts):.2e}")
    assert max(gaps) < 1e-4, gaps
    assert 1e-4 < np.mean(drifts) < 0.2, drifts  # FP8 changes what is computed, by a bounded amount


def test_a_quantizing_push_lands_the_same_fp8_bytes_on_every_engine(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    new_dir = init_tiny_model("qwen3-moe", tmp_path / "new", seed=1)
    pushed = dict(quantize_named(sorted(load_file(str(new_dir / "model.safetensors")).items())))
    engines = [ServedEngine(model_dir, weight_dtype="fp8", enable_return_routed_experts=True) for _ in range(2)]
    try:
        async def push(weights: dict[str, torch.Tensor], version: int) -> int:
            clients = [SGLangClient(e.url, retry=NO_RETRY) for e in engines]
            # The floats go as bf16 on the wire; FP8 bytes and their scales travel as they are.
            pusher = await WeightPusher.connect(clients, master_address="127.0.0.1", backend="gloo", timeout_s=60,
                                                options=PushOptions(dtype="bfloat16"))
            try:
                return (await pusher.push(list(weights.items()), version)).bytes
            finally:
                await pusher.close()
                for client in clients:
                    await client.close()

        fp8_bytes_pushed = asyncio.run(push(pushed, 1))
        for engine in engines:
            fp8 = engine.engine.weights.fp8
            assert fp8 is not None
            for name, q in fp8.q.items():
                assert torch.equal(q.view(torch.uint8), pushed[name].view(torch.uint8)), name
                assert torch.equal(fp8.scales[name + "_scale_inv"], pushed[name + "_scale_inv"]), name
        # And they serve the new weights as FP8: the independent reference of the new model.
        results = asyncio.run(_greedy(engines[0].url))
        reference = fp8_reference(new_dir, others=torch.bfloat16)  # what went as bf16 on the wire
        for prompt, result in zip(PROMPTS, results):
            assert result.weight_versions[0].version == "1"
            gap = np.abs(logprobs_of(reference, prompt, result.output_ids.tolist()) - result.output_logprobs).max()
            assert gap < 1e-4, gap
        # The same weights unquantized, as a BF16 push carries them: the FP8 push's bytes against them are what
        # --dry-run's arithmetic says (the engines quantize the floats on arrival).
        bf16_bytes_pushed = asyncio.run(push(load_file(str(new_dir / "model.safetensors")), 2))
        counts = fp8_bytes(ModelConfig.from_hf(json.loads((new_dir / "config.json").read_text())),
                           sum(t.numel() for t in load_file(str(new_dir / "model.safetensors")).values()))
        print(f"push bytes FP8 / BF16: {fp8_bytes_pushed / bf16_bytes_pushed:.4f}")
        assert (fp8_bytes_pushed, bf16_bytes_pushed) == (counts.fp8, counts.bf16)
    finally:
        for engine in engines:
            engine.stop()
