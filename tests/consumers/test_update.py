"""The update of a drained batch: mini-batch PPO (the clip acts), the learning-rate schedule, fp32 master weights for
bf16 parameters (and their checkpoint), on the real megatron-core model. The same behavioural checks run on CUDA
with megatron's DDP and distributed optimizer when a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pipeline.config.trainer import CorrectionConfig, LossConfig, LRScheduleConfig, TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, init_parallel  # noqa: E402
from pipeline.consumers.rl.optim import MasterWeightOptimizer  # noqa: E402
from pipeline.consumers.rl.schedule import lr_at  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from tests.helpers.train_samples import synthetic_groups, tiny_moe  # noqa: E402

SIZES = [4, 4, 4, 4]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    return tiny_moe(tmp_path_factory.mktemp("tiny"))


def _step(tiny: tuple[Path, ModelConfig], cfg: TrainStepConfig, *, device: str = "cpu", dtype: str = "float32",
          optimizer: torch.optim.Optimizer | None = None, total_steps: int | None = None) -> TrainStep:
    folder, model_cfg = tiny
    model_cfg = model_cfg.model_copy(update={"dtype": dtype})
    parallel = ParallelConfig(device=device)  # type: ignore[arg-type]
    init_parallel(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    return TrainStep(model, model_cfg, cfg, optimizer=optimizer, total_steps=total_steps)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])


# ---------------------------------------------------------------------------------------------- mini-batch PPO


@pytest.mark.parametrize("device", DEVICES)
def test_one_update_per_batch_never_clips_and_mini_batches_do(tiny: tuple[Path, ModelConfig], device: str) -> None:
    """The defect this guards against: one optimizer step per batch makes current == proximal, so the clip never acts
    and the proximal forward changes nothing."""
    groups = synthetic_groups(tiny[1], SIZES, seed=5)
    base = dict(lr=3e-3, micro_batch_samples=4, grad_clip=None,
                loss=LossConfig(clip_low=0.05, clip_high=0.05, correction=CorrectionConfig(type="none")))
    single = _step(tiny, TrainStepConfig(**base), device=device)
    one = single.step(groups)
    single.close()
    several = _step(tiny, TrainStepConfig(**base, mini_batches=4, epochs=2), device=device)
    many = several.step(groups)
    several.close()
    print(f"one update: clip {one['clip_fraction']:.3f} kl {one['policy_kl_k3']:.2e}; 8 updates: clip "
          f"{many['clip_fraction']:.3f} (high {many['clip_high_fraction']:.3f}, low {many['clip_low_fraction']:.3f}) "
          f"kl {many['policy_kl_k3']:.2e}")
    assert one["optimizer_steps"] == 1 and one["clip_fraction"] == 0.0 and one["policy_kl_k3"] < 1e-10
    assert many["optimizer_steps"] == 8 and several.optimizer_steps == 8
    assert many["clip_fraction"] > 0.05 and many["policy_kl_k3"] > 1e-4
    # The batch is counted once, whatever the number of passes over it.
    assert many["num_tokens"] == one["num_tokens"] and several.samples_trained == single.samples_trained


def test_the_clip_bounds_the_move_away_from_the_proximal_policy(tiny: tuple[Path, ModelConfig]) -> None:
    """Sixteen updates on one batch: with a tight clip the policy stays nearer the proximal one (tokens past the
    bound in their advantage's direction stop pulling); without it (a clip of 100) it moves further. Measured on
    the batch's own tokens."""
    groups = synthetic_groups(tiny[1], SIZES, seed=6)
    moved = {}
    for clip in (0.02, 100.0):
        cfg = TrainStepConfig(lr=5e-4, micro_batch_samples=8, mini_batches=2, epochs=8, grad_clip=None,
                              loss=LossConfig(clip_low=min(clip, 0.99), clip_high=clip,
                                              correction=CorrectionConfig(type="none")))
        step = _step(tiny, cfg)
        before = step.compute_logprobs(groups, replay=False)
        step.step(groups)
        after = step.compute_logprobs(groups, replay=False)
        step.close()
        moved[clip] = float(np.mean(np.concatenate([abs(a - b) for a, b in zip(after, before, strict=True)])))
    print(f"mean token log-prob change after 16 updates: clip 0.02 -> {moved[0.02]:.3f}, no clip -> "
          f"{moved[100.0]:.3f}")
    assert moved[100.0] > 1.3 * moved[0.02]


# ------------------------------------------------------------------------------------------------ the LR schedule


def test_lr_schedule_by_hand() -> None:
    warm = LRScheduleConfig(warmup_steps=4)
    assert [lr_at(s, 1.0, warm) for s in range(6)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    cos = LRScheduleConfig(warmup_steps=2, decay="cosine", min_lr_ratio=0.1)
    assert lr_at(2, 1.0, cos, total_steps=12) == pytest.approx(1.0)
    assert lr_at(7, 1.0, cos, total_steps=12) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_at(12, 1.0, cos, total_steps=12) == pytest.approx(0.1)
    assert lr_at(99, 1.0, cos, total_steps=12) == pytest.approx(0.1)  # the floor holds past the end
    lin = LRScheduleConfig(decay="linear", decay_steps=4)
    assert [lr_at(s, 2.0, lin) for s in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="negative"):
        lr_at(-1, 1.0, warm)


def test_a_decay_by_samples_gives_the_same_rate_at_the_same_samples_whatever_the_steps() -> None:
    cos = LRScheduleConfig(warmup_steps=2, decay="cosine", min_lr_ratio=0.1, decay_unit="samples", decay_samples=1000)
    assert lr_at(0, 1.0, cos, samples=0) == pytest.approx(1 / 3)  # warm-up counts optimizer steps
    # Two runs at 500 samples trained, one at its optimizer step 5 and one at step 40: the same rate, half way.
    assert lr_at(5, 1.0, cos, samples=500) == lr_at(40, 1.0, cos, samples=500) == pytest.approx(0.55)
    assert lr_at(6, 1.0, cos, samples=5000) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="decay_samples"):
        LRScheduleConfig(decay="cosine", decay_unit="samples")
    with pytest.raises(ConfigError, match="ignores it"):
        LRScheduleConfig(decay="cosine", decay_samples=10)


def test_the_train_step_decays_by_samples_trained(tiny: tuple[Path, ModelConfig]) -> None:
    sched = LRScheduleConfig(decay="linear", decay_unit="samples", decay_samples=10_000, min_lr_ratio=0.0)
    step = _step(tiny, TrainStepConfig(lr=1e-3, micro_batch_samples=8, lr_schedule=sched), total_steps=1_000)
    first = step.step(synthetic_groups(tiny[1], SIZES, seed=0))
    second = step.step(synthetic_groups(tiny[1], SIZES, seed=1))
    step.close()
    assert first["lr"] == pytest.approx(1e-3)  # nothing trained before the first step
    # The second step's rate is set by the samples the first trained, not by its step count out of 1,000.
    assert second["lr"] == pytest.approx(1e-3 * (1 - first["num_trainable_samples"] / 10_000))
    assert second["lr"] < 1e-3 * (1 - 1 / 1_000) - 1e-9


def test_the_train_step_follows_the_schedule_across_mini_batches_and_a_resume(tiny: tuple[Path, ModelConfig]) -> None:
    cfg = TrainStepConfig(lr=1e-3, micro_batch_samples=8, mini_batches=2,
                          lr_schedule=LRScheduleConfig(warmup_steps=3, decay="linear", min_lr_ratio=0.5))
    step = _step(tiny, cfg, total_steps=4)  # 8 optimizer steps: 3 of warm-up, 5 of decay to 5e-4
    seen = [step.step(synthetic_groups(tiny[1], SIZES, seed=s))["lr"] for s in range(2)]
    state = step.state_dict()
    step.close()
    # The last update of each step: optimizer steps 1 (warm-up, 2/4 of lr) and 3 (the peak, decay starts there).
    assert seen == pytest.approx([1e-3 * 2 / 4, 1e-3])
    resumed = _step(tiny, cfg, total_steps=4)
    resumed.load_state_dict(state)
    # Optimizer step 5: 2/5 of the way down from 1e-3 to the floor 5e-4.
    assert resumed.step(synthetic_groups(tiny[1], SIZES, seed=9))["lr"] == pytest.approx(1e-3 - 5e-4 * 2 / 5)
    resumed.close()


# -------------------------------------------------------------------------------------------- bf16 master weights


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_weights_move_under_a_tiny_lr_only_with_fp32_masters(tiny: tuple[Path, ModelConfig],
                                                                  device: str) -> None:
    """At lr 1e-6 an AdamW step is far below half a bf16 ulp of most weights: stepping the bf16 parameters
    directly rounds it away every time, while fp32 masters keep it (and the bf16 weights are their rounding, so they
    follow once the sum passes half an ulp). Measured as total weight movement against the same run in fp32."""
    cfg = TrainStepConfig(lr=1e-6, micro_batch_samples=16, grad_clip=None)
    batches = [synthetic_groups(tiny[1], SIZES, seed=s) for s in range(40)]

    def movement(step: TrainStep) -> float:
        # The weights the optimizer steps: the masters when there are some (the bf16 copy is their rounding).
        opt = step.optimizer
        weights = _stepped_weights(step)
        start = torch.cat([w.detach().float().flatten().cpu() for w in weights])
        for groups in batches:
            step.step(groups)
        moved = float((torch.cat([w.detach().float().flatten().cpu() for w in weights]) - start).abs().sum())
        if isinstance(opt, MasterWeightOptimizer):
            assert all(torch.equal(p.detach(), m.detach().to(p.dtype))
                       for p, m in zip(opt.checkpoint_params, opt.master_params, strict=True))
        step.close()
        return moved

    reference = movement(_step(tiny, cfg, device=device))
    masters = _step(tiny, cfg, device=device, dtype="bfloat16")
    assert torch.bfloat16 in {p.dtype for p in masters.model.parameters()}
    with_masters = movement(masters)
    print(f"total |weight change| after 40 steps at lr 1e-6, as a fraction of fp32's: {with_masters / reference:.2f} "
          "with fp32 masters")
    assert with_masters > 0.5 * reference
    if device == "cpu":  # what the masters prevent: the local optimizer stepping bf16 weights directly
        plain = _step(tiny, cfg, device=device, dtype="bfloat16")
        plain.updater.optimizer = torch.optim.AdamW(list(plain.model.parameters()), lr=cfg.lr)
        without = movement(plain)
        print(f"  {without / reference:.2f} stepping bf16 directly")
        assert without < 0.25 * reference


def _stepped_weights(step: TrainStep) -> list[torch.Tensor]:
    """The tensors the optimizer updates: fp32 masters (sluice's, or megatron's main params), else the model's."""
    opt = step.optimizer
    if isinstance(opt, MasterWeightOptimizer):
        return opt.master_params
    inner = getattr(opt, "chained_optimizers", None) or ([opt] if hasattr(opt, "optimizer") else [])
    if inner:  # megatron: each optimizer's torch optimizer holds the fp32 main params (shards of them)
        return [p for o in inner for g in o.optimizer.param_groups for p in g["params"]]
    return list(step.model.parameters())


def test_master_weights_survive_a_checkpoint_exactly(tiny: tuple[Path, ModelConfig], tmp_path: Path) -> None:
    from pipeline.consumers.megatron.checkpoint import load_checkpoint, save_checkpoint

    cfg = TrainStepConfig(lr=1e-5, micro_batch_samples=16)
    step = _step(tiny, cfg, dtype="bfloat16")
    assert isinstance(step.optimizer, MasterWeightOptimizer)
    for s in range(3):
        step.step(synthetic_groups(tiny[1], SIZES, seed=s))
    masters = [m.detach().clone() for m in step.optimizer.master_params]
    rounded = [p.detach().float() for p in step.optimizer.checkpoint_params]
    assert any(not torch.equal(m, r) for m, r in zip(masters, rounded, strict=True))  # masters are finer than bf16
    save_checkpoint(tmp_path / "ckpt", step.model, step.optimizer, meta={"step": 3})
    step.close()

    fresh = _step(tiny, cfg, dtype="bfloat16")
    load_checkpoint(tmp_path / "ckpt", fresh.model, fresh.optimizer)
    assert all(torch.equal(a, b) for a, b in zip(fresh.optimizer.master_params, masters, strict=True))
    assert all(torch.equal(p.detach().float(), r)
               for p, r in zip(fresh.optimizer.checkpoint_params, rounded, strict=True))
    assert int(next(iter(fresh.optimizer.state.values()))["step"]) == 3
    fresh.close()
