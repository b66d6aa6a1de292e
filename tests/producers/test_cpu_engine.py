"""The CPU engine against the real thing: a tiny Qwen3-MoE served by a real engine subprocess, checked against an
independent full-sequence forward pass of the same HF model, and a real gloo weight push from a sender process."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.models.tiny import init_tiny_model  # noqa: E402
from pipeline.net import free_port  # noqa: E402

# fp32 everywhere. The engine decodes token by token against a KV cache, in batches padded on the left, while the
# reference runs one forward over the whole sequence: the same math in a different summation order. On this model
# that moves logprobs by ~1e-6; 1e-4 leaves room for other BLAS builds and is still 1000x smaller than the smallest
# real bug we check for (a logprob taken at the wrong temperature or position is off by > 0.1).
LOGPROB_ATOL = 1e-4
STARTUP_TIMEOUT_S = 120.0


class EngineProcess:
    """An engine subprocess this test started, stopped by its own PID."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--port", str(self.port), *extra]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"engine did not become healthy in {STARTUP_TIMEOUT_S} s:\n{self.log_path.read_text()}")

    def post(self, path: str, body: dict[str, Any], timeout: float = 60.0) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)

    def generate(self, body: dict[str, Any]) -> Any:
        response = self.post("/generate", body)
        assert response.status_code == 200, response.text
        return response.json()

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.url}{path}", timeout=10.0)
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model("qwen3-moe", tmp_path_factory.mktemp("tiny_moe"), seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("engine_log") / "engine.log"
    proc = EngineProcess(model_dir, log, "--enable-return-routed-experts", "--max-batch", "16")
    try:
        yield proc
    finally:
        proc.stop()


def reference(model: Any, prompt: list[int], output: list[int], temperature: float) -> dict[str, Any]:
    """One independent forward over prompt + output: next-token argmax, logprobs and router top-k per position."""
    captured: list[Any] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out: captured.append(out[2]))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    p, r = len(prompt), len(output)
    predicting = logits[p - 1 : p + r - 1]  # row i predicts output[i]
    scale = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(predicting / scale, dim=-1)
    targets = torch.tensor(output)
    return {
        "argmax": predicting.argmax(-1).tolist(),
        "logprobs": logprobs.gather(-1, targets[:, None])[:, 0].numpy(),
        "dist": logprobs,
        # [tokens, layers, topk]; the last output token never goes through the model, hence p + r - 1 rows.
        "routing": torch.stack(captured, dim=1)[: p + r - 1].numpy(),
    }


def decode_routing(meta: dict[str, Any], layers: int, topk: int) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    return raw.reshape(-1, layers, topk)


PROMPTS = [[5, 6, 14, 7, 8, 18], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [9]]


def _request(prompt: list[int], **sampling: Any) -> dict[str, Any]:
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True, **sampling}
    return {"input_ids": prompt, "sampling_params": params, "return_logprob": True, "return_routed_experts": True}


def _check_against_reference(
    hf_model: Any, results: list[dict[str, Any]], prompts: list[list[int]], temperature: float
) -> tuple[float, int, int]:
    max_diff, agree, total = 0.0, 0, 0
    info_layers, topk = len(hf_model.model.layers), hf_model.config.num_experts_per_tok
    for prompt, res in zip(prompts, results, strict=False):
        out = res["output_ids"]
        meta = res["meta_info"]
        ref = reference(hf_model, prompt, out, temperature)
        if temperature == 0:
            assert out == ref["argmax"], "greedy tokens differ from the full-sequence argmax"
        got_lp = np.array([entry[0] for entry in meta["output_token_logprobs"]])
        assert [entry[1] for entry in meta["output_token_logprobs"]] == out
        max_diff = max(max_diff, float(np.abs(got_lp - ref["logprobs"]).max()))
        routing = decode_routing(meta, info_layers, topk)
        assert routing.shape == ref["routing"].shape == (len(prompt) + len(out) - 1, info_layers, topk)
        agree += int((routing == ref["routing"]).all(axis=-1).sum())
        total += routing.shape[0] * routing.shape[1]
    return max_diff, agree, total


def test_greedy_tokens_logprobs_and_routing_match_full_forward(engine: EngineProcess, hf_model: Any) -> None:
    results = [engine.generate(_request(p, max_new_tokens=12 + i)) for i, p in enumerate(PROMPTS)]
    max_diff, agree, total = _check_against_reference(hf_model, results, PROMPTS, 0.0)
    print(
        f"greedy: max |logprob diff| = {max_diff:.2e}; routing agreement {agree}/{total} = {100 * agree / total:.2f}%"
    )
    assert max_diff < LOGPROB_ATOL
    assert agree == total
    for res, i in zip(results, range(len(PROMPTS)), strict=False):
        meta = res["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["completion_tokens"] == len(res["output_ids"]) == 12 + i
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 12 + i}]


