"""Options of the update that must do what their docs say, each through the path a run takes.

- ``failed_in_group_stats``: a group drained from the real queue (readers, rank 0's fetch, a replay) with a failed
  sample reaches the train step with that sample, so its reward counts in the group's advantages, and the step
  trains none of its tokens.
- the KL penalty is bounded per token, so one token far below the reference cannot dominate a step;
- ``constant_norm`` divides by a fixed generation budget, not by each batch's padded length;
- a correction setting that no correction reads is refused at load;
- with several mini-batches the proximal pass cuts the batch as training does, so the ratio is exactly 1 before
  the first update.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import redis  # noqa: E402

from pipeline.config.root import SluiceConfig, load_config  # noqa: E402
from pipeline.config.staleness import StalenessConfig  # noqa: E402
from pipeline.config.trainer import CorrectionConfig, LossConfig, TrainStepConfig  # noqa: E402
from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig  # noqa: E402
from pipeline.consumers.megatron.convert import load_hf_into_megatron  # noqa: E402
from pipeline.consumers.megatron.model import build_gpt_model, init_parallel  # noqa: E402
from pipeline.consumers.rl import passes as passes_module  # noqa: E402
from pipeline.consumers.rl.batch import collate  # noqa: E402
from pipeline.consumers.rl.loss import policy_loss  # noqa: E402
from pipeline.consumers.rl.train_step import TrainStep  # noqa: E402
from pipeline.consumers.trainer.drain import Drainer  # noqa: E402
from pipeline.consumers.trainer.ledger import Ledger  # noqa: E402
from pipeline.consumers.trainer.loop import LocalClock, RankZero, RedisClock, Trainer, TrainerSettings  # noqa: E402
from pipeline.consumers.trainer.readers import SharePlanner  # noqa: E402
from pipeline.consumers.trainer.replay import ReplaySource  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.queue.redis_streams import SampleQueue  # noqa: E402
from pipeline.queue.sample import SampleStatus  # noqa: E402
from tests.helpers.samples import make_group  # noqa: E402
from tests.helpers.train_samples import synthetic_groups, tiny_moe  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu-moe.toml"


# ------------------------------------------------------------------------------------- failed samples in the stats
def _group_with_a_failure(seed: int) -> list:
    rng = np.random.default_rng(seed)
    group = make_group(rng, 4)
    rewards = [1.0, 0.0, 1.0, 0.5]
    group = [dataclasses.replace(s, reward=r) for s, r in zip(group, rewards, strict=True)]
    # A failed generation (say, the reward function raised): nothing of it is trained, its 0 is a real outcome.
    group[2] = dataclasses.replace(group[2], status=SampleStatus.FAILED, reward=0.0)
    return group


def _drain_one(tmp_path: Path, source_kind: str, queue: SampleQueue | None, group: list) -> list:
    """The groups the train step gets for one drained step, through a real single-rank Trainer."""
    ledger = Ledger(tmp_path / f"ledger-{source_kind}")
    staleness = StalenessConfig(max_lag=1000)
    planner = None
    if source_kind == "replay":
        source = ReplaySource(iter([("0-1", group)]), staleness, ledger, LocalClock())
        lead = RankZero(source=source, clock=source.clock, ledger=ledger)  # type: ignore[arg-type]
    else:
        assert queue is not None
        source = Drainer(queue, ledger, staleness, block_ms=50)
        source.recover()
        lead = RankZero(source=source, clock=RedisClock(queue), ledger=ledger)
        if source_kind == "rank0":
            planner = SharePlanner(1, "rank0", queue)
    settings = TrainerSettings(steps=1, batch_groups=1, checkpoint_every=1000, keep_checkpoints=1,
                               run_dir=tmp_path / f"run-{source_kind}")
    model = torch.nn.Linear(1, 1)
    trainer = Trainer(settings, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      step_fn=None, export_weights=None, lead=lead, planner=planner)  # type: ignore[arg-type]
    batch = trainer.drain()
    assert batch is not None
    # The ledger side is unchanged: the failed sample is recorded invalid, not trained.
    rank0 = trainer._rank0_batch
    assert rank0 is not None and [s.sample_id for s in rank0.groups[0]] == \
        [s.sample_id for s in group if s.status != SampleStatus.FAILED]
    return batch.groups


@pytest.mark.parametrize("source_kind", ["readers", "rank0", "replay"])
def test_a_failed_sample_counts_in_its_groups_advantages_however_the_group_was_drained(
        source_kind: str, redis_url: str, run_name: str, tmp_path: Path) -> None:
    group = _group_with_a_failure(1)
    queue = None
    if source_kind != "replay":
        queue = SampleQueue(redis.Redis.from_url(redis_url), run_name)
        queue.put_many([group])
    drained = _drain_one(tmp_path, source_kind, queue, group)
    assert [s.sample_id for s in drained[0]] == [s.sample_id for s in group]
    expected = collate([group]).advantages
    got = collate(drained).advantages
    trained = [i for i, s in enumerate(group) if s.status != SampleStatus.FAILED]
    # Rewards 1, 0, (failed) 0, 0.5: the baseline is 0.375 with the failure and 0.5 without it.
    assert torch.allclose(got[trained], expected[trained], atol=1e-6), (got, expected)
    without = collate([[s for s in group if s.status != SampleStatus.FAILED]]).advantages
    assert not torch.allclose(without, expected[trained], atol=1e-3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    return tiny_moe(tmp_path_factory.mktemp("tiny"))


def _step(tiny: tuple[Path, ModelConfig], cfg: TrainStepConfig) -> TrainStep:
    folder, model_cfg = tiny
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(model, folder, model_cfg)
    return TrainStep(model, model_cfg, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=cfg.lr))


def test_the_step_trains_no_token_of_a_failed_sample_and_runs_no_forward_on_it(
        tiny: tuple[Path, ModelConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    groups = synthetic_groups(tiny[1], [4, 4], seed=2, failed=((0, 1), (1, 3)))
    rows_seen: list[tuple[str, ...]] = []
    real = passes_module.Passes.proximal_pass

    def spy(self, mb, acc):  # type: ignore[no-untyped-def]
        rows_seen.append(mb.sample_ids)
        return real(self, mb, acc)

    monkeypatch.setattr(passes_module.Passes, "proximal_pass", spy)
    step = _step(tiny, TrainStepConfig(lr=1e-3, micro_batch_samples=8))
    metrics = step.step(groups)
    step.close()
    failed = {groups[0][1].sample_id, groups[1][3].sample_id}
    forwarded = {sid for ids in rows_seen for sid in ids if sid}
    assert forwarded and not forwarded & failed
    assert metrics["num_samples"] == 8 and metrics["num_trainable_samples"] == 6
    assert metrics["num_tokens"] == sum(s.num_response_tokens for g in groups for s in g
                                        if s.sample_id not in failed)


# -------------------------------------------------------------------------------------------- the KL penalty bound
def test_one_token_far_below_the_reference_adds_a_bounded_finite_gradient() -> None:
    kl_coef = 0.01
    current = torch.tensor([[-16.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]])  # current - ref = -15 on the first token, 0 on the second
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = LossConfig(kl_coef=kl_coef, correction=CorrectionConfig(type="none"))
    out = policy_loss(current, current.detach(), torch.zeros(1), mask, cfg, ref=ref)
    out.loss.backward()
    assert current.grad is not None and torch.isfinite(current.grad).all()
    assert float(current.grad.abs().max()) <= 10 * kl_coef
    assert float(out.loss.detach()) <= 10 * kl_coef  # the token's k3 is exp(15) - 16, about 3.3e6, before the bound


# ------------------------------------------------------------------------------------------------ constant_norm
def _response_token_grads(cfg: LossConfig, prompt: int) -> torch.Tensor:
    """d loss / d log-prob of each response token, for two responses (3 and 5 tokens) after a ``prompt``-token prompt,
    laid out as the collator lays them out (response token j of a P-token prompt in column P + j - 1)."""
    lengths, T = [3, 5], prompt + 5
    current = torch.full((2, T - 1), -1.0, requires_grad=True)
    mask = torch.zeros(2, T - 1, dtype=torch.bool)
    for b, r in enumerate(lengths):
        mask[b, prompt - 1: prompt - 1 + r] = True
    out = policy_loss(current, current.detach(), torch.tensor([1.0, -0.5]), mask, cfg, normalizer=2.0)
    out.loss.backward()
    assert current.grad is not None
    return torch.stack([current.grad[b, prompt - 1: prompt - 1 + 3] for b in range(2)])


def test_constant_norm_divides_by_the_generation_budget_whatever_the_prompt_length() -> None:
    cfg = load_config(RECIPE, ["trainer.loss.aggregation=constant_norm", "producer.sampling.max_new_tokens=6"])
    loss = cfg.trainer.loss
    assert loss.norm_length == 6  # the producers' budget, not a length taken from the batch
    short, long = _response_token_grads(loss, prompt=2), _response_token_grads(loss, prompt=9)
    assert torch.equal(short, long)
    assert float(short[0, 0]) == pytest.approx(-1.0 / (2 * 6))
    # A recipe's own norm_length stands; it is refused for another aggregation, and a train step refuses none.
    assert load_config(RECIPE, ["trainer.loss.aggregation=constant_norm",
                                "trainer.loss.norm_length=64"]).trainer.loss.norm_length == 64
    with pytest.raises(ConfigError, match="only read by aggregation = 'constant_norm'"):
        LossConfig(norm_length=64)
    with pytest.raises(ConfigError, match="needs trainer.loss.norm_length"):
        TrainStep(torch.nn.Linear(1, 1), None, TrainStepConfig(loss=LossConfig(aggregation="constant_norm")))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- corrections that do nothing
@pytest.mark.parametrize(("fields", "match"), [
    ({"type": "is", "level": "sequence"}, "has no sequence level"),
    ({"type": "none", "level": "sequence"}, "has no sequence level"),
    ({"type": "mis", "cap": 3.0}, "cap is set but"),
    ({"type": "tis", "low": 0.5}, "low is set but"),
    ({"type": "tis", "sequence_weight": "product"}, "sequence_weight is set but"),
])
def test_a_correction_setting_no_correction_reads_is_refused(fields: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CorrectionConfig(**fields)


def test_a_recipe_with_sequence_level_raw_is_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="has no sequence level"):
        load_config(RECIPE, ["trainer.loss.correction.type=is", "trainer.loss.correction.level=sequence",
                             "trainer.loss.correction.cap=2.0"])
    with pytest.raises(ConfigError, match="cap is set but"):
        load_config(RECIPE, ["trainer.loss.correction.type=icepop", "trainer.loss.correction.cap=4.0"])
    # A run's resolved config names every field, at its default where the recipe set none: it loads again.
    resolved = load_config(RECIPE, ["trainer.loss.correction.type=icepop"])
    assert SluiceConfig.model_validate(json.loads(resolved.model_dump_json())) == resolved


# ------------------------------------------------------------------------------- the proximal pass's micro-batches
def test_with_two_mini_batches_and_no_update_the_ratio_is_exactly_1(tiny: tuple[Path, ModelConfig],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SGD at lr 1e-30 moves no fp32 weight (far below their resolution). Tokens per micro-batch bound the split, so that the whole batch and each mini-batch cut differently, with
    different padded lengths: the current and proximal forwards then differ unless both cut alike."""
    gaps: list[float] = []
    real = passes_module.policy_loss

    def spy(current, behaviour, advantages, mask, cfg, **kw):  # type: ignore[no-untyped-def]
        gaps.append(float((current.detach().float() - kw["proximal"].float()).abs()[mask.bool()].max()))
        return real(current, behaviour, advantages, mask, cfg, **kw)

    monkeypatch.setattr(passes_module, "policy_loss", spy)
    groups = synthetic_groups(tiny[1], [4, 4, 4, 4], seed=11, min_response=2)
    step = _step(tiny, TrainStepConfig(lr=1e-30, mini_batches=2, micro_batch_samples=64, micro_batch_tokens=40,
                                       r3=True, loss=LossConfig(correction=CorrectionConfig(type="none"))))
    metrics = step.step(groups)
    step.close()
    assert len(gaps) >= 4 and metrics["policy_kl_k3"] <= 1e-10
    assert max(gaps) == 0.0, gaps


