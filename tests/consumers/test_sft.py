"""The warm start (SFT) through the real megatron-core model: the loss scores only answers and EOS, it teaches the
tiny model two-digit addition well enough to answer held-out prompts it never saw, its checkpoint holds what it
exported, and the CPU engine serves the exported folder in the trained format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from pipeline.config import SluiceConfig, load_config
from pipeline.consumers.warmstart.config import read_done
from pipeline.consumers.warmstart.sft import (
    BatchOrder,
    SFTData,
    SFTPair,
    SFTTrainer,
    greedy_exact_match,
    sft_loss,
    sft_prompts,
    tokenize_pairs,
)
from pipeline.data.prompts import Prompt, setup_heldout, setup_prompts
from pipeline.errors import ConfigError
from pipeline.models.tiny import build_tokenizer
from pipeline.rundir import warmstart_metrics_path, warmstart_model_dir

STEPS = 400
HELDOUT = 200


def _config(run_dir: Path, model_dir: Path, *extra: str) -> SluiceConfig:
    return load_config(None, [
        f'run.run_dir="{run_dir}"', f'model.path="{model_dir}"', "prompts.task=addition", "prompts.digits=2",
        "prompts.size=9000", f"prompts.heldout={HELDOUT}", f"warmstart.steps={STEPS}", "warmstart.lr=3e-3",
        "warmstart.batch_size=64", f"warmstart.eval_prompts={HELDOUT}", "warmstart.log_every=25", *extra,
    ])


# ------------------------------------------------------------------------------------------------ pure pieces
def test_the_loss_scores_answer_tokens_and_eos_only() -> None:
    eos = 1
    pairs = [SFTPair((5, 6, 7), (8, 9, eos)), SFTPair((5, 6), (10, eos))]
    data = SFTData(pairs, pad_id=0)
    batch = data.batch(np.array([0, 1]))
    # logits at t predict token t+1: row 0's targets are tokens 3..5 (8, 9, EOS), row 1's tokens 2..3 (10, EOS).
    assert batch.loss_mask.tolist() == [[False, False, True, True, True], [False, True, True, False, False]]
    assert batch.input_ids[:, 1:][batch.loss_mask].tolist() == [8, 9, eos, 10, eos]
    assert batch.num_targets == 5

    logits = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    loss, _, _ = sft_loss(logits, batch, batch.num_targets)
    prompt_positions = logits.clone()
    prompt_positions[0, :2] += 50 * torch.randn(2, 16)  # predictions of prompt tokens 6 and 7
    prompt_positions[1, 0] += 50 * torch.randn(16)
    prompt_positions[1, 3:] += 50 * torch.randn(3, 16)  # EOS's own position and the padding after it
    assert torch.equal(sft_loss(prompt_positions, batch, batch.num_targets)[0], loss)
    answer_position = logits.clone()
    answer_position[1, 2, eos] += 5.0  # the prediction of row 1's EOS
    assert sft_loss(answer_position, batch, batch.num_targets)[0] < loss

    # Token mean over the batch: the loss is the mean of the five targets' negative log-likelihoods.
    nll = -torch.log_softmax(logits, -1)
    expected = (nll[0, 2, 8] + nll[0, 3, 9] + nll[0, 4, eos] + nll[1, 1, 10] + nll[1, 2, eos]) / 5
    assert torch.allclose(loss, expected)

    # Exact match counts rows whose every target is the argmax: row 0 all three, row 1 all but its EOS.
    forced = torch.zeros(2, 6, 16)
    for row, t, token in ((0, 2, 8), (0, 3, 9), (0, 4, eos), (1, 1, 10)):
        forced[row, t, token] = 10.0
    forced[1, 2, 3] = 10.0  # row 1 predicts token 3 where EOS belongs
    _, tokens_right, rows_right = sft_loss(forced, batch, batch.num_targets)
    assert (int(tokens_right), int(rows_right)) == (4, 1)
    forced[1, 2, eos] = 20.0
    assert int(sft_loss(forced, batch, batch.num_targets)[2]) == 2


def test_pairs_are_tokenised_apart_with_eos_appended() -> None:
    tok = build_tokenizer()
    pairs = tokenize_pairs([Prompt("a", text="37+45=", answer="82")], tok, where="test")
    assert tok.decode(list(pairs[0].prompt_ids)) == "37+45="
    assert pairs[0].answer_ids == (*tok.encode("82", add_special_tokens=False), tok.eos_token_id)
    with pytest.raises(ConfigError, match="no answer"):
        tokenize_pairs([Prompt("b", text="1+1=")], tok, where="test")


def test_batches_cover_every_pair_once_per_epoch_in_a_seeded_order() -> None:
    order = BatchOrder(10, 5, seed=3)
    epoch = np.concatenate([order.next(), order.next()])
    assert sorted(epoch.tolist()) == list(range(10))
    again = BatchOrder(10, 5, seed=3)
    assert np.array_equal(np.concatenate([again.next(), again.next()]), epoch)
    assert not np.array_equal(BatchOrder(10, 5, seed=4).next(), epoch[:5])


def test_the_default_data_is_the_training_split_and_a_jsonl_with_heldout_prompts_is_refused(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run", tmp_path / "model")
    train = sft_prompts(cfg.warmstart, cfg.prompts)
    held = setup_heldout(cfg.prompts)
    split = setup_prompts(cfg.prompts)
    assert [p.text for p in train] == [split[i].text for i in range(len(split))]
    assert not {p.text for p in train} & {held[i].text for i in range(len(held))}

    leaky = tmp_path / "sft.jsonl"
    leaky.write_text("\n".join(json.dumps({"prompt": p, "answer": "0"}) for p in ["1+2=", held[5].text]))
    with pytest.raises(ConfigError, match="1 prompts of the held-out split"):
        leaky_cfg = _config(tmp_path / "run", tmp_path / "model", f'warmstart.path="{leaky}"')
        sft_prompts(leaky_cfg.warmstart, leaky_cfg.prompts)
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"prompt": "zz", "answer": "7"}))
    clean_cfg = _config(tmp_path / "run", tmp_path / "model", f'warmstart.path="{clean}"')
    got = sft_prompts(clean_cfg.warmstart, clean_cfg.prompts)
    assert [(p.text, p.answer) for p in got] == [("zz", "7")]


# ---------------------------------------------------------------------------------------------- the real thing
@pytest.fixture(scope="module")
def warm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One warm start on two-digit addition (9,000 training prompts, 200 held out), shared by the tests below."""
    from pipeline.consumers.warmstart.sft import run_warmstart

    run_dir = tmp_path_factory.mktemp("sft") / "run"
    cfg = _config(run_dir, model_dir)
    summary = run_warmstart(run_dir, model_dir, warmstart=cfg.warmstart, prompts=cfg.prompts, run=cfg.run, model=cfg.model)
    return {"cfg": cfg, "run_dir": run_dir, "summary": summary}


