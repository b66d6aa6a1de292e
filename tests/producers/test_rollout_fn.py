"""Rollout functions (``producer.rollout``): multi-turn trajectories through the real producer, CPU engine and
Redis queue. Environment tokens are masked out of the loss; each model token keeps its own log-prob and version;
the routing the trainer replays lines up with the final sequence position by position across turns; a bad
``producer.rollout`` is refused at load with the field named; a rollout that raises skips its prompt, counted."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline import plugins
from pipeline.config import load_config
from pipeline.config.producer import ProducerConfig, SamplingConfig
from pipeline.data.prompts import Prompt, synthetic
from pipeline.errors import ConfigError, SampleError
from pipeline.producers.cursor import PromptCursor
from pipeline.producers.producer import Producer, load_codec, read_num_experts, resolve_rollout
from pipeline.producers.rollout import EnvTurn, ModelTurn, Trajectory
from pipeline.producers.sglang_client import SGLangClient
from pipeline.queue.connection import connect
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample
from tests.helpers.engines import EngineProcess

FIXTURES = Path(__file__).parents[1] / "fixtures"
ROOT = Path(__file__).parents[2]
plugins.activate([FIXTURES, ROOT / "examples"])  # as a recipe's plugins.paths would
import calc_tool  # noqa: E402  (the shipped example)
import user_rollouts  # noqa: E402

# Independent prefill of the same sequence vs the sampled one: the same fp32 model in differently shaped matmuls.
LOGPROB_TOL = 1e-4


def _reward(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    return float(len(response)), {"text": response}


def _producer(queue: SampleQueue, engine: Any, model_dir: Path, rollout: str, **cfg: Any) -> Producer:
    config = ProducerConfig(sampling=SamplingConfig(max_new_tokens=8), rollout=rollout, **cfg)
    return Producer(config, name="p0", queue=queue, engine=engine, prompts=synthetic("addition", size=64, seed=1),
                    tokenize=load_codec(model_dir).encode, reward_fn=_reward, pacing=None,
                    num_experts=read_num_experts(model_dir), rollout_fn=resolve_rollout(rollout),
                    codec=load_codec(model_dir))


def _queued(queue: SampleQueue) -> list[list[Sample]]:
    groups = []
    for _, entry in queue.scan():
        assert not isinstance(entry, Exception), entry
        groups.append(entry.samples)
    return groups


def _run(producer: Producer, engine: EngineProcess, max_groups: int) -> None:
    async def go() -> None:
        client = SGLangClient(engine.url)
        producer.engine = client
        try:
            await producer.run(max_groups=max_groups)
        finally:
            await client.close()

    asyncio.run(go())


def _reference(engine: EngineProcess, sample: Sample) -> tuple[np.ndarray, np.ndarray]:
    """An independent prefill of the sample's whole sequence in one fresh request: (log-prob of each token given
    the ones before it, routing rows [P + R, layers, topk])."""
    ids = [int(t) for t in (*sample.prompt_ids, *sample.response_ids)]

    async def go() -> Any:
        async with SGLangClient(engine.url) as client:
            return await client.generate_raw({
                "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0, "return_routed_experts": True})

    meta = asyncio.run(go())["meta_info"]
    logprobs = np.array([np.nan if x[0] is None else x[0] for x in meta["input_token_logprobs"]], dtype=np.float64)
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(len(ids), 2, 2)
    return logprobs, rows


@pytest.fixture(scope="module")
def three_turn_groups(engine: EngineProcess, model_dir: Path, redis_url: str) -> list[list[Sample]]:
    client = connect(redis_url)
    queue = SampleQueue(client, f"rollout-{uuid.uuid4().hex[:12]}", capacity=1000)
    producer = _producer(queue, None, model_dir, "user_rollouts:three_turns", group_size=2)
    _run(producer, engine, max_groups=3)
    groups = _queued(queue)
    keys = list(client.scan_iter(match=f"{queue.keys.prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()
    assert producer.stats.rollouts_failed == 0 and len(groups) == 3
    return groups


def test_environment_tokens_are_masked_and_model_tokens_keep_their_logprobs(
    three_turn_groups: list[list[Sample]], engine: EngineProcess, model_dir: Path
) -> None:
    codec = load_codec(model_dir)
    env = [codec.encode(t) for t in user_rollouts.ENV_TEXTS]
    a, b, c = user_rollouts.TURN_TOKENS
    expected_mask = [1] * a + [0] * len(env[0]) + [1] * b + [0] * len(env[1]) + [1] * c
    for group in three_turn_groups:
        for s in group:
            assert s.loss_mask.tolist() == expected_mask
            response = s.response_ids.tolist()
            assert response[a:a + len(env[0])] == env[0]
            assert response[a + len(env[0]) + b:][:len(env[1])] == env[1]
            assert s.reward_info["turns"] == 5 and s.reward_info["text"] == codec.decode(response)
            masked = s.loss_mask == 0
            assert np.all(s.rollout_logprobs[masked] == 0.0)  # placeholders, never trained on
            assert np.all(s.rollout_logprobs[~masked] < 0.0)
            assert s.token_versions.tolist() == [0] * len(response)
            # Each model token's log-prob is the one its own turn sampled it with: an independent prefill of the
            # final sequence gives the same numbers at exactly those positions.
            ref, _ = _reference(engine, s)
            p = len(s.prompt_ids)
            diff = np.abs(ref[p:][~masked] - s.rollout_logprobs[~masked])
            assert diff.max() < LOGPROB_TOL, diff


def test_routing_lines_up_with_the_final_sequence_across_turns(
    three_turn_groups: list[list[Sample]], engine: EngineProcess
) -> None:
    """R3 replays row i at position i of prompt + response. Rows come from three engine calls (the prompt and turn 1
    from the first; the environment tokens and turn 2 from the second's prefill; ...): they must agree, position by
    position, with one fresh prefill of the whole sequence; a row missing or doubled at a turn boundary would shift
    everything after it, which the shifted comparison shows."""
    same = shifted = total = 0
    for group in three_turn_groups:
        for s in group:
            rows = s.routed_experts
            assert rows is not None and len(rows) == len(s.prompt_ids) + len(s.response_ids) - 1
            _, ref = _reference(engine, s)
            got, want = np.sort(rows.astype(np.int64), -1), np.sort(ref[: len(rows)].astype(np.int64), -1)
            agree = (got == want).all(-1)  # [positions, layers]
            same += int(agree.sum())
            shifted += int((got[1:] == want[:-1]).all(-1).sum())
            total += agree.size
    print(f"routing rows agreeing with one fresh prefill: {same}/{total}; moved by one position: {shifted}/{total}")
    assert same / total >= 0.99, f"{same}/{total} top-k sets agree"
    assert shifted / total < 0.6, "the shifted comparison agrees too: the check has no power on this model"


def test_the_trainer_replaying_multi_turn_routing_reproduces_the_engines_logprobs(
    three_turn_groups: list[list[Sample]], model_dir: Path
) -> None:
    """Through megatron-core's router replay (R3) with the engine's weights: every model token of every turn gets
    the log-prob the engine sampled it with; the same rows moved by one position (a row lost at a turn boundary)
    do not."""
    pytest.importorskip("megatron.core")
    from pipeline.config.trainer import TrainStepConfig
    from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig
    from pipeline.consumers.megatron.convert import load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel
    from pipeline.consumers.rl.train_step import TrainStep

    model_cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()), dtype="float32")
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel, seed=3)
    model = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(model, model_dir, model_cfg)
    trainer = TrainStep(model, model_cfg, TrainStepConfig(r3=True))
    shifted = [[dataclasses.replace(s, routed_experts=np.roll(s.routed_experts, 1, axis=0)) for s in g]
               for g in three_turn_groups]
    try:
        replayed = trainer.compute_logprobs(three_turn_groups, replay=True)
        moved = trainer.compute_logprobs(shifted, replay=True)
    finally:
        trainer.close()
    samples = [s for g in three_turn_groups for s in g]
    gaps = [np.abs(x - s.rollout_logprobs)[s.loss_mask == 1] for x, s in zip(replayed, samples, strict=True)]
    moved_gaps = [np.abs(x - s.rollout_logprobs)[s.loss_mask == 1] for x, s in zip(moved, samples, strict=True)]
    worst, moved_mean = max(float(g.max()) for g in gaps), float(np.mean(np.concatenate(moved_gaps)))
    print(f"max |trainer (R3) - engine log-prob| over model tokens of 3-turn samples: {worst:.2e}; "
          f"with the rows moved by one: mean {moved_mean:.3f}")
    assert worst < LOGPROB_TOL
    assert moved_mean > 100 * LOGPROB_TOL


def test_the_heldout_evaluator_runs_the_recipes_rollout_function(
    engine: EngineProcess, model_dir: Path, tmp_path: Path
) -> None:
    """A tool-using policy is evaluated as it acts: the reward sees the environment's text only when the evaluator
    generates through the rollout function, and the response length counts the model's tokens alone."""
    from pipeline.heldout.evaluate import HeldoutEvaluator, HeldoutSettings

    codec = load_codec(model_dir)
    settings = HeldoutSettings(samples=2, pass_k=(1, 2), temperature=1.0, max_new_tokens=4, seed=3)
    prompts = [synthetic("addition", size=4, seed=1)[i] for i in range(4)]

    def saw_the_environment(prompt: Prompt, response: str) -> float:
        return float(all(t in response for t in user_rollouts.ENV_TEXTS))

    async def evaluate(rollout_fn: Any) -> dict[str, Any]:
        client = SGLangClient(engine.url)
        evaluator = HeldoutEvaluator(settings, engine=client, prompts=prompts, tokenize=codec.encode,
                                     reward_fn=saw_the_environment, metrics_path=tmp_path / "heldout.jsonl",
                                     rollout_fn=rollout_fn, codec=codec)
        try:
            return await evaluator.evaluate(0, model_dir)  # the same weights, labelled with the version they have
        finally:
            await client.close()

    through = asyncio.run(evaluate(user_rollouts.three_turns))
    plain = asyncio.run(evaluate(None))
    assert through["greedy_pass1"] == 1.0 and through["sampled_pass1"] == 1.0
    assert through["response_len_mean"] == sum(user_rollouts.TURN_TOKENS)
    assert plain["greedy_pass1"] == 0.0 and plain["sampled_pass1"] == 0.0


@pytest.mark.parametrize("fn", ["odd_prompts_raise", "odd_prompts_raise_oserror", "odd_prompts_hang"])
def test_a_failing_rollout_skips_its_prompt_and_the_producer_goes_on(
    engine: EngineProcess, model_dir: Path, queue: SampleQueue, fn: str
) -> None:
    producer = _producer(queue, None, model_dir, f"user_rollouts:{fn}", group_size=2, rollout_timeout_s=1.0)
    _run(producer, engine, max_groups=3)
    groups = _queued(queue)
    assert len(groups) == 3 and producer.stats.groups_put == 3
    assert producer.stats.rollouts_failed >= 2  # prompts 1 and 3 at least were tried on the way
    assert producer.stats.engine_errors == 0  # an OSError of the function's own is not taken for the engine's
    assert all(int(g[0].prompt_id.split("-")[1]) % 2 == 0 for g in groups)
    assert PromptCursor(queue.redis, queue.run).retries() == []  # skipped, not handed back to fail again


def test_a_rollout_returning_the_wrong_count_fails_its_group(
    engine: EngineProcess, model_dir: Path, queue: SampleQueue
) -> None:
    producer = _producer(queue, None, model_dir, "user_rollouts:one_too_few", group_size=2)

    async def go() -> None:
        client = SGLangClient(engine.url)
        producer.engine = client
        stop = asyncio.Event()
        task = asyncio.create_task(producer.run(stop=stop))
        while producer.stats.rollouts_failed < 3 and not task.done():
            await asyncio.sleep(0.05)
        stop.set()
        await task
        await client.close()

    asyncio.run(go())
    assert producer.stats.rollouts_failed >= 3 and producer.stats.groups_put == 0 and _queued(queue) == []


@pytest.mark.parametrize(("ref", "hint"), [
    ("user_rollouts:missing", "has no attribute"),
    ("no_such_module:rollout", "cannot import"),
    ("user_rollouts:not_async", "must be an async function"),
    ("user_rollouts:two_arguments", "must accept"),
    ("user_rollouts", "not an import path"),
])
def test_a_bad_rollout_is_refused_at_load_with_the_field_named(ref: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=r"producer\.rollout") as err:
        load_config(overrides=[f"producer.rollout={ref}", f"plugins.paths=[{str(FIXTURES)!r}]"])
    assert hint in str(err.value)
    cfg = load_config(overrides=["producer.rollout=user_rollouts:three_turns", f"plugins.paths=[{str(FIXTURES)!r}]"])
    assert [r["field"] for r in cfg.plugin_records()] == ["producer.rollout"]  # recorded in RUN_DIR/plugins.json


def _turn(ids: list[int], versions: list[str], rows: int | None) -> ModelTurn:
    return ModelTurn(ids=np.array(ids, dtype=np.int32), logprobs=np.full(len(ids), -1.0, dtype=np.float32),
                     versions=tuple(versions), routing=None if rows is None else np.zeros((rows, 2, 2), np.int32),
                     finish_reason="stop", finish_detail={}, text="", engine_text="", engine="e")


def test_environment_tokens_take_the_version_before_them_and_routing_must_cover_the_sequence() -> None:
    traj = Trajectory(np.array([5, 6, 7], dtype=np.int32))
    traj.add_model(_turn([10, 11], ["3", "4"], rows=3 + 2 - 1))
    traj.add_env([20, 21, 22], "env")
    traj.add_model(_turn([12], ["5"], rows=3 + 1))  # rows for the three env tokens and the last of turn 1
    flat = traj.flatten()
    assert flat.loss_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert flat.versions == ("3", "4", "4", "4", "4", "5")  # so version_min/max are the model tokens' own
    assert flat.routing is not None and len(flat.routing) == 3 + 6 - 1
    assert isinstance(traj.turns[1], EnvTurn) and traj.ids == [5, 6, 7, 10, 11, 20, 21, 22, 12]
    traj.add_env([23, 24], "done")  # a closing environment turn: nothing trained comes after it, nothing routed it
    assert traj.flatten().response_ids.tolist() == [10, 11, 20, 21, 22, 12] and traj.text.endswith("done")
    bad = Trajectory(np.array([5, 6, 7], dtype=np.int32), turns=[*traj.turns[:2]])
    bad.add_model(_turn([12], ["5"], rows=1 + 1))  # as if generated from the prompt alone: rows do not line up
    with pytest.raises(SampleError, match="P \\+ R - 1"):
        bad.flatten()


def test_the_calculator_evaluates_arithmetic_and_nothing_else() -> None:
    assert calc_tool.calculate("37*45") == "1665" and calc_tool.calculate("(2+3)*4-1") == "19"
    for expr in ("__import__('os')", "2**10", "1/0", "x", "9" * 70, "[1]"):
        assert calc_tool.calculate(expr) == calc_tool.ERROR
    p = Prompt(prompt_id="m", text="37*45=", answer="1665")
    assert calc_tool.reward(p, "<calc>37*45</calc>1665\n1665") == (1.0, {"pass": True, "used_tool": True})
    assert calc_tool.reward(p, "1665")[0] == 1.0 and calc_tool.reward(p, "<calc>37*45</calc>1665\n1666")[0] == 0.0


@pytest.mark.learning
def test_the_calc_recipe_learns_to_use_the_tool(tmp_path: Path) -> None:
    """recipes/cpu-calc.toml: the reward climbs as the calls take over (three runs of it on two shared cores gave
    reward windows 0.364 ... 0.659 0.766 0.728, 0.368 ... 0.671 0.773 0.767 and 0.370 ... 0.962 0.983 0.967;
    held-out greedy pass@1 0.074 -> 0.805, 0.816 and 0.988; docs/plugins.md)."""
    from pipeline.queue.archive import ArchiveReader

    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "recipes/cpu-calc.toml", "--run-dir",
                        str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {}
    for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines():
        d = json.loads(line)
        rows[d["step"]] = d["reward_mean"]
    values = [rows[k] for k in sorted(rows)]
    size = len(values) // 10
    windows = [sum(values[i * size:(i + 1) * size]) / size for i in range(10)]
    held = [json.loads(x) for x in (run_dir / "eval" / "metrics.jsonl").read_text().splitlines()]
    greedy = {d["version"]: d["greedy_pass1"] for d in held if d.get("kind") == "heldout"}
    samples = sorted(ArchiveReader(run_dir / "archive").samples(), key=lambda s: s.created_at)
    tenth = len(samples) // 10
    tool = [sum(bool(s.reward_info.get("used_tool")) for s in part) / len(part)
            for part in (samples[:tenth], samples[-tenth:])]
    print(f"reward windows {[round(w, 3) for w in windows]}; held-out greedy {greedy}; tool use {tool}")
    assert windows[0] < 0.45 and sum(windows[-3:]) / 3 >= 0.65
    assert greedy[0] <= 0.2 and greedy[max(greedy)] >= 0.7
    assert tool[0] < 0.6 and tool[1] >= 0.9  # the reward climbed by calling the tool