# ------------------------------------------------------------------- aggregation under DP = 2 and two mini-batches
AGGREGATIONS = {"token_mean": {}, "sequence_mean": {}, "constant_norm": {"norm_length": 12}}
DP_SIZES = [3, 2, 4, 3, 4, 3]  # uneven groups: the ranks hold different sample and token counts


def _dp_cfg(aggregation: str) -> TrainStepConfig:
    # SGD, so that serial and parallel runs compare tightly; a tight clip makes the global norm matter.
    loss = LossConfig(aggregation=aggregation, correction=CorrectionConfig(type="none"),  # type: ignore[arg-type]
                      **AGGREGATIONS[aggregation])
    return TrainStepConfig(lr=1.0, micro_batch_samples=2, grad_clip=0.05, mini_batches=2, loss=loss)


def _by_parity(self: TrainStep, batch) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Mini-batches by each sample's place in its group (even, odd): a split that is the same union of samples on
    one rank as on two, which the seeded shuffle of each rank's own rows is not."""
    seen: dict[int, int] = {}
    parity = []
    for g in batch.group_index.tolist():
        parity.append(seen.get(g, 0) % 2)
        seen[g] = seen.get(g, 0) + 1
    return [[b for b, p in enumerate(parity) if p == k] for k in (0, 1)]


