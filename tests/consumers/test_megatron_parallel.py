"""DP=2, EP=2 (both dispatchers) and dense TP=2 over 2 real gloo processes equal one process (CPU, fp32).

The test process computes the single-rank reference, then starts this file as a script on 2 ranks; each rank
writes its results as safetensors/JSON into a temporary folder. No pickle crosses the process boundary.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from safetensors.torch import load_file, save_file  # noqa: E402

from pipeline.consumers.megatron.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron, megatron_to_hf_state_dict  # noqa: E402
from pipeline.consumers.megatron.model import (  # noqa: E402
    allreduce_gradients,
    build_gpt_model,
    forward_logits,
    forward_logprobs,
    init_parallel,
)
from pipeline.consumers.megatron.router_replay import RouterReplay, from_megatron_layers, topk_agreement  # noqa: E402
from pipeline.net import free_port  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks  # noqa: E402

BATCH, SEQ, LR = 4, 24, 0.5
# name -> (moe?, tp, ep, dispatcher)
LAYOUTS = {
    "dp2": (True, 1, 1, "alltoall"),
    "ep2-alltoall": (True, 1, 2, "alltoall"),
    "ep2-allgather": (True, 1, 2, "allgather"),
    "tp2-dense": (False, 2, 1, "alltoall"),
}
TOLERANCE = 1e-5


def _tiny_hf(moe: bool) -> torch.nn.Module:
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    if moe:
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_((0.5 if name.endswith("mlp.gate.weight") else 0.08) * noise)
    return model.float()


def _batch() -> torch.Tensor:
    return torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """One SGD step (linear in the gradient, so parallel and serial updates compare tightly); (logprobs, loss)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    logprobs = forward_logprobs(model, ids, torch.ones_like(ids))
    loss = -logprobs.mean()
    loss.backward()
    allreduce_gradients(model)
    opt.step()
    return logprobs.detach(), float(loss.detach())


def _run_layout(name: str, weights_dir: Path, out_dir: Path, rank: int, world: int) -> None:
    moe, tp, ep, dispatcher = LAYOUTS[name]
    parallel = ParallelConfig(tp=tp, ep=ep, dispatcher=dispatcher, device="cpu")
    folder = weights_dir / ("moe" if moe else "dense")
    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    init_parallel(parallel, seed=5)
    model = build_gpt_model(model_cfg, parallel, r3=moe)
    load_hf_into_megatron(model, folder, model_cfg)
    dp = parallel.dp(world)
    dp_rank = rank // tp  # megatron's default order puts TP innermost
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    tensors = {"rows": torch.arange(BATCH)[rows].contiguous()}
    if moe:
        tensors["replayed"] = _replayed_routing(model, model_cfg, rows)
    logprobs, loss = _step(model, _batch()[rows])
    tensors["logprobs"] = logprobs.contiguous()
    # Collective; rank 0 receives the gathered weights. Cloned: they may be views of the live parameters.
    exported = {k: v.clone() for k, v in megatron_to_hf_state_dict(model, model_cfg).items()}
    if name == "ep2-alltoall":
        tensors.update(_adam_step_and_checkpoint(model, model_cfg, rows, out_dir / "ckpt-ep2"))
    if rank == 0:
        tensors.update({f"w.{k}": v for k, v in exported.items()})
    save_file(tensors, str(out_dir / f"{name}.rank{rank}.safetensors"))
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps({"loss": loss}))


def _global_param_name(name: str, experts_per_rank: int) -> str:
    """Rank-local megatron name with the expert index made global (local index + EP rank * experts per rank)."""
    from megatron.core import parallel_state as ps

    match = re.match(r"^(.*\.local_experts)\.(\d+)\.(.*)$", name)
    if match is None:
        return name
    offset = ps.get_expert_model_parallel_rank() * experts_per_rank
    return f"{match.group(1)}.{int(match.group(2)) + offset}.{match.group(3)}"


def _adam_step_and_checkpoint(
    model: torch.nn.Module, model_cfg: ModelConfig, rows: slice, directory: Path
) -> dict[str, torch.Tensor]:
    """One AdamW step, then a dist-checkpoint of model + optimizer; returns weights and first moments by global name."""
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _batch()[rows]
    (-forward_logprobs(model, ids, torch.ones_like(ids)).mean()).backward()
    allreduce_gradients(model)
    adam.step()
    save_checkpoint(directory, model, adam, meta={"layout": "ep2"})
    per_rank = model_cfg.num_experts // 2
    out = {}
    for name, param in model.named_parameters():
        out[f"a.{_global_param_name(name, per_rank)}"] = param.detach().clone()
        out[f"m.{_global_param_name(name, per_rank)}"] = adam.state[param]["exp_avg"].clone()
    return out


def _target_routing(model_cfg: ModelConfig) -> torch.Tensor:
    """Arbitrary valid routing for the whole batch: distinct experts per token, unlike what the router would pick."""
    gen = torch.Generator().manual_seed(8)
    scores = torch.rand(BATCH, SEQ, model_cfg.num_layers, model_cfg.num_experts, generator=gen)
    return scores.topk(model_cfg.moe_topk, dim=-1).indices


def _replayed_routing(model: torch.nn.Module, model_cfg: ModelConfig, rows: slice) -> torch.Tensor:
    """Replay this rank's rows of the target routing; return the experts the routers actually dispatched to."""
    maps: list[torch.Tensor] = []
    routers = [layer.mlp.router for layer in model.decoder.layers]
    hooks = [router.register_forward_hook(lambda m, i, o: maps.append(o[1])) for router in routers]
    replay = RouterReplay.for_model(model_cfg)
    replay.replay_forward(_target_routing(model_cfg)[rows])
    ids = _batch()[rows]
    with torch.no_grad():
        forward_logprobs(model, ids, torch.ones_like(ids))
    replay.off()
    for hook in hooks:
        hook.remove()
    layers = [m.float().topk(model_cfg.moe_topk, dim=-1).indices for m in maps]
    return from_megatron_layers(layers, ids.shape[0])


