"""Held-out evaluation by generation: the pass@k estimator, the trainer's weight snapshots (versions, atomicity,
pruning, a real megatron-core export), and the evaluator generating on a real CPU engine with those snapshots,
checked against an independent HF forward of each snapshot's weights; then ``sluice eval --heldout`` and a whole
``sluice run`` with held-out evaluation on."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.config import SluiceConfig, load_config  # noqa: E402
from pipeline.consumers.trainer.snapshots import (  # noqa: E402
    DONE_MARK,
    SnapshotWriter,
    is_done,
    mark_done,
)
from pipeline.data.prompts import Prompt  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.heldout.evaluate import (  # noqa: E402
    HeldoutEvaluator,
    HeldoutSettings,
    PromptOutcome,
    caught_up,
    pass_at_k,
    plan_live,
    summarize,
)
from pipeline.models.tiny import init_tiny_model  # noqa: E402
from pipeline.producers.producer import load_tokenize  # noqa: E402
from pipeline.producers.rewards import exact_match  # noqa: E402
from pipeline.producers.sglang_client import SGLangClient  # noqa: E402
from pipeline.rundir import list_snapshots, read_heldout  # noqa: E402

ROOT = Path(__file__).parents[2]
MAX_NEW = 6


# ------------------------------------------------------------------------------------------------- pure figures
def test_pass_at_k_against_hand_worked_values() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)/C(5,3)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # C(7,5)/C(10,5)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 2, 3) == 1.0  # only 2 failures: any 3 draws hold a pass
    # Large n stays exact (integer binomials): 1 - C(900, 10)/C(1000, 10).
    assert pass_at_k(1000, 100, 10) == pytest.approx(1 - 0.9**10, abs=5e-3)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_summary_of_hand_built_outcomes() -> None:
    outcomes = [
        PromptOutcome("a", True, 1.0, [True, False, False, False], [1.0, 0.0, 0.0, 0.0], truncated=1,
                      response_tokens=10),
        PromptOutcome("b", False, 0.0, [True, True, False, False], [1.0, 1.0, 0.0, 0.5], response_tokens=15),
    ]
    s = summarize(outcomes, [1, 2, 4])
    assert s["prompts"] == 2 and s["samples"] == 8
    assert s["greedy_pass1"] == 0.5 and s["sampled_pass1"] == 3 / 8
    assert s["pass_at_k"]["1"] == pytest.approx(3 / 8)  # pass@1 is the mean per-sample pass rate
    assert s["pass_at_k"]["2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    assert s["pass_at_k"]["4"] == 1.0
    assert s["reward_mean"] == pytest.approx(3.5 / 8) and s["greedy_reward_mean"] == 0.5
    assert s["truncated"] == 1 and s["response_len_mean"] == 25 / 10


def test_live_plan_takes_the_newest_and_skips_the_rest() -> None:
    present = [(0, Path("v0")), (5, Path("v5")), (10, Path("v10")), (15, Path("v15"))]
    assert plan_live(present, evaluated={0}, marked={0}) == ((15, Path("v15")), [(5, Path("v5")), (10, Path("v10"))])
    assert plan_live(present, evaluated={15}, marked={5, 10}) == ((0, Path("v0")), [])
    assert plan_live(present, evaluated={0, 15}, marked={5, 10}) == (None, [])


def test_config_rules_name_the_fields() -> None:
    with pytest.raises(ConfigError, match=r"prompts\.heldout .*prompts\.heldout_path"):
        load_config(None, ["eval.heldout.enabled=true"])
    with pytest.raises(ConfigError, match=r"pass_k.*samples"):
        load_config(None, ["eval.heldout.enabled=true", "prompts.heldout=8", "eval.heldout.pass_k=[1, 8]"])
    with pytest.raises(ConfigError, match=r"eval\.heldout\.engine_url"):
        load_config(None, ["eval.heldout.enabled=true", "prompts.heldout=8", "engine.type=sglang",
                           'engine.urls=["http://a:1"]'])
    with pytest.raises(ConfigError, match="one of engine.urls"):
        load_config(None, ["eval.heldout.enabled=true", "prompts.heldout=8", "engine.type=sglang",
                           'engine.urls=["http://a:1"]', 'eval.heldout.engine_url="http://a:1/"'])
    with pytest.raises(ConfigError, match="eval.heldout"):
        load_config(None, ["eval.heldout.unknown=1"])
    cfg = load_config(None, ["eval.heldout.enabled=true", "prompts.heldout=8", "eval.heldout.pass_k=[4, 1, 4]"])
    assert cfg.eval.heldout.pass_k == [1, 4]
    # The trainer and the evaluator resolve the same sampling: the producer's unless [eval.heldout] says otherwise.
    s = HeldoutSettings.from_config(cfg.eval, cfg.producer)
    assert (s.temperature, s.max_new_tokens) == (cfg.producer.sampling.temperature,
                                                 cfg.producer.sampling.max_new_tokens)
    cfg = load_config(None, ["eval.heldout.enabled=true", "prompts.heldout=8", "eval.heldout.temperature=0.5",
                             "eval.heldout.max_new_tokens=3"])
    s = HeldoutSettings.from_config(cfg.eval, cfg.producer)
    assert (s.temperature, s.max_new_tokens) == (0.5, 3)


# ---------------------------------------------------------------------------------------------------- snapshots
def _weights(model_dir: Path, shift: float) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [(k, v + shift) for k, v in sorted(load_file(str(model_dir / "model.safetensors")).items())]


def test_snapshots_at_zero_every_k_and_last_then_pruned(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    root = tmp_path / "snapshots"
    writer = SnapshotWriter(root, model_dir, every=3, keep=2, protect_unevaluated=False)
    given: dict[int, list[tuple[str, torch.Tensor]]] = {}
    assert writer.maybe_write(0)
    for v in range(1, 8):
        given[v] = _weights(model_dir, 0.01 * v)
        writer.maybe_write(v, given[v], final=v == 7)
    writer.close()
    assert writer.written == [0, 3, 6, 7]
    assert [v for v, _ in list_snapshots(root)] == [6, 7]  # pruned to keep=2
    for v in (6, 7):
        folder = root / f"v{v:08d}"
        assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in folder.iterdir()}
        loaded = load_file(str(folder / "model.safetensors"))
        assert sorted(loaded) == sorted(k for k, _ in given[v])
        assert all(torch.equal(loaded[k], t) for k, t in given[v])
    # The folder is a servable HF model: transformers loads exactly these weights.
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "v00000007", dtype=torch.float32)
    state = hf.state_dict()
    probe = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(state[probe], dict(given[7])[probe])
    assert transformers.AutoTokenizer.from_pretrained(root / "v00000007").encode("12+3=") != []


def test_version_zero_is_the_model_folder_and_protection_waits_for_the_evaluator(model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    writer = SnapshotWriter(root, model_dir, every=3, keep=1, background=False)
    writer.maybe_write(0)
    zero = root / "v00000000"
    assert (zero / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    for v in (3, 6):
        writer.maybe_write(v, _weights(model_dir, v))
    # keep=1, but nothing was evaluated yet: every snapshot stays.
    assert [v for v, _ in list_snapshots(root)] == [0, 3, 6]
    mark_done(zero, "evaluated")
    mark_done(root / "v00000003", "skipped")
    assert is_done(zero) and json.loads((zero / DONE_MARK).read_text())["status"] == "evaluated"
    writer.maybe_write(9, _weights(model_dir, 9))
    assert [v for v, _ in list_snapshots(root)] == [6, 9]  # marked ones went; the unevaluated v6 stays
    assert not writer.maybe_write(10, _weights(model_dir, 10))  # not due
    with pytest.raises(ConfigError, match="only version 0"):
        writer.maybe_write(12)


class _BreaksMidway(list):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(list.__iter__(self)):
            if i == 3:
                raise OSError("disk full")
            yield item


def test_a_write_cut_short_leaves_no_snapshot(model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    writer = SnapshotWriter(root, model_dir, every=1, keep=5)
    writer.maybe_write(4, _BreaksMidway(_weights(model_dir, 1.0)))
    with pytest.raises(OSError, match="disk full"):
        writer.close()
    assert list_snapshots(root) == [] and (root / "v00000004.tmp").is_dir()  # readers never see half a snapshot
    SnapshotWriter(root, model_dir, every=1, keep=5).close()
    assert not (root / "v00000004.tmp").exists()  # the next writer clears the leftover


def test_snapshot_of_a_megatron_export_is_the_trainers_model(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig
    from pipeline.consumers.megatron.convert import iter_hf_weights, load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, forward_logits, init_parallel

    model_cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()), dtype="float32")
    init_parallel(ParallelConfig())
    mg = build_gpt_model(model_cfg, ParallelConfig(), r3=False).eval()
    load_hf_into_megatron(mg, model_dir, model_cfg)
    with torch.no_grad():  # a "trained" model: every weight moved
        gen = torch.Generator().manual_seed(3)
        for p in mg.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    exported = [(n, t.detach().clone()) for n, t in iter_hf_weights(mg, model_cfg)]  # what the push exports
    writer = SnapshotWriter(tmp_path / "snapshots", model_dir, every=5, keep=3)
    writer.maybe_write(5, exported)
    writer.close()
    folder = tmp_path / "snapshots" / "v00000005"
    loaded = load_file(str(folder / "model.safetensors"))
    assert sorted(loaded) == sorted(n for n, _ in exported)
    assert all(torch.equal(loaded[n], t) for n, t in exported)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, model_cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - forward_logits(mg, ids, torch.ones_like(ids))).abs().max().item()
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        moved = (base(input_ids=ids).logits - hf(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4 and moved > 100 * max(diff, 1e-6)


# ------------------------------------------------------------------------------------- the generating evaluator
def hf_greedy_text(model: Any, tokenizer: Any, ids: list[int], max_new: int) -> str:
    """Greedy decoding by full forwards, independent of the engine (its stop rule: any EOS id, kept in the output)."""
    eos = {tokenizer.eos_token_id, *([model.config.eos_token_id] if isinstance(model.config.eos_token_id, int)
                                     else model.config.eos_token_id or [])}
    seq, out = list(ids), []
    for _ in range(max_new):
        with torch.no_grad():
            t = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return str(tokenizer.decode(out, skip_special_tokens=True))


PROMPT_TEXTS = ["12+34=", "7+8=", "copy abc:", "rev 123:", "99+1=", "5+5=", "40+2=", "hello:"]


@pytest.fixture(scope="module")
def two_snapshots(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run folder with snapshots v0 (the model) and v5 (other weights), and held-out prompts whose answers are the
    v5 greedy output for the first five prompts and the v0 greedy output for the last three."""
    run_dir = tmp_path_factory.mktemp("heldout-run")
    other = init_tiny_model("qwen3-moe", tmp_path_factory.mktemp("other"), seed=1)
    writer = SnapshotWriter(run_dir / "snapshots", model_dir, every=5, keep=10)
    writer.maybe_write(0)
    writer.maybe_write(5, _weights(other, 0.0))
    writer.close()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenize = load_tokenize(model_dir)
    texts: dict[int, list[str]] = {}
    for v in (0, 5):
        hf = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "snapshots" / f"v{v:08d}",
                                                               dtype=torch.float32).eval()
        texts[v] = [hf_greedy_text(hf, tokenizer, list(tokenize(t)), MAX_NEW) for t in PROMPT_TEXTS]
    answers = [t.split("\n", 1)[0].strip() for t in texts[5][:5] + texts[0][5:]]
    prompts = [Prompt(prompt_id=f"h{i}", text=t, answer=a) for i, (t, a) in enumerate(zip(PROMPT_TEXTS, answers))]
    expected = {v: sum(exact_match(p, texts[v][i])[0] for i, p in enumerate(prompts)) / len(prompts) for v in (0, 5)}
    assert expected[0] != expected[5]  # the two weight sets must be told apart by their greedy pass rate
    return {"run_dir": run_dir, "prompts": prompts, "expected": expected, "tokenize": tokenize}


