"""Loss plug-ins and reweighted groups on the real train step (megatron-core on CPU, tiny Qwen3-MoE, fp32).

Each test measures an effect on the gradient the optimizer receives, captured by an optimizer that records it and
does not step (so every run starts from the same weights): a term whose gradient never arrived, a replacement that
was only added, or a weight that never reached the loss would each leave the gradient as it was.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from pipeline import plugins  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.config.trainer import CorrectionConfig, LossConfig, LossTermConfig, TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, init_parallel  # noqa: E402
from pipeline.consumers.rl.batch import collate  # noqa: E402
from pipeline.consumers.rl.loss_plugins import LossInputs, LossPluginError  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.net import free_port  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks, synthetic_groups, tiny_moe  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
plugins.activate([FIXTURES, EXAMPLES])  # as a recipe's plugins.paths would

SIZES = [4, 3, 4, 3]
TERM = "user_losses:low_token_logprob"


class GradCapture(torch.optim.SGD):
    """Keeps the gradient of the last step instead of stepping: the weights never move, so runs compare exactly."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, lr=1.0)
        self.grads: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.grads.append(torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten()
                                     for g in self.param_groups for p in g["params"]]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig, torch.nn.Module]:
    folder, model_cfg = tiny_moe(tmp_path_factory.mktemp("tiny"))
    init_parallel(ParallelConfig(device="cpu"), seed=7)
    model = build_gpt_model(model_cfg, ParallelConfig(device="cpu"), r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    return folder, model_cfg, model


def _cfg(**loss: object) -> TrainStepConfig:
    micro = loss.pop("micro_batch_samples", 64)
    # r3 off: the router picks its own experts, as in the hand-made forward of _term_gradient.
    return TrainStepConfig(lr=1.0, grad_clip=None, micro_batch_samples=micro, r3=False, measure_r3=False,
                           loss=LossConfig(correction=CorrectionConfig(type="none"), **loss))


def _grad(tiny: tuple, cfg: TrainStepConfig, groups: list, weights: list[float] | None = None,
          ) -> tuple[torch.Tensor, dict[str, float]]:
    _, model_cfg, model = tiny
    opt = GradCapture(list(model.parameters()))
    step = TrainStep(model, model_cfg, cfg, optimizer=opt)
    try:
        metrics = step.step(groups, weights)
    finally:
        step.close()
    assert len(opt.grads) == 1
    return opt.grads[0], metrics


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4) -> float:
    """max |a - b| relative to the larger of the two; asserted below ``rel``."""
    err = float((a - b).abs().max() / max(float(a.abs().max()), float(b.abs().max()), 1e-12))
    assert err < rel, err
    return err


def _term_gradient(tiny: tuple, groups: list) -> torch.Tensor:
    """The fixture term's gradient, by hand: one forward of the whole batch, the term, backward."""
    from user_losses import low_token_logprob

    from pipeline.consumers.megatron.model import forward_logits
    from pipeline.consumers.megatron.scoring import score_tokens

    _, model_cfg, model = tiny
    model.zero_grad(set_to_none=True)
    batch = collate(groups)  # dense collation: the router picks its own experts, as with r3 off
    logits = forward_logits(model, batch.input_ids, batch.attention_mask, padding_mask=~batch.attention_mask.bool())
    logprobs, _ = score_tokens(logits, batch.targets, batch.temperatures)
    inputs = LossInputs(logprobs=logprobs, proximal=logprobs.detach(), behaviour=batch.behaviour_logprobs,
                        advantages=batch.advantages, loss_mask=batch.loss_mask, sample_weights=batch.sample_weights,
                        token_versions=batch.token_versions, rewards=batch.rewards, group_index=batch.group_index,
                        targets=batch.targets, ref=None, entropy=None, aux_losses={}, sample_ids=batch.sample_ids)
    value, _ = low_token_logprob(inputs)
    value.backward()
    grad = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grad


