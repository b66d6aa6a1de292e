"""The gated attention example (model.spec) under tensor parallelism: 2 real gloo ranks equal one process (CPU, fp32).

The gate is column-parallel over heads, so each TP rank must load, gate, train, export and checkpoint exactly its own
heads' gates. The test process computes the one-process reference, then starts this file as a script on 2 ranks
(TP=2, a dense Qwen3); results come back as safetensors. No pickle crosses the process boundary.
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

from pipeline import plugins  # noqa: E402
from pipeline.net import free_port  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
plugins.activate([ROOT / "examples"])  # as a recipe's plugins.paths would

from pipeline.consumers.megatron.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron, megatron_to_hf_state_dict  # noqa: E402
from pipeline.consumers.megatron.model import (  # noqa: E402
    allreduce_gradients,
    build_gpt_model,
    forward_logprobs,
    init_parallel,
)

pytestmark = pytest.mark.slow
SPEC = "gated_attention:gated_attention"
TOLERANCE = 1e-5


def _batch() -> torch.Tensor:
    return torch.randint(0, 96, (4, 24), generator=torch.Generator().manual_seed(4))


def _build(folder: Path, parallel: ParallelConfig, seed: int = 5) -> tuple[torch.nn.Module, ModelConfig]:
    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    init_parallel(parallel, seed=seed)
    model = build_gpt_model(model_cfg, parallel, r3=False, spec=SPEC)
    return model, model_cfg


def _step(model: torch.nn.Module, model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Log-probs before, then one SGD step (linear in the gradient: parallel and serial compare tightly), then the
    exported HF weights (a collective: every rank calls it; rank 0 gets them)."""
    ids = _batch()
    logprobs = forward_logprobs(model, ids, torch.ones_like(ids))
    (-logprobs.mean()).backward()
    allreduce_gradients(model)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    out = {f"w.{k}": v.clone() for k, v in megatron_to_hf_state_dict(model, model_cfg).items()}
    out["logprobs"] = logprobs.detach()
    return out


def _gated_checkpoint(folder: Path) -> None:
    """A dense Qwen3 with gates that are not 1 (and differ per head), as a model.spec model exports it."""
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64)
    hf = transformers.Qwen3ForCausalLM(cfg).float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.08 * torch.randn(param.shape, generator=gen))
    hf.save_pretrained(folder)
    model, model_cfg = _build(folder, ParallelConfig(device="cpu"))
    load_hf_into_megatron(model, folder, model_cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".linear_gate." in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
    save_file(megatron_to_hf_state_dict(model, model_cfg), str(folder / "model.safetensors"),
              metadata={"format": "pt"})


def _worker(rank: int, port: int, folder: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    model, model_cfg = _build(Path(folder), ParallelConfig(tp=2, device="cpu"))
    load_hf_into_megatron(model, Path(folder), model_cfg)
    tensors = _step(model, model_cfg)
    save_checkpoint(Path(out) / "ckpt-tp2", model, None, meta={"layout": "tp2"})
    if rank == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out) / "tp2.safetensors"))
    torch.distributed.destroy_process_group()


def test_two_tp_ranks_load_gate_train_export_and_checkpoint_like_one_process(tmp_path: Path) -> None:
    folder, out = tmp_path / "gated", tmp_path / "out"
    out.mkdir()
    _gated_checkpoint(folder)
    model, model_cfg = _build(folder, ParallelConfig(device="cpu"))
    load_hf_into_megatron(model, folder, model_cfg)
    ref = _step(model, model_cfg)

    finish_ranks(start_ranks(__file__, [str(free_port()), str(folder), str(out)]))

    tp2 = load_file(str(out / "tp2.safetensors"))
    assert set(tp2) == set(ref)
    gate_names = [k for k in ref if "head_gate" in k]
    assert len(gate_names) == 4 and ref["w.model.layers.0.self_attn.head_gate.weight"].shape == (4, 32)
    diffs = {k: (tp2[k] - ref[k]).abs().max().item() for k in ref}
    print(f"TP=2 vs one process: logprobs {diffs['logprobs']:.2e}, weights after a step "
          f"{max(diffs.values()):.2e}, gates {max(diffs[k] for k in gate_names):.2e}")
    assert max(diffs.values()) < TOLERANCE
    # The step moved the gates far beyond the tolerance: equal gates after it mean equal gate gradients.
    start = load_file(str(folder / "model.safetensors"))
    assert min((ref[k] - start[k[2:]]).abs().max().item() for k in gate_names) > 100 * TOLERANCE

    # The TP=2 dist-checkpoint loads into one process, resharded: the gates are the ones TP=2 exported.
    fresh, _ = _build(folder, ParallelConfig(device="cpu"), seed=99)
    assert load_checkpoint(out / "ckpt-tp2", fresh, None) == {"layout": "tp2"}
    loaded = megatron_to_hf_state_dict(fresh, model_cfg)
    assert max((loaded[k[2:]] - tp2[k]).abs().max().item() for k in gate_names) == 0.0


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
