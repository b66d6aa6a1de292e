"""Offline replay: trains from a Parquet archive with no producers or engines, deterministically, under the recipe's
staleness policy (so it can emulate another eta), and over a stream-id range."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from pipeline.models.tiny import init_tiny_model
from pipeline.queue.archive import ArchiveWriter
from pipeline.queue.base import QueueEntry
from pipeline.queue.sample import Sample, compact_routing

pytestmark = pytest.mark.slow
GROUPS, GROUP_SIZE, BATCH = 12, 4, 2


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """A tiny model and an archive of 12 groups whose versions trail a live run's clock by 0-2 pushes."""
    root = tmp_path_factory.mktemp("replay")
    model_dir = init_tiny_model("qwen3-moe", root / "model", seed=0)
    hf = json.loads((model_dir / "config.json").read_text())
    layers, topk, experts = hf["num_hidden_layers"], hf["num_experts_per_tok"], hf["num_local_experts"]
    rng = np.random.default_rng(0)
    entries = []
    for g in range(GROUPS):
        version = max(0, g // BATCH - int(rng.integers(0, 3)))  # behind the clock by 0-2 versions
        samples = []
        for i in range(GROUP_SIZE):
            p, r = int(rng.integers(4, 9)), int(rng.integers(3, 8))
            routed = np.stack([rng.permutation(experts)[:topk] for _ in range((p + r - 1) * layers)])
            samples.append(Sample(
                prompt_ids=rng.integers(4, hf["vocab_size"], p), response_ids=rng.integers(4, hf["vocab_size"], r),
                rollout_logprobs=-rng.random(r).astype(np.float32) - 2.0,
                token_versions=np.full(r, version, np.int32),
                routed_experts=compact_routing(routed.reshape(p + r - 1, layers, topk), experts),
                reward=float(rng.random()), group_id=f"g{g}", prompt_id=f"p{g}", index=i,
            ))
        entries.append(QueueEntry(id=f"{1000 + g}-0", samples=samples, version_min=version, version_max=version))
    ArchiveWriter(root / "archive").write_segment(entries[:6])
    ArchiveWriter(root / "archive").write_segment(entries[6:])
    return model_dir, root / "archive", [e.id for e in entries]


def _replay(model_dir: Path, archive: Path, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "pipeline.cli", "replay", "recipes/cpu-moe.toml", "--from", str(archive),
           "--run-dir", str(out), "--set", f"model.path={json.dumps(str(model_dir))}", "--set",
           f"trainer.batch_groups={BATCH}", "--set", "trainer.checkpoint_every=3", "--set", "warmstart.enabled=false",
           "--set", "filters.zero_variance=false", "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fates(out: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in (out / "ledger").glob("seg-*.parquet"):
        for fate in pq.read_table(p)["fate"].to_pylist():
            counts[fate] = counts.get(fate, 0) + 1
    return counts


def test_two_replays_with_the_same_seed_give_identical_weights(recording, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model_dir, archive, _ = recording
    a = _replay(model_dir, archive, tmp_path / "a", "--set", "staleness.max_lag=10")
    b = _replay(model_dir, archive, tmp_path / "b", "--set", "staleness.max_lag=10")
    wa, wb = load_file(Path(a["model"]) / "model.safetensors"), load_file(Path(b["model"]) / "model.safetensors")
    w0 = load_file(model_dir / "model.safetensors")
    assert wa.keys() == wb.keys() == w0.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], w0[k]) for k in wa)  # it really trained
    assert _fates(tmp_path / "a") == {"trained": GROUPS * GROUP_SIZE}
    steps = [json.loads(x)["step"] for x in (tmp_path / "a" / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert steps == list(range(1, GROUPS // BATCH + 1))


def test_replay_emulates_a_smaller_eta(recording, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model_dir, archive, _ = recording
    _replay(model_dir, archive, tmp_path / "eta0", "--set", "staleness.max_lag=0")
    fates = _fates(tmp_path / "eta0")
    assert fates.get("stale", 0) > 0 and fates.get("trained", 0) > 0
    assert fates["stale"] + fates["trained"] == GROUPS * GROUP_SIZE


def test_replay_of_a_stream_id_range(recording, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model_dir, archive, ids = recording
    _replay(model_dir, archive, tmp_path / "r", "--range", f"{ids[2]}:{ids[7]}", "--set", "staleness.max_lag=10")
    entries = set()
    for p in (tmp_path / "r" / "ledger").glob("seg-*.parquet"):
        entries |= set(pq.read_table(p)["entry_id"].to_pylist())
    assert entries == set(ids[2:8])