def test_seeded_sampling_matches_full_forward_and_reproduces(engine: EngineProcess, hf_model: Any) -> None:
    temperature = 0.7

    def body(seed: int) -> dict[str, Any]:
        return _request(PROMPTS[0], max_new_tokens=24, temperature=temperature, top_p=0.9, top_k=20, sampling_seed=seed)

    first, again, other = engine.generate(body(123)), engine.generate(body(123)), engine.generate(body(124))
    assert first["output_ids"] == again["output_ids"]
    assert first["output_ids"] != other["output_ids"]
    max_diff, agree, total = _check_against_reference(hf_model, [first, other], [PROMPTS[0]] * 2, temperature)
    print(
        f"sampling T={temperature}: max |logprob diff| = {max_diff:.2e}; routing agreement {100 * agree / total:.2f}%"
    )
    assert max_diff < LOGPROB_ATOL
    assert agree == total
    # Every sampled token lies inside the top-k (20) of the tempered distribution.
    ref = reference(hf_model, PROMPTS[0], first["output_ids"], temperature)
    ranks = (ref["dist"] > ref["dist"].gather(-1, torch.tensor(first["output_ids"])[:, None])).sum(-1)
    assert int(ranks.max()) < 20


def test_concurrent_requests_share_forwards_and_match_one_at_a_time(engine: EngineProcess) -> None:
    prompts = [[5 + (i % 40), 6 + i % 30, 7] + [10 + j for j in range(i % 5)] for i in range(8)]
    bodies = [_request(p, max_new_tokens=24) for p in prompts]

    before = engine.get("/get_load")
    start = time.perf_counter()
    sequential = [engine.generate(b) for b in bodies]
    seq_s = time.perf_counter() - start
    mid = engine.get("/get_load")

    async def send_all() -> list[Any]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            answers = await asyncio.gather(*(client.post(f"{engine.url}/generate", json=b) for b in bodies))
        return [a.json() for a in answers]

    start = time.perf_counter()
    concurrent = asyncio.run(send_all())
    conc_s = time.perf_counter() - start
    after = engine.get("/get_load")

    assert [r["output_ids"] for r in concurrent] == [r["output_ids"] for r in sequential]
    tokens = sum(len(r["output_ids"]) for r in sequential)
    seq_fw = mid["forward_passes"] - before["forward_passes"]
    conc_fw = after["forward_passes"] - mid["forward_passes"]
    print(
        f"{tokens} tokens: one at a time {tokens / seq_s:.0f} tok/s in {seq_fw} forwards; "
        f"concurrent {tokens / conc_s:.0f} tok/s in {conc_fw} forwards"
    )
    assert seq_fw == tokens  # one prefill + (R - 1) decodes per request
    assert conc_fw < seq_fw / 2, "concurrent requests were not batched into shared forward passes"


def test_stop_token_and_max_new_tokens(engine: EngineProcess) -> None:
    free = engine.generate(_request(PROMPTS[2], max_new_tokens=20))
    out = free["output_ids"]
    stop = out[5]
    cut = out.index(stop)
    stopped = engine.generate(_request(PROMPTS[2], max_new_tokens=20, stop_token_ids=[stop]))
    assert stopped["output_ids"] == out[: cut + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    routing_rows = len(base64.b64decode(stopped["meta_info"]["routed_experts"])) // 4 // (2 * 2)
    assert routing_rows == len(PROMPTS[2]) + cut + 1 - 1
    short = engine.generate(_request(PROMPTS[2], max_new_tokens=3))
    assert short["output_ids"] == out[:3]
    assert short["meta_info"]["finish_reason"]["type"] == "length"
    # routed_experts_start_len drops leading rows.
    skipped = engine.generate({**_request(PROMPTS[2], max_new_tokens=3), "routed_experts_start_len": 4})
    full = decode_routing(short["meta_info"], 2, 2)
    np.testing.assert_array_equal(decode_routing(skipped["meta_info"], 2, 2), full[4:])


def test_list_of_prompts_with_n_samples(engine: EngineProcess) -> None:
    body = {
        "input_ids": [PROMPTS[0], PROMPTS[1]],
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "n": 3, "sampling_seed": 7, "ignore_eos": True},
        "return_logprob": True,
    }
    results = engine.generate(body)
    assert isinstance(results, list) and len(results) == 6
    # Prompt-major order: results i*n + j belong to prompt i.
    assert [r["meta_info"]["prompt_tokens"] for r in results] == [len(PROMPTS[0])] * 3 + [len(PROMPTS[1])] * 3
    # Sample j of a seeded request is the single request seeded with sampling_seed + j.
    for j in range(3):
        single = engine.generate(
            {
                "input_ids": PROMPTS[1],
                "return_logprob": True,
                "sampling_params": {**body["sampling_params"], "n": 1, "sampling_seed": 7 + j},
            }
        )
        assert single["output_ids"] == results[3 + j]["output_ids"]
    assert len({tuple(r["output_ids"]) for r in results[:3]}) > 1
    assert all(len(r["meta_info"]["output_token_logprobs"]) == 8 for r in results)


