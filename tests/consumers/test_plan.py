"""`sluice run --dry-run` plans one trainer rank's memory from a config.json alone, and refuses layouts that cannot
run or cannot fit: every GPU recipe's dry run (no weights, no GPU), the planner's parameter counts against real
megatron-core models and published model sizes, and the refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.consumers.megatron.plan import Layout, count_parameters
from pipeline.errors import ConfigError
from pipeline.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = sorted((ROOT / "recipes").glob("gpu-*.toml"))


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # recipes name their config.json relative to the repository


def _dry_run(recipe: Path, capsys: pytest.CaptureFixture[str], *sets: str) -> tuple[int, str, str]:
    args = ["run", str(recipe.relative_to(ROOT)), "--dry-run"]
    for s in sets:
        args += ["--set", s]
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_gpu_recipes_cover_both_families_at_scale() -> None:
    names = {r.stem for r in GPU_RECIPES}
    assert {"gpu-deepseek-v3", "gpu-kimi-k2", "gpu-qwen3-30b-a3b", "gpu-qwen3-235b-a22b"} <= names


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=[r.stem for r in GPU_RECIPES])
def test_gpu_recipe_dry_run_prints_a_plan_that_fits(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(recipe)
    assert not (ROOT / str(cfg.model.path) / "config.json").exists()  # planned from hardware.hf_config, no weights
    code, out, err = _dry_run(recipe, capsys)
    assert code == 0, err
    plan = out[out.index("memory plan per trainer rank") :]
    print(plan)
    gib = {kind: float(v) for kind, v in re.findall(r"^  (\w+) +([\d.]+) GiB", plan, re.MULTILINE)}
    assert set(gib) == {"parameters", "gradients", "optimizer", "activations", "push", "total"}
    assert gib["total"] == pytest.approx(sum(v for k, v in gib.items() if k != "total"), abs=0.05)
    usable = float(re.search(r"of ([\d.]+) GiB usable", plan).group(1))  # type: ignore[union-attr]
    assert 0 < gib["total"] <= usable
    launch = cfg.hardware.sglang_launch
    assert launch is not None and launch in plan
    assert "--enable-return-routed-experts" in launch and re.search(r"--weight-version \d+", launch)
    assert cfg.trainer.pp == 1 and cfg.hardware.gpu and cfg.hardware.trainer_nodes
    assert cfg.hardware.trainer_nodes * cfg.hardware.gpus_per_node == cfg.trainer.world_size
    assert "PP > 1 is refused" in recipe.read_text() or "Pipeline parallelism stays refused" in recipe.read_text()


# Published totals (parameters of the main model; DeepSeek-V3's 671B excludes its MTP module).
PUBLISHED = {"deepseek-v3": (671e9, 37e9), "kimi-k2": (1.03e12, 32e9), "qwen3-30b-a3b": (30.5e9, 3.3e9),
             "qwen3-235b-a22b": (235e9, 22e9)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published_sizes(name: str) -> None:
    model = ModelConfig.from_hf(json.loads((ROOT / "recipes" / "models" / f"{name}.json").read_text()))
    counts = count_parameters(model, Layout(world_size=1, tp=1, ep=1))
    total, active = PUBLISHED[name]
    print(f"{name}: {counts.total / 1e9:.2f}B parameters, {counts.active / 1e9:.2f}B active")
    assert counts.total == pytest.approx(total, rel=0.01)
    assert counts.active == pytest.approx(active, rel=0.05)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe", "deepseek-v3"])
def test_parameter_counts_match_a_built_megatron_model(arch: str, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from pipeline.consumers.megatron.config import ParallelConfig
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel
    from pipeline.models.tiny import init_tiny_model

    folder = init_tiny_model(arch, tmp_path / arch, seed=0)
    model = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel)
    built = build_gpt_model(model, parallel, r3=False)
    expert = sum(p.numel() for n, p in built.named_parameters() if ".mlp.experts." in n)
    dense = sum(p.numel() for n, p in built.named_parameters() if ".mlp.experts." not in n)
    counts = count_parameters(model, Layout(world_size=1, tp=1, ep=1))
    assert (counts.dense, counts.expert) == (dense, expert)
    halves = count_parameters(model, Layout(world_size=2, tp=1, ep=2))
    assert halves.rank_expert * 2 == expert and halves.rank_dense == dense


@pytest.mark.parametrize(("recipe", "sets", "match"), [
    ("gpu-deepseek-v3", ["trainer.world_size=64", "hardware.trainer_nodes=8", "trainer.ep=8"], "cannot fit"),
    ("gpu-qwen3-30b-a3b", ["trainer.micro_batch_tokens=65536"], "cannot fit"),
    ("gpu-deepseek-v3", ["trainer.ep=24", "trainer.world_size=192", "hardware.trainer_nodes=24", "trainer.batch_groups=48"],
     "ep=24 must divide num_experts=256"),
    ("gpu-qwen3-235b-a22b", ["trainer.tp=8", "trainer.batch_groups=8"], "num_kv_heads=4"),
    ("gpu-kimi-k2", ["hardware.trainer_nodes=16"], "trainer_nodes x gpus_per_node = 16 x 8"),
])
def test_layouts_that_cannot_fit_or_run_are_refused(recipe: str, sets: list[str], match: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _dry_run(ROOT / "recipes" / f"{recipe}.toml", capsys, *sets)
    print(err)
    assert code != 0 and re.search(match, err), err


@pytest.mark.parametrize(("sets", "match"), [
    (["trainer.pp=2"], "pipeline parallelism is refused"),
    (['hardware.sglang_launch="python -m sglang.launch_server --weight-version 0"'],
     "lacks --enable-return-routed-experts"),
    (['hardware.sglang_launch="python -m sglang.launch_server --enable-return-routed-experts"'],
     "integer --weight-version"),
    (['hardware.sglang_launch="x --enable-return-routed-experts --weight-version v1"'], "integer --weight-version"),
])
def test_recipes_that_cannot_run_are_refused_with_the_reason(sets: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "recipes" / "gpu-deepseek-v3.toml", sets)


def test_a_dry_run_needs_a_config_json_but_no_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = ROOT / "recipes" / "gpu-deepseek-v3.toml"
    code, _, err = _dry_run(recipe, capsys, "hardware.hf_config=none.json")
    assert code != 0 and "hardware.hf_config none.json is not a file" in err
    with pytest.raises(ConfigError, match="holds no config.json and hardware.hf_config is unset"):
        from pipeline.consumers.megatron.plan import dry_run_plan

        cfg = load_config(recipe)
        dry_run_plan(cfg.trainer, cfg.model, cfg.hardware.model_copy(update={"hf_config": None}))
    # A folder with only its config.json is enough: weights are never opened.
    (tmp_path / "config.json").write_text((ROOT / "recipes" / "models" / "deepseek-v3.json").read_text())
    code, out, err = _dry_run(recipe, capsys, f"model.path={json.dumps(str(tmp_path))}")
    assert code == 0 and f"from {tmp_path / 'config.json'}" in out, err


def test_the_dry_run_prints_lora_ratios_and_refuses_targets_the_model_lacks() -> None:
    from pipeline.consumers.megatron.plan import dry_run_plan, plan_model_config

    attention = 'trainer.lora={rank=32, targets=["q_proj", "k_proj", "v_proj", "o_proj"]}'
    cfg = load_config("recipes/gpu-qwen3-30b-a3b.toml", [attention, "engine.type=cpu", "engine.urls=[]",
                                                          "engine.launch=false"])
    text = dry_run_plan(cfg.trainer, cfg.model, cfg.hardware, cfg.sync)
    # Qwen3-30B-A3B, 48 layers: rank 32 on q (2048 -> 4096), k and v (2048 -> 512 each), o (4096 -> 2048).
    push = 48 * 32 * ((2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048))
    model_cfg, _ = plan_model_config(cfg.model, cfg.hardware)
    assert (model_cfg.hidden_size, model_cfg.num_attention_heads, model_cfg.num_kv_heads) == (2048, 32, 4)
    full_push = count_parameters(model_cfg, Layout(world_size=1, tp=1, ep=1)).total
    assert f"push bytes / full = {push / full_push:.5f}" in text
    assert "optimizer state / full = 0.0007" in text
    full = load_config("recipes/gpu-qwen3-30b-a3b.toml")
    plain = dry_run_plan(full.trainer, full.model, full.hardware, full.sync)
    optimizer = [float(line.split()[1]) for t in (text, plain) for line in t.splitlines()
                 if line.strip().startswith("optimizer")]
    assert optimizer[0] < 0.01 * optimizer[1]  # Adam's state for the adapters alone
    dense = load_config("recipes/gpu-qwen3-30b-a3b.toml", ['trainer.lora={targets=["gate_proj"]}', "engine.type=cpu",
                                                          "engine.urls=[]", "engine.launch=false"])
    with pytest.raises(ConfigError, match=r"\['gate_proj'\] match no layer"):
        dry_run_plan(dense.trainer, dense.model, dense.hardware, dense.sync)


def test_the_dry_run_prints_fp8_engine_memory_and_push_ratio() -> None:
    from pipeline.consumers.megatron.plan import dry_run_plan, plan_model_config

    cfg = load_config("recipes/gpu-qwen3-30b-a3b.toml")
    text = dry_run_plan(cfg.trainer, cfg.model, cfg.hardware, cfg.sync)
    model_cfg, _ = plan_model_config(cfg.model, cfg.hardware)
    total = count_parameters(model_cfg, Layout(world_size=1, tp=1, ep=1)).total
    # Qwen3-30B-A3B: per layer q 4096x2048, k and v 512x2048, o 2048x4096, and 128 experts of gate/up 768x2048 and
    # down 2048x768; a float32 scale per 128 x 128 block; everything else (embeddings, head, norms, routers) BF16.
    shapes = [(4096, 2048, 1), (512, 2048, 2), (2048, 4096, 1), (768, 2048, 256), (2048, 768, 128)]
    fp8 = sum(n * (o * i + 4 * -(-o // 128) * -(-i // 128)) for o, i, n in shapes) * 48
    projected = sum(n * o * i for o, i, n in shapes) * 48
    ratio = (fp8 + 2 * (total - projected)) / (2 * total)
    assert f"push bytes FP8 / BF16 = {ratio:.3f}" in text and 0.5 < ratio < 0.52
    assert "with engine.weight_dtype = fp8: engine weights 29.03 GiB" in text
