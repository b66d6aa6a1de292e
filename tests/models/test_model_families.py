"""The family registry and each family's config mapping: HF configs in, ModelConfig out, refusals with a reason."""

from __future__ import annotations

from typing import Any, get_args

import pytest

from pipeline.config import ModelSource
from pipeline.errors import ConfigError
from pipeline.models.config import ModelConfig
from pipeline.models.families import FAMILIES, family_for_hf, family_for_tiny, tiny_archs
from pipeline.models.tiny import TINY_ARCHS

transformers = pytest.importorskip("transformers")


def test_registry_covers_every_tiny_arch_and_model_type() -> None:
    assert set(TINY_ARCHS) == set(tiny_archs()) == set(get_args(ModelSource.model_fields["init_tiny"].annotation))
    assert set(FAMILIES) == set(get_args(ModelConfig.model_fields["family"].annotation))
    for name, fam in FAMILIES.items():
        assert fam.name == name
        assert all(family_for_hf(t) is fam for t in fam.hf_model_types)
        assert all(family_for_tiny(a) is fam for a in fam.tiny_archs)
    with pytest.raises(ConfigError, match="llama.*deepseek_v3"):
        family_for_hf("llama")
    with pytest.raises(ConfigError, match="choose one of"):
        family_for_tiny("gpt2")


def _dsv3(**overrides: Any) -> dict[str, Any]:
    config = FAMILIES["deepseek-v3"].tiny_config("deepseek-v3", {"vocab_size": 62, **overrides}).to_dict()
    return config


def test_deepseek_v3_config_mapping() -> None:
    cfg = ModelConfig.from_hf(_dsv3(), dtype="float32")
    assert cfg.family == "deepseek-v3" and cfg.mla is not None
    assert (cfg.num_layers, cfg.first_dense_layers, cfg.num_moe_layers, cfg.moe_layer_pattern) == (3, 1, 2, [0, 1, 1])
    assert (cfg.num_experts, cfg.moe_topk, cfg.router_groups, cfg.router_group_topk) == (16, 4, 4, 2)
    assert (cfg.router_score, cfg.router_expert_bias, cfg.routed_scaling_factor) == ("sigmoid", True, 2.5)
    assert cfg.shared_expert_ffn_hidden_size == cfg.moe_ffn_hidden_size == 32
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim) == (32, 32, 8)
    assert cfg.yarn is None and cfg.rope_theta == 10000.0
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    scaled = ModelConfig.from_hf({**_dsv3(), "rope_parameters": yarn})
    assert scaled.yarn is not None and scaled.yarn.factor == 40.0 and scaled.yarn.mscale_all_dim == 1.0
    # Kimi K2 names its config kimi_k2 and uses one expert group (no group limiting).
    kimi = ModelConfig.from_hf({**_dsv3(), "model_type": "kimi_k2", "n_group": 1, "topk_group": 1})
    assert kimi.family == "deepseek-v3" and kimi.router_groups == 1


@pytest.mark.parametrize(("overrides", "match"), [
    ({"rope_interleave": False}, "rope_interleave"),
    ({"num_experts_per_tok": 6}, "HF scores an expert group by its 2 best"),
    ({"norm_topk_prob": False}, "renormalises"),
    ({"quantization_config": {"quant_method": "fp8"}}, "dequantize"),
    ({"attention_bias": True}, "attention_bias"),
    ({"scoring_func": "softmax"}, "noaux_tc"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "plain RoPE and YaRN"),
])
def test_deepseek_v3_configs_sluice_cannot_reproduce_are_refused(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**_dsv3(), **overrides})


def test_model_config_checks_router_shapes() -> None:
    base = ModelConfig.from_hf(_dsv3()).model_dump()
    for change, match in [({"router_groups": 5}, "must divide num_experts"), ({"router_group_topk": 8}, "exceeds"),
                          ({"first_dense_layers": 3}, "leaves no MoE layer"),
                          ({"router_score": "softmax"}, "router_expert_bias needs")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig(**{**base, **change})
