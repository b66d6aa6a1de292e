"""LoRA checkpoints: they hold the adapters and their optimizer state (not the frozen base), a resume continues the
adapters bit for bit, and adapters are refused on any base but their own. Real megatron-core dist-checkpointing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from pipeline.config.trainer import CorrectionConfig, LossConfig, TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.checkpoint import check_base, load_checkpoint, save_checkpoint  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron  # noqa: E402
from pipeline.consumers.megatron.lora import LoRASpec, apply_lora, lora_state_dict  # noqa: E402
from pipeline.consumers.megatron.lora_export import base_identity  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, init_parallel  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.models.tiny import init_tiny_model  # noqa: E402
from tests.helpers.train_samples import synthetic_groups, tiny_moe  # noqa: E402

TARGETS = ("q_proj", "o_proj", "experts.up_proj", "experts.down_proj")
CFG = TrainStepConfig(lr=1e-2, micro_batch_samples=4, grad_clip=1.0,
                      loss=LossConfig(correction=CorrectionConfig(type="none")))


def _trainer(folder: Path, model_cfg: ModelConfig, seed: int = 3) -> TrainStep:
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    apply_lora(model, LoRASpec(rank=4, alpha=8.0, targets=TARGETS), seed=seed)
    return TrainStep(model, model_cfg, CFG)


def _adapters(step: TrainStep) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in lora_state_dict(step.model).items()}


def test_a_resume_continues_the_adapters_exactly_and_saves_no_base_weight(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    folder, model_cfg = tiny_moe(tmp_path / "base")
    batches = [synthetic_groups(model_cfg, [4, 4], seed=s) for s in range(4)]
    first = _trainer(folder, model_cfg)
    for groups in batches[:2]:
        first.step(groups)
    base = base_identity(folder)
    save_checkpoint(tmp_path / "ckpt", first.model, first.optimizer, meta={"step": 2, "lora_base": base})
    saved = _adapters(first)
    for groups in batches[2:]:
        first.step(groups)
    expected = _adapters(first)
    first.close()

    keys = list(FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata)
    # Every saved tensor is an adapter or an adapter's Adam moment: no weight of the frozen base.
    assert all(".lora_" in k for k in keys), [k for k in keys if ".lora_" not in k][:5]
    assert any(k.startswith("decoder.") for k in keys) and any(k.startswith("optimizer.state.exp_avg") for k in keys)

    # Another adapter seed: everything the resume gives must come from the checkpoint.
    resumed = _trainer(folder, model_cfg, seed=99)
    assert any(not torch.equal(v, saved[k]) for k, v in _adapters(resumed).items())
    check_base(tmp_path / "ckpt", base_identity(folder))
    load_checkpoint(tmp_path / "ckpt", resumed.model, resumed.optimizer)
    assert all(torch.equal(v, saved[k]) for k, v in _adapters(resumed).items())
    for groups in batches[2:]:
        resumed.step(groups)
    got = _adapters(resumed)
    resumed.close()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert any(not torch.equal(expected[k], saved[k]) for k in saved)  # the two steps after the save moved them


def test_adapters_are_refused_on_another_base_and_across_lora_and_full(tmp_path: Path) -> None:
    ours = init_tiny_model("qwen3-moe", tmp_path / "ours", seed=0)
    other = init_tiny_model("qwen3-moe", tmp_path / "other", seed=1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "sluice_meta.json").write_text(json.dumps({"step": 5, "lora_base": base_identity(ours)}))
    check_base(ckpt, base_identity(ours))
    with pytest.raises(ConfigError, match="trained on the base at .*ours.* sha256"):
        check_base(ckpt, base_identity(other))
    with pytest.raises(ConfigError, match="LoRA adapters only"):
        check_base(ckpt, None)
    full = tmp_path / "full"
    full.mkdir()
    (full / "sluice_meta.json").write_text(json.dumps({"step": 5}))
    check_base(full, None)
    with pytest.raises(ConfigError, match="holds every weight"):
        check_base(full, base_identity(ours))


def test_the_base_hash_is_cached_by_size_and_time_and_read_again_when_they_change(tmp_path: Path) -> None:
    folder = init_tiny_model("qwen3-moe", tmp_path / "m", seed=0)
    cache = tmp_path / "run" / "base.json"
    first = base_identity(folder, cache)
    assert json.loads(cache.read_text())["sha256"] == first["sha256"]
    assert base_identity(folder, cache) == first
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert base_identity(folder, cache)["sha256"] != first["sha256"]
