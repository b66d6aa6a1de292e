"""The DeepSeek-V3 family on the trainer side (CPU, fp32, real megatron-core): the MLA GPTModel built from sluice's
tiny DeepseekV3 checkpoint, HF <-> megatron conversion, R3 on samples recorded under other weights, and the expert
bias (updated as megatron-core does, checkpointed, exported with the weights the engines load)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from pipeline.config.trainer import TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import (  # noqa: E402
    hf_state_dict,
    iter_hf_weights,
    load_hf_into_megatron,
    megatron_to_hf_state_dict,
)
from pipeline.consumers.megatron.model import build_gpt_model, forward_logits, init_parallel  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.models.tiny import init_tiny_model  # noqa: E402
from pipeline.producers.cpu_engine.weight_loader import WeightLoader  # noqa: E402
from tests.consumers.test_r3 import PERTURBATION, _generate  # noqa: E402

CPU = ParallelConfig(device="cpu")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _folder(tmp_path: Path, **overrides: Any) -> tuple[Path, ModelConfig]:
    folder = init_tiny_model("deepseek-v3", tmp_path, seed=0, **overrides)
    return folder, ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")


def _hf(folder: Path, seed: int = 0) -> Any:
    """The HF model with its norms randomised too (HF starts them at 1, where a mapping that swaps two norms would
    still give the right logits); the weights, expert bias included, are the tiny model's own random ones."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif seed:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return hf


def _megatron(model_cfg: ModelConfig, source: Any, *, r3: bool = True) -> Any:
    init_parallel(CPU, seed=3)
    model = build_gpt_model(model_cfg, CPU, r3=r3).eval()
    load_hf_into_megatron(model, source, model_cfg)
    return model