def test_stop_strings_end_the_output_as_sglang_does(engine: EngineProcess) -> None:
    # The character tokenizer makes token i of the output character i of its text (ids >= 4 are characters).
    free = engine.generate(_request(PROMPTS[0], max_new_tokens=24))
    out, text = free["output_ids"], free["text"]
    assert all(t >= 4 for t in out), "the greedy output holds a special token; pick another prompt"
    first = next(i for i in range(4, 20) if text[i:i + 2] not in text[:i + 1])  # a pair that first ends at i + 1
    stop = text[first:first + 2]
    stopped = engine.generate(_request(PROMPTS[0], max_new_tokens=24, stop=["never", stop]))
    assert stopped["output_ids"] == out[: first + 2]  # the tokens that spell it are kept: the model made them
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == text[:first]  # the text is cut before it
    rows = len(base64.b64decode(stopped["meta_info"]["routed_experts"])) // 4 // (2 * 2)
    assert rows == len(PROMPTS[0]) + first + 2 - 1


def test_bad_requests_are_refused_with_a_reason(engine: EngineProcess) -> None:
    cases = [
        ({"input_ids": []}, "empty"),
        ({"input_ids": [5, 999]}, "vocabulary"),
        ({"input_ids": [5], "sampling_params": {"stop": [""]}}, "stop strings"),
        ({"input_ids": [5], "sampling_params": {"min_p": 0.1}}, "min_p"),
        ({"input_ids": [5], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [5], "stream": True}, "stream"),
    ]
    for body, hint in cases:
        response = engine.post("/generate", body)
        assert response.status_code == 400, body
        assert hint in response.json()["error"]["message"], response.text
    update = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[62, 64]], "group_name": "g"}
    response = engine.post("/update_weights_from_distributed", update)
    assert response.status_code == 400 and response.json()["success"] is False
    assert "begin_weight_update" in response.json()["message"]


def test_bad_weight_announcements_fail_before_receiving(engine: EngineProcess) -> None:
    baseline = engine.generate(_request(PROMPTS[0]))["output_ids"]
    assert engine.post("/begin_weight_update", {"selector": "all"}).json()["success"]
    try:
        for names, shapes, hint in [
            (["model.layers.0.mlp.experts.99.up_proj.weight"], [[32, 64]], "not a parameter"),
            (["lm_head.weight"], [[64, 62]], "shape"),
        ]:
            body = {
                "names": names,
                "dtypes": ["float32"],
                "shapes": shapes,
                "group_name": "none",
                "weight_version": "9",
            }
            response = engine.post("/update_weights_from_distributed", body)
            assert response.status_code == 400
            reply = response.json()
            assert reply["success"] is False and hint in reply["message"], reply
    finally:
        assert engine.post("/end_weight_update", {}).json()["success"]
    assert engine.get("/model_info")["weight_version"] == "0"
    assert engine.generate(_request(PROMPTS[0]))["output_ids"] == baseline


def test_model_info_and_load(engine: EngineProcess) -> None:
    info = engine.get("/model_info")
    assert info["weight_version"] == "0"
    assert (info["num_moe_layers"], info["num_experts"], info["num_experts_per_tok"]) == (2, 8, 2)
    load = engine.get("/get_load")
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    # SGLang 0.5.23's path and shape, which the client reads for both engines.
    loads = engine.get("/v1/loads")
    assert loads["dp_rank_count"] == 1 and loads["aggregate"]["num_total_reqs"] == 0
    assert loads["loads"][0]["num_running_reqs"] == 0 and loads["loads"][0]["tokens_generated"] == load[
        "tokens_generated"]


SENDER = textwrap.dedent(
    """
    import sys
    from safetensors.torch import load_file
    from pipeline.sync.weights import init_weight_group

    path, port, group_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tensors = load_file(path)
    group = init_weight_group("127.0.0.1", port, 0, 2, group_name, "gloo", 120.0)
    for name in sorted(tensors):
        group.broadcast(tensors[name].contiguous(), src=0)
    group.close()
    print("sent", len(tensors))
    """
)