def test_an_auxiliary_term_adds_its_gradient_whatever_the_micro_batching(tiny: tuple) -> None:
    groups = synthetic_groups(tiny[1], SIZES, seed=5, failed=((2, 1),))
    coef = 0.3
    base, m0 = _grad(tiny, _cfg(), groups)
    with_term, m1 = _grad(tiny, _cfg(terms=[LossTermConfig(fn=TERM, coef=coef)]), groups)
    # The same term over micro-batches of 3 samples: each micro-batch's mean is scaled by its share of the tokens.
    split, m2 = _grad(tiny, _cfg(terms=[LossTermConfig(fn=TERM, coef=coef)], micro_batch_samples=3), groups)
    own = _term_gradient(tiny, groups)
    replaced, m3 = _grad(tiny, _cfg(replace=TERM), groups)

    print(f"|grad| base {base.norm():.4f}, with term {with_term.norm():.4f}, term alone {own.norm():.4f}; "
          f"micro-batches {m0['micro_batches']:.0f} vs {m2['micro_batches']:.0f}")
    assert own.norm() > 0.1 * base.norm()  # the term is not negligible next to the policy gradient
    errors = (_close(with_term - base, coef * own, rel=1e-4), _close(split, with_term, rel=1e-4),
              # replace: the gradient is the replacement's.
              _close(replaced, own, rel=1e-4))
    print("relative errors: term added {:.1e}, split vs whole {:.1e}, replacement {:.1e}".format(*errors))
    # The built-in loss's parts and diagnostics are gone under replace.
    assert "clip_fraction" not in m3 and "pg_loss" not in m3 and "is_weight_mean" not in m3
    assert "clip_fraction" in m1 and "pg_loss" in m1
    # Metrics under loss/<name>/: the term's value (before coef) and its own metrics, equal however split.
    value = m1["loss/low_token_logprob/value"]
    assert value < 0 and m2["loss/low_token_logprob/value"] == pytest.approx(value, rel=1e-5)
    assert 0 < m1["loss/low_token_logprob/hit_fraction"] < 1
    assert m2["loss/low_token_logprob/hit_fraction"] == pytest.approx(m1["loss/low_token_logprob/hit_fraction"])
    assert m1["loss"] == pytest.approx(m0["loss"] + coef * value, rel=1e-5)
    assert m3["loss"] == pytest.approx(value, rel=1e-5)
    assert m3["loss/low_token_logprob/value"] == pytest.approx(m3["loss"], rel=1e-6)
    assert m3["num_tokens"] == m0["num_tokens"] > 0


def test_a_few_optimizer_steps_follow_the_term(tiny: tuple) -> None:
    """A term that maximises the low tokens' log-prob (coef < 0) raises them more than the policy loss alone."""
    folder, model_cfg, _ = tiny
    # Every sample routed: compute_logprobs then answers in the groups' order.
    groups = [[s for s in g if s.routed_experts is not None] for g in synthetic_groups(model_cfg, SIZES, seed=6)]
    gains = {}
    for coef in (0.0, -2.0):
        init_parallel(ParallelConfig(device="cpu"), seed=7)
        model = build_gpt_model(model_cfg, ParallelConfig(device="cpu"), r3=True)
        load_hf_into_megatron(model, folder, model_cfg)
        terms = [LossTermConfig(fn=TERM, coef=coef)] if coef else []
        cfg = TrainStepConfig(lr=3e-3, micro_batch_samples=4,
                              loss=LossConfig(correction=CorrectionConfig(type="none"), terms=terms))
        step = TrainStep(model, model_cfg, cfg)
        low = [[(s.response_ids < 20) for s in g] for g in groups]
        before = step.compute_logprobs(groups, replay=False)
        for _ in range(4):
            step.step(groups)
        after = step.compute_logprobs(groups, replay=False)
        step.close()
        hits = [m for g in low for m in g]
        gains[coef] = float(sum((a - b)[m].sum() for a, b, m in zip(after, before, hits, strict=True))
                            / sum(m.sum() for m in hits))
    print(f"mean log-prob change of the low tokens after 4 AdamW steps: policy loss alone {gains[0.0]:+.3f}, "
          f"with the term {gains[-2.0]:+.3f}")
    assert gains[-2.0] > gains[0.0] + 0.05


def test_a_bad_term_answer_stops_the_step_naming_the_plugin(tiny: tuple) -> None:
    groups = synthetic_groups(tiny[1], [2, 2], seed=1)
    cases = {
        "user_losses:nan_term": r"user_losses:nan_term.*trainer\.loss\.terms\[0\]\.fn.*returned nan",
        "user_losses:per_sample_term": r"per_sample_term.*must be a 0-dim tensor",
        "user_losses:bare_tensor": r"bare_tensor.*must return \(value, metrics\)",
        "user_losses:text_metric": r"text_metric.*metric 'note'",
        "user_losses:raising_term": r"raising_term.*raised KeyError: 'no such column'",
    }
    for ref, pattern in cases.items():
        with pytest.raises(LossPluginError, match=pattern):
            _grad(tiny, _cfg(terms=[LossTermConfig(fn=ref)]), groups)
    with pytest.raises(LossPluginError, match=r"trainer\.loss\.replace.*returned nan"):
        _grad(tiny, _cfg(replace="user_losses:nan_term"), groups)


