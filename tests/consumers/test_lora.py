"""LoRA adapters on the real megatron-core tiny Qwen3-MoE (fp32, CPU): a fresh adapter changes nothing, training moves
only the adapters, the merged weights reproduce the adapted model, untargeted parts of a fused linear stay zero, and
two TP ranks train the same adapters as one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from pipeline.config.trainer import CorrectionConfig, LossConfig, TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron, megatron_to_hf_state_dict  # noqa: E402
from pipeline.consumers.megatron.lora import (  # noqa: E402
    LoRASpec,
    apply_lora,
    lora_linears,
    lora_state_dict,
    merge_lora,
)
from pipeline.consumers.megatron.lora_export import iter_hf_adapters  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, init_parallel  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.models.tiny import init_tiny_model  # noqa: E402
from pipeline.net import free_port  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks, synthetic_groups, tiny_moe  # noqa: E402

ALL_MOE = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj")
ALL_DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CFG = TrainStepConfig(lr=1e-2, micro_batch_samples=4, grad_clip=1.0,
                      loss=LossConfig(correction=CorrectionConfig(type="none")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    return tiny_moe(tmp_path_factory.mktemp("tiny"))


def _trainer(folder: Path, model_cfg: ModelConfig, spec: LoRASpec | None, cfg: TrainStepConfig = CFG,
             parallel: ParallelConfig | None = None, sgd: bool = False) -> tuple[TrainStep, list[str]]:
    parallel = parallel or ParallelConfig(device="cpu")
    init_parallel(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    added = apply_lora(model, spec, seed=3) if spec is not None else []
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr) if sgd else None
    return TrainStep(model, model_cfg, cfg, optimizer=opt), added


def _routed(model_cfg: ModelConfig, seed: int) -> list[list]:
    # Replayed routing pins the experts, so models whose hidden states differ by rounding route the same.
    return [[s for s in g if s.routed_experts is not None] for g in synthetic_groups(model_cfg, [4, 4, 4], seed)]


def _cat(logprobs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(logprobs)


def test_unknown_targets_are_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="q_proj.*experts.down_proj"):
        LoRASpec(targets=("q_proj", "qkv"))
    with pytest.raises(ConfigError, match="rank"):
        LoRASpec(rank=0)


def test_a_target_the_model_lacks_is_refused(tiny: tuple[Path, ModelConfig]) -> None:
    folder, model_cfg = tiny
    init_parallel(ParallelConfig(device="cpu"), seed=7)
    model = build_gpt_model(model_cfg, ParallelConfig(device="cpu"), r3=True)
    with pytest.raises(ConfigError, match=r"\['gate_proj'\] match no linear"):
        apply_lora(model, LoRASpec(targets=("q_proj", "gate_proj")), seed=0)


def test_fresh_adapters_change_no_log_prob_and_no_exported_weight(tiny: tuple[Path, ModelConfig]) -> None:
    folder, model_cfg = tiny
    groups = _routed(model_cfg, seed=1)
    base, _ = _trainer(folder, model_cfg, None)
    base_lp = _cat(base.compute_logprobs(groups, replay=True))
    base_export = megatron_to_hf_state_dict(base.model, model_cfg)
    base.close()
    lora, added = _trainer(folder, model_cfg, LoRASpec(rank=4, targets=ALL_MOE))
    lora_lp = _cat(lora.compute_logprobs(groups, replay=True))
    export = megatron_to_hf_state_dict(lora.model, model_cfg)
    lora.close()
    # Per layer: linear_qkv, linear_proj and each of 8 experts' fc1 and fc2, an A and a B on each.
    assert len(added) == 2 * 18 * model_cfg.num_layers
    assert all(torch.count_nonzero(p) > 0 for n, p in lora_state_dict(lora.model).items() if n.endswith("lora_a"))
    assert np.array_equal(lora_lp, base_lp)
    # The export skips the adapters and holds the base weights, bit for bit.
    assert set(export) == set(base_export)
    assert all(torch.equal(export[k], v) for k, v in base_export.items())


def test_training_moves_only_the_adapters_and_merged_weights_reproduce_it(tiny: tuple[Path, ModelConfig]) -> None:
    folder, model_cfg = tiny
    lora, added = _trainer(folder, model_cfg, LoRASpec(rank=4, alpha=8.0, targets=ALL_MOE))
    base = {n: p.detach().clone() for n, p in lora.model.named_parameters() if ".lora_" not in n}
    groups = synthetic_groups(model_cfg, [4, 4, 4], seed=3)
    snapshots = [{k: v.clone() for k, v in lora_state_dict(lora.model).items()}]
    for _ in range(3):
        metrics = lora.step(groups)
        assert metrics["skipped_step"] == 0 and metrics["grad_norm"] > 0
        snapshots.append({k: v.clone() for k, v in lora_state_dict(lora.model).items()})

    assert all(torch.equal(p, base[n]) for n, p in lora.model.named_parameters() if ".lora_" not in n)
    assert all(not p.requires_grad for n, p in lora.model.named_parameters() if ".lora_" not in n)
    # Adam holds state for the adapters alone: one entry per adapter parameter, none for the frozen base.
    state = lora.optimizer.state
    assert len(state) == len(added) and sum(1 for g in lora.optimizer.param_groups for _ in g["params"]) == len(added)
    bs = [k for k in added if k.endswith("lora_b")]
    moved = [sum(float((b[k] - a[k]).abs().max()) for k in bs) for a, b in zip(snapshots, snapshots[1:], strict=False)]
    print(f"{len(added)} adapter tensors; sum of per-B max change per step {[f'{m:.2e}' for m in moved]}")
    assert all(torch.count_nonzero(snapshots[-1][k]) > 0 for k in bs) and all(m > 0 for m in moved)

    routed = _routed(model_cfg, seed=4)
    adapted = _cat(lora.compute_logprobs(routed, replay=True))
    merged = merge_lora(lora.model)
    lora.close()
    plain, _ = _trainer(folder, model_cfg, None)
    before = _cat(plain.compute_logprobs(routed, replay=True))
    with torch.no_grad():
        for name, weight in merged.items():
            plain.model.get_parameter(name).copy_(weight)
    after = _cat(plain.compute_logprobs(routed, replay=True))
    plain.close()
    diff, shift = float(np.abs(after - adapted).max()), float(np.abs(before - adapted).max())
    print(f"merged vs adapted log-probs: max |diff| {diff:.2e} (the adapters moved them by {shift:.2e})")
    assert shift > 1e-3 and diff < 1e-5


def test_q_only_adapters_leave_the_k_and_v_rows_of_the_fused_qkv_zero(tiny: tuple[Path, ModelConfig]) -> None:
    folder, model_cfg = tiny
    lora, added = _trainer(folder, model_cfg, LoRASpec(rank=4, targets=("q_proj",)))
    assert len(added) == 2 * model_cfg.num_layers
    for _ in range(2):
        lora.step(synthetic_groups(model_cfg, [4, 4], seed=5))
    config = lora.model.config
    per_group, d = config.num_attention_heads // config.num_query_groups, config.kv_channels
    for name, linear in lora_linears(lora.model).items():
        rows = linear.lora_b.detach().view(config.num_query_groups, (per_group + 2) * d, -1)
        assert torch.count_nonzero(rows[:, : per_group * d]) > 0, name
        assert torch.count_nonzero(rows[:, per_group * d:]) == 0, name  # k and v rows, exactly zero
        merged = merge_lora(lora.model)[f"{name}.weight"].view_as(rows[..., :1].expand(-1, -1, linear.weight.shape[1]))
        base = linear.weight.detach().view_as(merged)
        assert torch.equal(merged[:, per_group * d:], base[:, per_group * d:])
    lora.close()


# -------------------------------------------------------------------------------------------- TP = 2 over gloo


def _full_adapters(model: torch.nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """Every adapter whole (gathered over TP on every rank), GLU fc1's B joined as [all gate rows; all up rows]."""
    import torch.distributed as dist

    out = {}
    for name, p in model.named_parameters():
        if ".lora_" not in name:
            continue
        # The TP tags live on the parameter, not on detached views (lora_state_dict's).
        if tp == 1 or not getattr(p, "tensor_model_parallel", False):
            out[name] = p.detach().clone()
            continue
        parts = [torch.empty_like(p.detach()) for _ in range(tp)]
        dist.all_gather(parts, p.detach().contiguous())
        dim = p.partition_dim
        if "linear_fc1" in name:
            gates, ups = zip(*(t.chunk(2, dim=dim) for t in parts), strict=True)
            parts = [*gates, *ups]
        out[name] = torch.cat(parts, dim=dim)
    return out