def test_weight_push_mid_generation_switches_version(model_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    new_dir = init_tiny_model("qwen3-moe", tmp_path / "new_weights", seed=1)
    new_model = transformers.AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    with safe_open(str(new_dir / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        shapes = [list(f.get_slice(n).get_shape()) for n in names]

    engine = EngineProcess(model_dir, tmp_path / "engine.log", "--enable-return-routed-experts")
    sender = None
    try:
        prompt = PROMPTS[0]
        before = engine.generate(_request(prompt, max_new_tokens=40))["output_ids"]
        store_port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        sender = subprocess.Popen(
            [sys.executable, "-c", SENDER, str(new_dir / "model.safetensors"), str(store_port), "push"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        joined = engine.post(
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": store_port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "push",
                "backend": "gloo",
            },
            timeout=120.0,
        )
        assert joined.json()["success"], joined.text

        async def straddle() -> tuple[dict[str, Any], dict[str, Any]]:
            async with httpx.AsyncClient(timeout=120.0) as client:
                long_req = asyncio.ensure_future(
                    client.post(f"{engine.url}/generate", json=_request(prompt, max_new_tokens=900))
                )
                while (await client.get(f"{engine.url}/get_load")).json()["tokens_generated"] < 40 + 50:
                    await asyncio.sleep(0.01)
                # As the pusher does, and as SGLang needs: paused in place first, or the begin would take the
                # model-update writer lock and wait for the generation to end.
                assert (await client.post(f"{engine.url}/pause_generation", json={"mode": "in_place"})).json()[
                    "success"
                ]
                assert (await client.post(f"{engine.url}/begin_weight_update", json={"selector": "all"})).json()[
                    "success"
                ]
                update = await client.post(
                    f"{engine.url}/update_weights_from_distributed",
                    json={
                        "names": names,
                        "dtypes": ["float32"] * len(names),
                        "shapes": shapes,
                        "group_name": "push",
                        "flush_cache": True,
                        "abort_all_requests": False,
                        "weight_version": "1",
                    },
                )
                assert (await client.post(f"{engine.url}/end_weight_update", json={})).json()["success"]
                assert (await client.post(f"{engine.url}/continue_generation", json={})).json()["success"]
                return update.json(), (await long_req).json()

        update, straddling = asyncio.run(straddle())
        assert update["success"], update
        assert sender.wait(timeout=60) == 0

        spans = straddling["meta_info"]["weight_versions"]
        out = straddling["output_ids"]
        print(f"straddling request: {len(out)} tokens, spans {spans}")
        assert [s["version"] for s in spans] == ["0", "1"]
        switch = spans[0]["end"]
        assert spans == [
            {"version": "0", "start": 0, "end": switch},
            {"version": "1", "start": switch, "end": len(out)},
        ]
        assert 0 < switch < len(out)
        assert straddling["meta_info"]["weight_version"] == "1"
        # Tokens labelled "0" came from the old weights: they are the old greedy continuation.
        assert out[: min(switch, 40)] == before[: min(switch, 40)]

        assert engine.get("/model_info")["weight_version"] == "1"
        # Keyed to the new version, as sluice's client keys it: the flush with the update came while the
        # generation was paused in place and was refused, so the prompt's old KV is still cached under no key.
        after = engine.generate({**_request(prompt, max_new_tokens=40), "extra_key": "w1"})
        assert after["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 40}]
        assert after["output_ids"] != before
        ref = reference(new_model, prompt, after["output_ids"], 0.0)
        assert after["output_ids"] == ref["argmax"]
        diff = np.abs(np.array([e[0] for e in after["meta_info"]["output_token_logprobs"]]) - ref["logprobs"]).max()
        assert diff < LOGPROB_ATOL
        assert (decode_routing(after["meta_info"], 2, 2) == ref["routing"]).all()
    finally:
        if sender is not None and sender.poll() is None:
            sender.kill()
            sender.wait(timeout=10)
        engine.stop()


def test_update_weights_from_disk_serves_the_new_weights(model_dir: Path, hf_model: Any, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    new_dir = init_tiny_model("qwen3-moe", tmp_path / "new_weights", seed=1)
    new_model = transformers.AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    dense_dir = init_tiny_model("qwen3", tmp_path / "dense", seed=1)
    partial_dir = tmp_path / "partial"
    shutil.copytree(new_dir, partial_dir)
    tensors = load_file(str(partial_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(partial_dir / "model.safetensors"), metadata={"format": "pt"})

    engine = EngineProcess(model_dir, tmp_path / "engine.log", "--enable-return-routed-experts")
    try:
        before = [engine.generate(_request(p, max_new_tokens=20)) for p in PROMPTS]
        for folder, hint in [(tmp_path / "nowhere", "not a folder"), (dense_dir, "not a parameter"),
                             (partial_dir, "missing lm_head.weight")]:
            response = engine.post("/update_weights_from_disk", {"model_path": str(folder), "weight_version": "9"})
            reply = response.json()
            assert response.status_code == 400 and reply["success"] is False and hint in reply["message"], reply
        # Refused loads change nothing: same version, same tokens.
        assert engine.get("/model_info")["weight_version"] == "0"
        assert engine.generate(_request(PROMPTS[0], max_new_tokens=20))["output_ids"] == before[0]["output_ids"]

        reply = engine.post("/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "7"}).json()
        assert reply == {"success": True, "message": reply["message"]} and reply["success"], reply
        info = engine.get("/model_info")
        assert info["weight_version"] == "7" and info["model_path"] == str(new_dir)
        after = [engine.generate(_request(p, max_new_tokens=20)) for p in PROMPTS]
        # The engine now computes the NEW model: greedy tokens, logprobs and routing of an independent forward.
        max_diff, agree, total = _check_against_reference(new_model, after, PROMPTS, 0.0)
        assert max_diff < LOGPROB_ATOL and agree == total
        assert all(a["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 20}] for a in after)
        assert [a["output_ids"] for a in after] != [b["output_ids"] for b in before]
        # ... and not the old one: the old model gives these tokens clearly different logprobs.
        old = reference(hf_model, PROMPTS[0], after[0]["output_ids"], 0.0)["logprobs"]
        got = np.array([e[0] for e in after[0]["meta_info"]["output_token_logprobs"]])
        assert np.abs(got - old).max() > 0.1
    finally:
        engine.stop()


def _wait_for(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_pause_in_place_then_version_bump_without_abort(engine: EngineProcess) -> None:
    def generated() -> int:
        return int(engine.get("/get_load")["tokens_generated"])

    async def scenario() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=120.0) as client:
            start = generated()
            task = asyncio.ensure_future(
                client.post(f"{engine.url}/generate", json=_request(PROMPTS[1], max_new_tokens=600))
            )
            await asyncio.to_thread(_wait_for, lambda: generated() > start + 20)
            assert (await client.post(f"{engine.url}/pause_generation", json={"mode": "in_place"})).json()["success"]
            await asyncio.sleep(0.1)
            frozen = generated()
            await asyncio.sleep(0.3)
            load = (await client.get(f"{engine.url}/get_load")).json()
            assert load["tokens_generated"] == frozen and load["paused"] and load["num_running_reqs"] == 1
            bump = await client.post(
                f"{engine.url}/update_weight_version", json={"new_version": "5", "abort_all_requests": False}
            )
            assert bump.json()["success"]
            assert (await client.post(f"{engine.url}/continue_generation", json={})).json()["success"]
            return (await task).json()

    try:
        result = asyncio.run(scenario())
    finally:
        engine.post("/continue_generation", {})
        engine.post("/update_weight_version", {"new_version": "0", "abort_all_requests": False})
    spans = result["meta_info"]["weight_versions"]
    assert result["meta_info"]["finish_reason"]["type"] == "length" and len(result["output_ids"]) == 600
    assert [s["version"] for s in spans] == ["0", "5"] and spans[0]["end"] == spans[1]["start"] > 20


def test_pause_abort_mode_and_client_disconnect_free_the_batch(engine: EngineProcess) -> None:
    async def paused_abort() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=120.0) as client:
            task = asyncio.ensure_future(
                client.post(f"{engine.url}/generate", json=_request(PROMPTS[0], max_new_tokens=900))
            )
            await asyncio.to_thread(_wait_for, lambda: engine.get("/get_load")["num_running_reqs"] == 1)
            assert (await client.post(f"{engine.url}/pause_generation", json={"mode": "abort"})).json()["success"]
            return (await task).json()

    try:
        aborted = asyncio.run(paused_abort())
    finally:
        assert engine.post("/continue_generation", {}).json()["success"]
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < 900

    # A client that hangs up: its sequence leaves the batch instead of running to max_new_tokens.
    start = engine.get("/get_load")["tokens_generated"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}/generate", json=_request(PROMPTS[0], max_new_tokens=900), timeout=0.3)
    _wait_for(lambda: engine.get("/get_load")["num_running_reqs"] == 0, timeout_s=10.0)
    assert engine.get("/get_load")["tokens_generated"] - start < 900


def test_input_token_logprobs(engine: EngineProcess, hf_model: Any) -> None:
    prompt = PROMPTS[2]
    res = engine.generate({**_request(prompt, max_new_tokens=2), "logprob_start_len": 3})
    entries = res["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt[3:]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits[2:-1], dim=-1).gather(-1, torch.tensor(prompt[3:])[:, None])[:, 0]
    np.testing.assert_allclose([e[0] for e in entries], expected.numpy(), atol=LOGPROB_ATOL)
    first = engine.generate({**_request(prompt, max_new_tokens=1), "logprob_start_len": 0})
    assert first["meta_info"]["input_token_logprobs"][0] == [None, prompt[0], None]


# ----- in-process checks of the pieces (no server) -----


def test_truncation_and_logprob_modes() -> None:
    from pipeline.producers.cpu_engine.sampling import SamplingSettings, _truncate, select_token

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert (_truncate(probs, -1, 0.8) > 0).tolist() == [True, True, False, False]
    assert (_truncate(probs, -1, 0.81) > 0).tolist() == [True, True, True, False]
    assert (_truncate(probs, 1, 1.0) > 0).tolist() == [True, False, False, False]
    logits = torch.log(probs) * 3.0
    settings = SamplingSettings(temperature=2.0, top_p=1.0, top_k=2)
    seen = set()
    for seed in range(50):
        token, lp = select_token(logits, settings, torch.Generator().manual_seed(seed), "temperature")
        seen.add(token)
        assert lp == pytest.approx(float(torch.log_softmax(logits / 2.0, -1)[token]), abs=1e-6)
        _, original = select_token(logits, settings, torch.Generator().manual_seed(seed), "original")
        assert original == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-6)
    assert seen == {0, 1}


def _recording_generator(model: Any) -> Any:
    from pipeline.producers.cpu_engine.generator import BatchGenerator

    return BatchGenerator(model, eos_ids=frozenset(), pad_id=0, logprob_mode="temperature", record_routing=True,
                          max_context_len=1024, version="0")


def test_dense_model_batches_sequences_that_join_mid_flight(tmp_path: Path) -> None:
    from pipeline.producers.cpu_engine.generator import Sequence
    from pipeline.producers.cpu_engine.sampling import SamplingSettings

    model_dir = init_tiny_model("qwen3", tmp_path / "dense", seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = _recording_generator(model)
    assert gen.recorder is None
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    seqs = [
        Sequence(p, 10 + 2 * i, SamplingSettings(0.0, 1.0, -1), frozenset(), True, None) for i, p in enumerate(prompts)
    ]
    done = gen.admit(seqs[:2])
    for _ in range(4):
        done += gen.step()
    done += gen.admit(seqs[2:3])
    done += gen.step()
    done += gen.admit(seqs[3:])
    while gen.rows:
        done += gen.step()
    assert sorted(map(id, done)) == sorted(map(id, seqs))
    for seq in seqs:
        with torch.no_grad():
            logits = model(torch.tensor([seq.prompt_ids + seq.output_ids])).logits[0].float()
        p, r = len(seq.prompt_ids), len(seq.output_ids)
        assert r == seq.max_new_tokens
        assert seq.output_ids == logits[p - 1 : p + r - 1].argmax(-1).tolist()
        expected = torch.log_softmax(logits[p - 1 : p + r - 1], -1).gather(-1, torch.tensor(seq.output_ids)[:, None])[
            :, 0
        ]
        assert np.abs(np.array(seq.output_logprobs) - expected.numpy()).max() < LOGPROB_ATOL
        assert seq.routed_experts() is None


def test_moe_routing_through_joins_aborts_and_long_runs(model_dir: Path, hf_model: Any) -> None:
    """The generator's routing buffer (flushed on batch changes and every 64 steps) against full forwards."""
    from pipeline.producers.cpu_engine.generator import Sequence
    from pipeline.producers.cpu_engine.sampling import SamplingSettings

    gen = _recording_generator(hf_model)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23], [30, 31]]
    lengths = [150, 1, 90, 70, 40]  # past the 64-step flush, a one-token answer, and sequences of every age
    seqs = [Sequence(p, n, SamplingSettings(0.0, 1.0, -1), frozenset(), True, None) for p, n in zip(prompts, lengths)]
    done = gen.admit(seqs[:2])
    for _ in range(5):
        done += gen.step()
    done += gen.admit(seqs[2:4])
    for _ in range(30):
        done += gen.step()
    done += gen.abort(lambda seq: seq is seqs[3], "test abort")
    done += gen.admit(seqs[4:])
    while gen.rows:
        done += gen.step()
    assert sorted(map(id, done)) == sorted(map(id, seqs))
    for seq in seqs:
        ref = reference(hf_model, seq.prompt_ids, seq.output_ids, 0.0)
        routed = seq.routed_experts()
        assert routed is not None and routed.shape == ref["routing"].shape
        assert np.array_equal(routed.numpy(), ref["routing"]), f"routing differs for a sequence of {len(seq.output_ids)}"
        if seq is not seqs[3]:
            assert seq.output_ids == ref["argmax"] and len(seq.output_ids) == seq.max_new_tokens
    assert 0 < len(seqs[3].output_ids) < seqs[3].max_new_tokens  # the aborted one stopped early, rows intact


def test_tiny_model_cli_and_tokenizer(tmp_path: Path) -> None:
    out = tmp_path / "cli_model"
    cmd = [
        sys.executable,
        "-m",
        "pipeline.models.tiny",
        "--arch",
        "qwen3-moe",
        "--out",
        str(out),
        "--seed",
        "4",
        "--set",
        "num_hidden_layers=3",
        "--set",
        "num_experts=4",
    ]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.num_hidden_layers, config.num_experts, config.num_experts_per_tok) == (3, 4, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert config.vocab_size == len(tokenizer)
    text = "12+34=46 abc\n(7*8)-9/3"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert config.eos_token_id == tokenizer.eos_token_id and config.pad_token_id == tokenizer.pad_token_id
    # Same seed, same weights.
    again = init_tiny_model("qwen3-moe", tmp_path / "again", seed=4, num_hidden_layers=3, num_experts=4)
    from safetensors.torch import load_file

    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _full_forward_stats(model: Any, seqs: list[Any]) -> tuple[np.ndarray, float]:
    """|logprob diff| per token and routing agreement of generated sequences against one full forward of ``model``."""
    diffs, agree, total = [], 0, 0
    for seq in seqs:
        ref = reference(model, seq.prompt_ids, seq.output_ids, 0.0)
        diffs.append(np.abs(np.array(seq.output_logprobs) - ref["logprobs"]))
        routing = seq.routed_experts().numpy()
        agree += int((routing == ref["routing"]).all(axis=-1).sum())
        total += routing.shape[0] * routing.shape[1]
    return np.concatenate(diffs), agree / total


def test_bfloat16_generation_against_bf16_and_fp32_forwards(model_dir: Path, hf_model: Any) -> None:
    from pipeline.producers.cpu_engine.generator import Sequence
    from pipeline.producers.cpu_engine.sampling import SamplingSettings

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    gen = _recording_generator(model)
    seqs = [Sequence(p, 48, SamplingSettings(0.0, 1.0, -1), frozenset(), True, None) for p in PROMPTS]
    gen.admit(seqs)
    while gen.rows:
        gen.step()
    bf16_diff, bf16_agree = _full_forward_stats(model, seqs)
    fp32_diff, fp32_agree = _full_forward_stats(hf_model, seqs)
    print(
        f"bf16 engine vs bf16 forward: |logprob diff| max {bf16_diff.max():.3f} median {np.median(bf16_diff):.4f}, "
        f"routing {100 * bf16_agree:.1f}%; vs fp32 forward: max {fp32_diff.max():.3f} "
        f"median {np.median(fp32_diff):.4f}, routing {100 * fp32_agree:.1f}%"
    )
    # bf16 keeps 8 significant bits, so a cached, batched decode and a full forward differ in rounding, and where
    # that flips a router's top-k (the mismatch R3 removes) a logprob can move by ~0.5. Most tokens must still agree
    # closely: a wrong position or temperature would move nearly all of them by far more than 0.1.
    assert float(np.mean(bf16_diff < 0.1)) >= 0.9
    assert bf16_agree >= 0.95


def test_scheduler_queues_beyond_max_batch(hf_model: Any) -> None:
    from concurrent.futures import Future

    from pipeline.producers.cpu_engine.generator import BatchGenerator, Sequence
    from pipeline.producers.cpu_engine.sampling import SamplingSettings
    from pipeline.producers.cpu_engine.scheduler import Scheduler

    def make_generator() -> BatchGenerator:
        return BatchGenerator(
            hf_model,
            eos_ids=frozenset(),
            pad_id=0,
            logprob_mode="temperature",
            record_routing=False,
            max_context_len=1024,
            version="0",
        )

    def run(prompts: list[list[int]], max_batch: int) -> tuple[list[list[int]], int]:
        scheduler = Scheduler(make_generator(), max_batch)
        busiest = 0
        futures: list[Future[Sequence]] = []
        seqs = []
        for i, prompt in enumerate(prompts):
            done: Future[Sequence] = Future()
            seq = Sequence(prompt, 6 + i, SamplingSettings(0.0, 1.0, -1), frozenset(), True, None)
            seq.on_finish = done.set_result
            seqs.append(seq)
            futures.append(done)
        scheduler.submit(seqs)
        scheduler.start()
        try:
            while not all(f.done() for f in futures):
                busiest = max(busiest, scheduler.load().num_running_reqs)
                time.sleep(0.001)
        finally:
            scheduler.stop()
        return [f.result().output_ids for f in futures], busiest

    prompts = [[5 + i, 6, 7 + i] for i in range(5)]
    batched, busiest = run(prompts, max_batch=2)
    alone = [run([p], max_batch=1)[0][0] for p in prompts]
    assert busiest <= 2
    assert [out[: len(a)] for out, a in zip(batched, alone, strict=True)] == alone
    assert [len(out) for out in batched] == [6 + i for i in range(5)]


def test_batched_token_selection_samples_each_row_from_its_own_distribution() -> None:
    """Rows sampled together (one softmax, one draw) follow each row's own distribution and report its log-prob;
    seeded and truncated rows keep the row-by-row path (so a seed repeats whatever it is batched with)."""
    import torch

    from pipeline.producers.cpu_engine.sampling import SamplingSettings, select_token, select_tokens

    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 2
    plain = SamplingSettings(temperature=0.7, top_p=1.0, top_k=-1)
    rows = 3 * 4000
    batch = logits.repeat(4000, 1)
    picks = select_tokens(batch, [plain] * rows, [None] * rows, "temperature")
    expected = torch.softmax(logits / 0.7, dim=-1)
    for r in range(3):
        tokens = torch.tensor([picks[i][0] for i in range(r, rows, 3)])
        freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
        assert torch.allclose(freq, expected[r], atol=0.03), (freq, expected[r])
    scaled = torch.log_softmax(logits / 0.7, dim=-1)
    assert all(abs(picks[i][1] - float(scaled[i % 3, picks[i][0]])) < 1e-6 for i in range(30))
    original = select_tokens(logits, [plain] * 3, [None] * 3, "original")
    assert all(abs(lp - float(torch.log_softmax(logits[i], -1)[t])) < 1e-6 for i, (t, lp) in enumerate(original))
    seeded = [torch.Generator().manual_seed(5) for _ in range(3)]
    alone = [select_token(logits[i], plain, torch.Generator().manual_seed(5), "temperature") for i in range(3)]
    assert select_tokens(logits, [plain] * 3, seeded, "temperature") == alone


def test_unseeded_requests_take_the_batched_sampling_path_and_seeded_ones_keep_their_own_generator(
    model_dir: Path,
) -> None:
    """A per-sequence generator forces row-by-row sampling (a sixth of a decode step on the tiny model), so only
    requests that ask for a seed get one; the rest draw together from the process RNG the engine's --seed fixes."""
    from pipeline.producers.cpu_engine.config import CpuEngineConfig
    from pipeline.producers.cpu_engine.protocol import PromptSpec, SamplingParams
    from pipeline.producers.cpu_engine.server import Engine

    def spec(**params: Any) -> PromptSpec:
        return PromptSpec([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.8, **params), True, -1, True, 0,
                          "r")

    def first_tokens(seed: int) -> list[int]:
        engine = Engine(CpuEngineConfig(model_path=str(model_dir), seed=seed, enable_return_routed_experts=True))
        seqs = [engine.new_sequence(spec(), j) for j in range(64)]
        assert all(s.generator is None for s in seqs)
        engine.generator.admit(seqs)
        engine.generator.reset()
        return [s.output_ids[0] for s in seqs]

    assert first_tokens(3) == first_tokens(3)  # --seed still makes an engine's unseeded draws repeat
    assert first_tokens(3) != first_tokens(4)
    seeded = Engine(CpuEngineConfig(model_path=str(model_dir))).new_sequence(spec(sampling_seed=11), 2)
    assert seeded.generator is not None and seeded.generator.initial_seed() == 13


def test_an_engine_started_with_hold_serves_only_after_its_first_weight_update(model_dir: Path,
                                                                               tmp_path: Path) -> None:
    """What a restarted engine (or one a resumed run starts) does: healthy at once, so the trainer finds it and
    pushes, but nothing sampled with its start-up weights."""
    from concurrent.futures import ThreadPoolExecutor

    new_dir = init_tiny_model("qwen3-moe", tmp_path / "new_weights", seed=1)
    engine = EngineProcess(model_dir, tmp_path / "engine.log", "--hold-until-update", "--enable-return-routed-experts")
    try:
        assert httpx.get(f"{engine.url}/health", timeout=5).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(engine.generate, _request(PROMPTS[0], max_new_tokens=8))
            time.sleep(3.0)
            assert not pending.done()  # held: queued, not sampled
            reply = engine.post("/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "5"})
            assert reply.json()["success"], reply.text
            served = pending.result(timeout=120)
        # Every token of it came from the weights the update brought.
        assert served["meta_info"]["weight_versions"] == [
            {"version": "5", "start": 0, "end": len(served["output_ids"])}]
    finally:
        engine.stop()