def test_a_reweighted_group_scales_its_part_of_the_gradient(tiny: tuple) -> None:
    groups = synthetic_groups(tiny[1], [3, 4, 3], seed=8)
    ones, m1 = _grad(tiny, _cfg(micro_batch_samples=4), groups, [1.0, 1.0, 1.0])
    first_only, _ = _grad(tiny, _cfg(micro_batch_samples=4), groups, [1.0, 0.0, 0.0])
    doubled, m2 = _grad(tiny, _cfg(micro_batch_samples=4), groups, [2.0, 1.0, 1.0])
    halved, m3 = _grad(tiny, _cfg(micro_batch_samples=4), groups, [0.5, 1.0, 1.0])
    unweighted, m0 = _grad(tiny, _cfg(micro_batch_samples=4), groups)
    assert first_only.norm() > 0.1 * ones.norm()
    assert torch.equal(unweighted, ones) and m0["loss"] == m1["loss"]
    # Weight 2 adds the first group's part once more; 0.5 takes half of it away; the others' parts are untouched.
    _close(doubled - ones, first_only, rel=1e-4)
    _close(ones - halved, 0.5 * first_only, rel=1e-4)
    assert m2["loss"] != m1["loss"] != m3["loss"]
    assert m2["num_tokens"] == m1["num_tokens"]  # the normaliser counts tokens, not weights
    # A replacement built on inputs.mean sees the weights too (examples/losses.py's REINFORCE).
    r1, _ = _grad(tiny, _cfg(replace="losses:reinforce", micro_batch_samples=4), groups, [1.0, 1.0, 1.0])
    r2, _ = _grad(tiny, _cfg(replace="losses:reinforce", micro_batch_samples=4), groups, [2.0, 1.0, 1.0])
    r0, _ = _grad(tiny, _cfg(replace="losses:reinforce", micro_batch_samples=4), groups, [1.0, 0.0, 0.0])
    _close(r2 - r1, r0, rel=1e-4)


def test_loss_plugins_are_checked_when_the_recipe_loads() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.loss\.terms\[0\]\.fn.*cannot import 'nowhere'"):
        load_config(overrides=['trainer.loss.terms=[{fn = "nowhere:term", coef = 0.1}]'])
    with pytest.raises(ConfigError, match=r"trainer\.loss\.terms\[1\]\.fn.*must accept \(inputs"):
        load_config(overrides=[f'trainer.loss.terms=[{{fn = "{TERM}"}}, {{fn = "user_losses:two_arguments"}}]'])
    with pytest.raises(ConfigError, match=r"trainer\.loss\.replace.*is async"):
        load_config(overrides=['trainer.loss.replace="user_losses:async_term"'])
    with pytest.raises(ConfigError, match=r"trainer\.loss\.replace.*not an import path"):
        load_config(overrides=['trainer.loss.replace="user_losses.nan_term"'])
    with pytest.raises(ConfigError, match="share the metrics name"):
        load_config(overrides=[f'trainer.loss.terms=[{{fn = "{TERM}"}}, {{fn = "{TERM}", coef = 2.0}}]'])
    with pytest.raises(ConfigError, match="entropy_coef.*replace"):
        load_config(overrides=[f'trainer.loss.replace="{TERM}"', "trainer.loss.entropy_coef=0.01"])
    cfg = load_config(overrides=[f'trainer.loss.terms=[{{fn = "{TERM}", coef = 0.01, name = "low"}}]',
                                 'trainer.loss.replace="losses:reinforce"'])
    assert [(f, r) for f, r, _ in cfg.plugin_refs()][-2:] == [("trainer.loss.terms[0].fn", TERM),
                                                               ("trainer.loss.replace", "losses:reinforce")]
    records = {r["field"]: r for r in cfg.plugin_records()}
    assert records["trainer.loss.terms[0].fn"]["sha256"] and records["trainer.loss.replace"]["file"]


