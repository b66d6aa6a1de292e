"""Version lineage after a trainer rollback (docs/versions.md): lags are distances along the tree of versions that
restores make, so samples of the restored weights (and their ancestors) train, and samples of an abandoned branch
are judged by how far they really are from the current weights."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.trainer.drain import Drainer, load_lineage, record_restore
from pipeline.consumers.trainer.ledger import Ledger
from pipeline.consumers.trainer.staleness import Lineage, decide_group, group_lag
from pipeline.errors import SluiceError
from pipeline.queue.redis_streams import SampleQueue


def test_without_restores_the_distance_is_the_counter_difference() -> None:
    line = Lineage()
    assert [line.distance(v, 10) for v in (10, 9, 3, 0)] == [0, 1, 7, 10]
    assert line.distance(12, 10) == -2  # a future version: negative, as before


def test_a_rollback_to_step_0_at_version_41() -> None:
    """Issue 11's case: the trainer died at version 41 with its last checkpoint at version 0, and its first push
    after resuming (42) holds version 0's weights."""
    line = Lineage({42: 0})
    assert line.distance(0, 42) == 0  # the restored weights themselves: on-policy
    assert line.distance(41, 42) == 41 and line.distance(3, 42) == 3  # the abandoned branch, from its fork at 0
    assert line.distance(42, 44) == 2 and line.distance(0, 44) == 2 and line.distance(41, 44) == 43
    # A sample whose tokens straddle the restore: its worst token is the abandoned branch's newest (41), not an end.
    assert line.worst(40, 42, 42) == 41


def test_nested_restores_and_their_common_ancestors() -> None:
    line = Lineage({42: 0, 50: 45})  # 0..41 abandoned at 42 (back to 0); 42..49 abandoned at 50 (back to 45)
    assert line.distance(45, 50) == 0 and line.distance(44, 52) == 3  # 52 -> 50 = 45 -> 44
    assert line.distance(47, 52) == 4  # abandoned 47 forks from the current branch at 45: 2 + 2
    assert line.distance(41, 52) == 46  # from the first abandoned branch: 41 steps to 0, then 0 -> 42..45 -> 52
    assert line.distance(0, 52) == 5 and line.distance(42, 52) == 5
    with pytest.raises(SluiceError, match="older version"):
        Lineage({5: 7})


def test_the_policy_decides_by_distance() -> None:
    from pipeline.consumers.trainer.staleness import GroupVersions

    cfg = StalenessConfig(max_lag=2, action="drop")
    line = Lineage({42: 0})
    restored = GroupVersions("a", (0, 0), (0, 1))
    abandoned = GroupVersions("b", (40,), (41,))
    assert decide_group(restored, 43, cfg, line).action == "train"  # lag 1 along the lineage
    assert decide_group(restored, 43, cfg).action == "drop"  # lag 43 by the counter: a drop after every restore
    assert decide_group(abandoned, 43, cfg, line).lag == 42
    assert group_lag(abandoned, 43, "version_max", line) == 42


def _groups(rng: np.random.Generator, versions: list[int]) -> list[list]:
    from tests.helpers.samples import make_group

    return [make_group(rng, 2, version=v) for v in versions]


