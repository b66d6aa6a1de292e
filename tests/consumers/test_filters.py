"""Group filters in the drainer and in replay: real Redis, groups put through the real SampleQueue, the real ledger and
audit. A filter that did nothing would leave the constant groups in the batch, and these tests would see them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline import plugins
from pipeline.config import load_config
from pipeline.config.filters import FilterConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.trainer.audit import audit_trainer
from pipeline.consumers.trainer.drain import Drainer
from pipeline.consumers.trainer.filters import GroupFilters, resolve_filter
from pipeline.consumers.trainer.ledger import Ledger, LedgerLine
from pipeline.consumers.trainer.replay import ReplaySource
from pipeline.errors import ConfigError, SluiceError
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import Sample
from tests.helpers.samples import make_group

plugins.activate([Path(__file__).parents[1] / "fixtures"])  # as a recipe's plugins.paths would

FRESH = StalenessConfig(max_lag=1, action="drop")


def rewarded(rng: np.random.Generator, rewards: list[float]) -> list[Sample]:
    group = make_group(rng, len(rewards), version=0)
    for s, r in zip(group, rewards):
        s.reward = r
    return group


def test_zero_variance_filter_drops_exactly_the_constant_groups_and_keeps_drawing(queue: SampleQueue,
                                                                                  tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    constant = [[0.0] * 4, [1.0] * 4, [0.1] * 4, [0.0] * 4]
    varied = [[0.0, 1.0, 0.0, 0.0], [0.1, 0.1, 1.0, 0.1], [1.0, 1.0, 1.0, 0.0]]
    # Interleaved, three constant groups first: a drainer that stopped at batch_groups entries would train them.
    order = [constant[0], constant[1], varied[0], constant[2], varied[1], constant[3], varied[2], varied[0]]
    groups = [rewarded(rng, r) for r in order]
    # Every group holds a pacing slot, as a producer's would.
    queue.redis.set(queue.keys.groups_started, len(groups))
    for i, g in enumerate(groups):
        queue.redis.hset(queue.keys.group_slots, g[0].group_id, f"{i}:0")
    ids = queue.put_many(groups)
    d = Drainer(queue, Ledger(tmp_path / "ledger"), FRESH, filters=FilterConfig(zero_variance=True), block_ms=10)
    d.recover()
    batch = d.next_batch(3, step=0, version=lambda: 0)

    assert [[s.reward for s in g] for g in batch.groups] == [[np.float32(x) for x in r] for r in varied]
    assert batch.group_entries == [ids[2], ids[4], ids[6]]
    assert batch.consumed == ids[:7]  # it kept reading past the constant ones, and no further than needed
    filtered_ids = {s.sample_id for g in (groups[0], groups[1], groups[3], groups[5]) for s in g}
    assert {line.sample_id for line in batch.lines if line.fate == "filtered"} == filtered_ids
    assert all(line.fate == "filtered" for line in batch.lines)
    assert batch.filters.as_metrics() == {"filter/groups_zero_variance": 4.0, "filter/groups_user": 0.0,
                                          "filter/samples": 16.0, "filter/capped": 0.0,
                                          "filter/groups_reweighted": 0.0, "filter/weight_mean": 1.0}
    assert batch.weights() is None  # nothing reweighted: the train step gets no weights
    # The four filtered groups gave their slots back at drain time; the trained ones keep theirs.
    assert batch.slots.released == 4 and int(queue.redis.get(queue.keys.groups_started)) == len(groups) - 4
    assert batch.drain_metrics()["pacing/slots_released"] == 4.0
    assert batch.counts.groups_train == 3 and len(batch.lags) == 3  # the staleness counters count trained groups
    # Without the filter the same stream gives the first three groups, constant ones included.
    queue.create_group("plain", "0")
    plain = Drainer(queue, Ledger(tmp_path / "plain"), FRESH, group="plain", block_ms=10).next_batch(
        3, step=0, version=lambda: 0)
    assert plain.group_entries == ids[:3]


def test_the_draw_cap_trains_a_partial_batch_instead_of_drawing_on(queue: SampleQueue, tmp_path: Path) -> None:
    """Near convergence most groups are all right: without a cap the drainer would read every one of them."""
    rng = np.random.default_rng(1)
    order = [[1.0] * 4, [0.0, 1.0, 1.0, 1.0], *([[1.0] * 4] * 6), [0.0, 0.0, 1.0, 1.0]]
    ids = queue.put_many([rewarded(rng, r) for r in order])
    capped = Drainer(queue, Ledger(tmp_path / "capped"), FRESH, block_ms=10,
                     filters=FilterConfig(zero_variance=True, max_draw_factor=2.0))
    capped.recover()
    batch = capped.next_batch(2, step=0, version=lambda: 0)
    # Two groups wanted; after 2 x 2 = 4 filtered groups it stops with the one informative group it has.
    assert batch.group_entries == [ids[1]] and batch.consumed == ids[:5]
    assert batch.filters.groups_zero_variance == 4 and batch.filters.capped == 1
    queue.create_group("uncapped", "0")
    full = Drainer(queue, Ledger(tmp_path / "full"), FRESH, group="uncapped", block_ms=10,
                   filters=FilterConfig(zero_variance=True)).next_batch(2, step=0, version=lambda: 0)
    assert full.group_entries == [ids[1], ids[8]] and full.filters.groups_zero_variance == 7
    assert full.filters.capped == 0
    # A cap never leaves a rank without a group: with min_groups = 2 the capped drainer reads on.
    queue.create_group("two-ranks", "0")
    two = Drainer(queue, Ledger(tmp_path / "two"), FRESH, group="two-ranks", block_ms=10, min_groups=2,
                  filters=FilterConfig(zero_variance=True, max_draw_factor=2.0)).next_batch(2, step=0,
                                                                                        version=lambda: 0)
    assert two.group_entries == [ids[1], ids[8]]


def test_a_user_filter_by_import_path_is_applied(queue: SampleQueue, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    groups = [rewarded(rng, r) for r in ([1.0, 1.0, 0.0], [0.0, 0.1, 0.0], [1.0, 0.0, 1.0], [0.1, 0.1, 0.1])]
    ids = queue.put_many(groups)
    cfg = FilterConfig(zero_variance=True, user=["user_filters:mean_reward_above_half"])
    d = Drainer(queue, Ledger(tmp_path / "ledger"), FRESH, filters=cfg, block_ms=10)
    d.recover()
    batch = d.next_batch(2, step=0, version=lambda: 0)
    assert batch.group_entries == [ids[0], ids[2]] and batch.consumed == ids[:3]
    # Group 1 has varied rewards but a low mean: the user filter drops it.
    assert (batch.filters.groups_user, batch.filters.groups_zero_variance, batch.filters.samples) == (1, 0, 3)
    assert {line.sample_id for line in batch.lines} == {s.sample_id for s in groups[1]}
    # Group 3 is constant: the built-in filter, which runs first, drops it.
    rest = d.next_batch(1, step=1, version=lambda: 0, should_stop=lambda: len(queue.pending_ids("trainer")) >= 4)
    assert rest.groups == [] and rest.consumed == [ids[3]]
    assert (rest.filters.groups_user, rest.filters.groups_zero_variance) == (0, 1)


def test_filtered_groups_are_accounted_for_by_the_audit(queue: SampleQueue, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    groups = [rewarded(rng, r) for r in ([0.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0])]
    queue.put_many(groups)
    run_dir = tmp_path / "run"
    ledger = Ledger(run_dir / "ledger")
    d = Drainer(queue, ledger, FRESH, filters=FilterConfig(zero_variance=True), block_ms=10)
    d.recover()
    batch = d.next_batch(2, step=1, version=lambda: 0)
    # What the trainer's record and commit do: ledger lines, segment, checkpoint in place, then the acks.
    ledger.record([*batch.lines, *(LedgerLine(s.sample_id, e, "trained", 1, 0)
                                   for e, g in zip(batch.group_entries, batch.groups) for s in g)])
    ledger.write_segment(1)
    (run_dir / "checkpoints" / "step-00000001").mkdir(parents=True)
    ledger.mark_committed(1)
    d.ack(batch.consumed)
    audit = audit_trainer(queue, run_dir)
    assert (audit.trained, audit.filtered, audit.stale, audit.invalid) == (4, 4, 0, 0)
    assert audit.lost == 0 and audit.duplicates == 0 and audit.pending == 0


def test_replay_applies_the_same_filters(tmp_path: Path) -> None:
    from pipeline.consumers.trainer.loop import LocalClock

    rng = np.random.default_rng(3)
    groups = [rewarded(rng, r) for r in ([1.0, 1.0], [0.0, 1.0], [0.5, 0.5], [1.0, 0.0])]
    records = iter([(f"{i}-0", g) for i, g in enumerate(groups)])
    clock = LocalClock(0)
    src = ReplaySource(records, FRESH, Ledger(tmp_path / "ledger"), clock, filters=FilterConfig(zero_variance=True))
    batch = src.next_batch(2, step=0, version=clock.get)
    assert batch.group_entries == ["1-0", "3-0"] and batch.consumed == ["0-0", "1-0", "2-0", "3-0"]
    assert batch.filters.groups_zero_variance == 2
    assert {(line.entry_id, line.fate) for line in batch.lines} == {("0-0", "filtered"), ("2-0", "filtered")}


def test_a_bad_filter_path_is_rejected_when_the_recipe_loads() -> None:
    with pytest.raises(ConfigError, match=r"filters\.user.*cannot import 'no_such_module'"):
        load_config(overrides=['filters.user=["no_such_module:keep"]'])
    with pytest.raises(ConfigError, match=r"filters\.user\[1\].*has no attribute 'missing'"):
        load_config(overrides=['filters.user=["user_filters:mean_reward_above_half", "user_filters:missing"]'])
    with pytest.raises(ConfigError, match=r"filters\.user\[0\].*must accept \(group"):
        load_config(overrides=['filters.user=["user_filters:two_arguments"]'])
    with pytest.raises(ConfigError, match="not a function"):
        load_config(overrides=['filters.user=["user_filters:NOT_CALLABLE"]'])
    with pytest.raises(ConfigError, match="is async"):
        load_config(overrides=['filters.user=["user_filters:async_filter"]'])
    with pytest.raises(ConfigError, match="not an import path"):
        load_config(overrides=['filters.user=["user_filters.mean_reward_above_half"]'])
    with pytest.raises(ConfigError, match="filters.unknown"):
        load_config(overrides=["filters.unknown=true"])
    with pytest.raises(ConfigError, match="group_size = 1 drops every group"):
        load_config(overrides=["filters.zero_variance=true", "producer.group_size=1"])
    cfg = load_config(overrides=["filters.zero_variance=true", 'filters.user=["user_filters:mean_reward_above_half"]'])
    assert cfg.filters.zero_variance and cfg.filters.user == ["user_filters:mean_reward_above_half"]


def test_a_filter_must_answer_with_a_bool_or_a_weight() -> None:
    rng = np.random.default_rng(4)
    group = rewarded(rng, [0.0, 0.8])
    assert GroupFilters(FilterConfig(user=["user_filters:numpy_keep_all"])).check(group) is None
    assert GroupFilters(FilterConfig(user=["user_filters:returns_a_number"])).weigh(group).weight == 1.0
    # Two filters' weights multiply; a weight of zero drops, naming the filter that did.
    both = GroupFilters(FilterConfig(user=["user_filters:double_low_mean", "user_filters:double_low_mean"]))
    assert both.weigh(group).weight == 4.0 and both.check(group) is None
    zero = GroupFilters(FilterConfig(user=["user_filters:double_low_mean", "user_filters:drop_reward_above_2"]))
    assert zero.check(rewarded(rng, [0.0, 3.0])) == "user_filters:drop_reward_above_2"
    for ref, answer in (("negative_weight", "returned the weight -1.0"), ("nan_weight", "returned the weight nan"),
                        ("text_weight", "returned str 'keep'"), ("raising_filter", "raised ZeroDivisionError")):
        bad = GroupFilters(FilterConfig.model_construct(zero_variance=False, user=[]))
        bad.user = [(f"user_filters:{ref}", resolve_filter(f"user_filters:{ref}"))]
        with pytest.raises(SluiceError, match=rf"group filter 'user_filters:{ref}' {answer}"):
            bad.check(group)


def test_a_reweighting_filter_weighs_kept_groups_and_still_drops(queue: SampleQueue, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    rewards = ([0.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 3.0, 1.0], [0.0, 0.5, 0.0], [1.0, 1.0, 1.0], [0.9, 1.0, 0.0])
    groups = [rewarded(rng, r) for r in rewards]
    ids = queue.put_many(groups)
    cfg = FilterConfig(zero_variance=True, user=["user_filters:double_low_mean", "user_filters:drop_reward_above_2"])
    d = Drainer(queue, Ledger(tmp_path / "ledger"), FRESH, filters=cfg, block_ms=10)
    d.recover()
    batch = d.next_batch(4, step=0, version=lambda: 0)
    # Group 2 (a reward above 2: weight 0) and group 4 (constant) are dropped; the low-mean groups weigh 2.
    assert batch.group_entries == [ids[0], ids[1], ids[3], ids[5]]
    assert batch.group_weights == [2.0, 1.0, 2.0, 1.0] and batch.weights() == [2.0, 1.0, 2.0, 1.0]
    assert {line.sample_id for line in batch.lines if line.fate == "filtered"} == \
        {s.sample_id for g in (groups[2], groups[4]) for s in g}
    metrics = batch.drain_metrics()
    assert (metrics["filter/groups_reweighted"], metrics["filter/weight_mean"]) == (2.0, 1.5)
    assert (metrics["filter/groups_user"], metrics["filter/groups_zero_variance"]) == (1.0, 1.0)
    # Replay judges with the same filters, so it weighs the same groups.
    from pipeline.consumers.trainer.loop import LocalClock

    clock = LocalClock(0)
    src = ReplaySource(iter([(f"{i}-0", g) for i, g in enumerate(groups)]), FRESH, Ledger(tmp_path / "replay"),
                       clock, filters=cfg)
    assert src.next_batch(4, step=0, version=clock.get).group_weights == [2.0, 1.0, 2.0, 1.0]


def test_filter_weights_reach_the_train_step_and_the_step_metrics(queue: SampleQueue, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The real trainer loop over a real drain: the step function gets each group's weight, the metrics line counts."""
    import json

    import torch

    from pipeline.consumers.megatron import checkpoint
    from pipeline.consumers.trainer.loop import RankZero, RedisClock, Trainer, TrainerSettings

    class Recording:
        policy_version: int | None = None

        def __init__(self) -> None:
            self.calls: list[tuple[list[float], list[float] | None]] = []

        def step(self, groups: list[list[Sample]], weights: list[float] | None = None) -> dict[str, float]:
            self.calls.append(([float(np.mean([s.reward for s in g])) for g in groups], weights))
            return {"loss": 0.0}

        def state_dict(self) -> dict[str, int]:
            return {}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    def save_checkpoint(directory: Path, model: object, optimizer: object, meta: dict) -> float:
        directory.mkdir(parents=True)
        return 0.0

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_checkpoint)
    rng = np.random.default_rng(6)
    queue.put_many([rewarded(rng, r) for r in ([0.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 1.0, 0.0],
                                               [1.0, 0.0, 1.0], [1.0, 1.0, 0.0])])
    run_dir = tmp_path / "run"
    cfg = FilterConfig(user=["user_filters:double_low_mean", "user_filters:drop_reward_above_2"])
    model = torch.nn.Linear(2, 2)
    step_fn = Recording()
    trainer = Trainer(TrainerSettings(steps=2, batch_groups=2, checkpoint_every=2, keep_checkpoints=2,
                                      run_dir=run_dir, overlap_push=False),
                      model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step_fn=step_fn,
                      export_weights=lambda: iter([("w", model.weight.detach().clone())]),
                      lead=RankZero(source=Drainer(queue, Ledger(run_dir / "ledger"), FRESH, filters=cfg, block_ms=10),
                                    clock=RedisClock(queue), ledger=Ledger(run_dir / "ledger")))
    try:
        trainer.train()
    finally:
        trainer.close()
    means = [pytest.approx(1 / 3), pytest.approx(2 / 3)]
    assert step_fn.calls == [(means, [2.0, 1.0]), ([pytest.approx(2 / 3)] * 2, None)]
    rows = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [(r["filter/groups_reweighted"], r["filter/weight_mean"], r["filter/groups_user"]) for r in rows] == \
        [(1.0, 1.5, 1.0), (0.0, 1.0, 0.0)]


