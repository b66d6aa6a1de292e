"""The weight push in the `--dry-run` memory plan: each source's snapshot (on the GPU or in pinned host memory), two
bucket buffers and the owner's gather are counted, and a layout whose push does not fit is refused naming the
setting that would make it fit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.config.sync import SyncConfig
from pipeline.consumers.megatron.plan import GIB, Layout, count_parameters, dry_run_plan, plan_push
from pipeline.errors import ConfigError
from pipeline.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = sorted((ROOT / "recipes").glob("gpu-*.toml"))
PUSH_LINE = re.compile(r"^  push +([\d.]+) GiB  \((.*)\)$", re.MULTILINE)


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # recipes name their config.json relative to the repository


def _plan(recipe: str, *sets: str) -> str:
    cfg = load_config(ROOT / "recipes" / f"{recipe}.toml", list(sets))
    return dry_run_plan(cfg.trainer, cfg.model, cfg.hardware, cfg.sync)


def _gib(line: str, what: str) -> float:
    return float(re.search(rf"^  {what} +([\d.]+) GiB", line, re.MULTILINE).group(1))  # type: ignore[union-attr]


def _model(name: str) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((ROOT / "recipes" / "models" / f"{name}.json").read_text()))


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=[r.stem for r in GPU_RECIPES])
def test_every_gpu_recipe_dry_run_prints_the_push_and_fits(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(recipe.relative_to(ROOT)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = out[out.index("memory plan per trainer rank") :]
    print(plan)
    push = PUSH_LINE.search(plan)
    assert push is not None, plan
    pushed, what = float(push.group(1)), push.group(2)
    # The line's figure is its parts that live on the GPU: two 512 MB buckets, the gather, a snapshot on the GPU.
    assert "2 x 512 MB buckets" in what and "owners:" in what
    snapshot = re.search(r"snapshot ([\d.]+) GiB (on the GPU|in pinned host memory)", what)
    assert snapshot is not None, what
    gather = re.search(r"gather ([\d.]+) GiB", what)
    on_gpu = 1.0 + (float(gather.group(1)) if gather else 0.0)
    on_gpu += float(snapshot.group(1)) if snapshot.group(2) == "on the GPU" else 0.0
    assert pushed == pytest.approx(on_gpu, abs=0.02) and pushed >= 1.0
    # the snapshot is the share the line says a rank sends, and the total carries the push
    assert float(snapshot.group(1)) == float(re.search(r"at most ([\d.]+) GiB", what).group(1))  # type: ignore[union-attr]
    parts = sum(_gib(plan, k) for k in ("parameters", "gradients", "optimizer", "activations", "push"))
    assert _gib(plan, "total") == pytest.approx(parts, abs=0.05)
    assert _gib(plan, "total") <= float(re.search(r"of ([\d.]+) GiB usable", plan).group(1))  # type: ignore[union-attr]


def test_rank0_sends_the_whole_model_and_owners_about_one_over_world() -> None:
    model = _model("qwen3-30b-a3b")
    layout = Layout(world_size=8, tp=1, ep=8)  # EP = world: every rank owns 1/8 of the experts
    whole = count_parameters(model, Layout(world_size=1, tp=1, ep=1)).total * 2  # bf16 on the wire
    rank0 = plan_push(model, layout, device="cuda", sync=SyncConfig(sources="rank0"), overlap_push=True, room=None)
    owners = plan_push(model, layout, device="cuda", sync=SyncConfig(), overlap_push=True, room=None)
    print(f"whole {whole / GIB:.2f} GiB, rank0 {rank0.share / GIB:.2f}, owners {owners.share / GIB:.2f}")
    assert rank0.share == rank0.snapshot == whole
    # an even eighth, plus at most one whole tensor (the embedding, 0.58 GiB) for the spread of the dense ones
    assert whole / 8 <= owners.share <= whole / 8 + 151936 * 2048 * 2
    assert owners.snapshot == owners.share and owners.gather == 0  # tp = etp = 1: nothing to gather
    # Rank 0 alone streams without a snapshot when the push does not overlap; owners always pack their share.
    streamed = plan_push(model, layout, device="cuda", sync=SyncConfig(sources="rank0"), overlap_push=False,
                         room=None)
    assert streamed.snapshot == 0 and streamed.device_bytes == 2 * 512 * 2**20 + streamed.gather
    owned = plan_push(model, layout, device="cuda", sync=SyncConfig(), overlap_push=False, room=None)
    assert owned.snapshot == owned.share
    # DeepSeek-V3 in rank0 mode: rank 0's snapshot is the whole 1.34 TB model
    dsv3 = plan_push(_model("deepseek-v3"), Layout(world_size=256, tp=8, ep=32), device="cuda",
                     sync=SyncConfig(sources="rank0"), overlap_push=True, room=None)
    assert dsv3.share == pytest.approx(1.342e12, rel=0.001)


def _snapshot_between(recipe: str) -> tuple[str, float]:
    """A GPU size that holds the recipe's plan with its snapshot on the host but not on the GPU."""
    host_plan = _plan(recipe, 'sync.snapshot="host"')
    snapshot = float(re.search(r"snapshot ([\d.]+) GiB in pinned host memory", host_plan).group(1))  # type: ignore[union-attr]
    assert snapshot > 5
    usable = _gib(host_plan, "total") + snapshot / 2
    return host_plan, usable / 0.9