def test_the_drain_reads_the_lineage_a_trainer_recorded(queue: SampleQueue, tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    ids = queue.put_many(_groups(rng, [6, 4, 3, 5]))
    queue.redis.set(queue.keys.policy_version, 6)  # a trainer pushed 5 and 6, then died; its checkpoint was at 4
    record_restore(queue, 7, 4)  # what its successor records before its first push
    assert load_lineage(queue) == Lineage({7: 4})
    assert [e["kind"] for e in queue.events()][-1] == "restore"
    drainer = Drainer(queue, Ledger(tmp_path / "ledger"), StalenessConfig(max_lag=1, action="drop"), block_ms=20)
    drainer.recover()
    batch = drainer.next_batch(3, step=5, version=lambda: 7)
    # 6 is 2 steps from the fork at 4: dropped; 4 (lag 0), 3 (1) and 5 (1 from the fork) train. By the counter it
    # was the other way round: 6 had lag 1, and 4, 3 and 5 lags of 2 to 4.
    assert batch.group_entries == ids[1:] and batch.lags == [2, 0, 1, 1]
    assert {line.entry_id for line in batch.lines} == {ids[0]}
    record_restore(queue, 3, 5)  # refused: a restore holds an older version
    assert load_lineage(queue) == Lineage({7: 4})


@pytest.mark.slow
def test_a_resume_after_rollback_trains_the_restored_weights_samples(tmp_path: Path) -> None:
    """A real trainer commits step 4 (version 4). Its successor finds the counter at 6 (the dead trainer pushed 5
    and 6 without committing them): its first push, 7, holds version 4's weights. With max_lag 1 it must train the
    groups of versions 4 and 5 (distance 1 from the fork at 4) and drop those of 6 (distance 2); by the counter it
    would have dropped 4 and 5 and trained 6."""
    from pipeline.config import load_config
    from pipeline.consumers.trainer.audit import audit_trainer
    from pipeline.consumers.trainer.ledger import read_ledger
    from pipeline.launch.launcher import prepare_run
    from pipeline.producers.producer import read_num_experts
    from tests.consumers.test_trainer_crash import GROUP_SIZE, _start_trainer
    from tests.helpers.train_samples import routed_groups

    run_dir = tmp_path / "run"

    def cfg(steps: int):  # type: ignore[no-untyped-def]
        return load_config(None, [
            f"run.run_dir={json.dumps(str(run_dir))}", "run.name=lineage", f"trainer.steps={steps}",
            "trainer.batch_groups=2", "trainer.checkpoint_every=2", "trainer.drain_block_ms=100",
            "staleness.max_lag=1", "staleness.action=drop", "eval.enabled=false", "queue.archive.enabled=false",
        ])

    handle, model_dir = prepare_run(cfg(4))
    try:
        (run_dir / "engines.json").write_text("[]")
        hf = json.loads((model_dir / "config.json").read_text())
        shape = (hf["vocab_size"], hf["num_hidden_layers"], hf["num_experts_per_tok"], read_num_experts(model_dir))

        def put(versions: list[int]) -> list[str]:
            groups = routed_groups(np.random.default_rng(len(versions) + versions[0]), len(versions), GROUP_SIZE, *shape)
            for n, (group, v) in enumerate(zip(groups, versions)):
                for s in group:
                    s.token_versions[:] = v
                    s.group_id = f"g{v}-{n}"
            return handle.queue.put_many(groups)

        # Steps 1-4 train on groups made while the trainer advanced (lag 0 or 1 at most).
        put([0, 0, 1, 1, 2, 2, 3, 3])
        proc = _start_trainer(run_dir)
        assert proc.wait(timeout=600) == 0, (run_dir / "trainer-test.log").read_text()[-3000:]
        assert handle.queue.policy_version() == 4
        # The rolled-back trainer's pushes 5 and 6 (it died before committing them), and what was generated meanwhile.
        handle.queue.redis.incrby(handle.queue.keys.policy_version, 2)
        ids = put([6, 6, 5, 5, 4, 4])
        put([7, 7, 7, 7])  # made by the resumed trainer's first push: a judging by the counter finishes too, wrongly
        prepare_run(cfg(6), handle)  # the rerun's config: two more steps
        proc = _start_trainer(run_dir)
        assert proc.wait(timeout=600) == 0, (run_dir / "trainer-test.log").read_text()[-3000:]
        assert load_lineage(handle.queue) == Lineage({7: 4})
        lines = list(read_ledger(run_dir / "ledger"))
        # Four samples a group. Version 6: distance 2 from the fork at 4; versions 5 and 4: distance 1.
        assert Counter(x.fate for x in lines if x.entry_id in ids[:2]) == Counter({"stale": 8})
        assert Counter(x.fate for x in lines if x.entry_id in ids[2:]) == Counter({"trained": 16})
        audit = audit_trainer(handle.queue, run_dir)
        assert audit.committed_step == 6 and audit.lost == 0 and audit.duplicates == 0
    finally:
        handle.close(stop_server=True)
