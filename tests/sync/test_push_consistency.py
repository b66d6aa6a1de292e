"""Generation across a push: a push of many buckets lands while two real CPU engines are generating.

The trainer's own push path drives it (``Trainer.push_weights`` with a ``RedisClock`` on a real Redis, the rotation
and the pusher), with weights of another model so that every token shows which weights computed it. Checked:

- the policy version in Redis moves only after every engine confirmed (a poller reads Redis, then both engines;
  versions only grow, so Redis at the new version with an engine still at the old one would be a violation);
- no request was aborted: both run to their full length;
- every token was computed by the weights of the version it is labelled with. Tokens labelled 0 match an
  independent forward of the old model; tokens labelled 1 match the new model run over the KV cache the old model
  left (the engine pauses *in place*: cached keys and values stay, the next forward pass is the new weights'). A
  token from half-updated weights matches neither.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.consumers.trainer.ledger import Ledger
from pipeline.consumers.trainer.loop import RankZero, RedisClock, Trainer, TrainerSettings
from pipeline.models.tiny import init_tiny_model
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.queue.redis_streams import SampleQueue
from pipeline.sync.pusher import PushOptions, WeightPusher
from pipeline.sync.rotation import EngineRotation
from tests.helpers.engines import start_engine

pytestmark = pytest.mark.slow
PROMPT = [11, 12, 13, 14, 15]
NEW_TOKENS = 600
LOGPROB_ATOL = 1e-4  # fp32 engine vs an fp32 reference: rounding of differently shaped matmuls only


class _Unused:
    """The trainer's source and step, which a push never touches."""

    policy_version: int | None = None

    def recover(self) -> None: ...

    def state_dict(self) -> dict[str, int]:
        return {}


def _reference_logprobs(old: Any, new: Any, tokens: list[int], switch: int) -> np.ndarray:
    """Log-probs of ``tokens`` (the output after PROMPT): the old model up to output ``switch``, then the new model
    continuing over the old model's KV cache, as an engine paused in place computes them."""
    ids = torch.tensor([PROMPT + tokens])
    p = len(PROMPT)
    with torch.no_grad():
        if switch == 0:
            logits = new(ids).logits[0]
        else:
            # The old model fed everything up to output switch - 1 (exclusive); its forward of output switch - 1
            # already ran under the new weights.
            first = old(ids[:, : p + switch - 1], use_cache=True)
            rest = new(ids[:, p + switch - 1 :], cache=first.cache, use_cache=True)
            logits = torch.cat([first.logits[0], rest.logits[0]])
    logprobs = torch.log_softmax(logits.float(), dim=-1)[p - 1 : p - 1 + len(tokens)]
    return logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


def test_a_push_mid_generation_pauses_in_place_and_every_token_matches_its_version(
    model_dir: Path, tmp_path: Path, queue: SampleQueue
) -> None:
    import transformers

    new_dir = init_tiny_model("qwen3-moe", tmp_path / "new", seed=1)
    old = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = transformers.AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    weights = sorted(load_file(str(new_dir / "model.safetensors")).items())
    engines = [start_engine(model_dir, tmp_path), start_engine(model_dir, tmp_path)]
    clock = RedisClock(queue)
    violations: list[tuple[int, list[str]]] = []
    seen: list[tuple[int, list[str]]] = []
    polling = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=10) as http:
            while not polling.is_set():
                version = clock.get()  # first Redis, then the engines: an engine's version only grows
                reported = [http.get(f"{e.url}/model_info").json()["weight_version"] for e in engines]
                seen.append((version, reported))
                if version >= 1 and reported != ["1", "1"]:
                    violations.append((version, reported))
                time.sleep(0.005)

    def trainer_side() -> Trainer:
        # The trainer's loop is its own, as in a trainer process; its engine clients live on it.
        loop = asyncio.new_event_loop()
        clients: list[Any] = [SGLangClient(e.url, retry=NO_RETRY) for e in engines]

        async def connect(members: list[Any]) -> WeightPusher:
            # 16 KB buckets: the tiny model takes dozens, so without a pause decode steps would run between them.
            return await WeightPusher.connect(members, master_address="127.0.0.1", backend="gloo", timeout_s=60,
                                              options=PushOptions(bucket_bytes=16 * 1024))

        rotation = loop.run_until_complete(EngineRotation.start(clients, connect))
        model = torch.nn.Linear(1, 1)
        return Trainer(
            TrainerSettings(steps=1, batch_groups=1, checkpoint_every=1, keep_checkpoints=1, run_dir=tmp_path / "run",
                            overlap_push=False),
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step_fn=_Unused(),  # type: ignore[arg-type]
            export_weights=lambda: iter(weights), loop=loop,
            lead=RankZero(source=_Unused(), clock=clock, ledger=Ledger(tmp_path / "run" / "ledger"),  # type: ignore[arg-type]
                          pusher=rotation),
        )

    async def scenario() -> tuple[list[Any], Any]:
        trainer = await asyncio.to_thread(trainer_side)
        clients = [SGLangClient(e.url, retry=NO_RETRY) for e in engines]
        greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        running = [asyncio.ensure_future(c.generate(PROMPT, greedy)) for c in clients]
        try:
            while min([(await c.get_load()).total("tokens_generated") for c in clients]) < 100:
                await asyncio.sleep(0.01)
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            try:
                await asyncio.to_thread(trainer.push_weights, background=False)
                results = await asyncio.gather(*running)
            finally:
                polling.set()
                poller.join()
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await asyncio.to_thread(trainer.close)
            for c in clients:
                await c.close()
        return results, trainer

    try:
        results, trainer = asyncio.run(scenario())
    finally:
        for e in engines:
            e.stop()

    assert trainer.version == 1 and clock.get() == 1
    assert not violations, violations[:5]
    assert any(v == 0 for v, _ in seen) and any(v == 1 for v, _ in seen)  # the poller saw the push happen
    for result in results:
        tokens = result.output_ids.tolist()
        assert result.finish_reason == "length" and len(tokens) == NEW_TOKENS  # nothing was aborted
        spans = [(s.version, s.start, s.end) for s in result.weight_versions]
        assert [v for v, _, _ in spans] == ["0", "1"], spans  # the push landed mid-generation
        switch = spans[0][2]
        expected = _reference_logprobs(old, new, tokens, switch)
        got = np.asarray(result.output_logprobs)
        worst = np.abs(got - expected).max()
        print(f"switch at token {switch} of {len(tokens)}; worst logprob gap {worst:.2e}")
        assert worst < LOGPROB_ATOL, (switch, np.argmax(np.abs(got - expected)), worst)