def _train_dp(folder: Path, aggregation: str, dp_rank: int, dp_size: int) -> tuple[dict, dict[str, torch.Tensor]]:
    from pipeline.consumers.megatron.convert import megatron_to_hf_state_dict
    from pipeline.consumers.rl.train_step import shard_groups

    model_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()), dtype="float32")
    step = _step((folder, model_cfg), _dp_cfg(aggregation))
    groups = synthetic_groups(model_cfg, DP_SIZES, seed=13, failed=((2, 1),))
    metrics = step.step(shard_groups(groups, dp_rank, dp_size))
    weights = {k: v.clone().contiguous() for k, v in megatron_to_hf_state_dict(step.model, model_cfg).items()}
    step.close()
    return metrics, weights


def test_every_aggregation_on_two_ranks_and_two_mini_batches_equals_one_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file

    from pipeline.models.tiny import init_tiny_model
    from pipeline.net import free_port
    from tests.helpers.train_samples import finish_ranks, start_ranks

    folder, out = tmp_path / "model", tmp_path / "out"
    out.mkdir()
    init_tiny_model("qwen3-moe", folder, seed=0)
    procs = start_ranks(__file__, [str(free_port()), str(folder), str(out)])
    monkeypatch.setattr(TrainStep, "_mini_batch_rows", _by_parity)
    refs = {aggregation: _train_dp(folder, aggregation, 0, 1) for aggregation in AGGREGATIONS}
    finish_ranks(procs, timeout_s=300)
    for aggregation, (ref, ref_weights) in refs.items():
        got = json.loads((out / f"{aggregation}.json").read_text())
        weights = load_file(str(out / f"{aggregation}.safetensors"))
        diff = max((weights[k] - v).abs().max().item() for k, v in ref_weights.items())
        print(f"{aggregation}: max |weight diff| {diff:.2e}, loss {ref['loss']:.6f} vs {got['loss']:.6f}")
        assert ref["grad_clip_coef"] < 1.0 and ref["optimizer_steps"] == 2
        assert diff < 1e-5
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)


def _rank_main(rank: int, port: str, folder: str, out: str) -> None:
    from safetensors.torch import save_file

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    TrainStep._mini_batch_rows = _by_parity  # type: ignore[method-assign]
    for aggregation in AGGREGATIONS:
        metrics, weights = _train_dp(Path(folder), aggregation, rank, 2)
        if rank == 0:
            save_file(weights, str(Path(out) / f"{aggregation}.safetensors"))
            (Path(out) / f"{aggregation}.json").write_text(json.dumps(metrics))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import sys

    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
