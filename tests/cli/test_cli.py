"""The ``sluice`` command as a user runs it: a real process against a run folder with an embedded Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.queue.rundir import RunHandle, open_run
from tests.helpers.samples import make_group


def sluice(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          check=check, timeout=120)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[RunHandle]:
    handle = open_run(run_dir=tmp_path / "run", create=True)
    yield handle
    handle.close(stop_server=True)


def test_queue_commands_on_a_run_folder(run: RunHandle, tmp_path: Path) -> None:
    q = run.queue
    rng = np.random.default_rng(0)
    q.create_group("trainer")
    q.create_group("eval")
    ids = q.put_many([make_group(rng, 2, version=v) for v in range(5)])
    q.ack("trainer", [e.id for e in q.read("trainer", "t", count=3)][:2])  # 2 acked, 1 pending, 2 undelivered
    q.redis.xadd(q.keys.samples, {"v": 1, "n": 1, "vmin": 0, "vmax": 0, "data": b"junk"})
    q.read("eval", "e", count=100)  # eval reads all; the junk entry goes to the dead letters
    q.redis.incr(q.keys.policy_version)
    rd = str(tmp_path / "run")

    st = json.loads(sluice("queue", "stats", "--run-dir", rd, "--json").stdout)
    assert st["length"] == 6 and st["produced"] == 5 and st["deadletter"] == 1 and st["policy_version"] == 1
    groups = {g["name"]: g for g in st["groups"]}
    assert groups["trainer"]["pending"] == 1 and groups["trainer"]["lag"] == 2
    assert groups["eval"]["pending"] == 5 and groups["eval"]["lag"] == 0

    lines = sluice("queue", "tail", "--run-dir", rd, "-n", "3", "--json").stdout.strip().splitlines()
    recs = [json.loads(x) for x in lines]
    assert [r["stream_id"] for r in recs if "sample_id" in r] == [ids[3], ids[3], ids[4], ids[4]]
    assert "error" in recs[-1]  # the junk entry is shown, with the reason it does not decode
    assert recs[0]["response_ids"] and recs[0]["version_min"] == 3

    out = tmp_path / "export"
    ex = json.loads(sluice("queue", "export", "--run-dir", rd, "--to", str(out), "--json").stdout)
    assert ex["samples"] == 10 and ex["entries"] == 5
    assert sum(pq.read_table(p).num_rows for p in out.glob("seg-*.parquet")) == 10
    part = json.loads(sluice("queue", "export", "--run-dir", rd, "--to", str(tmp_path / "p"), "--range",
                             f"{ids[1]}:{ids[2]}", "--json").stdout)
    assert part["entries"] == 2

    au = json.loads(sluice("queue", "audit", "--run-dir", rd, "--json", "--samples").stdout)
    assert au["entries_produced"] == 5 and au["undecodable_in_stream"] == 1 and au["deadlettered"] == 1
    assert au["groups"]["trainer"] == {"acked_entries": 2, "acked_samples": 4, "pending_entries": 1,
                                       "pending_samples": 2, "undelivered_entries": 2, "undelivered_samples": 4}
    assert au["groups"]["eval"]["pending_samples"] == 10 and au["duplicate_sample_ids"] == 0
    assert len(au["samples"]) == 10

    human = sluice("queue", "stats", "--run-dir", rd).stdout
    assert "trainer" in human and "policy_version 1" in human


def test_queue_commands_by_url_and_run_name(run: RunHandle) -> None:
    run.queue.put(make_group(np.random.default_rng(1), 1))
    st = json.loads(sluice("queue", "stats", "--redis", run.url, "--run", run.run, "--json").stdout)
    assert st["run"] == run.run and st["length"] == 1


def test_bad_arguments_fail_with_a_clear_message(tmp_path: Path) -> None:
    r = sluice("queue", "stats", "--run-dir", str(tmp_path / "nothing"), check=False)
    assert r.returncode == 2 and "not a sluice run folder" in r.stderr
    r = sluice("queue", "stats", check=False)
    assert r.returncode == 2 and "--run-dir" in r.stderr


def test_bench_queue_prints_a_ratio() -> None:
    r = sluice("bench", "queue", "--json", "--samples", "16", "--group-size", "4", "--response-tokens", "256",
               "--layers", "4", "--rounds", "1")
    res = json.loads(r.stdout)
    assert res["ratio"] > 0 and res["raw"]["samples_per_s"] > 0 and res["sluice"]["samples_per_s"] > 0
    assert res["codec_us_per_sample"]["encode"] > 0 and res["sample_bytes"] > 256 * 4 * 8


def test_help_is_fast_and_imports_nothing_heavy() -> None:
    code = "import sys, pipeline.cli; pipeline.cli.build_parser(); print(sorted(m for m in ('torch', 'megatron', 'transformers', 'ray') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


# A recipe of the tests' own, so that tuning the shipped recipes cannot change what these tests check: a task the
# warm start learns in a few dozen steps (10 prompts, "7+1=" -> "8").
WARM_RECIPE = """
[run]
name = "warm-cli"
[producer]
group_size = 4
concurrency = 2
reward = "integer_match"
return_routed_experts = true
[producer.sampling]
temperature = 1.0
max_new_tokens = 3
[prompts]
type = "synthetic"
task = "increment"
digits = 1
size = 10
[trainer]
steps = 2
batch_groups = 2
checkpoint_every = 1
lr = 1e-5
[warmstart]
enabled = true
steps = 60
batch_size = 32
lr = 3e-3
log_every = 20
eval_prompts = 10
[queue.archive]
enabled = false
"""


def test_sluice_sft_trains_the_warm_start_into_the_run_folder(tmp_path: Path) -> None:
    recipe = tmp_path / "warm.toml"
    recipe.write_text(WARM_RECIPE)
    run_dir = tmp_path / "run"
    # What an interrupted attempt leaves behind (no done.json): it must be discarded, not built upon.
    (run_dir / "warmstart" / "checkpoint.tmp").mkdir(parents=True)
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "warmstart.jsonl").write_text('{"step": 999}\n' * 5)
    r = sluice("sft", str(recipe), "--run-dir", str(run_dir), "--set", "warmstart.steps=40")
    assert not (run_dir / "warmstart" / "checkpoint.tmp").exists()
    assert "warm start: 40 steps" in r.stdout and "greedy exact match" in r.stdout
    done = json.loads((run_dir / "warmstart" / "done.json").read_text())
    assert done["steps"] == 40 and done["eval"]["split"] == "train" and done["eval"]["prompts"] == 10
    assert done["eval"]["exact_match"] >= 0.5  # the untrained tiny model answers none of them
    assert (run_dir / "model" / "config.json").exists()  # the base model, written because model.path is unset
    assert (run_dir / "warmstart" / "model" / "model.safetensors").exists()
    assert len((run_dir / "metrics" / "warmstart.jsonl").read_text().splitlines()) == 2
    assert not (run_dir / "config.json").exists()  # sft alone starts no run


@pytest.mark.slow
def test_sluice_run_warm_starts_once_and_a_rerun_skips_it(tmp_path: Path) -> None:
    recipe = tmp_path / "warm.toml"
    recipe.write_text(WARM_RECIPE)
    run_dir = tmp_path / "run"

    def run(steps: int) -> str:
        r = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(recipe), "--run-dir", str(run_dir),
                            "--steps", str(steps)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout

    first = run(2)
    assert "warm start: 60 steps" in first and "skipped" not in first
    marker = run_dir / "warmstart" / "done.json"
    stamp = marker.stat().st_mtime_ns
    steps = [json.loads(x) for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    # Engines sampled from the warm-started weights (the untrained model almost never answers "8" to "7+1="), and
    # the trainer scored those samples with the same weights (no rollout/trainer mismatch at version 0).
    assert steps[0]["reward_mean"] > 0.5
    assert steps[0]["r3/mismatch_k3_replay"] < 1e-3

    second = run(3)
    assert "warm start skipped, already done" in second
    assert marker.stat().st_mtime_ns == stamp
    log = (run_dir / "logs" / "warmstart.log").read_text()
    assert log.count("warm start step 60:") == 1  # trained once, in the first run
    assert json.loads((run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()[-1])["step"] == 3
