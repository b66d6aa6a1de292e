"""KL to a frozen reference policy in the train step: real megatron-core on CPU (fp32) with a tiny Qwen3-MoE.

The reference is a second ``GPTModel`` holding the starting weights. These tests check that its KL is exactly 0
while the policy equals it (which also shows that both scored under the same replayed routing), that it grows as the
policy learns, that its gradient pulls a perturbed policy back, that ``kl_coef = 0`` builds and runs nothing extra,
and that 2 gloo ranks (DP=2, EP=2) give the single-rank result. The 2-rank test starts this file as a script.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from pipeline.config.trainer import CorrectionConfig, LossConfig, TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron, megatron_to_hf_state_dict  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, init_parallel  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep, shard_groups  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.models.tiny import init_tiny_model  # noqa: E402
from pipeline.net import free_port  # noqa: E402
from pipeline.queue.sample import Sample  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks, synthetic_groups, tiny_moe  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    return tiny_moe(tmp_path_factory.mktemp("tiny"))


def _models(
    folder: Path, model_cfg: ModelConfig, parallel: ParallelConfig | None = None, *, ref_r3: bool = True
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(policy, reference), both loaded from ``folder``; the reference is built second, as ``build_rank`` does,
    which resets megatron's process-wide replay list to the reference's hooks."""
    parallel = parallel or ParallelConfig(device="cpu")
    init_parallel(parallel, seed=7)
    policy = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(policy, folder, model_cfg)
    reference = build_gpt_model(model_cfg, parallel, r3=ref_r3)
    load_hf_into_megatron(reference, folder, model_cfg)
    return policy, reference


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def test_kl_ref_is_zero_while_policy_equals_reference_then_grows(tiny: tuple[Path, ModelConfig]) -> None:
    folder, model_cfg = tiny
    cfg = TrainStepConfig(lr=3e-4, micro_batch_samples=4, loss=LossConfig(kl_coef=0.05))
    policy, reference = _models(folder, model_cfg)
    start = _weights(reference)
    trainer = TrainStep(policy, model_cfg, cfg, reference=reference)
    forwards: list[int] = []
    handle = reference.register_forward_pre_hook(lambda *_: forwards.append(1))
    groups = synthetic_groups(model_cfg, [4, 4, 4], seed=3, min_response=3)
    history = [trainer.step(groups) for _ in range(4)]
    handle.remove()
    trainer.close()

    kl = [m["kl_ref"] for m in history]
    print(f"kl_ref per step: {[f'{v:.2e}' for v in kl]}, losses {[round(m['loss'], 4) for m in history]}")
    # The routing in the samples is random, not the model's own choice: had the reference scored without the
    # policy's replay (or had the policy's replay reached the reference's routers), step one's KL would not be 0.
    assert history[0]["r3/replayed_samples"] == 11 and history[0]["r3/unreplayed_samples"] == 1
    assert kl[0] == pytest.approx(0.0, abs=1e-7)
    assert 0 < kl[1] < kl[2] < kl[3]
    for m in history:
        assert m["r3/agreement_train"] == 1.0  # the policy's own routers still replay after the reference was built
        assert m["loss"] == pytest.approx(m["pg_loss"] + 0.05 * m["kl_ref"], rel=1e-4, abs=1e-7)
    # One reference forward per micro-batch, nothing more; the reference is frozen and never updated.
    assert len(forwards) == 4 * history[0]["micro_batches"]
    assert all(not p.requires_grad and p.grad is None for p in reference.parameters())
    assert all(torch.equal(v, start[k]) for k, v in _weights(reference).items())
    assert any(not torch.equal(v, start[k]) for k, v in _weights(policy).items())
    assert "reference" not in json.dumps(trainer.state_dict())


def _exact_kl(policy: torch.nn.Module, reference: torch.nn.Module, groups: list[list[Sample]]) -> float:
    """Mean over the loss positions of the exact KL(policy || reference) over the whole vocabulary (free routing):
    an independent measure, where ``kl_ref`` estimates it from the sampled tokens only."""
    from pipeline.consumers.megatron.model import forward_logits
    from pipeline.consumers.rl.batch import collate

    batch = collate(groups)
    with torch.no_grad():
        logp, logq = (
            torch.log_softmax(forward_logits(m, batch.input_ids, batch.attention_mask)[:, :-1].float(), -1)
            for m in (policy, reference)
        )
    return float((logp.exp() * (logp - logq)).sum(-1)[batch.loss_mask].mean())