def _tp_run(folder: Path, tp: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Two steps at this TP size: the metrics, every adapter whole, and (prefixed ``push/``) the adapters as the push
    exports them by HF name, gathered over TP to rank 0."""
    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    # SGD is linear in the gradient and the tight clip makes the step depend on the global norm across TP.
    cfg = TrainStepConfig(lr=1.0, micro_batch_samples=2, grad_clip=0.05, loss=LossConfig(entropy_coef=0.01))
    trainer, _ = _trainer(folder, model_cfg, LoRASpec(rank=4, targets=ALL_DENSE), cfg,
                          ParallelConfig(tp=tp, device="cpu"), sgd=True)
    groups = synthetic_groups(model_cfg, [3, 2, 4], seed=11)
    metrics = trainer.step(groups)
    metrics = {**metrics, **{f"again/{k}": v for k, v in trainer.step(groups).items()}}
    adapters = _full_adapters(trainer.model, tp)
    adapters.update({f"push/{name}": t.clone() for name, t in iter_hf_adapters(trainer.model, model_cfg)})
    trainer.close()
    return metrics, adapters


def _worker(rank: int, port: int, folder: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    metrics, adapters = _tp_run(Path(folder), tp=2)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in adapters.items()}, str(Path(out) / "tp2.safetensors"))
        (Path(out) / "tp2.json").write_text(json.dumps(metrics))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_tp_ranks_train_the_single_rank_adapters(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder = init_tiny_model("qwen3", tmp_path / "qwen3", seed=0)
    out = tmp_path / "out"
    out.mkdir()
    procs = start_ranks(__file__, [str(free_port()), str(folder), str(out)])
    ref_metrics, ref = _tp_run(folder, tp=1)
    finish_ranks(procs, timeout_s=240)
    got, metrics = load_file(str(out / "tp2.safetensors")), json.loads((out / "tp2.json").read_text())
    assert set(got) == set(ref)
    # The push's export gathers each TP-split factor to rank 0 and splits fused linears by HF projection.
    assert sum(k.startswith("push/") for k in ref) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    diff = max(float((got[k] - v).abs().max()) for k, v in ref.items())
    moved = max(float(v.abs().max()) for k, v in ref.items() if k.endswith("lora_b"))
    norms = (metrics["grad_norm"], ref_metrics["grad_norm"], metrics["again/grad_norm"], ref_metrics["again/grad_norm"])
    print(f"TP=2 vs TP=1 adapters after 2 steps: max |diff| {diff:.2e} (largest B entry {moved:.2e}); grad norms "
          f"{norms}, clip coef {ref_metrics['grad_clip_coef']:.3f}")
    assert ref_metrics["grad_clip_coef"] < 1.0 and moved > 1e-3
    assert diff < 1e-5
    for key in ("loss", "grad_norm", "again/loss", "again/grad_norm"):
        assert abs(metrics[key] - ref_metrics[key]) < 1e-5, key


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