def _hf_routing(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    captured: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, i, out: captured.append(out[2]))
             for m in hf.modules() if isinstance(m, DeepseekV3TopkRouter)]
    with torch.no_grad():
        hf(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return torch.stack([c.reshape(ids.shape[0], ids.shape[1], -1) for c in captured], dim=2)


@pytest.mark.parametrize("rope", ["plain", "yarn"])
def test_logits_and_routing_match_hf_and_the_round_trip_is_exact(tmp_path: Path, rope: str) -> None:
    from pipeline.consumers.megatron.scoring import RouterProbe

    yarn = {"rope_parameters": YARN, "max_position_embeddings": 256}
    folder, model_cfg = _folder(tmp_path, **(yarn if rope == "yarn" else {}))
    assert (model_cfg.yarn is not None) == (rope == "yarn")
    hf = _hf(folder)
    mg = _megatron(model_cfg, hf)
    # Longer than YaRN's original 64 positions, so the extension is exercised.
    ids = torch.randint(0, model_cfg.vocab_size, (3, 96), generator=torch.Generator().manual_seed(1))
    probe = RouterProbe(mg, model_cfg.moe_topk)
    probe.start()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = forward_logits(mg, ids, torch.ones_like(ids))
    used = probe.take(ids.shape[0])
    probe.close()
    diff = (ref - out).abs().max().item()
    same = (used.sort(-1).values == _hf_routing(hf, ids).sort(-1).values).all(-1).float().mean().item()
    print(f"[deepseek-v3, {rope} RoPE] max |HF - megatron| logits = {diff:.3e} (tolerance 1e-4); top-k sets that "
          f"agree: {100 * same:.2f}%")
    assert diff < 1e-4 and same == 1.0
    with torch.no_grad():  # the check can fail: other weights disagree by orders of magnitude more
        assert (_hf(folder, seed=7)(input_ids=ids).logits - out).abs().max().item() > 100 * max(diff, 1e-6)
    back = megatron_to_hf_state_dict(mg, model_cfg)
    source = hf_state_dict(hf)
    assert set(back) == set(source)
    assert [name for name in source if not torch.equal(back[name], source[name])] == []
    assert sum(name.endswith("mlp.gate.e_score_correction_bias") for name in back) == model_cfg.num_moe_layers


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder, model_cfg = _folder(tmp_path_factory.mktemp("dsv3_r3"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    groups = []
    for g in range(4):
        prompt = rng.integers(4, model_cfg.vocab_size, int(rng.integers(4, 9))).tolist()
        group = [_generate(hf, prompt, int(rng.integers(6, 13)), gen, model_cfg.num_experts) for _ in range(4)]
        for i, s in enumerate(group):
            s.reward = float((i + g) % 3)
        groups.append(group)
    return dict(folder=folder, cfg=model_cfg, groups=groups)


def _trainer(rollout: dict[str, Any], *, r3: bool, perturb: bool = True, bias_rate: float = 0.0) -> TrainStep:
    model_cfg = rollout["cfg"]
    model = _megatron(model_cfg, rollout["folder"]).train()
    if perturb:  # the trainer has taken steps since the samples were generated
        gen = torch.Generator().manual_seed(42)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(PERTURBATION * param.std() * torch.randn(param.shape, generator=gen))
    cfg = TrainStepConfig(r3=r3, lr=1e-4, micro_batch_samples=6, expert_bias_update_rate=bias_rate)
    return TrainStep(model, model_cfg, cfg)


def test_r3_replays_the_rollout_routing_under_other_weights(rollout: dict[str, Any]) -> None:
    on = _trainer(rollout, r3=True)
    m_on = on.step(rollout["groups"])
    on.close()
    off = _trainer(rollout, r3=False)
    m_off = off.step(rollout["groups"])
    off.close()
    print(f"deepseek-v3 R3: top-k agreement of the training forward with the rollout: replay "
          f"{m_on['r3/agreement_train']:.4f}, no replay {m_off['r3/agreement_train']:.4f}; log-prob mismatch (k3) "
          f"with replay {m_on['r3/mismatch_k3_replay']:.5f}, without {m_on['r3/mismatch_k3_no_replay']:.5f}")
    assert m_on["r3/agreement_train"] == 1.0
    assert m_off["r3/agreement_train"] < 0.97
    assert m_on["r3/mismatch_k3_replay"] < m_on["r3/mismatch_k3_no_replay"]
    assert m_on["r3/replayed_samples"] == 16 and m_on["grad_norm_router"] > 0


def test_expert_bias_update_checkpoint_and_push(rollout: dict[str, Any], tmp_path: Path) -> None:
    rate = 0.01
    model_cfg, groups = rollout["cfg"], rollout["groups"]
    trainer = _trainer(rollout, r3=True, perturb=False, bias_rate=rate)
    routers = [layer.mlp.router for layer in trainer.model.decoder.layers if hasattr(layer.mlp, "router")]
    before = torch.stack([r.expert_bias.clone() for r in routers])
    metrics = trainer.step(groups)
    after = torch.stack([r.expert_bias.clone() for r in routers])
    # megatron's rule on the engine's routing: every expert moves by rate toward the mean load of its layer.
    routed = np.concatenate([s.routed_experts for g in groups for s in g]).astype(np.int64)  # [tokens, layers, k]
    counts = torch.stack([torch.bincount(torch.from_numpy(routed[:, layer].ravel()), minlength=model_cfg.num_experts)
                          for layer in range(model_cfg.num_moe_layers)]).float()
    expected = before + rate * torch.sign(counts.mean(-1, keepdim=True) - counts)
    print(f"expert bias after one step: max |bias - megatron's rule| {(after - expected).abs().max():.1e}; "
          f"load max/mean {metrics['expert_load_max_ratio']:.2f}")
    assert torch.allclose(after, expected, atol=1e-7) and not torch.equal(after, before)
    assert metrics["expert_bias_abs_max"] == pytest.approx(float(after.abs().max()))

    save_checkpoint(tmp_path / "ckpt", trainer.model, trainer.optimizer, meta={"step": 1})
    fresh = build_gpt_model(model_cfg, CPU, r3=True)  # megatron starts the bias at zero
    load_checkpoint(tmp_path / "ckpt", fresh)
    restored = torch.stack([layer.mlp.router.expert_bias for layer in fresh.decoder.layers if hasattr(layer.mlp,
                                                                                                        "router")])
    assert torch.equal(restored, after)

    # The push: the exported weights carry the bias under its HF name, and the engine's loader takes them.
    pushed = dict(iter_hf_weights(trainer.model, model_cfg))
    engine_model = transformers.AutoModelForCausalLM.from_pretrained(rollout["folder"], dtype=torch.float32)
    loader = WeightLoader(engine_model)
    names = list(pushed)
    loader.check(names, [str(t.dtype).removeprefix("torch.") for t in pushed.values()],
                 [list(t.shape) for t in pushed.values()])
    loader.check_complete(names)
    loader.apply(list(pushed.items()))
    served = torch.stack([engine_model.model.layers[i].mlp.gate.e_score_correction_bias
                          for i in range(model_cfg.num_layers) if model_cfg.is_moe_layer(i)])
    assert torch.equal(served, after)
    trainer.close()
