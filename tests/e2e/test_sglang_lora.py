"""LoRA on a real SGLang 0.5.23 server on this CPU (skipped, saying so, without ``bash scripts/sglang-cpu.sh``'s
environment): the adapter push writes each version as a PEFT folder the server loads by name, producers name the
adapter of the version they read, and what the server samples is what PEFT computes for that version's adapters.

One server for the module, started as a managed sluice engine would be (``--enable-lora``, rank 8, attention
targets, the torch-native LoRA backend this CPU has), on sluice's tiny Qwen3-MoE.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.errors import EngineError
from pipeline.producers.base import GenerateResult
from pipeline.producers.sglang_client import SGLangClient
from pipeline.sync.adapter_push import AdapterPush
from tests.helpers.sglang_server import (
    SGLangServer,
    assert_clean_run,
    moe_shape,
    require_sglang,
    sluice_run,
    start_server,
    weight_version,
    write_model,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

RANK, ALPHA = 8, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_FLAGS = ("--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", str(RANK),
              "--lora-target-modules", *TARGETS, "--max-loras-per-batch", "4")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
TOLERANCE = 0.05
"""Log-prob gap allowed between the bf16 server and the fp32 PEFT reference (measured: about 0.01)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_sglang()
    return write_model(tmp_path_factory.mktemp("sglang-lora-model") / "model")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    python = require_sglang()
    started = start_server(model_dir, tmp_path_factory.mktemp("sglang-lora-logs"), python=python, extra=LORA_FLAGS,
                           timeout=300)
    try:
        yield started
    finally:
        started.stop()
    assert not started.alive()


class Reference:
    """The HF model with a PEFT adapter whose B this test sets per version: what each version must sample as."""

    def __init__(self, model_dir: Path) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)
        self.model = get_peft_model(base, config).eval()

    def set_version(self, seed: int) -> list[tuple[str, torch.Tensor]]:
        """New A and B for every adapter; returns them as the trainer pushes them (PEFT names without the prefix,
        B times alpha / r)."""
        from peft import get_peft_model_state_dict

        generator = torch.Generator().manual_seed(seed)
        for name, param in self.model.named_parameters():
            if "lora_" in name:
                param.data = torch.randn(param.shape, generator=generator) * 0.3
        pushed = []
        for name, tensor in get_peft_model_state_dict(self.model).items():
            scale = ALPHA / RANK if ".lora_B." in name else 1.0
            pushed.append((name.removeprefix("base_model.model."), tensor * scale))
        return pushed

    def logprobs(self, prompt: list[int], output: np.ndarray, *, adapter: bool = True) -> np.ndarray:
        sequence = torch.tensor([prompt + output.tolist()])
        with torch.no_grad():
            if adapter:
                logits = self.model(sequence).logits
            else:
                with self.model.disable_adapter():
                    logits = self.model(sequence).logits
        scores = logits.log_softmax(-1)[0, len(prompt) - 1:-1]
        return scores.gather(-1, torch.as_tensor(output, dtype=torch.long)[:, None])[:, 0].numpy()


def _client(server: SGLangServer, adapters: bool = True) -> SGLangClient:
    return SGLangClient(server.url, routed_experts_shape=moe_shape(server.model_dir), timeout=120.0,
                        adapters=adapters)


async def _generate(client: SGLangClient, params: dict = GREEDY) -> list[GenerateResult]:
    return await client.generate_many(PROMPTS, params, return_routed_experts=True)


def _gap(reference: Reference, results: list[GenerateResult], *, adapter: bool = True) -> float:
    return max(float(np.abs(reference.logprobs(p, r.output_ids, adapter=adapter) - r.output_logprobs).max())
               for p, r in zip(PROMPTS, results))


