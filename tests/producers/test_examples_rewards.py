"""The shipped examples run: the group judges and hooks load through a recipe's plugins.paths, and the reward
service (examples/reward_server.py, started as its own process) scores a group through the producer's scorer."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.consumers.trainer.hooks import HookRunner
from pipeline.data.prompts import Prompt
from pipeline.net import free_port
from pipeline.producers.rewards import HttpScorer, setup_scorer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PROMPT = Prompt(prompt_id="p-1", text="12+30=", answer="42")


def test_the_example_judges_score_against_the_group() -> None:
    cfg = load_config(overrides=[f"plugins.paths=[{json.dumps(str(EXAMPLES))}]",
                                 'producer.group_reward="judge:pairwise"'])
    scorer = setup_scorer(cfg.producer)
    outcomes = asyncio.run(scorer.score_group(PROMPT, ["42", "40", "7", "x"]))
    assert [o.reward for o in outcomes] == [1.0, 2 / 3, 1 / 3, 0.0]
    cfg = load_config(overrides=[f"plugins.paths=[{json.dumps(str(EXAMPLES))}]",
                                 'producer.group_reward="judge:consensus"'])
    outcomes = asyncio.run(setup_scorer(cfg.producer).score_group(PROMPT, ["41", "41", "42", "?"]))
    assert [o.reward for o in outcomes] == [0.5, 0.5, 0.25, 0.0]


def test_the_example_hooks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(overrides=[f"plugins.paths=[{json.dumps(str(EXAMPLES))}]", 'hooks.metrics=["hooks:append_csv"]',
                                 'hooks.after_step=["hooks:warn_on_empty_step"]',
                                 'hooks.after_commit=["hooks:mark_latest"]'])
    monkeypatch.setenv("SLUICE_HOOKS_CSV", str(tmp_path / "m.csv"))
    runner = HookRunner.from_config(cfg.hooks)
    assert runner is not None
    (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)
    for step in (1, 2):
        assert runner.on_step(step, {"samples": 0, "policy_version": step}, {"step": step, "loss": 0.1})[
            "hooks/errors"] == 0
    runner.on_commit(2, str(tmp_path / "checkpoints" / "step-00000002"))
    assert (tmp_path / "m.csv").read_text().splitlines()[1:] == ["1.0,,,0.1,,", "2.0,,,0.1,,"]
    assert (tmp_path / "checkpoints" / "LATEST").read_text() == "step-00000002\n"


def test_the_example_reward_service_serves_the_protocol(tmp_path: Path) -> None:
    port = free_port()
    env = dict(os.environ, SLUICE_REWARD_TOKEN="s3cret")
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "reward_server.py"), "--port", str(port),
                             "--token-env", "SLUICE_REWARD_TOKEN"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the reward server did not start"
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/score"

        async def scenario() -> tuple[list, list]:  # type: ignore[type-arg]
            good = HttpScorer(url, headers={"Authorization": "Bearer s3cret"}, timeout_s=5, concurrency=2)
            bad = HttpScorer(url, timeout_s=5, concurrency=2)
            try:
                return (await good.score_group(PROMPT, ["42", "41\n", " 42 \nmore"]),
                        await bad.score_group(PROMPT, ["42"]))
            finally:
                await good.close()
                await bad.close()

        scored, refused = asyncio.run(scenario())
        assert [(o.reward, o.info) for o in scored] == [(1.0, {"pass": True}), (0.0, {"pass": False}),
                                                        (1.0, {"pass": True})]
        assert refused[0].failed and "401" in refused[0].info["error"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