def test_the_warm_start_learns_addition_on_heldout_prompts(warm: dict[str, Any], model_dir: Path) -> None:
    run_dir, cfg = warm["run_dir"], warm["cfg"]
    lines = [json.loads(x) for x in warmstart_metrics_path(run_dir).read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(25, STEPS + 1, 25))
    assert lines[-1]["loss"] < 0.5 * lines[0]["loss"]
    assert lines[-1]["token_accuracy"] > lines[0]["token_accuracy"] + 0.2

    held = setup_heldout(cfg.prompts)
    prompts = [held[i] for i in range(len(held))]
    before = greedy_exact_match(model_dir, prompts)["exact_match"]
    after = warm["summary"]["eval"]
    print(f"held-out greedy exact match: untrained {before:.3f}, warm-started {after['exact_match']:.3f}")
    assert after["split"] == "heldout" and after["prompts"] == HELDOUT
    assert after["exact_match"] >= before + 0.2
    assert after["stop_rate"] > 0.9  # it learned the format: a number, then EOS

    done = read_done(run_dir)
    assert done is not None and done["steps"] == STEPS and done["config"]["lr"] == 3e-3
    assert done["final_loss"] == lines[-1]["loss"]


def test_micro_batches_accumulate_to_the_whole_batch_gradient(warm: dict[str, Any], model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from pipeline.consumers.megatron.model import shutdown_parallel
    from pipeline.consumers.warmstart.sft import build_sft_model

    cfg = warm["cfg"]
    pairs = tokenize_pairs(sft_prompts(cfg.warmstart, cfg.prompts)[:64], AutoTokenizer.from_pretrained(str(model_dir)), where="test")
    data = SFTData(pairs, pad_id=0)
    grads = []
    try:
        for micro in (None, 24):
            model, _, _ = build_sft_model(model_dir, seed=0)
            # No clipping: it would rescale both gradients to the same norm and hide a wrong normalisation.
            ws = cfg.warmstart.model_copy(update={"batch_size": 64, "micro_batch_size": micro, "grad_clip": None})
            trainer = SFTTrainer(model, data, ws)
            metrics = trainer.step()  # the optimizer step leaves the gradients in place
            grads.append((metrics["loss"], [p.grad.clone() for p in trainer.params]))
    finally:
        shutdown_parallel()
    (loss_whole, g_whole), (loss_split, g_split) = grads
    assert loss_split == pytest.approx(loss_whole, rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g_whole, g_split))
    assert sum(float(g.abs().sum()) for g in g_whole) > 0