def test_each_pushed_version_samples_as_peft_computes_its_adapters_and_old_ones_are_unloaded(
    server: SGLangServer, model_dir: Path, tmp_path: Path
) -> None:
    reference = Reference(model_dir)
    pusher_client, client = _client(server, adapters=False), _client(server)
    pusher = AdapterPush([pusher_client], tmp_path / "adapters", base_dir=model_dir, keep=2)

    async def scenario() -> None:
        try:
            [adopted] = await pusher.adopt(0, fresh=True, model_path=str(model_dir))
            assert adopted.action in ("labelled", "kept", "loaded"), adopted
            base = await _generate(client)
            assert _gap(reference, base, adapter=False) < TOLERANCE  # version 0 is the base alone
            assert all([s.version for s in r.weight_versions] == ["0"] for r in base)
            for version in (1, 2, 3):
                stats = await pusher.push(reference.set_version(seed=version), version)
                assert stats.weight_version == str(version) and stats.bytes > 0
                assert weight_version(server.url) == str(version)
                results = await _generate(client)
                assert all([s.version for s in r.weight_versions] == [str(version)] for r in results)
                # The adapter is applied, and it is this version's: far from the base, close to PEFT's computation.
                assert _gap(reference, results) < TOLERANCE, version
                assert _gap(reference, results, adapter=False) > 0.2, version
            # keep=2: version 1 was unloaded when 3 arrived, and its folder deleted, so that SGLang cannot bring it
            # back for a request that names it (it reloads an unloaded adapter from its path on demand).
            assert pusher.unloads == 1 and pusher.unload_timeouts == 0, pusher.counters()
            with pytest.raises(EngineError, match="sluice-v1"):
                await pusher_client.generate_raw({"input_ids": PROMPTS[0], "sampling_params": GREEDY,
                                                  "lora_path": "sluice-v1"})
            # A request in flight when a push lands finishes under the adapter it started with, every token.
            long = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
            flight = asyncio.ensure_future(client.generate(PROMPTS[0], long))
            await asyncio.sleep(0.2)
            await pusher.push(reference.set_version(seed=4), 4)
            assert not flight.done(), "the request finished before the push: lengthen it"
            finished = await flight
            assert len(finished.output_ids) == 400
            assert [s.version for s in finished.weight_versions] == ["3"]
            reference.set_version(seed=3)
            assert _gap(reference, [finished]) < TOLERANCE
        finally:
            await pusher_client.close()
            await client.close()

    asyncio.run(scenario())
    # Folders on disk are the versions the engines keep; each is a PEFT adapter folder.
    folders = sorted(p.name for p in (tmp_path / "adapters").iterdir())
    assert folders == ["v3", "v4"], folders
    config = json.loads((tmp_path / "adapters" / "v4" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == RANK and sorted(config["target_modules"]) == sorted(TARGETS)


STEPS = 8
RUN_TIMEOUT_S = 600.0


def test_a_sync_lora_run_on_sglang_pushes_adapters_each_step_and_samples_under_them(
    server: SGLangServer, model_dir: Path, tmp_path: Path
) -> None:
    # On-policy (sync): the trainer's log-probs must equal the sampler's, so a producer that sampled from the base or
    # from another version's adapters shows at once (measured: k3 below 6e-5 at every step; 0.026 by step 8 when
    # requests named no adapter).
    run = sluice_run(tmp_path / "run", [
        "mode=sync", "engine.type=sglang", f'engine.urls=["{server.url}"]',
        f"model.path={json.dumps(str(model_dir))}",
        "warmstart.enabled=false", "eval.heldout.enabled=false",
        "trainer.batch_groups=4", "filters.zero_variance=false", "trainer.checkpoint_every=4",
        "producer.concurrency=4", "trainer.lora.serve=adapter", f"trainer.lora.rank={RANK}",
        "trainer.lora.keep_loaded=2", "trainer.lr=5e-2",
        # The untrained model's answers vary in length, so this reward has a gradient from the first step.
        'plugins.paths=["tests/fixtures"]', "producer.reward=user_rewards:length_reward",
    ], steps=STEPS, timeout=RUN_TIMEOUT_S, log=tmp_path / "launcher.log")
    assert_clean_run(run, STEPS, RUN_TIMEOUT_S)
    # The trainer's log-probs (base + its adapters) are those the server sampled with (base + the pushed adapters of
    # the version each request named): the push carried the adapters, and the server applied them.
    k3 = [m["mismatch_k3"] for m in run.metrics if "mismatch_k3" in m]
    assert k3 and max(k3) < 2e-3, k3
    assert weight_version(server.url) == str(STEPS)
    # Only the versions the engine keeps are on disk, as PEFT folders the server loaded.
    folders = sorted(p.name for p in (tmp_path / "run" / "adapters").iterdir())
    assert folders == [f"v{STEPS - 1}", f"v{STEPS}"], folders

    async def sample() -> GenerateResult:
        client = _client(server)
        try:
            return await client.generate(PROMPTS[0], {"max_new_tokens": 3, "temperature": 1.0})
        finally:
            await client.close()

    after = asyncio.run(sample())
    assert [s.version for s in after.weight_versions] == [str(STEPS)]
