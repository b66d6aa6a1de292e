"""Prompt sources, the shared prompt cursor, admission pacing and reward functions."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import plugins
from pipeline.config import load_config
from pipeline.config.prompts import PromptConfig
from pipeline.consumers.trainer.staleness import may_admit
from pipeline.data.prompts import Prompt, load_jsonl, setup_heldout, setup_prompts, synthetic
from pipeline.errors import ConfigError
from pipeline.producers.cursor import PromptCursor
from pipeline.producers.producer import _TAKE
from pipeline.producers.rewards import integer_match, prefix_match, resolve_reward, score
from pipeline.queue.keys import RunKeys

plugins.activate([Path(__file__).parents[1] / "fixtures"])  # as a recipe's plugins.paths would


def test_synthetic_tasks_are_deterministic_and_answerable() -> None:
    a, b = synthetic("addition", size=50, seed=3), synthetic("addition", size=50, seed=3)
    assert [a[i] for i in range(50)] == [b[i] for i in range(50)]
    for i in range(50):
        x, y = a[i].text.rstrip("=").split("+")
        assert int(a[i].answer) == int(x) + int(y)
    rev = synthetic("reverse", size=5)
    assert rev[0].answer == rev[0].text.split(" ")[1].rstrip(":")[::-1]
    assert a[50].prompt_id == a[0].prompt_id  # epochs wrap
    with pytest.raises(ConfigError, match="unknown synthetic task"):
        synthetic("chess")


def test_heldout_split_is_distinct_and_disjoint_from_training(tmp_path: Path) -> None:
    cfg = PromptConfig(task="addition", digits=2, size=2000, heldout=300, seed=5)
    train, held = setup_prompts(cfg), setup_heldout(cfg)
    train_texts = {train[i].text for i in range(len(train))}
    held_texts = {held[i].text for i in range(len(held))}
    assert len(train) == 2000 and len(train_texts) == 2000  # every training prompt distinct
    assert len(held) == 300 and len(held_texts) == 300
    assert not train_texts & held_texts  # never trained on
    assert setup_heldout(cfg)[7] == held[7]  # deterministic: producers and evaluator agree without talking
    with pytest.raises(ConfigError, match="has 100 distinct prompts"):
        setup_prompts(PromptConfig(task="addition", digits=1, size=90, heldout=20))
    with pytest.raises(ConfigError, match="no held-out split"):
        setup_heldout(PromptConfig())
    rows = [{"id": str(i), "prompt": f"{i}+0=", "answer": str(i)} for i in range(10)]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    file_cfg = PromptConfig(type="jsonl", path=tmp_path / "p.jsonl", heldout=3)
    assert len(setup_prompts(file_cfg)) == 7 and [setup_heldout(file_cfg)[i].prompt_id for i in range(3)] == ["7", "8", "9"]
    with pytest.raises(ConfigError, match="give one of them"):
        PromptConfig(type="jsonl", path=tmp_path / "p.jsonl", heldout=3, heldout_path=tmp_path / "p.jsonl")


def test_jsonl_and_parquet_sources(tmp_path: Path) -> None:
    rows = [{"id": "a", "prompt": "1+1=", "answer": "2", "level": 1}, {"id": "b", "input_ids": [5, 6], "answer": "x"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    src = load_jsonl(tmp_path / "p.jsonl")
    assert len(src) == 2 and src[0].text == "1+1=" and src[0].metadata == {"level": 1}
    assert src[1].input_ids == (5, 6) and src[1].text is None
    pq.write_table(pa.Table.from_pylist([{"id": "a", "prompt": "2+2=", "answer": "4"}]), tmp_path / "p.parquet")
    par = setup_prompts(PromptConfig(type="parquet", path=tmp_path / "p.parquet"))
    assert par[0] == Prompt(prompt_id="a", text="2+2=", answer="4")
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n{not json\n')
    with pytest.raises(ConfigError, match="neither 'prompt' nor 'input_ids'"):
        load_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="needs prompts.path"):
        setup_prompts(PromptConfig(type="jsonl"))
    with pytest.raises(ConfigError, match="not found"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_cursor_hands_out_each_index_once_across_producers(redis_client: redis.Redis, run_name: str) -> None:
    taken: list[int] = []
    lock = threading.Lock()

    def producer() -> None:
        cur = PromptCursor(redis_client, run_name)
        for _ in range(50):
            i, _ = cur.next()
            with lock:
                taken.append(i)

    threads = [threading.Thread(target=producer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == list(range(200))
    cur = PromptCursor(redis_client, run_name)
    cur.give_back(7)
    assert cur.next() == (7, True) and cur.next() == (200, False) and cur.position() == 201


@settings(max_examples=40, deadline=None)
@given(version=st.integers(0, 20), max_lag=st.integers(0, 4), batch=st.integers(1, 8), started=st.integers(0, 200))
def test_atomic_admission_matches_the_pure_rule(redis_url: str, version: int, max_lag: int, batch: int,
                                                started: int) -> None:
    client = redis.Redis.from_url(redis_url, protocol=2)
    keys = RunKeys("admission-prop")
    client.delete(keys.prompt_retry, keys.producer_inflight("p"))
    client.set(keys.policy_version, version)
    client.set(keys.groups_started, started)
    take = client.register_script(_TAKE)
    got = take(keys=[keys.policy_version, keys.groups_started, keys.prompt_retry, keys.prompt_cursor,
                     keys.producer_inflight("p")], args=[1, max_lag, batch, "g"])
    admitted = got != -1
    assert admitted == may_admit(started, version, max_lag, batch)
    assert int(client.get(keys.groups_started)) == started + int(admitted)
    # An admitted group is recorded as in flight, in the same script, with the prompt it took.
    assert client.hget(keys.producer_inflight("p"), "g") == (got[0] if admitted else None)


def test_builtin_rewards() -> None:
    p = Prompt(prompt_id="x", text="12+30=", answer="42")
    assert integer_match(p, "42\n") == (1.0, {"pass": True, "parsed": True})
    assert integer_match(p, "41") == (0.1, {"pass": False, "parsed": True})
    assert integer_match(p, "forty") == (0.0, {"pass": False, "parsed": False})
    assert resolve_reward("exact_match")(p, " 42 \nmore") == (1.0, {"pass": True})
    c = Prompt(prompt_id="c", text="copy abcd:", answer="abcd")
    assert prefix_match(c, "abxd")[0] == 0.75


def test_user_rewards_resolve_and_are_checked_at_startup() -> None:
    assert resolve_reward("user_rewards:length_reward")(None, "abc") == 3.0  # type: ignore[arg-type]
    for spec, match in [("nope", "neither a built-in"), ("user_rewards:missing", "no attribute"),
                        ("no_such_module:f", "cannot import"), ("user_rewards:NOT_CALLABLE", "not a function"),
                        ("user_rewards:wrong_signature", "must accept")]:
        with pytest.raises(ConfigError, match=match):
            resolve_reward(spec)


def test_failing_rewards_mark_the_sample_failed_and_do_not_raise() -> None:
    p = Prompt(prompt_id="x", text="q", answer="a")

    async def run() -> list:
        return await asyncio.gather(
            score(resolve_reward("user_rewards:raising_reward"), p, "r", 5.0),
            score(resolve_reward("user_rewards:slow_reward"), p, "r", 0.2),
            score(resolve_reward("user_rewards:nan_reward"), p, "r", 5.0),
            score(resolve_reward("user_rewards:async_reward"), p, "r", 5.0),
            score(resolve_reward("exact_match"), Prompt(prompt_id="n", text="q"), "r", 5.0),  # no answer
        )

    raising, slow, nan, ok, no_answer = asyncio.run(run())
    assert raising.failed and "verifier crashed on purpose" in raising.info["error"]
    assert slow.failed and "timed out" in slow.info["error"]
    assert nan.failed and "nan" in nan.info["error"]
    assert not ok.failed and ok.reward == 0.5 and ok.info == {"seen": "r"}
    assert no_answer.failed and "no answer" in no_answer.info["error"]


def test_plugins_come_only_from_the_recipes_folders_and_are_recorded(tmp_path: Path) -> None:
    """A module importable from elsewhere (the working directory, PYTHONPATH) is refused until plugins.paths names
    its folder; the run folder's record then holds its file and hash, which change when the code does."""
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "stray_reward.py").write_text("def score(prompt, response):\n    return 1.0\n")
    sys.path.insert(0, str(stray))  # importable, as a PYTHONPATH entry would make it
    try:
        with pytest.raises(ConfigError, match=r"producer\.reward = 'stray_reward:score'.*outside plugins\.paths"):
            load_config(overrides=["producer.reward=stray_reward:score"])
    finally:
        sys.path.remove(str(stray))
    with pytest.raises(ConfigError, match=r"plugins\.paths.*not a folder"):
        load_config(overrides=[f"plugins.paths=[{str(tmp_path / 'nowhere')!r}]"])
    cfg = load_config(overrides=["producer.reward=stray_reward:score", f"plugins.paths=[{str(stray)!r}]"])
    [rec] = cfg.plugin_records()
    source = (stray / "stray_reward.py").read_bytes()
    assert rec["field"] == "producer.reward" and rec["file"] == str(stray / "stray_reward.py")
    assert rec["sha256"] == hashlib.sha256(source).hexdigest()