SETTINGS = HeldoutSettings(samples=4, pass_k=(1, 2, 4), temperature=1.0, max_new_tokens=MAX_NEW, seed=11)


def _evaluator(engine: Any, data: dict[str, Any], metrics: Path) -> HeldoutEvaluator:
    return HeldoutEvaluator(SETTINGS, engine=SGLangClient(engine.url), prompts=data["prompts"],
                            tokenize=data["tokenize"], reward_fn=exact_match, metrics_path=metrics, run="t")


def test_evaluator_tells_two_snapshots_apart_as_direct_generation_does(engine: Any, two_snapshots: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    data = two_snapshots
    metrics = tmp_path / "eval" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text(json.dumps({"kind": "eval", "version": 0, "samples": 3}) + "\n")  # a stream line stays

    async def evaluate_twice() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        first = _evaluator(engine, data, metrics)
        again = _evaluator(engine, data, metrics)
        try:
            return await first.evaluate_pending(data["run_dir"] / "snapshots"), \
                await again.evaluate_pending(data["run_dir"] / "snapshots")
        finally:
            await first.engine.close()  # type: ignore[attr-defined]
            await again.engine.close()  # type: ignore[attr-defined]

    lines, repeated = asyncio.run(evaluate_twice())
    print({d["version"]: (d["greedy_pass1"], d["sampled_pass1"], d["pass_at_k"]) for d in lines})
    assert [d["version"] for d in lines] == [0, 5] and repeated == []  # a restart adds nothing
    for d in lines:
        assert d["kind"] == "heldout" and d["prompts"] == 8 and d["samples"] == 32
        # Greedy pass@1 is exactly what an independent HF forward of that snapshot's weights gives.
        assert d["greedy_pass1"] == data["expected"][d["version"]]
        assert d["pass_at_k"]["1"] == pytest.approx(d["sampled_pass1"])
        assert d["pass_at_k"]["1"] <= d["pass_at_k"]["2"] <= d["pass_at_k"]["4"]
        assert d["seconds"] > 0 and d["max_new_tokens"] == MAX_NEW
    raw = metrics.read_text().splitlines()
    assert len(raw) == 3 and json.loads(raw[0])["kind"] == "eval"
    assert sorted(read_heldout(metrics)) == [0, 5]
    assert all(is_done(p) for _, p in list_snapshots(data["run_dir"] / "snapshots"))


def has_digit(prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
    """A reward that sampled responses of the tiny model pass sometimes (exact answers they never hit)."""
    ok = any(ch.isdigit() for ch in response)
    return float(ok), {"pass": ok}


def test_a_group_judge_scores_each_held_out_prompt_as_one_group(engine: Any, two_snapshots: dict[str, Any],
                                                                 tmp_path: Path) -> None:
    from pipeline.producers.rewards import GroupScorer

    seen: list[int] = []

    def first_wins(prompt: Prompt, responses: list[str]) -> list[tuple[float, dict[str, Any]]]:
        seen.append(len(responses))  # the greedy response and the sampled ones, together
        return [(1.0, {"pass": True})] + [(0.0, {"pass": False})] * (len(responses) - 1)

    async def evaluate() -> dict[str, Any]:
        ev = _evaluator(engine, two_snapshots, tmp_path / "m.jsonl")
        ev.reward_fn = GroupScorer(first_wins, timeout_s=10, concurrency=4)
        try:
            return await ev.evaluate(5, two_snapshots["run_dir"] / "snapshots" / "v00000005")
        finally:
            await ev.engine.close()  # type: ignore[attr-defined]

    line = asyncio.run(evaluate())
    assert seen == [1 + SETTINGS.samples] * len(two_snapshots["prompts"])
    # The judge passed every greedy response and no sampled one: a per-sample reward would not have been asked.
    assert line["greedy_pass1"] == 1.0 and line["sampled_pass1"] == 0.0


def test_sampled_figures_repeat_with_the_seed_and_match_direct_requests(engine: Any, two_snapshots: dict[str, Any],
                                                                        tmp_path: Path) -> None:
    data = two_snapshots
    folder = data["run_dir"] / "snapshots" / "v00000005"

    async def evaluate(path: Path) -> dict[str, Any]:
        ev = _evaluator(engine, data, path)
        ev.reward_fn = has_digit
        try:
            return await ev.evaluate(5, folder)
        finally:
            await ev.engine.close()  # type: ignore[attr-defined]

    async def direct() -> list[int]:
        """Passes per prompt from plain requests to the engine, seeded as documented (seed + i * samples)."""
        async with SGLangClient(engine.url) as client:
            counts = []
            for i, ids in enumerate(data["tokenize"](p.text) for p in data["prompts"]):
                results = await client.generate_many([list(ids)], {
                    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": MAX_NEW, "n": 4,
                    "sampling_seed": SETTINGS.seed + i * 4})
                assert {r.weight_version for r in results} == {"5"}  # the snapshot is what the engine serves
                counts.append(sum(has_digit(data["prompts"][i], r.text)[1]["pass"] for r in results))
            return counts

    a, b = (asyncio.run(evaluate(tmp_path / f"{n}.jsonl")) for n in "ab")
    assert (a["sampled_pass1"], a["pass_at_k"], a["reward_mean"]) == (b["sampled_pass1"], b["pass_at_k"],
                                                                     b["reward_mean"])
    counts = asyncio.run(direct())
    print("passes per prompt:", counts, a["pass_at_k"])
    assert 0 < sum(counts) < 32  # a mix, so the estimator is exercised beyond 0 and 1
    assert a["sampled_pass1"] == sum(counts) / 32
    for k in (1, 2, 4):
        assert a["pass_at_k"][str(k)] == pytest.approx(sum(pass_at_k(4, c, k) for c in counts) / len(counts))


def test_live_evaluator_jumps_to_the_newest_snapshot(engine: Any, two_snapshots: dict[str, Any], model_dir: Path,
                                                     tmp_path: Path) -> None:
    data = two_snapshots
    root = tmp_path / "snapshots"
    writer = SnapshotWriter(root, model_dir, every=5, keep=10, background=False)
    writer.maybe_write(0)
    for v in (5, 10):
        writer.maybe_write(v, _weights(model_dir, 0.001 * v))
    metrics = tmp_path / "metrics.jsonl"
    stop = threading.Event()
    errors: list[BaseException] = []

    def live() -> None:
        async def main() -> None:
            ev = _evaluator(engine, data, metrics)
            try:
                await ev.run_live(root, stop, poll_s=0.1)
            finally:
                await ev.engine.close()  # type: ignore[attr-defined]

        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=live)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while 10 not in read_heldout(metrics):
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.1)
        writer.maybe_write(15, _weights(model_dir, 0.015))  # a new snapshot while it runs
        while 15 not in read_heldout(metrics):
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(60)
    assert not errors and not thread.is_alive()
    assert sorted(read_heldout(metrics)) == [10, 15]  # 0 and 5 were skipped: it was behind when it started
    marks = {v: json.loads((p / DONE_MARK).read_text())["status"] for v, p in list_snapshots(root)}
    assert marks == {0: "skipped", 5: "skipped", 10: "evaluated", 15: "evaluated"}


