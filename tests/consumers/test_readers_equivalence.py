"""The two ways a batch reaches the data-parallel ranks train the same thing.

One recorded stream (the same groups, the same sample ids, put through the real queue into two runs) is drained by
the real trainer loop at dp = 2 over two gloo processes, with the real megatron-core tiny MoE, its train step and
R3, once per ``trainer.fetch``:

- ``rank0``: rank 0 fetches every payload, decodes it and sends each rank its groups' bytes in the plan;
- ``readers``: rank 0 sends keys only, each rank fetches its own payloads from Redis and decodes them.

The ledgers (sample, fate, step, version) must match line for line and every step's loss within 1e-5 relative. A
reader that decoded the compact routing wrongly, dropped a sample, or got another rank's group would change the
loss (R3 replays the recorded routing in the router).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest.importorskip("megatron.core")

import pyarrow.parquet as pq  # noqa: E402
import redis  # noqa: E402

from pipeline.net import free_port  # noqa: E402
from pipeline.queue.redis_streams import SampleQueue  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks, synthetic_groups, tiny_moe  # noqa: E402

STEPS, BATCH_GROUPS = 4, 6
# Uneven group sizes, so that the token balance gives the ranks different group counts on some steps.
SIZES = [4, 2, 4, 3, 4, 4, 2, 4, 3, 4, 4, 4, 2, 4, 3, 4, 4, 2, 4, 4, 3, 4, 2, 4]


def _ledger(folder: Path) -> list[tuple[str, str, int, int]]:
    rows = []
    for path in sorted(folder.glob("seg-*.parquet")):
        rows += pq.read_table(path).to_pylist()
    return sorted((r["sample_id"], r["fate"], r["step"], r["policy_version"]) for r in rows)


def _losses(run_dir: Path) -> list[float]:
    from pipeline.rundir import trainer_metrics_path

    rows = [json.loads(line) for line in trainer_metrics_path(run_dir).read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def test_rank0_fetch_and_readers_train_the_same_ledger_and_loss(redis_url: str, run_name: str,
                                                               tmp_path: Path) -> None:
    model_dir, model_cfg = tiny_moe(tmp_path / "model")
    groups = synthetic_groups(model_cfg, SIZES, seed=11)
    client = redis.Redis.from_url(redis_url)
    results = {}
    for fetch in ("rank0", "readers"):
        run = f"{run_name}-{fetch}"
        SampleQueue(client, run).put_many(groups)  # the same recording: same samples, same order
        out = tmp_path / fetch
        out.mkdir()
        finish_ranks(start_ranks(__file__, [str(free_port()), redis_url, run, str(model_dir), str(out), fetch]),
                     timeout_s=300)
        stats = json.loads((out / "rank0.json").read_text())
        results[fetch] = (_ledger(out / "ledger"), _losses(out / "run0"), stats)
        client.delete(*client.scan_iter(match=f"{SampleQueue(client, run).keys.prefix}:*"))
    (old_ledger, old_loss, old_stats), (new_ledger, new_loss, new_stats) = results["rank0"], results["readers"]
    assert len(old_ledger) == sum(SIZES[: STEPS * BATCH_GROUPS])
    assert {fate for _, fate, _, _ in old_ledger} == {"trained"}
    assert new_ledger == old_ledger
    assert len(old_loss) == len(new_loss) == STEPS
    for step, (a, b) in enumerate(zip(old_loss, new_loss, strict=True)):
        assert b == pytest.approx(a, rel=1e-5), f"step {step}: rank0 {a} vs readers {b}"
    # The two paths really differed in what travelled: the batch in the plan, or keys and each rank's own fetch.
    assert old_stats["payload_bytes"] == 0 and old_stats["plan_bytes"] > 10 * new_stats["plan_bytes"]
    assert new_stats["payload_bytes"] > 0
    print(f"losses rank0 {old_loss} readers {new_loss}")


# --------------------------------------------------------------------------------------------- the rank script
def _rank_main(rank: int, port: str, redis_url: str, run: str, model_dir: str, out: str, fetch: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from pipeline.config.staleness import StalenessConfig
    from pipeline.config.trainer import CorrectionConfig, LossConfig, TrainStepConfig
    from pipeline.consumers.megatron.config import ModelConfig, ParallelConfig
    from pipeline.consumers.megatron.convert import load_hf_into_megatron
    from pipeline.consumers.megatron.model import build_gpt_model, init_parallel
    from pipeline.consumers.rl.train_step import TrainStep
    from pipeline.consumers.trainer.drain import Drainer
    from pipeline.consumers.trainer.ledger import Ledger
    from pipeline.consumers.trainer.loop import RankZero, RedisClock, Trainer, TrainerSettings
    from pipeline.consumers.trainer.readers import SharePlanner, ShareReader

    folder, path = Path(out), Path(model_dir)
    model_cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()), dtype="float32")
    parallel = ParallelConfig(device="cpu")
    init_parallel(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, r3=True)
    load_hf_into_megatron(model, path, model_cfg)
    step = TrainStep(model, model_cfg, TrainStepConfig(lr=0.05, micro_batch_samples=4, r3=True,
                                                       loss=LossConfig(correction=CorrectionConfig(type="tis"))))
    queue = SampleQueue(redis.Redis.from_url(redis_url), run)
    lead = None
    if rank == 0:
        source = Drainer(queue, Ledger(folder / "ledger"), StalenessConfig(max_lag=1000), block_ms=50)
        lead = RankZero(source=source, clock=RedisClock(queue), ledger=source.ledger)
    settings = TrainerSettings(steps=STEPS, batch_groups=BATCH_GROUPS, checkpoint_every=STEPS, keep_checkpoints=1,
                               run_dir=folder / f"run{rank}")
    dp_size = ps.get_data_parallel_world_size()
    trainer = Trainer(settings, model=model, optimizer=step.optimizer, step_fn=step, export_weights=lambda: iter(()),
                      lead=lead, dp_rank=ps.get_data_parallel_rank(), dp_size=dp_size,
                      reader=ShareReader(queue if fetch == "readers" or rank == 0 else None),
                      planner=SharePlanner(dp_size, fetch, queue) if rank == 0 else None)  # type: ignore[arg-type]
    totals = {"plan_bytes": 0.0, "payload_bytes": 0.0}
    drain = trainer.drain

    def counted_drain():  # type: ignore[no-untyped-def]
        batch = drain()
        for key in totals:
            totals[key] += trainer._reading.get(f"drain/{key}", 0.0)
        return batch

    trainer.drain = counted_drain  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        trainer.close()
        step.close()
    (folder / f"rank{rank}.json").write_text(json.dumps(totals))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), *sys.argv[2:])