def test_a_capped_step_spends_the_slots_it_left_unused_once(queue: SampleQueue, tmp_path: Path) -> None:
    """The budget grows by batch_groups per push; a capped step that trains fewer would leave the rest to producers
    for good, and in sync mode every such surplus group would finish a version late and be dropped."""
    rng = np.random.default_rng(1)
    order = [[1.0] * 4, [0.0, 1.0, 1.0, 1.0], *([[1.0] * 4] * 6), [0.0, 0.0, 1.0, 1.0]]
    groups = [rewarded(rng, r) for r in order]
    queue.redis.set(queue.keys.groups_started, len(groups))  # every group holds a slot, as a producer's would
    for i, g in enumerate(groups):
        queue.redis.hset(queue.keys.group_slots, g[0].group_id, f"{i}:0")
    queue.put_many(groups)

    def drain() -> Drainer:
        d = Drainer(queue, Ledger(tmp_path / "ledger"), FRESH, block_ms=10,
                    filters=FilterConfig(zero_variance=True, max_draw_factor=2.0))
        d.recover()
        return d

    batch = drain().next_batch(2, step=7, version=lambda: 0)
    assert len(batch.groups) == 1 and batch.filters.capped == 1 and batch.slots.released == 4
    # Held: the trained group, the unused slot of the batch, and the four groups not drained yet.
    assert int(queue.redis.get(queue.keys.groups_started)) == 1 + 1 + 4
    assert batch.drain_metrics()["pacing/slots_burned"] == 1.0
    # A restarted trainer redoes step 7 from its pending entries: nothing is released or spent twice.
    again = drain().next_batch(2, step=7, version=lambda: 0)
    assert len(again.groups) == 1 and again.slots.burned == 0
    assert int(queue.redis.get(queue.keys.groups_started)) == 6
    # A full batch spends nothing.
    full = drain().next_batch(1, step=8, version=lambda: 0)
    assert len(full.groups) == 1 and full.slots.burned == 0 and full.filters.capped == 0