def _worker(rank: int, world: int, port: int, weights_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    for name in LAYOUTS:
        _run_layout(name, Path(weights_dir), Path(out_dir), rank, world)
    torch.distributed.destroy_process_group()


def _reference(moe: bool, folder: Path) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel, seed=5)
    model = build_gpt_model(model_cfg, parallel, r3=False)
    load_hf_into_megatron(model, folder, model_cfg)
    logprobs, loss = _step(model, _batch())
    return logprobs, loss, megatron_to_hf_state_dict(model, model_cfg)


def test_two_gloo_ranks_match_one_process(tmp_path: Path) -> None:
    weights, out = tmp_path / "weights", tmp_path / "out"
    out.mkdir()
    for moe in (True, False):
        _tiny_hf(moe).save_pretrained(weights / ("moe" if moe else "dense"))

    port = free_port()
    refs = {moe: _reference(moe, weights / ("moe" if moe else "dense")) for moe in (True, False)}
    procs = start_ranks(__file__, ["2", str(port), str(weights), str(out)])
    finish_ranks(procs, timeout_s=240)

    for name, (moe, *_rest) in LAYOUTS.items():
        ref_logprobs, ref_loss, ref_weights = refs[moe]
        ranks = [load_file(str(out / f"{name}.rank{r}.safetensors")) for r in range(2)]
        losses = [json.loads((out / f"{name}.rank{r}.json").read_text())["loss"] for r in range(2)]
        logprob_diff = max((t["logprobs"] - ref_logprobs[t["rows"]]).abs().max().item() for t in ranks)
        loss_diff = abs(sum(losses) / 2 - ref_loss)
        weight_diff = max((ranks[0][f"w.{k}"] - v).abs().max().item() for k, v in ref_weights.items())
        print(
            f"{name}: max |logprob diff| {logprob_diff:.2e}, |loss diff| {loss_diff:.2e}, "
            f"max |weight diff after one step| {weight_diff:.2e} (tolerance {TOLERANCE:.0e})"
        )
        assert logprob_diff < TOLERANCE and loss_diff < TOLERANCE and weight_diff < TOLERANCE
        assert set(k[2:] for k in ranks[0] if k.startswith("w.")) == set(ref_weights)
        if moe:
            target = _target_routing(ModelConfig.from_hf(json.loads((weights / "moe" / "config.json").read_text())))
            agreement = min(topk_agreement(t["replayed"], target[t["rows"]]) for t in ranks)
            print(f"{name}: R3 replay top-k agreement per rank (min) {agreement:.4f}")
            assert agreement == 1.0
        # The step moved the weights far beyond the tolerance, so equal weights mean equal gradients.
        initial = load_file(str(_initial(weights, moe)))
        assert max((ref_weights[k] - v).abs().max().item() for k, v in initial.items()) > 100 * TOLERANCE
    _assert_ep2_checkpoint_loads_on_one_rank(out, weights)


def _assert_ep2_checkpoint_loads_on_one_rank(out: Path, weights: Path) -> None:
    # Saved by 2 EP ranks (2 experts each), loaded by 1 rank holding all 4: dist-checkpoint reshards the weights and
    # the optimizer moments alike.
    saved = {}
    for r in range(2):
        tensors = load_file(str(out / f"ep2-alltoall.rank{r}.safetensors"))
        saved.update({k: v for k, v in tensors.items() if k[:2] in ("a.", "m.")})
    model_cfg = ModelConfig.from_hf(json.loads((weights / "moe" / "config.json").read_text()), dtype="float32")
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel, seed=123)
    model = build_gpt_model(model_cfg, parallel, r3=False)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert load_checkpoint(out / "ckpt-ep2", model, adam) == {"layout": "ep2"}
    names = dict(model.named_parameters())
    assert len(names) == len([k for k in saved if k.startswith("a.")])
    for name, param in names.items():
        assert torch.equal(param.detach(), saved[f"a.{name}"]), name
        assert torch.equal(adam.state[param]["exp_avg"], saved[f"m.{name}"]), name
        assert int(adam.state[param]["step"]) == 1
    _assert_ep2_checkpoint_exports_to_hf(out, weights, model)


def _assert_ep2_checkpoint_exports_to_hf(out: Path, weights: Path, model: torch.nn.Module) -> None:
    # `sluice export` of the 2-rank EP checkpoint, in its own process at world size 1: transformers loads the folder
    # as it is and gives the logits of the megatron model that loaded the same checkpoint above.
    import shutil

    from pipeline.config import load_config

    run_dir = out / "run"
    shutil.copytree(out / "ckpt-ep2", run_dir / "checkpoints" / "step-00000001")
    cfg = load_config(None, [f"model.path={json.dumps(str(weights / 'moe'))}"])
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    hf_dir = out / "hf-ep2"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "export", "--run-dir", str(run_dir), "--to",
                        str(hf_dir)], capture_output=True, text=True, env=env, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = _batch()
    with torch.no_grad():
        diff = (hf(ids).logits - forward_logits(model.eval(), ids, torch.ones_like(ids))).abs().max().item()
    print(f"EP=2 checkpoint exported on one process: max |HF - megatron| logits {diff:.2e} (tolerance {TOLERANCE:.0e})")
    assert diff < TOLERANCE


def _initial(weights: Path, moe: bool) -> Path:
    return weights / ("moe" if moe else "dense") / "model.safetensors"


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
