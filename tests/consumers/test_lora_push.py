"""Only the adapters travel: a CPU engine given nothing but the trained LoRA adapters (merged into its weights, or
applied beside its base) samples with the trainer's log-probs, and a second push replaces the first adapter rather
than stacking on it. Real megatron-core trainer (tiny Qwen3-MoE, fp32), real engine process, real gloo push."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from pipeline.config.trainer import CorrectionConfig, LossConfig, TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import iter_hf_weights, load_hf_into_megatron  # noqa: E402
from pipeline.consumers.megatron.lora import LoRASpec, apply_lora  # noqa: E402
from pipeline.consumers.megatron.lora_export import iter_hf_adapters, iter_hf_merged  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, forward_logprobs, init_parallel  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient  # noqa: E402
from pipeline.sync.lora_names import adapted_weight  # noqa: E402
from pipeline.sync.pusher import WeightPusher  # noqa: E402
from tests.helpers.engines import start_engine  # noqa: E402
from tests.helpers.train_samples import synthetic_groups, tiny_moe  # noqa: E402

LOGPROB_ATOL = 1e-4  # fp32 KV-cache decoding vs one full forward, as the engine's own tests
PROMPT = [5, 6, 7, 8, 9, 10]
ALL_MOE = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj")
CFG = TrainStepConfig(lr=3e-2, micro_batch_samples=4, grad_clip=1.0,
                      loss=LossConfig(correction=CorrectionConfig(type="none")))


def _lora_trainer(folder: Path, model_cfg: ModelConfig, targets: tuple[str, ...]) -> TrainStep:
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    apply_lora(model, LoRASpec(rank=4, alpha=8.0, targets=targets), seed=3)
    return TrainStep(model, model_cfg, CFG)


def _engine_sample(url: str) -> tuple[list[int], np.ndarray, str]:
    async def go() -> tuple[list[int], np.ndarray, str]:
        async with SGLangClient(url, retry=NO_RETRY) as client:
            out = await client.generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True,
                                                 "sampling_seed": 0})
            return [int(t) for t in out.output_ids], np.asarray(out.output_logprobs), out.weight_version

    return asyncio.run(go())


def _trainer_logprobs(model: torch.nn.Module, output: list[int]) -> np.ndarray:
    ids = torch.tensor([PROMPT + output])
    with torch.no_grad():
        logprobs = forward_logprobs(model.eval(), ids, torch.ones_like(ids))[0]
    model.train()
    return logprobs[len(PROMPT) - 1:].numpy()


def _base_logprobs(model: torch.nn.Module, output: list[int]) -> np.ndarray:
    """The trainer's log-probs with every adapter's B zeroed (the base alone)."""
    bs = {n: p for n, p in model.named_parameters() if n.endswith(".lora_b")}
    saved = {n: p.detach().clone() for n, p in bs.items()}
    with torch.no_grad():
        for p in bs.values():
            p.zero_()
        base = _trainer_logprobs(model, output)
        for n, p in bs.items():
            p.copy_(saved[n])
    return base


def _push(url: str, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
    async def go() -> None:
        client = SGLangClient(url, retry=NO_RETRY)
        pusher = await WeightPusher.connect([client], master_address="127.0.0.1", backend="gloo", timeout_s=60)
        try:
            await pusher.push(iter(weights), version)
        finally:
            await pusher.close()
            await client.close()

    asyncio.run(go())


@pytest.mark.slow
@pytest.mark.parametrize("serve,targets", [("merge", ALL_MOE), ("adapter", ("q_proj", "v_proj", "o_proj"))])
def test_an_engine_given_only_the_adapters_samples_with_the_trainers_log_probs(tmp_path: Path, serve: str,
                                                                                targets: tuple[str, ...]) -> None:
    folder, model_cfg = tiny_moe(tmp_path / "base")
    trainer = _lora_trainer(folder, model_cfg, targets)
    full_bytes = sum(t.numel() * t.element_size() for _, t in iter_hf_weights(trainer.model, model_cfg))
    engine = start_engine(folder, tmp_path, None, "--lora", serve)
    try:
        for version in (1, 2):
            for _ in range(2):
                trainer.step(synthetic_groups(model_cfg, [4, 4], seed=version))
            adapters = list(iter_hf_adapters(trainer.model, model_cfg))
            assert adapters and all(adapted_weight(name) is not None for name, _ in adapters)
            _push(engine.url, adapters, version)
            output, logprobs, label = _engine_sample(engine.url)
            expected = _trainer_logprobs(trainer.model, output)
            gap = float(np.abs(logprobs - expected).max())
            print(f"{serve} v{version}: {len(adapters)} adapter tensors, "
                  f"{sum(t.numel() * t.element_size() for _, t in adapters)} B of {full_bytes} B in a full push; "
                  f"engine vs trainer log-probs max |diff| {gap:.2e}")
            assert label == str(version)
            assert gap < LOGPROB_ATOL
            # The adapter changed what the engine computes: the base's log-probs of the same tokens differ.
            assert float(np.abs(logprobs - _base_logprobs(trainer.model, output)).max()) > 1e-3
        pushed = sum(t.numel() * t.element_size() for _, t in adapters)
        assert pushed < full_bytes / 4
    finally:
        engine.stop()
        trainer.close()


def test_merged_export_holds_the_adapted_weights_and_equals_the_trainers_forward(tmp_path: Path) -> None:
    """What a held-out snapshot holds with LoRA: every weight, the adapters merged in; a plain megatron model loaded
    from it computes the adapted model's log-probs."""
    folder, model_cfg = tiny_moe(tmp_path / "base")
    trainer = _lora_trainer(folder, model_cfg, ALL_MOE)
    for seed in range(2):
        trainer.step(synthetic_groups(model_cfg, [4, 4], seed=seed))
    merged = dict(iter_hf_merged(trainer.model, model_cfg))
    plain_names = dict(iter_hf_weights(trainer.model, model_cfg))
    assert set(merged) == set(plain_names)
    changed = [n for n in merged if not torch.equal(merged[n], plain_names[n])]
    assert any(".q_proj." in n for n in changed) and any(".experts.0.down_proj." in n for n in changed)
    assert not any("router" in n or "gate.weight" in n.split("mlp.")[-1] for n in changed)
    ids = torch.tensor([PROMPT + [11, 12, 13, 14]])
    with torch.no_grad():
        adapted = forward_logprobs(trainer.model.eval(), ids, torch.ones_like(ids))
    trainer.close()
    from safetensors.torch import save_file

    out = tmp_path / "merged"
    out.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "model.safetensors"))
    parallel = ParallelConfig(device="cpu")
    plain = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(plain, out, model_cfg)
    with torch.no_grad():
        reloaded = forward_logprobs(plain.eval(), ids, torch.ones_like(ids))
    assert float((reloaded - adapted).abs().max()) < 1e-5