def test_the_example_terms_and_filters(tiny: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """examples/losses.py's terms move the gradient; the entropy bonus only with trainer.loss.entropy_grad on."""
    groups = synthetic_groups(tiny[1], SIZES, seed=2)
    base, m0 = _grad(tiny, _cfg(), groups)
    bonus = [LossTermConfig(fn="losses:entropy_bonus", coef=0.5)]
    with caplog.at_level("WARNING", logger="pipeline.consumers.rl.loss_plugins"):
        detached, _ = _grad(tiny, _cfg(terms=bonus), groups)
    assert "without gradient" in caplog.text
    _close(detached, base, rel=1e-6)  # the entropy carried no gradient: the update is the policy loss's alone
    with_grad, m1 = _grad(tiny, _cfg(terms=bonus, entropy_grad=True), groups)
    assert (with_grad - base).norm() > 0.01 * base.norm()
    assert m1["loss/entropy_bonus/entropy"] == pytest.approx(m0["entropy"], rel=1e-5)
    shorter, m2 = _grad(tiny, _cfg(terms=[LossTermConfig(fn="losses:length_penalty", coef=0.5)]), groups)
    assert (shorter - base).norm() > 0.01 * base.norm() and m2["loss/length_penalty/mean_length"] > 1
    cfg = load_config(overrides=['filters.user=["filters:quality_weight", "filters:upweight_hard"]',
                                 'trainer.loss.terms=[{fn = "losses:length_penalty", coef = 0.05}]',
                                 'trainer.loss.replace="losses:reinforce"'])
    assert [r for _, r, _ in cfg.plugin_refs()][-4:] == ["filters:quality_weight", "filters:upweight_hard",
                                                           "losses:length_penalty", "losses:reinforce"]
    from filters import quality_weight, upweight_hard

    from pipeline.queue.sample import SampleStatus

    group = [s for g in synthetic_groups(tiny[1], [4], seed=3) for s in g]
    assert quality_weight(group) == 1.0
    group[0].status = SampleStatus.TRUNCATED
    assert 0.5 < quality_weight(group) < 1.0
    for s in group:
        s.status, s.reward = SampleStatus.TRUNCATED, 0.0
    assert quality_weight(group) == 0.0 and upweight_hard(group) == 2.0


# --- 2 gloo ranks equal 1 rank, with a term, weights, and a rank that never calls the term -----------------------

DP_SIZES = [3, 2, 3, 2]
# Rank 1 gets groups 1 and 3 (every other group): all their samples failed, so it has no loss tokens and never calls
# the term; its metrics must still carry the term's keys (the names are united over ranks) and the update must match.
DP_FAILED = ((1, 0), (1, 1), (3, 0), (3, 1))
DP_WEIGHTS = [2.0, 1.0, 0.5, 1.0]


def _dp_cfg() -> TrainStepConfig:
    return _cfg(terms=[LossTermConfig(fn=TERM, coef=0.3)], micro_batch_samples=2)


def _dp_run(folder: Path, out: Path) -> None:
    """One rank of the 2-rank run (this file started as a script): its reduced gradient and metrics to ``out``."""
    import json

    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from pipeline.consumers.rl.train_step import shard_groups

    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    init_parallel(ParallelConfig(device="cpu"), seed=7)
    model = build_gpt_model(model_cfg, ParallelConfig(device="cpu"), r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    groups = synthetic_groups(model_cfg, DP_SIZES, seed=4, failed=DP_FAILED)
    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    opt = GradCapture(list(model.parameters()))  # it sees the gradient after the all-reduce over ranks
    step = TrainStep(model, model_cfg, _dp_cfg(), optimizer=opt)
    metrics = step.step(shard_groups(groups, rank, size), shard_groups(DP_WEIGHTS, rank, size))
    step.close()
    save_file({"grad": opt.grads[0].contiguous()}, str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps(metrics))


def test_two_gloo_ranks_give_the_single_rank_term_and_weights(tmp_path: Path, tiny: tuple) -> None:
    import json

    from safetensors.torch import load_file

    folder = tiny[0]
    procs = start_ranks(__file__, [str(free_port()), str(folder), str(tmp_path)])
    groups = synthetic_groups(tiny[1], DP_SIZES, seed=4, failed=DP_FAILED)
    ref_grad, ref = _grad(tiny, _dp_cfg(), groups, DP_WEIGHTS)
    finish_ranks(procs)
    ranks = [{"grad": load_file(str(tmp_path / f"rank{r}.safetensors"))["grad"],
              "metrics": json.loads((tmp_path / f"rank{r}.json").read_text())} for r in range(2)]
    assert ranks[1]["metrics"]["num_tokens"] == ref["num_tokens"]  # metrics are reduced over ranks
    for got in ranks:
        err = _close(got["grad"], ref_grad, rel=1e-5)
        assert set(got["metrics"]) == set(ref)
        for key in ("loss", "pg_loss", "loss/low_token_logprob/value", "loss/low_token_logprob/hit_fraction"):
            assert got["metrics"][key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    print(f"2 ranks vs 1: gradient relative error {err:.1e}; term value {ref['loss/low_token_logprob/value']:.4f}")


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK=sys.argv[1], WORLD_SIZE="2")
    _dp_run(Path(sys.argv[3]), Path(sys.argv[4]))
    torch.distributed.destroy_process_group()