def test_the_checkpoint_holds_the_exported_weights(warm: dict[str, Any], model_dir: Path) -> None:
    from pipeline.consumers.megatron.checkpoint import load_checkpoint
    from pipeline.consumers.megatron.model import shutdown_parallel
    from pipeline.consumers.warmstart.sft import build_sft_model, sft_adamw

    run_dir = warm["run_dir"]
    try:
        from_ckpt, _, _ = build_sft_model(model_dir, seed=0)  # starts as the untrained base model
        optimizer = sft_adamw(list(from_ckpt.parameters()), warm["cfg"].warmstart)
        meta = load_checkpoint(run_dir / "warmstart" / "checkpoint", from_ckpt, optimizer)
        exported, _, _ = build_sft_model(warmstart_model_dir(run_dir), seed=0)
        base, _, _ = build_sft_model(model_dir, seed=0)
    finally:
        shutdown_parallel()
    assert meta["step"] == STEPS and meta["kind"] == "warmstart"
    assert all(float(s["step"]) == STEPS for s in optimizer.state.values())
    ckpt, exp, untrained = (dict(m.named_parameters()) for m in (from_ckpt, exported, base))
    assert all(torch.equal(ckpt[k], exp[k]) for k in ckpt)
    assert any(not torch.equal(ckpt[k], untrained[k]) for k in ckpt)


def test_the_cpu_engine_serves_the_warm_model_in_the_trained_format(warm: dict[str, Any], tmp_path: Path) -> None:
    from tests.helpers.engines import start_engine

    held = setup_heldout(warm["cfg"].prompts)
    prompts = [held[i] for i in range(64)]
    tok = build_tokenizer()
    engine = start_engine(warmstart_model_dir(warm["run_dir"]), tmp_path)
    try:
        reply = httpx.post(f"{engine.url}/generate", timeout=120, json={
            "input_ids": [tok.encode(p.text, add_special_tokens=False) for p in prompts],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        }).json()
    finally:
        engine.stop()
    stopped = [r["meta_info"]["finish_reason"]["type"] == "stop" for r in reply]
    texts = [tok.decode(r["output_ids"], skip_special_tokens=True).strip() for r in reply]
    right = [s and t == p.answer for s, t, p in zip(stopped, texts, prompts)]
    print(f"engine: {sum(right)}/64 right, {sum(stopped)}/64 stopped; e.g. {texts[:8]}")
    assert sum(stopped) >= 58 and all(t.isdigit() for t in texts)
    hf = greedy_exact_match(warmstart_model_dir(warm["run_dir"]), prompts)["exact_match"]
    assert abs(sum(right) / 64 - hf) <= 0.05  # the engine generates what the exported HF model does
    assert sum(right) >= 13


