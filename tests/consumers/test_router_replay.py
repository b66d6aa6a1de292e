"""R3: megatron-core's built-in router replay, driven through sluice's wrapper, on a real tiny Qwen3-MoE (CPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, forward_logprobs, init_parallel  # noqa: E402
from pipeline.consumers.megatron.router_replay import (  # noqa: E402
    RouterReplay,
    from_megatron_layers,
    pad_routing,
    to_megatron_layers,
    topk_agreement,
)
from pipeline.errors import ConfigError, SampleError  # noqa: E402

VOCAB, EXPERTS, TOPK, LAYERS = 96, 8, 2, 2


# --- conversion and agreement (pure functions) -------------------------------------------------------------------


def test_layers_are_sequence_major() -> None:
    batch, seq = 3, 5
    routing = torch.zeros(batch, seq, 2, 1, dtype=torch.int64)
    for b in range(batch):
        for s in range(seq):
            routing[b, s, 0, 0] = 10 * b + s
            routing[b, s, 1, 0] = 100 + 10 * b + s
    layers = to_megatron_layers(routing)
    assert len(layers) == 2 and layers[0].shape == (seq * batch, 1)
    for b in range(batch):
        for s in range(seq):
            assert layers[0][s * batch + b, 0] == 10 * b + s
            assert layers[1][s * batch + b, 0] == 100 + 10 * b + s
    assert torch.equal(from_megatron_layers(layers, batch), routing)
    # A sequence-parallel rank sees only its contiguous slice of positions.
    sp = to_megatron_layers(routing[:, :4], sp_rank=1, sp_size=2)
    assert sp[0][:, 0].tolist() == [2, 12, 22, 3, 13, 23]


def test_pad_routing_fills_valid_distinct_experts() -> None:
    a = np.array([[[3, 1]], [[0, 2]]], dtype=np.uint8)  # 2 tokens, 1 layer, top-2
    b = np.array([[[5, 4]]], dtype=np.uint16)
    out = pad_routing([a, b], 4, num_layers=1, topk=2, num_experts=6)
    assert out.dtype == torch.int64 and out.shape == (2, 4, 1, 2)
    assert out[0, :2].tolist() == [[[3, 1]], [[0, 2]]]
    assert out[0, 2:].tolist() == [[[0, 1]], [[0, 1]]]
    assert out[1, 0].tolist() == [[5, 4]] and out[1, 1:].tolist() == [[[0, 1]]] * 3


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.zeros((2, 2, 2), dtype=np.uint8), r"shape"),
        (np.array([[[1, 9]]], dtype=np.uint8), r"outside"),
        (np.array([[[2, 2]]], dtype=np.uint8), r"repeats"),
        (np.tile(np.array([[[0, 1]]], dtype=np.uint8), (5, 1, 1)), r"more than seq"),
    ],
)
def test_pad_routing_rejects_malformed(bad: np.ndarray, message: str) -> None:
    with pytest.raises(SampleError, match=message):
        pad_routing([bad], 4, num_layers=1, topk=2, num_experts=6)


def test_topk_agreement_ignores_order_and_respects_mask() -> None:
    ref = torch.tensor([[[[0, 1]], [[2, 3]], [[4, 5]]]])  # [1, 3, 1, 2]
    got = torch.tensor([[[[1, 0]], [[2, 4]], [[0, 1]]]])
    assert topk_agreement(got, ref) == pytest.approx(1 / 3)
    assert topk_agreement(got, ref, torch.tensor([[1, 0, 0]])) == 1.0
    assert topk_agreement(got, ref, torch.tensor([[0, 1, 1]])) == 0.0
    with pytest.raises(ConfigError):
        topk_agreement(got, ref, torch.zeros(1, 3))


# --- against megatron-core -----------------------------------------------------------------------------------------


def _tiny_hf(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                # A small router spread keeps several experts close, as in real checkpoints, so routing is sensitive
                # to weight changes and precision.
                std = 0.1 if name.endswith("mlp.gate.weight") else 0.08
                param.copy_(std * torch.randn(param.shape, generator=gen))
    return model.float().eval()


def _hf_routing(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The HF model's own top-k experts, [batch, seq, layers, topk]."""
    with torch.no_grad():
        out = hf(input_ids=ids, output_router_logits=True)
    batch, seq = ids.shape
    per_layer = [
        logits.float().softmax(-1).topk(TOPK, dim=-1).indices.reshape(batch, seq, TOPK) for logits in out.router_logits
    ]
    return torch.stack(per_layer, dim=2)