def _perturbed_run(folder: Path, model_cfg: ModelConfig, kl_coef: float, steps: int) -> tuple[list[dict], float, float]:
    """Train a noised copy of the starting weights on zero-advantage groups: (metrics per step, exact KL to the
    reference before and after)."""
    policy, reference = _models(folder, model_cfg)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=generator))
    cfg = TrainStepConfig(
        lr=0.03,
        micro_batch_samples=6,
        grad_clip=None,
        loss=LossConfig(kl_coef=kl_coef, correction=CorrectionConfig(type="none")),
    )
    opt = torch.optim.SGD(policy.parameters(), lr=cfg.lr)
    trainer = TrainStep(policy, model_cfg, cfg, optimizer=opt, reference=reference if kl_coef > 0 else None)
    groups = synthetic_groups(model_cfg, [4, 4, 4], seed=8, equal_rewards=True, min_response=3)
    # Between steps no replay is armed, so both models route freely here.
    before = _exact_kl(policy, reference, groups)
    history = [trainer.step(groups) for _ in range(steps)]
    trainer.close()
    return history, before, _exact_kl(policy, reference, groups)


def test_kl_gradient_pulls_a_perturbed_policy_back_to_the_reference(tiny: tuple[Path, ModelConfig]) -> None:
    folder, model_cfg = tiny
    history, before, after = _perturbed_run(folder, model_cfg, kl_coef=1.0, steps=5)
    kl = [m["kl_ref"] for m in history]
    print(
        f"zero advantages, kl_coef=1: kl_ref {[f'{v:.3e}' for v in kl]}, exact full-vocabulary KL {before:.4f} -> "
        f"{after:.4f}"
    )
    assert history[0]["advantage_abs_mean"] == 0.0 and history[0]["pg_loss"] == 0.0
    assert kl[0] > 1e-2  # the noise moved the policy off the reference
    assert all(b < a for a, b in zip(kl, kl[1:])) and kl[-1] < 0.25 * kl[0]
    # The estimator's gradient acts through the sampled tokens, yet the whole next-token distribution comes back.
    assert after < 0.9 * before
    # Without the KL term the same batch gives no gradient at all: the policy stays where the noise put it.
    still, before0, after0 = _perturbed_run(folder, model_cfg, kl_coef=0.0, steps=2)
    assert "kl_ref" not in still[0] and still[0]["grad_norm"] == 0.0
    assert after0 == before0


def test_refuses_a_reference_it_cannot_use(tiny: tuple[Path, ModelConfig], caplog: pytest.LogCaptureFixture) -> None:
    folder, model_cfg = tiny
    kl_cfg = TrainStepConfig(loss=LossConfig(kl_coef=0.1))
    policy, reference = _models(folder, model_cfg, ref_r3=False)
    with pytest.raises(ConfigError, match="kl_coef=0.1 needs a reference model"):
        TrainStep(policy, model_cfg, kl_cfg)
    with pytest.raises(ConfigError, match="is the policy model itself"):
        TrainStep(policy, model_cfg, kl_cfg, reference=policy)
    with pytest.raises(ConfigError, match="reference built with build_gpt_model"):
        TrainStep(policy, model_cfg, kl_cfg, reference=reference)  # no replay hooks: could not share routing
    # Without R3 a reference without replay hooks is fine: both models route freely.
    TrainStep(policy, model_cfg, kl_cfg.model_copy(update={"r3": False}), reference=reference).close()
    dense_folder = init_tiny_model("qwen3", folder.parent / "dense", seed=0)
    dense_cfg = ModelConfig.from_hf(json.loads((dense_folder / "config.json").read_text()), dtype="float32")
    other = build_gpt_model(dense_cfg, ParallelConfig(device="cpu"), r3=False)
    with pytest.raises(ConfigError, match="parameters differ"):
        TrainStep(policy, model_cfg, kl_cfg.model_copy(update={"r3": False}), reference=other)
    with caplog.at_level(logging.WARNING):
        ignored = TrainStep(policy, model_cfg, TrainStepConfig(r3=False), reference=reference)
    assert ignored.reference is None and "kl_coef=0" in caplog.text
    ignored.close()


