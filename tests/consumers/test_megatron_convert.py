"""HF <-> megatron-core conversion against real transformers and real megatron-core models (CPU, fp32)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import (  # noqa: E402
    bucket_by_bytes,
    fuse_hf_experts,
    hf_state_dict,
    iter_hf_weights,
    load_hf_into_megatron,
    megatron_to_hf_state_dict,
    read_hf_checkpoint,
)
from pipeline.consumers.megatron.model import (  # noqa: E402
    build_gpt_model,
    forward_logits,
    forward_logprobs,
    init_parallel,
)
from pipeline.errors import ConfigError  # noqa: E402

VOCAB = 96


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF initialises the router to zeros and norms to ones; random values make routing and norms actually matter.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                std = 0.5 if name.endswith("mlp.gate.weight") else 0.08
                param.copy_(std * torch.randn(param.shape, generator=gen))


def tiny_hf(moe: bool = True, norm_topk_prob: bool = True, tie: bool = False, seed: int = 0) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
    )
    if moe:
        cfg = transformers.Qwen3MoeConfig(
            moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, **common
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    _randomize(model, seed)
    return model.float().eval()


def _megatron_from(hf: torch.nn.Module) -> tuple[object, ModelConfig]:
    model_cfg = ModelConfig.from_hf(hf.config, dtype="float32")
    parallel = ParallelConfig()
    init_parallel(parallel)
    mg = build_gpt_model(model_cfg, parallel, r3=False).eval()
    load_hf_into_megatron(mg, hf, model_cfg)
    return mg, model_cfg


CASES = [
    pytest.param(dict(moe=True, norm_topk_prob=True), id="moe-norm_topk"),
    pytest.param(dict(moe=True, norm_topk_prob=False), id="moe-no_norm_topk"),
    pytest.param(dict(moe=False), id="dense"),
    pytest.param(dict(moe=False, tie=True), id="dense-tied"),
]


@pytest.mark.parametrize("kind", CASES)
def test_roundtrip_is_bit_exact(kind: dict) -> None:
    hf = tiny_hf(**kind)
    mg, model_cfg = _megatron_from(hf)
    back = megatron_to_hf_state_dict(mg, model_cfg)
    source = hf_state_dict(hf)
    if model_cfg.tie_word_embeddings:
        source.pop("lm_head.weight", None)
    assert set(back) == set(source)
    mismatched = [name for name in source if not torch.equal(back[name], source[name])]
    assert mismatched == []


@pytest.mark.parametrize("kind", CASES)
def test_logits_match_hf(kind: dict) -> None:
    hf = tiny_hf(**kind)
    mg, _ = _megatron_from(hf)
    ids = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = forward_logits(mg, ids, torch.ones_like(ids))
    diff = (ref - out).abs().max().item()
    print(f"[{kind}] max |HF - megatron| logits = {diff:.3e}")
    assert diff < 1e-4
    # The check can fail: a model with other weights disagrees by orders of magnitude more.
    other = tiny_hf(**{**kind, "seed": 7})
    with torch.no_grad():
        assert (other(input_ids=ids).logits - out).abs().max().item() > 100 * max(diff, 1e-6)


def test_right_padded_logprobs_match_unpadded_rows() -> None:
    hf = tiny_hf()
    mg, _ = _megatron_from(hf)
    gen = torch.Generator().manual_seed(3)
    short = torch.randint(0, VOCAB, (1, 10), generator=gen)
    long = torch.randint(0, VOCAB, (1, 16), generator=gen)
    padded = torch.cat([torch.cat([short, torch.zeros(1, 6, dtype=torch.long)], dim=1), long])
    mask = torch.ones_like(padded)
    mask[0, 10:] = 0
    with torch.no_grad():
        batch = forward_logprobs(mg, padded, mask)
        alone = forward_logprobs(mg, short, torch.ones_like(short))
        hf_logits = hf(input_ids=short).logits[0, :-1].log_softmax(-1)
    hf_lp = hf_logits.gather(-1, short[0, 1:, None])[:, 0]
    assert torch.allclose(batch[0, :9], alone[0], atol=1e-5)
    assert torch.allclose(alone[0], hf_lp, atol=1e-5)
    assert torch.all(batch[0, 9:] == 0)
    with pytest.raises(ConfigError, match="right-padded"):
        forward_logprobs(mg, padded, mask.flip(1))


def test_checkpoint_folder_and_fused_experts(tmp_path) -> None:
    hf = tiny_hf()
    hf.save_pretrained(tmp_path)
    on_disk = read_hf_checkpoint(tmp_path)
    from_folder = hf_state_dict(tmp_path)
    in_memory = hf_state_dict(hf)
    assert set(from_folder) == set(in_memory)
    assert all(torch.equal(from_folder[k], in_memory[k]) for k in in_memory)
    # save_pretrained writes per-expert names, the layout SGLang loads and sluice pushes.
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in on_disk)
    model_cfg = ModelConfig.from_hf(hf.config, dtype="float32")
    fused = fuse_hf_experts(in_memory, model_cfg)
    assert set(fused) == set(hf.state_dict())
    assert all(torch.equal(fused[k], v) for k, v in hf.state_dict().items())


def test_buckets_respect_size_and_order() -> None:
    hf = tiny_hf()
    mg, model_cfg = _megatron_from(hf)
    weights = list(iter_hf_weights(mg, model_cfg))
    limit = 8 * 1024
    buckets = list(bucket_by_bytes(weights, limit))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in weights]
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
    assert len(buckets) > 1
    bf16 = dict(iter_hf_weights(mg, model_cfg, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


def test_mismatched_checkpoint_is_refused() -> None:
    hf = tiny_hf()
    model_cfg = ModelConfig.from_hf(hf.config, dtype="float32")
    wrong = model_cfg.model_copy(update={"num_layers": 3})
    parallel = ParallelConfig()
    init_parallel(parallel)
    mg = build_gpt_model(wrong, parallel, r3=False)
    with pytest.raises(ConfigError, match="lack "):
        load_hf_into_megatron(mg, hf, wrong)
    # The other way round: leftover HF tensors mean the config describes a smaller model than the checkpoint.
    bigger = dict(hf_state_dict(hf))
    bigger["model.layers.2.input_layernorm.weight"] = torch.ones(32)
    right = build_gpt_model(model_cfg, parallel, r3=False)
    with pytest.raises(ConfigError, match="no megatron parameter"):
        load_hf_into_megatron(right, bigger, model_cfg)


def test_from_hf_reads_transformers5_config() -> None:
    hf = tiny_hf(norm_topk_prob=False)
    cfg = ModelConfig.from_hf(hf.config)
    assert (cfg.num_experts, cfg.moe_topk, cfg.norm_topk_prob, cfg.rope_theta) == (4, 2, False, 10000.0)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.moe_ffn_hidden_size) == (2, 16, 16)
    dense = ModelConfig.from_hf(tiny_hf(moe=False).config)
    assert dense.num_experts == 0 and not dense.is_moe
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf({"model_type": "llama"})


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen3"])
def test_sluice_tiny_model_folder_loads_with_matching_logits(tmp_path, arch: str) -> None:
    # The folder the CPU engine serves: config.json (transformers-5 names) plus per-expert safetensors.
    tiny = pytest.importorskip("pipeline.models.tiny")
    folder = tiny.init_tiny_model(arch, tmp_path / arch, seed=3)
    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    assert model_cfg.is_moe == (arch == "qwen3-moe")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    parallel = ParallelConfig()
    init_parallel(parallel)
    mg = build_gpt_model(model_cfg, parallel, r3=False).eval()
    load_hf_into_megatron(mg, folder, model_cfg)
    ids = torch.randint(0, model_cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - forward_logits(mg, ids, torch.ones_like(ids))).abs().max().item()
    print(f"[{arch} from pipeline.models.tiny] max |HF - megatron| logits = {diff:.3e}")
    assert diff < 1e-4
