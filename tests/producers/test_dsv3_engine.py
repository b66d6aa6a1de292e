"""The DeepSeek-V3 family on the rollout side: sluice's tiny DeepseekV3 model (MLA, shared expert, sigmoid router with
expert bias, group-limited top-k, a dense first layer) served by a real CPU engine subprocess, its tokens, log-probs
and routing checked against an independent full-sequence forward of the same HF model."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.models.tiny import build_tokenizer, init_tiny_model  # noqa: E402
from pipeline.producers.producer import routed_experts_shape  # noqa: E402
from tests.helpers.engines import EngineProcess, start_engine  # noqa: E402

LOGPROB_ATOL = 1e-4  # as tests/producers/test_cpu_engine.py: fp32 KV-cache decoding vs one full forward
PROMPTS = [[5, 6, 14, 7, 8, 18], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model("deepseek-v3", tmp_path_factory.mktemp("tiny_dsv3"), seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    proc = start_engine(model_dir, tmp_path_factory.mktemp("dsv3_engine_log"), None, "--max-batch", "16")
    try:
        yield proc
    finally:
        proc.stop()


def _gates(model: Any) -> list[Any]:
    # Found by class, not through sluice's family code, so that the reference is independent of what it checks.
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]


def _reference(model: Any, prompt: list[int], output: list[int], temperature: float) -> dict[str, Any]:
    captured: list[Any] = []
    hooks = [gate.register_forward_hook(lambda mod, inp, out: captured.append(out[2])) for gate in _gates(model)]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    p, r = len(prompt), len(output)
    predicting = logits[p - 1 : p + r - 1]
    logprobs = torch.log_softmax(predicting / (temperature if temperature > 0 else 1.0), dim=-1)
    return {
        "argmax": predicting.argmax(-1).tolist(),
        "logprobs": logprobs.gather(-1, torch.tensor(output)[:, None])[:, 0].numpy(),
        "routing": torch.stack(captured, dim=1)[: p + r - 1].numpy(),
    }


def _generate(engine: EngineProcess, prompt: list[int], **sampling: Any) -> dict[str, Any]:
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True, **sampling}
    body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True, "return_routed_experts": True}
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    return response.json()


def _routing(meta: dict[str, Any], layers: int, topk: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, layers, topk)


def test_tiny_model_has_every_feature_of_the_family(model_dir: Path, hf_model: Any) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["q_lora_rank"] and config["kv_lora_rank"] and config["qk_rope_head_dim"] < config["qk_nope_head_dim"]
    assert config["n_shared_experts"] == 1 and config["first_k_dense_replace"] == 1
    assert config["n_group"] > config["topk_group"] > 1  # group limiting removes candidates
    layers = hf_model.model.layers
    assert not hasattr(layers[0].mlp, "gate") and all(hasattr(layer.mlp, "shared_experts") for layer in layers[1:])
    # What producers reshape an engine's flat routing into: the MoE layers only (the dense first layer routes nothing).
    assert routed_experts_shape(model_dir) == (2, 4)
    biases = [g.e_score_correction_bias for g in _gates(hf_model)]
    assert len(biases) == 2 and all(float(b.abs().max()) > 0 for b in biases)  # a trained model's bias is not zero
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.get_vocab() == build_tokenizer().get_vocab()
    assert tokenizer.decode(tokenizer("37+45=82")["input_ids"]) == "37+45=82"
    # Same seed, same weights: the tiny model is reproducible, bias included.
    again = init_tiny_model("deepseek-v3", model_dir.parent / "again", seed=0)
    from safetensors.torch import load_file

    first, second = load_file(str(model_dir / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_engine_serves_it_with_routing_from_its_gate(engine: EngineProcess, hf_model: Any) -> None:
    info = httpx.get(f"{engine.url}/model_info", timeout=10).json()
    assert (info["num_moe_layers"], info["num_experts"], info["num_experts_per_tok"]) == (2, 16, 4)
    layers, topk, groups = 2, 4, hf_model.config.n_group
    worst, agree, total = 0.0, 0, 0
    runs = [(p, 0.0, None) for p in PROMPTS] + [(PROMPTS[0], 0.8, 11), (PROMPTS[2], 0.8, 12)]
    for prompt, temperature, seed in runs:
        sampling = {"temperature": temperature} | ({"sampling_seed": seed} if seed is not None else {})
        result = _generate(engine, prompt, **sampling)
        out, meta = result["output_ids"], result["meta_info"]
        ref = _reference(hf_model, prompt, out, temperature)
        if temperature == 0:
            assert out == ref["argmax"]
        logprobs = np.array([entry[0] for entry in meta["output_token_logprobs"]])
        worst = max(worst, float(np.abs(logprobs - ref["logprobs"]).max()))
        routing = _routing(meta, layers, topk)
        assert routing.shape == ref["routing"].shape == (len(prompt) + len(out) - 1, layers, topk)
        agree += int((routing == ref["routing"]).all(axis=-1).sum())
        total += routing.shape[0] * layers
        # Group-limited top-k is visible in what the engine reports: a token's experts span at most topk_group
        # of the n_group groups.
        spanned = np.array([[len(set(row // (16 // groups))) for row in token] for token in routing])
        assert spanned.max() <= hf_model.config.topk_group
    print(f"DeepSeek-V3 tiny on the CPU engine: max |logprob - HF forward| {worst:.2e} (tolerance {LOGPROB_ATOL}); "
          f"routing agreement {agree}/{total}")
    assert worst < LOGPROB_ATOL
    assert agree == total