def _train_until(warm: dict[str, Any], model_dir: Path, tmp_path: Path, pairs_count: int | None,
                 stop: str, metric: str) -> tuple[SFTTrainer, dict[str, float], list[dict[str, float]], float]:
    """Train from the base model with ``warmstart.<stop>`` set halfway between the first and last window of the shared
    warm start's ``metric``; returns the trainer, its last line, every line written, and the target."""
    from transformers import AutoTokenizer

    from pipeline.consumers.megatron.model import shutdown_parallel
    from pipeline.consumers.warmstart.sft import build_sft_model, train_steps

    cfg = warm["cfg"]
    pairs = tokenize_pairs(sft_prompts(cfg.warmstart, cfg.prompts)[:pairs_count], AutoTokenizer.from_pretrained(str(model_dir)),
                           where="test")
    lines = [json.loads(x) for x in warmstart_metrics_path(warm["run_dir"]).read_text().splitlines()]
    target = (lines[0][metric] + lines[-1][metric]) / 2
    try:
        model, _, _ = build_sft_model(model_dir, seed=0)
        ws = cfg.warmstart.model_copy(update={stop: target, "log_every": 5})
        trainer = SFTTrainer(model, SFTData(pairs, pad_id=0), ws)
        last = train_steps(trainer, tmp_path / "warmstart.jsonl")
    finally:
        shutdown_parallel()
    written = [json.loads(x) for x in (tmp_path / "warmstart.jsonl").read_text().splitlines()]
    assert trainer.steps_done == last["step"] < ws.steps and trainer.steps_done % 5 == 0
    return trainer, last, written, target


def test_until_loss_stops_the_warm_start_at_the_first_window_that_reaches_it(
    warm: dict[str, Any], model_dir: Path, tmp_path: Path
) -> None:
    # The shared warm start's loss curve: a target between its first and last window must stop it in between.
    _, last, written, target = _train_until(warm, model_dir, tmp_path, 256, "until_loss", "loss")
    assert last["loss"] <= target < min(x["loss"] for x in written[:-1])


def test_the_training_exact_match_is_what_greedy_decoding_gets_right(warm: dict[str, Any]) -> None:
    """Teacher forcing and greedy decoding agree up to the first wrong token, so a row whose every answer token is
    the argmax is one greedy answers exactly: the warm start's exact match (and ``until_exact_match``) measure RL's
    reward at no generation cost."""
    from transformers import AutoTokenizer

    from pipeline.consumers.megatron.model import forward_logits, shutdown_parallel
    from pipeline.consumers.warmstart.sft import build_sft_model

    cfg, run_dir = warm["cfg"], warm["run_dir"]
    model_dir = warmstart_model_dir(run_dir)
    prompts = sft_prompts(cfg.warmstart, cfg.prompts)[:256]
    pairs = tokenize_pairs(prompts, AutoTokenizer.from_pretrained(str(model_dir)), where="test")
    batch = SFTData(pairs, pad_id=0).batch(np.arange(len(pairs)))
    try:
        model, _, _ = build_sft_model(model_dir, seed=0)
        model.eval()
        with torch.no_grad():
            _, _, rows_right = sft_loss(forward_logits(model, batch.input_ids, batch.attention_mask), batch,
                                        batch.num_targets)
    finally:
        shutdown_parallel()
    greedy = greedy_exact_match(model_dir, prompts)["exact_match"]
    print(f"teacher-forced exact match {int(rows_right) / len(pairs):.3f}, greedy {greedy:.3f}")
    assert 0.05 < greedy < 0.95  # a model part way, where the two could differ
    assert abs(int(rows_right) - round(greedy * len(pairs))) <= 2  # float ties between megatron and HF at most


def test_until_exact_match_stops_the_warm_start_once_a_window_reaches_it(
    warm: dict[str, Any], model_dir: Path, tmp_path: Path
) -> None:
    _, last, written, target = _train_until(warm, model_dir, tmp_path, None, "until_exact_match", "exact_match")
    assert last["exact_match"] >= target > max(x["exact_match"] for x in written[:-1])