def test_private_engine_dies_with_a_killed_evaluator(model_dir: Path, tmp_path: Path) -> None:
    import signal

    import psutil

    code = ("import sys, time; from pathlib import Path; from pipeline.heldout.evaluate import PrivateEngine; "
            "e = PrivateEngine.start(Path(sys.argv[1]), Path(sys.argv[2])); print(e.proc.pid, flush=True); "
            "time.sleep(600)")
    evaluator = subprocess.Popen([sys.executable, "-c", code, str(model_dir), str(tmp_path / "engine.log")],
                                 stdout=subprocess.PIPE, text=True, cwd=ROOT)
    engine = None
    try:
        engine = psutil.Process(int(evaluator.stdout.readline()))  # type: ignore[union-attr]
        assert engine.is_running()
        evaluator.send_signal(signal.SIGKILL)  # no cleanup code runs in the evaluator
        evaluator.wait(10)
        engine.wait(30)  # raises TimeoutExpired if the engine outlived it
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
            evaluator.wait()
        if engine is not None and engine.is_running():
            engine.kill()  # the engine this test's evaluator started, left behind: the failure case


def test_private_engine_binds_a_port_of_its_own_choosing(model_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A port probed free and handed to the engine could be taken by another of the run's processes before the
    engine binds it; here every probe answers a port already taken, which the engine must never be given."""
    import socket

    import httpx

    from pipeline.heldout.evaluate import PrivateEngine
    from pipeline.queue import redis_server

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setattr(redis_server, "free_port", lambda: taken.getsockname()[1])
    engine = PrivateEngine.start(model_dir, tmp_path / "logs" / "heldout-engine.log")
    try:
        port = int(engine.url.rsplit(":", 1)[1])
        assert port != taken.getsockname()[1]
        assert httpx.get(f"{engine.url}/health", timeout=5).status_code == 200
        assert int((tmp_path / "logs" / ".heldout-engine.port").read_text()) == port
    finally:
        engine.stop()
        taken.close()
    assert engine.proc.poll() is not None


# --------------------------------------------------------------------------------------------------- the CLI
def _sluice(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_sluice_eval_heldout_on_a_finished_run(two_snapshots: dict[str, Any], model_dir: Path,
                                               tmp_path: Path) -> None:
    data = two_snapshots
    run_dir = tmp_path / "run"
    shutil.copytree(data["run_dir"] / "snapshots", run_dir / "snapshots")
    for _, p in list_snapshots(run_dir / "snapshots"):
        (p / DONE_MARK).unlink(missing_ok=True)
    held = tmp_path / "heldout.jsonl"
    held.write_text("".join(json.dumps({"id": p.prompt_id, "prompt": p.text, "answer": p.answer}) + "\n"
                            for p in data["prompts"]))
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"id": "t0", "prompt": "1+1=", "answer": "2"}) + "\n")
    cfg = load_config(None, [f"model.path={json.dumps(str(model_dir))}", "prompts.type=jsonl",
                             f"prompts.path={json.dumps(str(train))}", f"prompts.heldout_path={json.dumps(str(held))}",
                             "eval.heldout.enabled=true", "eval.heldout.samples=2", "eval.heldout.pass_k=[1, 2]",
                             f"eval.heldout.max_new_tokens={MAX_NEW}"])
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))

    assert not caught_up(run_dir)
    r = _sluice("eval", "--run-dir", str(run_dir), "--heldout")
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    assert caught_up(run_dir)
    assert "evaluated 2 new version(s) [0, 5]" in r.stdout and "pass@2" in r.stdout
    got = read_heldout(run_dir / "eval" / "metrics.jsonl")
    assert {v: d["greedy_pass1"] for v, d in got.items()} == data["expected"]
    r = _sluice("eval", "--run-dir", str(run_dir), "--heldout", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["evaluated"] == [] and [d["version"] for d in out["all"]] == [0, 5]
    assert len((run_dir / "eval" / "metrics.jsonl").read_text().splitlines()) == 2  # nothing evaluated twice

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    r = _sluice("eval", "--run-dir", str(empty), "--heldout")
    assert r.returncode == 2 and "holds no weight snapshot" in r.stderr


def test_sluice_eval_heldout_converts_and_evaluates_checkpoints(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from pipeline.consumers.megatron.checkpoint import save_checkpoint
    from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig
    from pipeline.consumers.megatron.convert import load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, forward_logits, init_parallel

    model_cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    init_parallel(ParallelConfig())
    mg = build_gpt_model(model_cfg, ParallelConfig(), r3=True).eval()
    load_hf_into_megatron(mg, model_dir, model_cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for p in mg.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    opt = torch.optim.AdamW(mg.parameters(), lr=1e-3)  # the trainer's checkpoints hold optimizer state too
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir / "checkpoints" / "step-00000003", mg, opt, meta={"step": 3, "policy_version": 3})

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenize = load_tokenize(model_dir)

    def megatron_greedy(ids: list[int]) -> str:  # the trainer's own forward, not the HF conversion
        seq, out = list(ids), []
        for _ in range(MAX_NEW):
            with torch.no_grad():
                t = int(forward_logits(mg, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))[0, -1]
                        .argmax())
            out.append(t)
            seq.append(t)
            if t == tokenizer.eos_token_id:
                break
        return str(tokenizer.decode(out, skip_special_tokens=True))

    answers = [megatron_greedy(list(tokenize(t))).split("\n", 1)[0].strip() for t in PROMPT_TEXTS]
    held = tmp_path / "heldout.jsonl"
    held.write_text("".join(json.dumps({"id": f"h{i}", "prompt": t, "answer": a}) + "\n"
                            for i, (t, a) in enumerate(zip(PROMPT_TEXTS, answers))))
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base_pass = sum(hf_greedy_text(base, tokenizer, list(tokenize(t)), MAX_NEW).split("\n", 1)[0].strip() == a
                    for t, a in zip(PROMPT_TEXTS, answers)) / len(answers)
    assert base_pass < 1.0  # the starting weights do not already give these answers
    cfg = load_config(None, [f"model.path={json.dumps(str(model_dir))}", "prompts.type=jsonl",
                             f"prompts.path={json.dumps(str(held))}", f"prompts.heldout_path={json.dumps(str(held))}",
                             "eval.heldout.samples=1", "eval.heldout.pass_k=[1]",
                             f"eval.heldout.max_new_tokens={MAX_NEW}"])
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))

    r = _sluice("eval", "--run-dir", str(run_dir), "--heldout")
    assert r.returncode == 2 and "--checkpoints" in r.stderr  # no snapshot: it says how to use the checkpoints
    r = _sluice("eval", "--run-dir", str(run_dir), "--heldout", "--checkpoints", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    [line] = json.loads(r.stdout)["evaluated"]
    assert (line["version"], line["source"], line["step"]) == (3, "checkpoint", 3)
    assert line["greedy_pass1"] == 1.0  # the checkpoint's weights answer exactly as the trainer's model does
    assert not (run_dir / "eval" / "checkpoint-hf" / "v00000003").exists()  # the converted copy is gone
    r = _sluice("eval", "--run-dir", str(run_dir), "--heldout", "--checkpoints", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["evaluated"] == []


@pytest.mark.slow
def test_sluice_run_evaluates_held_out_snapshots_to_the_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = _sluice("run", "recipes/cpu-moe.toml", "--run-dir", str(run_dir), "--steps", "5",
                "--set", "prompts.task=addition", "--set", "prompts.digits=2", "--set", "prompts.size=256",
                "--set", "prompts.heldout=12", "--set", "eval.heldout.enabled=true",
                "--set", "eval.heldout.every_versions=2", "--set", "eval.heldout.samples=2",
                "--set", "eval.heldout.pass_k=[1, 2]", "--set", "eval.heldout.poll_s=0.2",
                "--set", "trainer.checkpoint_every=5", "--set", "warmstart.enabled=false",
                "--set", "trainer.batch_groups=4", "--set", "filters.zero_variance=false",
                "--set", "eval.enabled=true", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout[-2000:])
    assert "held-out pass rate per policy version" in r.stdout
    got = read_heldout(run_dir / "eval" / "metrics.jsonl")
    present = [v for v, _ in list_snapshots(run_dir / "snapshots")]
    # The last step's snapshot was written by the trainer (megatron export -> HF names) and evaluated.
    assert present and present[-1] == max(got) >= 5 and caught_up(run_dir)
    assert all(d["prompts"] == 12 and d["samples"] == 24 for d in got.values())
    assert json.loads((run_dir / "snapshots" / f"v{max(got):08d}" / "snapshot.json").read_text())["source"] == \
        "trainer"
    stream = [json.loads(x) for x in (run_dir / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert any(d["kind"] == "eval" for d in stream)  # the stream aggregator ran beside it


def test_run_config_round_trips_with_heldout(tmp_path: Path) -> None:
    cfg = load_config(None, ["eval.heldout.enabled=true", "prompts.heldout=8"])
    again = SluiceConfig.model_validate(json.loads(json.dumps(cfg.model_dump(mode="json"))))
    assert again.eval.heldout == cfg.eval.heldout
