"""model.spec: user modules swapped into the real megatron-core model (examples/gated_attention.py), on CPU.

Shows the module is built in, starts as an exact identity, trains, survives a dist-checkpoint, converts to HF and
back (or is refused when it declares no HF names), and that bad specs are refused with the field named.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from pipeline import plugins  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
plugins.activate([ROOT / "examples", Path(__file__).parents[1] / "fixtures"])  # as a recipe's plugins.paths would

from gated_attention import GatedSelfAttention  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.consumers.megatron.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import (  # noqa: E402
    check_exportable,
    hf_state_dict,
    iter_hf_weights,
    load_hf_into_megatron,
    megatron_to_hf_state_dict,
    spec_weights,
)
from pipeline.consumers.megatron.model import (  # noqa: E402
    allreduce_gradients,
    build_gpt_model,
    forward_logits,
    forward_logprobs,
    init_parallel,
)
from pipeline.consumers.trainer.main import check_spec_weights  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402

SPEC = "gated_attention:gated_attention"
PATCH = "gated_attention:patch_hf_model"
VOCAB = 96
CPU = ParallelConfig(device="cpu")
GATE_NAMES = [f"model.layers.{i}.self_attn.head_gate.{p}" for i in range(2) for p in ("weight", "bias")]


def tiny_hf(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=10000.0,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # HF leaves routers at zero and norms at one; random values make them matter
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(param.shape, generator=gen))
    return model.float().eval()


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return tiny_hf()


def build(hf: torch.nn.Module, spec: str | None = SPEC, *, seed: int = 1, load: object | None = None) -> tuple:
    model_cfg = ModelConfig.from_hf(hf.config, dtype="float32")
    init_parallel(CPU, seed=seed)
    model = build_gpt_model(model_cfg, CPU, r3=False, spec=spec, hf_config=hf.config.to_dict())
    load_hf_into_megatron(model, hf if load is None else load, model_cfg)
    return model, model_cfg


def batch(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(3))
    return ids, torch.ones_like(ids)


def gates(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".linear_gate." in n}


def train(model: torch.nn.Module, steps: int, opt: torch.optim.Optimizer | None = None) -> list[float]:
    opt = opt or torch.optim.AdamW(model.parameters(), lr=3e-2)
    ids, mask = batch(model.vocab_size)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = -forward_logprobs(model, ids, mask).sum() / mask[:, 1:].sum()
        loss.backward()
        allreduce_gradients(model)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_the_user_module_is_built_in_and_starts_as_the_plain_model(hf: torch.nn.Module) -> None:
    plain, _ = build(hf, spec=None)
    gated, _ = build(hf)
    attention = [m for m in gated.modules() if isinstance(m, GatedSelfAttention)]
    assert len(attention) == 2 and not any(isinstance(m, GatedSelfAttention) for m in plain.modules())
    assert sorted(gates(gated)) == [f"decoder.layers.{i}.self_attention.linear_gate.{p}"
                                    for i in range(2) for p in ("bias", "weight")]
    ids, mask = batch()
    with torch.no_grad():
        reference, out = forward_logits(plain.eval(), ids, mask), forward_logits(gated.eval(), ids, mask)
        # The gate is really applied: a closed gate on one layer changes the logits.
        attention[0].linear_gate.bias.fill_(-30.0)
        closed = forward_logits(gated, ids, mask)
    assert torch.equal(out, reference)  # 2 * sigmoid(0) = 1 exactly: bit-identical to the plain model
    assert (closed - reference).abs().max() > 1e-3


def test_the_gate_gets_gradients_and_trains(hf: torch.nn.Module) -> None:
    model, _ = build(hf)
    before = gates(model)
    losses = train(model, steps=4)
    grads = {n: p.grad for n, p in model.named_parameters() if ".linear_gate." in n}
    assert all(g is not None and g.abs().max() > 0 for g in grads.values())
    after = gates(model)
    assert all((after[n] - before[n]).abs().max() > 1e-3 for n in before)
    assert losses[-1] < losses[0]
    # A trained gate moves the model away from the plain one it started as.
    plain, _ = build(hf, spec=None)
    ids, mask = batch()
    with torch.no_grad():
        assert (forward_logits(model.eval(), ids, mask) - forward_logits(plain.eval(), ids, mask)).abs().max() > 1e-3


def test_a_dist_checkpoint_keeps_the_gate(hf: torch.nn.Module, tmp_path: Path) -> None:
    model, _ = build(hf)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    train(model, steps=2, opt=opt)
    trained = gates(model)
    save_checkpoint(tmp_path / "ckpt", model, opt, meta={"step": 2})
    fresh, _ = build(hf, seed=7)  # a fresh model: gates at zero again
    assert all(torch.count_nonzero(g) == 0 for g in gates(fresh).values())
    load_checkpoint(tmp_path / "ckpt", fresh, torch.optim.AdamW(fresh.parameters(), lr=3e-2))
    loaded = gates(fresh)
    assert sorted(loaded) == sorted(trained)
    assert all(torch.equal(loaded[n], trained[n]) for n in trained)
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(forward_logits(fresh.eval(), ids, mask), forward_logits(model.eval(), ids, mask))


def test_conversion_maps_the_declared_gate_weights_both_ways(hf: torch.nn.Module) -> None:
    model, model_cfg = build(hf)
    train(model, steps=2)
    assert spec_weights(model, model_cfg) == {
        f"decoder.layers.{i}.self_attention.linear_gate.{p}": f"model.layers.{i}.self_attn.head_gate.{p}"
        for i in range(2) for p in ("weight", "bias")
    }
    exported = {k: v.clone() for k, v in megatron_to_hf_state_dict(model, model_cfg).items()}
    assert set(exported) == set(hf_state_dict(hf)) | set(GATE_NAMES)
    assert exported["model.layers.0.self_attn.head_gate.weight"].shape == (4, 32)  # [heads, hidden]
    pushed = dict(iter_hf_weights(model, model_cfg))  # what a weight push announces
    assert set(GATE_NAMES) <= set(pushed)
    # HF import when present: a fresh model takes the trained gates from the exported checkpoint.
    back, _ = build(hf, seed=5, load=exported)
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(forward_logits(back.eval(), ids, mask), forward_logits(model.eval(), ids, mask))
    # A plain model does not silently drop them, and a checkpoint with only some of them is refused.
    with pytest.raises(ConfigError, match="model.spec"):
        build(hf, spec=None, load=exported)
    partial = {k: v for k, v in exported.items() if k != GATE_NAMES[0]}
    with pytest.raises(ConfigError, match="some of model.spec's weights"):
        build(hf, load=partial)


def test_weights_without_hf_names_are_refused_for_export_and_push(hf: torch.nn.Module) -> None:
    model, model_cfg = build(hf, spec="user_specs:undeclared_gate")  # importing from plain HF is fine
    assert set(spec_weights(model, model_cfg).values()) == {None}
    with pytest.raises(ConfigError, match=r"model\.spec added weights with no HF name: "
                                          r"decoder\.layers\.0\.self_attention\.linear_gate\.bias"):
        check_exportable(model, model_cfg)
    with pytest.raises(ConfigError, match="hf_weights"):
        next(iter_hf_weights(model, model_cfg))
    train(model, steps=1)  # it still trains: only leaving the trainer is refused


def test_a_gap_in_the_family_mapping_is_not_blamed_on_a_spec(hf: torch.nn.Module) -> None:
    model, model_cfg = build(hf, spec=None)
    model.decoder.layers[0].mlp.register_parameter("stray", torch.nn.Parameter(torch.zeros(2)))  # a megatron module's
    assert spec_weights(model, model_cfg) == {}
    with pytest.raises(ConfigError, match=r"'decoder\.layers\.0\.mlp\.stray' has no HF counterpart in sluice's qwen3"):
        list(iter_hf_weights(model, model_cfg))


def test_the_trainer_refuses_a_spec_its_engines_cannot_run_at_start_up(hf: torch.nn.Module) -> None:
    model, model_cfg = build(hf)
    cpu = load_config(overrides=[f'plugins.paths=["{ROOT / "examples"}"]', f'model.spec="{SPEC}"'])
    with pytest.raises(ConfigError, match=r"model\.spec.*head_gate.*CPU engine cannot run"):
        check_spec_weights(model, model_cfg, source=cpu.model, engine=cpu.engine)
    patched = cpu.model_copy(update={"model": cpu.model.model_copy(update={"engine_patch": PATCH})})
    check_spec_weights(model, model_cfg, source=patched.model, engine=patched.engine)  # the engines will run the gate (model.engine_patch)
    sglang = cpu.model_copy(update={"engine": cpu.engine.model_copy(update={"type": "sglang"})})
    check_spec_weights(model, model_cfg, source=sglang.model, engine=sglang.engine)  # declared names: an SGLang model with the gate can take them
    undeclared, _ = build(hf, spec="user_specs:undeclared_gate")
    with pytest.raises(ConfigError, match="no HF name"):
        check_spec_weights(undeclared, model_cfg, source=sglang.model, engine=sglang.engine)


def test_a_single_layer_spec_is_used_for_every_layer(hf: torch.nn.Module) -> None:
    model, _ = build(hf, spec="user_specs:one_layer_spec")
    assert sum(isinstance(m, GatedSelfAttention) for m in model.modules()) == 2


def test_bad_specs_are_refused_with_the_field_named(hf: torch.nn.Module) -> None:
    paths = f'plugins.paths=["{ROOT / "examples"}", "{Path(__file__).parents[1] / "fixtures"}"]'
    cfg = load_config(overrides=[paths, f'model.spec="{SPEC}"'])
    assert ("model.spec", SPEC) in [(f, r) for f, r, _ in cfg.plugin_refs()]
    assert [r["field"] for r in cfg.plugin_records()] == ["model.spec"]
    with pytest.raises(ConfigError, match=r"model\.spec = 'no_such_module:spec'.*cannot import"):
        load_config(overrides=[paths, 'model.spec="no_such_module:spec"'])
    with pytest.raises(ConfigError, match=r"model\.spec.*has no attribute 'missing'"):
        load_config(overrides=[paths, 'model.spec="user_specs:missing"'])
    with pytest.raises(ConfigError, match=r"model\.spec.*must accept \(context: SpecContext\)"):
        load_config(overrides=[paths, 'model.spec="user_specs:two_arguments"'])
    with pytest.raises(ConfigError, match=r"model\.spec.*is async"):
        load_config(overrides=[paths, 'model.spec="user_specs:async_spec"'])
    with pytest.raises(ConfigError, match=r"model\.spec.*not an import path"):
        load_config(overrides=[paths, 'model.spec="gated_attention.gated_attention"'])
    with pytest.raises(ConfigError, match=r"model\.engine_patch.*must accept \(hf_model"):
        load_config(overrides=[paths, f'model.spec="{SPEC}"', 'model.engine_patch="user_specs:two_arguments"'])
    cfg = load_config(overrides=[paths, f'model.spec="{SPEC}"', f'model.engine_patch="{PATCH}"'])
    assert [r["field"] for r in cfg.plugin_records()] == ["model.spec", "model.engine_patch"]
    # What the function returns is checked when the model is built.
    with pytest.raises(ConfigError, match=r"model\.spec = 'user_specs:returns_config' returned TransformerConfig, "
                                          "not a megatron-core ModuleSpec"):
        build(hf, spec="user_specs:returns_config")
    with pytest.raises(ConfigError, match=r"model\.spec.*block spec of 1 layer specs for a model of 2"):
        build(hf, spec="user_specs:drops_a_layer")
    with pytest.raises(ConfigError, match=r"model\.spec = 'user_specs:raises' raised RuntimeError: no spec for you"):
        build(hf, spec="user_specs:raises")


# --- the CPU engine with model.engine_patch -------------------------------------------------------------------------

LOGPROB_ATOL = 1e-4  # fp32 engine vs fp32 megatron: rounding of differently shaped matmuls only


def test_the_patched_hf_model_computes_what_the_gated_megatron_model_computes(hf: torch.nn.Module) -> None:
    from gated_attention import patch_hf_model

    from pipeline.consumers.megatron.convert import fuse_hf_experts

    model, model_cfg = build(hf)
    train(model, steps=3)
    twin = tiny_hf(seed=9)  # other weights: everything must come from the export
    patch_hf_model(twin)
    twin.load_state_dict(fuse_hf_experts(megatron_to_hf_state_dict(model, model_cfg), model_cfg), strict=True)
    ids, mask = batch()
    with torch.no_grad():
        reference = forward_logits(model.eval(), ids, mask)
        torch.testing.assert_close(twin(input_ids=ids).logits, reference, rtol=0, atol=1e-5)
        twin.model.layers[0].self_attn.head_gate.bias.fill_(-30.0)  # the patch's gate is really applied
        assert (twin(input_ids=ids).logits - reference).abs().max() > 1e-3


def _engine_logprobs(url: str, prompt: list[int], tokens: int) -> tuple[list[int], np.ndarray, str]:
    from pipeline.producers.sglang_client import NO_RETRY, SGLangClient

    async def go() -> tuple[list[int], np.ndarray, str]:
        async with SGLangClient(url, retry=NO_RETRY) as client:
            out = await client.generate(prompt, {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True,
                                                 "sampling_seed": 0})
            return [int(t) for t in out.output_ids], np.asarray(out.output_logprobs), out.weight_version

    return asyncio.run(go())


def _megatron_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = forward_logprobs(model.eval(), ids, torch.ones_like(ids))[0]
    return logprobs[len(prompt) - 1:].numpy()


def _push(url: str, model: torch.nn.Module, model_cfg: ModelConfig) -> None:
    from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
    from pipeline.sync.pusher import WeightPusher

    async def go() -> None:
        client = SGLangClient(url, retry=NO_RETRY)
        pusher = await WeightPusher.connect([client], master_address="127.0.0.1", backend="gloo", timeout_s=60)
        try:
            await pusher.push(iter_hf_weights(model, model_cfg), 1)
        finally:
            await pusher.close()
            await client.close()

    asyncio.run(go())


@pytest.mark.slow
def test_a_patched_cpu_engine_takes_the_gate_by_push_and_from_an_exported_folder(tmp_path: Path) -> None:
    from pipeline.consumers.trainer.main import export_hf_model
    from pipeline.models.tiny import init_tiny_model
    from tests.helpers.engines import start_engine

    base = init_tiny_model("qwen3-moe", tmp_path / "base")
    model_cfg = ModelConfig.from_hf(json.loads((base / "config.json").read_text()), dtype="float32")
    init_parallel(CPU, seed=1)
    model = build_gpt_model(model_cfg, CPU, r3=False, spec=SPEC)
    load_hf_into_megatron(model, base, model_cfg)
    train(model, steps=3)
    assert all(g.abs().max() > 1e-3 for g in gates(model).values())
    patch = ("--patch", PATCH, "--plugin-path", str(ROOT / "examples"))
    prompt = [5, 6, 7, 8, 9]
    engine = start_engine(base, tmp_path, None, *patch)  # a plain folder: the patch's gates start at exactly 1
    try:
        _push(engine.url, model, model_cfg)  # the push announces head_gate names; a plain engine would refuse them
        output, logprobs, version = _engine_logprobs(engine.url, prompt, 12)
    finally:
        engine.stop()
    assert version == "1"
    np.testing.assert_allclose(logprobs, _megatron_logprobs(model, prompt, output), rtol=0, atol=LOGPROB_ATOL)
    ungated = {n: p for n, p in model.named_parameters() if ".linear_gate." in n}
    saved = {n: p.detach().clone() for n, p in ungated.items()}
    with torch.no_grad():  # the tolerance is tight enough to tell: without the trained gates the numbers differ
        for p in ungated.values():
            p.zero_()
        assert np.abs(logprobs - _megatron_logprobs(model, prompt, output)).max() > 1e-3
        for n, p in ungated.items():
            p.copy_(saved[n])
    export_hf_model(model, model_cfg, base, tmp_path / "exported")  # what snapshots and `sluice replay` write
    engine = start_engine(tmp_path / "exported", tmp_path, None, *patch)
    try:
        output, logprobs, _ = _engine_logprobs(engine.url, prompt, 12)
    finally:
        engine.stop()
    np.testing.assert_allclose(logprobs, _megatron_logprobs(model, prompt, output), rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.slow
def test_a_trainer_process_refuses_the_spec_at_start_up_and_says_not_to_restart_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    from pipeline.launch.launcher import CONFIG_EXIT_CODE, REFUSED, _refusal, prepare_run
    from pipeline.net import free_port

    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"run.run_dir={json.dumps(str(run_dir))}", "run.name=spec", "eval.enabled=false",
                             "queue.archive.enabled=false", f'plugins.paths=["{ROOT / "examples"}"]',
                             f'model.spec="{SPEC}"'])  # engine.type = cpu and no model.engine_patch
    handle, _ = prepare_run(cfg)
    try:
        # Never contacted: the refusal comes before the trainer connects to its engines.
        (run_dir / "engines.json").write_text('["http://127.0.0.1:9"]')
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        log = run_dir / "trainer-test.log"
        with log.open("ab") as out:
            code = subprocess.run([sys.executable, "-m", "pipeline.launch.processes", "trainer", str(run_dir)], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
        assert code == CONFIG_EXIT_CODE, log.read_text()[-3000:]
        assert REFUSED in log.read_text()
        assert _refusal(log).startswith(f"model.spec = '{SPEC}' adds weights (model.layers.0.self_attn.head_gate")
        assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    finally:
        handle.close(stop_server=True)
