"""LoRA exports: a PEFT adapter folder that ``peft.PeftModel.from_pretrained`` loads onto the HF base, and the
merged model that ``from_pretrained`` loads alone, both computing the trainer's logits (fp32, within 1e-4); and
``sluice export`` of a LoRA run's checkpoint, which refuses to put the adapters on another base."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from pipeline.config.trainer import CorrectionConfig, LossConfig, TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron  # noqa: E402
from pipeline.consumers.megatron.lora import LoRASpec, apply_lora  # noqa: E402
from pipeline.consumers.megatron.lora_export import write_peft_adapter  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, forward_logits, init_parallel  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.consumers.trainer.main import export_hf_model  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from tests.helpers.train_samples import synthetic_groups, tiny_moe  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
CFG = TrainStepConfig(r3=False, lr=3e-2, micro_batch_samples=4, grad_clip=1.0,
                      loss=LossConfig(correction=CorrectionConfig(type="none")))


def _trained(folder: Path, model_cfg: ModelConfig, targets: tuple[str, ...]) -> TrainStep:
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, r3=False)
    load_hf_into_megatron(model, folder, model_cfg)
    apply_lora(model, LoRASpec(rank=4, alpha=8.0, targets=targets), seed=3)
    step = TrainStep(model, model_cfg, CFG)
    for seed in range(3):
        step.step(synthetic_groups(model_cfg, [4, 4], seed=seed))
    return step


def _hf(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def test_the_peft_adapter_and_the_merged_model_compute_the_trainers_logits(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    folder, model_cfg = tiny_moe(tmp_path / "base")
    step = _trained(folder, model_cfg, ATTENTION)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        expected = forward_logits(step.model.eval(), ids, torch.ones_like(ids))
    write_peft_adapter(step.model, model_cfg, rank=4, alpha=8.0, targets=ATTENTION, base_dir=folder,
                       out=tmp_path / "adapter")
    export_hf_model(step.model, model_cfg, folder, tmp_path / "merged")
    step.close()

    base = _hf(folder)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        peft_logits = adapted(input_ids=ids).logits
        merged_logits = _hf(tmp_path / "merged")(input_ids=ids).logits
    gaps = {name: float((got - expected).abs().max())
            for name, got in (("peft", peft_logits), ("merged", merged_logits), ("base", base_logits))}
    print(f"max |logit - trainer's|: {gaps}")
    assert gaps["peft"] < 1e-4 and gaps["merged"] < 1e-4
    assert gaps["base"] > 1e-2  # the adapters moved the logits: the two matches above are not the base's


def test_expert_adapters_have_no_peft_form_and_say_so(tmp_path: Path) -> None:
    folder, model_cfg = tiny_moe(tmp_path / "base")
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, r3=False)
    targets = ("q_proj", "experts.down_proj")
    apply_lora(model, LoRASpec(rank=2, targets=targets), seed=0)
    with pytest.raises(ConfigError, match="experts fused.*merged model"):
        write_peft_adapter(model, model_cfg, rank=2, alpha=16.0, targets=targets, base_dir=folder,
                           out=tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