def test_build_rank_builds_a_reference_only_for_a_kl_penalty(tiny: tuple[Path, ModelConfig]) -> None:
    from pipeline.config import SluiceConfig
    from pipeline.consumers.trainer.main import build_rank

    folder, _ = tiny
    plain_cfg = SluiceConfig()
    _, model, optimizer, plain = build_rank(folder, trainer=plain_cfg.trainer, run=plain_cfg.run, model=plain_cfg.model)
    assert plain.reference is None
    plain.close()
    kl = SluiceConfig(trainer={"loss": {"kl_coef": 0.2}})
    model_cfg, model, optimizer, step = build_rank(folder, trainer=kl.trainer, run=kl.run, model=kl.model)
    reference = step.reference
    assert reference is not None and reference is not model
    assert all(not p.requires_grad for p in reference.parameters())
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized.isdisjoint(id(p) for p in reference.parameters())
    ref_hf, policy_hf = megatron_to_hf_state_dict(reference, model_cfg), megatron_to_hf_state_dict(model, model_cfg)
    assert set(ref_hf) == set(policy_hf) and all(torch.equal(ref_hf[k], policy_hf[k]) for k in ref_hf)
    step.close()


# --- 2 gloo ranks equal 1 rank -------------------------------------------------------------------------------------

LAYOUTS = {"dp2": (1, "alltoall"), "ep2-alltoall": (2, "alltoall"), "ep2-allgather": (2, "allgather")}
GROUP_SIZES = [3, 2, 4, 3]
STEPS = 2
TOLERANCE = 1e-5


def _parallel_cfg() -> TrainStepConfig:
    # SGD: the update is linear in the gradient, so serial and parallel runs compare tightly.
    return TrainStepConfig(lr=1.0, micro_batch_samples=2, grad_clip=0.05, loss=LossConfig(kl_coef=0.5))


def _train(folder: Path, parallel: ParallelConfig | None = None) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    policy, reference = _models(folder, model_cfg, parallel)
    trainer = TrainStep(
        policy, model_cfg, _parallel_cfg(), optimizer=torch.optim.SGD(policy.parameters(), lr=1.0), reference=reference
    )
    groups = synthetic_groups(model_cfg, GROUP_SIZES, seed=11, min_response=3)
    mine = shard_groups(groups, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    history = [trainer.step(mine) for _ in range(STEPS)]
    weights = {k: v.clone().contiguous() for k, v in megatron_to_hf_state_dict(policy, model_cfg).items()}
    trainer.close()
    return history, weights


def _worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    from safetensors.torch import save_file

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    for name, (ep, dispatcher) in LAYOUTS.items():
        parallel = ParallelConfig(ep=ep, dispatcher=dispatcher, device="cpu")  # type: ignore[arg-type]
        history, weights = _train(Path(folder), parallel)
        if rank == 0:
            save_file(weights, str(Path(out) / f"{name}.safetensors"))
            (Path(out) / f"{name}.json").write_text(json.dumps(history))
    torch.distributed.destroy_process_group()


def test_two_gloo_ranks_give_the_single_rank_kl(tiny: tuple[Path, ModelConfig], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder, _ = tiny
    port = free_port()
    procs = start_ranks(__file__, ["2", str(port), str(folder), str(tmp_path)])
    ref_history, ref_weights = _train(folder)  # one rank, the whole batch, while the workers start
    finish_ranks(procs, timeout_s=240)

    assert ref_history[0]["kl_ref"] == pytest.approx(0.0, abs=1e-7) and ref_history[1]["kl_ref"] > 1e-4
    for name in LAYOUTS:
        history = json.loads((tmp_path / f"{name}.json").read_text())
        weights = load_file(str(tmp_path / f"{name}.safetensors"))
        weight_diff = max((weights[k] - v).abs().max().item() for k, v in ref_weights.items())
        diffs = [
            abs(got[k] - ref[k])
            for got, ref in zip(history, ref_history, strict=True)
            for k in ("kl_ref", "loss", "grad_norm")
        ]
        kl = ", ".join(f"{m['kl_ref']:.3e}" for m in history)
        print(f"{name}: kl_ref [{kl}], max |weight diff| {weight_diff:.1e}, max metric diff {max(diffs):.1e}")
        assert set(weights) == set(ref_weights)
        assert weight_diff < TOLERANCE and max(diffs) < TOLERANCE


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
