"""DeepSeek-V3 family: DP=2 and EP=2 (both dispatchers) over 2 real gloo processes equal one process (CPU, fp32).

As tests/consumers/test_megatron_parallel.py does for Qwen3-MoE: the test process computes the single-rank reference, then
starts this file as a script on 2 ranks, which write safetensors/JSON into a temporary folder (no pickle crosses the
process boundary). One step is a forward, an SGD update (linear in the gradient, so parallel and serial updates
compare tightly) and the expert-bias update, whose token counts must add up over the ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from safetensors.torch import load_file, save_file  # noqa: E402

from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron, megatron_to_hf_state_dict  # noqa: E402
from pipeline.consumers.megatron.expert_bias import update_expert_bias  # noqa: E402
from pipeline.consumers.megatron.model import (  # noqa: E402
    allreduce_gradients,
    build_gpt_model,
    forward_logprobs,
    init_parallel,
)
from pipeline.consumers.megatron.router_replay import RouterReplay, from_megatron_layers, topk_agreement  # noqa: E402
from pipeline.net import free_port  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks  # noqa: E402

BATCH, SEQ, LR, BIAS_RATE = 4, 24, 0.5, 0.01
LAYOUTS = {"dp2": (1, "alltoall"), "ep2-alltoall": (2, "alltoall"), "ep2-allgather": (2, "allgather")}
TOLERANCE = 1e-5


def _config(folder: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")


def _batch(vocab: int) -> torch.Tensor:
    # No special tokens: HF leaves the pad token's embedding at zero, where RMSNorm's gradient is 1/sqrt(eps) large
    # and float rounding alone exceeds the tolerance; real batches never feed a pad token as a real one.
    return torch.randint(4, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    logprobs = forward_logprobs(model, ids, torch.ones_like(ids))
    loss = -logprobs.mean()
    loss.backward()
    allreduce_gradients(model)
    opt.step()
    update_expert_bias(model, BIAS_RATE)
    return logprobs.detach(), float(loss)


def _target_routing(model_cfg: ModelConfig) -> torch.Tensor:
    gen = torch.Generator().manual_seed(8)
    scores = torch.rand(BATCH, SEQ, model_cfg.num_moe_layers, model_cfg.num_experts, generator=gen)
    return scores.topk(model_cfg.moe_topk, dim=-1).indices


def _replayed(model: torch.nn.Module, model_cfg: ModelConfig, rows: slice) -> torch.Tensor:
    maps: list[torch.Tensor] = []
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    hooks = [router.register_forward_hook(lambda m, i, o: maps.append(o[1])) for router in routers]
    replay = RouterReplay.for_model(model_cfg)
    replay.replay_forward(_target_routing(model_cfg)[rows])
    ids = _batch(model_cfg.vocab_size)[rows]
    with torch.no_grad():
        forward_logprobs(model, ids, torch.ones_like(ids))
    replay.off()
    for hook in hooks:
        hook.remove()
    return from_megatron_layers([m.float().topk(model_cfg.moe_topk, dim=-1).indices for m in maps], ids.shape[0])


def _run_layout(name: str, folder: Path, out: Path, rank: int, world: int) -> None:
    ep, dispatcher = LAYOUTS[name]
    parallel = ParallelConfig(ep=ep, dispatcher=dispatcher, device="cpu")
    model_cfg = _config(folder)
    init_parallel(parallel, seed=5)
    model = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    tensors = {"rows": torch.arange(BATCH)[rows].contiguous(), "replayed": _replayed(model, model_cfg, rows)}
    logprobs, loss = _step(model, _batch(model_cfg.vocab_size)[rows])
    tensors["logprobs"] = logprobs.contiguous()
    exported = {k: v.clone() for k, v in megatron_to_hf_state_dict(model, model_cfg).items()}
    if rank == 0:
        tensors.update({f"w.{k}": v for k, v in exported.items()})
    save_file(tensors, str(out / f"{name}.rank{rank}.safetensors"))
    (out / f"{name}.rank{rank}.json").write_text(json.dumps({"loss": loss}))


def _worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    for name in LAYOUTS:
        _run_layout(name, Path(folder), Path(out), rank, world)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tmp_path: Path) -> None:
    from pipeline.models.tiny import init_tiny_model

    folder = init_tiny_model("deepseek-v3", tmp_path / "model", seed=0)
    out = tmp_path / "out"
    out.mkdir()
    model_cfg = _config(folder)
    init_parallel(ParallelConfig(device="cpu"), seed=5)
    reference = build_gpt_model(model_cfg, ParallelConfig(device="cpu"), r3=False)
    load_hf_into_megatron(reference, folder, model_cfg)
    ref_logprobs, ref_loss = _step(reference, _batch(model_cfg.vocab_size))
    ref_weights = megatron_to_hf_state_dict(reference, model_cfg)

    port = free_port()
    procs = start_ranks(__file__, ["2", str(port), str(folder), str(out)])
    finish_ranks(procs, timeout_s=300)

    initial = load_file(str(folder / "model.safetensors"))
    biases = [k for k in ref_weights if k.endswith("e_score_correction_bias")]
    assert len(biases) == model_cfg.num_moe_layers
    assert all(not torch.equal(ref_weights[k], initial[k]) for k in biases)  # the bias update moved them
    target = _target_routing(model_cfg)
    for name in LAYOUTS:
        ranks = [load_file(str(out / f"{name}.rank{r}.safetensors")) for r in range(2)]
        losses = [json.loads((out / f"{name}.rank{r}.json").read_text())["loss"] for r in range(2)]
        logprob_diff = max((t["logprobs"] - ref_logprobs[t["rows"]]).abs().max().item() for t in ranks)
        loss_diff = abs(sum(losses) / 2 - ref_loss)
        weight_diff = max((ranks[0][f"w.{k}"] - v).abs().max().item() for k, v in ref_weights.items())
        bias_diff = max((ranks[0][f"w.{k}"] - ref_weights[k]).abs().max().item() for k in biases)
        agreement = min(topk_agreement(t["replayed"], target[t["rows"]]) for t in ranks)
        print(f"deepseek-v3 {name}: max |logprob diff| {logprob_diff:.2e}, |loss diff| {loss_diff:.2e}, max |weight "
              f"diff after one step| {weight_diff:.2e}, expert bias {bias_diff:.1e} (tolerance {TOLERANCE:.0e}); R3 "
              f"replay agreement {agreement:.4f}")
        assert logprob_diff < TOLERANCE and loss_diff < TOLERANCE and weight_diff < TOLERANCE
        assert bias_diff == 0.0 and agreement == 1.0
        assert set(k[2:] for k in ranks[0] if k.startswith("w.")) == set(ref_weights)
    assert max((ref_weights[k] - v).abs().max().item() for k, v in initial.items()) > 100 * TOLERANCE


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
