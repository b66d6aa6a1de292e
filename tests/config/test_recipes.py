"""Recipes are data, validated before anything starts: every shipped recipe loads, and bad ones are refused with a
message naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import apply_overrides, load_config
from pipeline.errors import ConfigError

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.toml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_shipped_recipes_validate(recipe: Path) -> None:
    cfg = load_config(recipe)
    assert cfg.trainer.steps >= 1 and cfg.run.name


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["trainer.lrr=1"], "trainer.lrr: Extra inputs are not permitted"),
        (["trainer.lr=-1"], "trainer.lr: Input should be greater than 0"),
        (["engine.type=sglang"], "needs engine.urls"),
        (['engine.urls=["http://x:1"]'], "only read with engine.type = 'sglang'"),
        (["trainer.r3=true", "producer.return_routed_experts=false"], "trainer.r3 replays routing"),
        (["producer.sampling.temperature=0"], "greedy"),
        (["trainer.world_size=2", "trainer.batch_groups=3"], "multiple of the data-parallel size 2"),
        (["staleness.max_lag=2", "staleness.action=train", "staleness.train_max_lag=1"], "train_max_lag"),
        (["prompts.type=chess"], "prompts.type"),
        (["run.name=has space"], "run.name"),
        (["warmstart.steps=0"], "warmstart.steps: Input should be greater than or equal to 1"),
        (["warmstart.lr=2"], "warmstart.lr: Input should be less than or equal to 1"),
        (["warmstart.batch_sise=8"], "warmstart.batch_sise: Extra inputs are not permitted"),
        (["warmstart.schedule.decay=square"], "warmstart.schedule.decay"),
        (["warmstart.path=data.parquet"], "warmstart.path: .*must be a .jsonl file"),
        (["warmstart.enabled=true", "engine.type=sglang", 'engine.urls=["http://x:1"]'], "SGLang servers serve"),
        (['trainer.lora={targets=["qkv"]}'], r"trainer.lora.targets = \['qkv'\]: give one or more of"),
        (['trainer.lora={targets=["q_proj", "q_proj"]}'], "names a target twice"),
        (['trainer.lora={targets=["experts.down_proj"], serve="adapter"}'], "fused in one tensor"),
        (["trainer.lora={rank=0}"], "trainer.lora.rank"),
        (["trainer.lora={}", "engine.type=sglang", 'engine.urls=["http://x:1"]'], "SGLang cannot merge"),
        (['trainer.lora={serve="adapter", targets=["q_proj", "experts.up_proj"]}', "engine.type=sglang",
          'engine.urls=["http://x:1"]'], r"\['experts.up_proj'\] with engine.type = 'sglang'.*no PEFT form"),
        (['trainer.lora={keep_loaded=0}'], "trainer.lora.keep_loaded"),
        (["engine.weight_dtype=fp8", "engine.dtype=bfloat16"], "computes in float32 from the FP8 values"),
        (["engine.weight_dtype=fp8", "sync.wire=tensors"], "gloo cannot broadcast float8"),
        (["engine.weight_dtype=fp8", "trainer.lora={}"], "FP8 engines quantize whole weights"),
        (["engine.weight_dtype=fp16"], "engine.weight_dtype"),
    ],
)
def test_bad_recipes_are_refused_with_the_field_named(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(RECIPES[0], overrides)


def test_overrides_parse_toml_values() -> None:
    data = apply_overrides({}, ["a.b=3", "a.c=1.5", "a.d=true", 'a.e="x y"', "a.f=word", "a.g=[1, 2]"])
    assert data == {"a": {"b": 3, "c": 1.5, "d": True, "e": "x y", "f": "word", "g": [1, 2]}}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["novalue"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("recipes/missing.toml")


def test_sync_mode_is_on_policy_and_says_what_it_overrides(caplog: pytest.LogCaptureFixture) -> None:
    recipe = RECIPES[0].parent / "cpu-moe.toml"
    assert load_config(recipe).staleness.max_lag > 0  # the recipe itself runs async
    with caplog.at_level("WARNING"):
        cfg = load_config(recipe, ["mode=sync"])
    assert cfg.mode == "sync" and cfg.staleness.max_lag == 0
    assert "replaced by 0" in caplog.text
    with pytest.raises(ConfigError, match="mode"):
        load_config(recipe, ["mode=lockstep"])
    schedule = load_config(recipe, ["trainer.lr_schedule.warmup_steps=10", "trainer.lr_schedule.decay=cosine"])
    assert schedule.trainer.lr_schedule.decay == "cosine"
    with pytest.raises(ConfigError, match="trainer.mini_batches"):
        load_config(recipe, ["trainer.mini_batches=0"])
