"""The trainer replays compact routing exactly as plain routing: bit-identical log-probs through megatron-core's
router replay, on a top-8 model where the order of ids within a row changes the last bits (so a codec that sorted
them, or lost anything else, would fail here)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from pipeline.config.trainer import TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, init_parallel  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.models.tiny import init_tiny_model  # noqa: E402
from pipeline.producers.cpu_engine.routing import RoutingRecorder  # noqa: E402
from pipeline.queue import Sample, SamplingInfo, compact_routing, decode_samples, encode_samples  # noqa: E402

EXPERTS, TOPK = 32, 8


def _group(hf: torch.nn.Module, prompt: list[int], size: int, new: int, gen: torch.Generator) -> list[Sample]:
    out = []
    for i in range(size):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new):
                logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].float()
                ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
            recorder = RoutingRecorder(hf)
            fed = torch.tensor([ids[:-1]])
            logits = hf(input_ids=fed).logits[0].float()
            routing = recorder.take(1, fed.shape[1])[0]
            recorder.close()
        p = len(prompt)
        logprobs = logits.log_softmax(-1)[p - 1:].gather(-1, torch.tensor(ids[p:])[:, None])[:, 0]
        out.append(Sample(
            prompt_ids=np.array(prompt, np.int32), response_ids=np.array(ids[p:], np.int32),
            rollout_logprobs=logprobs.numpy().astype(np.float32), token_versions=np.zeros(new, np.int32),
            routed_experts=compact_routing(routing.numpy(), EXPERTS), reward=float(i % 2), index=i,
            sampling=SamplingInfo(temperature=1.0, max_new_tokens=new),
        ))
    return out


def test_compact_and_plain_routing_replay_to_bit_identical_logprobs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = init_tiny_model("qwen3-moe", tmp_path / "tiny", seed=0, num_experts=EXPERTS, num_experts_per_tok=TOPK)
    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    groups = [_group(hf, [5, 9, 13, 21, 8, 30], 4, 10, gen), _group(hf, [7, 7, 40, 2], 4, 12, gen)]

    init_parallel(ParallelConfig(device="cpu"), seed=3)
    model = build_gpt_model(model_cfg, ParallelConfig(device="cpu"), r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    with torch.no_grad():  # the trainer has moved on since generation, so its own routing differs from the replay
        for param in model.parameters():
            param.add_(0.05 * param.std() * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    trainer = TrainStep(model, model_cfg, TrainStepConfig(r3=True))
    try:
        compact = [decode_samples(encode_samples(g, routing="compact")) for g in groups]
        plain = [decode_samples(encode_samples(g, routing="plain")) for g in groups]
        from_compact = trainer.compute_logprobs(compact, replay=True)
        from_plain = trainer.compute_logprobs(plain, replay=True)
        # The same sets in another order within each row: megatron softmaxes the top-k in the given order.
        reordered = [[Sample(**{**s.__dict__, "routed_experts": np.ascontiguousarray(np.sort(s.routed_experts, -1))})
                      for s in g] for g in groups]
        from_sorted = trainer.compute_logprobs(reordered, replay=True)
    finally:
        trainer.close()
    assert all(np.array_equal(a, b) for a, b in zip(from_compact, from_plain, strict=True))
    worst = max(float(np.abs(a - b).max()) for a, b in zip(from_sorted, from_plain, strict=True))
    print(f"max |log-prob| change from sorting each row's ids before replay: {worst:.2e}")
    assert worst > 0