def test_a_device_snapshot_that_cannot_fit_is_refused_naming_sync_snapshot() -> None:
    _, gpu = _snapshot_between("gpu-qwen3-30b-a3b")
    with pytest.raises(ConfigError) as refused:
        _plan("gpu-qwen3-30b-a3b", 'sync.snapshot="device"', f"hardware.gpu_memory_gib={gpu:.2f}")
    message = str(refused.value)
    print(message)
    assert "cannot fit its weight push" in message and 'set sync.snapshot = "host"' in message


def test_auto_puts_the_snapshot_that_does_not_fit_the_gpu_in_host_memory() -> None:
    host_plan, gpu = _snapshot_between("gpu-qwen3-30b-a3b")
    plan = _plan("gpu-qwen3-30b-a3b", f"hardware.gpu_memory_gib={gpu:.2f}")
    print(plan)
    assert re.search(r"snapshot [\d.]+ GiB in pinned host memory \(auto: no room\)", plan)
    assert _gib(plan, "total") == _gib(host_plan, "total")
    assert "host memory: " in plan and "GiB per node" in plan
    # the recipe's own GPU has room: auto keeps it there
    assert "on the GPU (auto: it fits)" in _plan("gpu-qwen3-30b-a3b")


def test_rank0_mode_on_the_gpu_is_refused_naming_sync_sources() -> None:
    with pytest.raises(ConfigError) as refused:
        _plan("gpu-deepseek-v3", 'sync.sources="rank0"', 'sync.snapshot="device"')
    message = str(refused.value)
    print(message)
    assert re.search(r"snapshot 1249\.\d\d GiB on the GPU", message)
    assert 'sync.sources = "owners"' in message and 'sync.snapshot = "host"' in message


def test_a_host_snapshot_larger_than_host_memory_is_refused() -> None:
    with pytest.raises(ConfigError) as refused:
        _plan("gpu-deepseek-v3", 'sync.snapshot="host"', "hardware.host_memory_gib=40")
    message = str(refused.value)
    print(message)
    assert "hardware.host_memory_gib" in message and 'sync.snapshot = "device"' in message
    assert "host memory: " in _plan("gpu-deepseek-v3", 'sync.snapshot="host"', "hardware.host_memory_gib=2048")


def test_buckets_that_do_not_fit_are_refused_naming_a_bucket_size_that_does() -> None:
    sets = ['sync.snapshot="host"', "sync.bucket_mb=16384"]  # two 16 GiB buckets on the GPU
    with pytest.raises(ConfigError) as refused:
        _plan("gpu-kimi-k2", *sets)
    message = str(refused.value)
    print(message)
    bucket = re.search(r"sync\.bucket_mb = (\d+)", message)
    assert bucket is not None and 512 < int(bucket.group(1)) < 16384
    assert "2 x 16384 MB buckets" in message
    _plan("gpu-kimi-k2", sets[0], f"sync.bucket_mb={bucket.group(1)}")  # the size it names fits