class _RoutingProbe:
    """Captures the experts each megatron router actually dispatched to (its routing_map), not RouterReplay's notes."""

    def __init__(self, mg: torch.nn.Module) -> None:
        self.maps: list[torch.Tensor] = []
        self.handles = [layer.mlp.router.register_forward_hook(self._hook) for layer in mg.decoder.layers]

    def _hook(self, module: torch.nn.Module, inputs: object, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.maps.append(output[1].detach())

    def routing(self, batch: int) -> torch.Tensor:
        layers = [m.float().topk(TOPK, dim=-1).indices for m in self.maps]
        self.maps = []
        return from_megatron_layers(layers, batch)


@pytest.fixture(scope="module")
def setup() -> dict:
    hf = _tiny_hf()
    model_cfg = ModelConfig.from_hf(hf.config, dtype="float32")
    parallel = ParallelConfig()
    init_parallel(parallel)
    mg = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(mg, hf, model_cfg)
    replay = RouterReplay.for_model(model_cfg)
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(5))
    return dict(hf=hf, mg=mg, cfg=model_cfg, replay=replay, ids=ids, probe=_RoutingProbe(mg))


def test_record_matches_hf_routing_with_same_weights(setup: dict) -> None:
    mg, replay, ids = setup["mg"], setup["replay"], setup["ids"]
    replay.record()
    with torch.no_grad():
        forward_logprobs(mg, ids, torch.ones_like(ids))
    recorded = replay.recorded(ids.shape[0])
    replay.off()
    setup["probe"].maps.clear()
    agreement = topk_agreement(recorded, _hf_routing(setup["hf"], ids))
    print(f"recorded megatron routing vs HF fp32, same weights: {agreement:.4f}")
    assert agreement == 1.0


def test_replay_removes_bf16_rollout_vs_fp32_trainer_mismatch(setup: dict) -> None:
    # Same weights, rollout engine in bf16, trainer in fp32: the mismatch R3 exists for.
    mg, replay, probe = setup["mg"], setup["replay"], setup["probe"]
    ids = torch.randint(0, VOCAB, (8, 48), generator=torch.Generator().manual_seed(9))
    full = torch.ones_like(ids)
    rollout = _hf_routing(_tiny_hf().to(torch.bfloat16), ids)
    replay.off()
    probe.maps.clear()
    with torch.no_grad():
        forward_logprobs(mg, ids, full)
        without = topk_agreement(probe.routing(ids.shape[0]), rollout)
        replay.replay_forward(rollout)
        forward_logprobs(mg, ids, full)
        with_replay = topk_agreement(probe.routing(ids.shape[0]), rollout)
    replay.off()
    print(f"bf16 rollout vs fp32 megatron, same weights: replay off {without:.4f}, replay on {with_replay:.4f}")
    assert with_replay == 1.0
    assert 0.5 < without < 1.0


def test_replay_pins_experts_of_a_stale_rollout_and_router_gets_grads(setup: dict) -> None:
    mg, replay, ids, probe = setup["mg"], setup["replay"], setup["ids"], setup["probe"]
    batch, seq = ids.shape
    rollout = _hf_routing(setup["hf"], ids)  # the behaviour policy's routing, before the trainer moved on

    # Move the trainer's weights on a few AdamW steps, as happens between generation and training of a stale sample.
    replay.off()
    opt = torch.optim.AdamW(mg.parameters(), lr=2e-3)
    other = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(11))
    for _ in range(3):
        opt.zero_grad()
        (-forward_logprobs(mg, other, torch.ones_like(other)).mean()).backward()
        opt.step()
    opt.zero_grad()
    probe.maps.clear()

    # Engine-shaped routing: per sample [tokens - 1, layers, topk] in uint8, right-padded rows of varied length.
    lengths = [32, 27, 20, 13]
    mask = torch.zeros(batch, seq, dtype=torch.long)
    samples = []
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        samples.append(rollout[b, : n - 1].numpy().astype(np.uint8))
    routed = torch.zeros(batch, seq, dtype=torch.long)
    for b, n in enumerate(lengths):
        routed[b, : n - 1] = 1

    with torch.no_grad():
        forward_logprobs(mg, ids, mask)
    free = probe.routing(batch)
    without = topk_agreement(free, rollout, routed)

    replay.replay_forward(samples, seq_len=seq)
    logprobs = forward_logprobs(mg, ids, mask)
    pinned = probe.routing(batch)
    with_replay = topk_agreement(pinned, rollout, routed)
    (-logprobs.sum() / mask[:, 1:].sum()).backward()
    replay.off()

    print(f"top-k agreement with the stale rollout's routing: replay off {without:.4f}, replay on {with_replay:.4f}")
    assert with_replay == 1.0
    assert without < 0.97
    # Pad positions (and each row's last token, which the engine never routed) got the filler experts 0..topk-1.
    assert torch.all(pinned[routed == 0].sort(-1).values == torch.arange(TOPK))
    router_grads = [layer.mlp.router.weight.grad for layer in mg.decoder.layers]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in router_grads)


def test_replay_refuses_wrong_layer_count(setup: dict) -> None:
    with pytest.raises(ConfigError, match="router-replay instances"):
        RouterReplay(num_layers=LAYERS + 1, topk=TOPK, num_experts=EXPERTS)
    with pytest.raises(ConfigError, match="seq_len"):
        setup["replay"].replay_forward([np.zeros((3, LAYERS, TOPK), dtype=np.uint8)])
