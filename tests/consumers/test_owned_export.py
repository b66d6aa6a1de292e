"""Exporting from owners over 2 real gloo ranks: every HF tensor comes from exactly one rank, together they are the
model bit for bit, each rank sends about half the bytes at EP=2, and no rank receives a byte it does not send.

The same counts are taken of the rank-0 export (``iter_hf_weights``): rank 1 receives nothing either. The test
process starts this file as a script on 2 ranks; each writes safetensors and JSON into a temporary folder.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from safetensors.torch import load_file, save_file  # noqa: E402

from pipeline.benchmarks.export_bytes import ReceivedBytes  # noqa: E402 - the same counting as the benchmark
from pipeline.net import free_port  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks  # noqa: E402

# name -> (moe?, tp, ep)
LAYOUTS = {"ep2": (True, 1, 2), "dp2": (True, 1, 1), "tp2-dense": (False, 2, 1)}  # MoE with TP needs TE on CPU


def _tiny_hf(moe: bool) -> torch.nn.Module:
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    if moe:
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **common)
        return transformers.Qwen3MoeForCausalLM(cfg).float()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common)).float()


def _run_layout(name: str, weights_dir: Path, out_dir: Path, rank: int, received: ReceivedBytes) -> None:
    from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig
    from pipeline.consumers.megatron.convert import iter_hf_weights, load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel
    from pipeline.consumers.megatron.owners import OwnedExport

    moe, tp, ep = LAYOUTS[name]
    folder = weights_dir / ("moe" if moe else "dense")
    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    init_parallel(ParallelConfig(tp=tp, ep=ep, device="cpu"), seed=5)
    model = build_gpt_model(model_cfg, ParallelConfig(tp=tp, ep=ep, device="cpu"), r3=False)
    load_hf_into_megatron(model, folder, model_cfg)
    exporter = OwnedExport(model, model_cfg)
    received.take()
    owned = {k: v.clone() for k, v in exporter()}
    owned_received = received.take()
    root = {k: v.clone() for k, v in iter_hf_weights(model, model_cfg)}
    root_received = received.take()
    save_file({f"o.{k}": v for k, v in owned.items()} | {f"r.{k}": v for k, v in root.items()},
              str(out_dir / f"{name}.rank{rank}.safetensors"))
    sent = sum(t.numel() * t.element_size() for t in owned.values())
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps({
        "owned_sent": sent, "owned_received": owned_received, "root_received": root_received,
        "planned": exporter.share_bytes}))


def _worker(rank: int, world: int, port: int, weights_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    received = ReceivedBytes()
    for name in LAYOUTS:
        _run_layout(name, Path(weights_dir), Path(out_dir), rank, received)
    torch.distributed.destroy_process_group()


def test_owners_export_the_model_once_and_receive_only_what_they_send(tmp_path: Path) -> None:
    weights, out = tmp_path / "weights", tmp_path / "out"
    out.mkdir()
    for moe in (True, False):
        _tiny_hf(moe).save_pretrained(weights / ("moe" if moe else "dense"))
    procs = start_ranks(__file__, ["2", str(free_port()), str(weights), str(out)])
    finish_ranks(procs, timeout_s=300)

    for name, (moe, _tp, _ep) in LAYOUTS.items():
        reference = load_file(str(weights / ("moe" if moe else "dense") / "model.safetensors"))
        ranks = [load_file(str(out / f"{name}.rank{r}.safetensors")) for r in range(2)]
        stats = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]
        owned = [{k[2:]: v for k, v in t.items() if k.startswith("o.")} for t in ranks]
        assert not set(owned[0]) & set(owned[1]), f"{name}: a tensor was sent by both ranks"
        union = owned[0] | owned[1]
        root = {k[2:]: v for k, v in ranks[0].items() if k.startswith("r.")}
        assert not any(k.startswith("r.") for k in ranks[1]), f"{name}: the rank-0 export yielded on rank 1"
        expected = _per_expert(reference, moe)
        assert set(union) == set(expected) == set(root), name
        for key, tensor in expected.items():
            assert torch.equal(union[key], tensor) and torch.equal(root[key], tensor), f"{name}: {key} differs"
        total = sum(s["owned_sent"] for s in stats)
        shares = [s["owned_sent"] / total for s in stats]
        print(f"{name}: share of the bytes sent per rank {shares[0]:.3f} / {shares[1]:.3f}; received by gathers "
              f"(owners) {[s['owned_received'] for s in stats]}, (rank 0 alone) {[s['root_received'] for s in stats]}")
        for s in stats:
            assert s["owned_received"] <= s["owned_sent"], f"{name}: a rank received bytes it does not send"
            assert s["planned"] == s["owned_sent"], f"{name}: the plan's bytes are not what the rank sent"
        assert stats[1]["root_received"] == 0, f"{name}: rank 1 received bytes for rank 0's export"
        assert max(shares) < 0.62, f"{name}: the owners' shares are unbalanced: {shares}"


def _per_expert(state: dict[str, torch.Tensor], moe: bool) -> dict[str, torch.Tensor]:
    from pipeline.consumers.megatron.convert import unfuse_hf_experts

    return dict(unfuse_hf_experts(state)) if moe else dict(state)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
