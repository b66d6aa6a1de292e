"""No data or sync path unpickles (docs/security.md): with every unpickler refused (tests/helpers/nopickle.py) in this
process and in the engine and trainer-rank processes it starts, samples go from a real CPU engine through a
producer into Redis, weights are pushed to that engine over gloo, and the trainer's drain, the trainer ranks'
batch broadcast, the evaluator, the archive, its reader and the replay sources all read them back. A stream entry
whose payload is a malicious pickle is dead-lettered without running anything."""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config.eval import EvaluatorConfig
from pipeline.config.producer import ProducerConfig, SamplingConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.consumers.evaluator import Evaluator
from pipeline.consumers.trainer.drain import Drainer
from pipeline.consumers.trainer.ledger import Ledger
from pipeline.consumers.trainer.replay import archive_records, stream_records
from pipeline.data.prompts import synthetic
from pipeline.producers.producer import Producer, load_tokenize, read_num_experts
from pipeline.producers.sglang_client import SGLangClient
from pipeline.queue.archive import Archiver, ArchiveReader
from pipeline.queue.codec import encode_samples
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.rundir import write_run_file
from pipeline.sync.pusher import WeightPusher
from tests.helpers.engines import REPO_ROOT, EngineProcess, free_port, wait_healthy
from tests.helpers.nopickle import ENV_LOG, Unpickled, refusing_pickle

SITE = Path(__file__).parents[1] / "nopickle_site"


def _guarded_env(log: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO_ROOT)]), "OMP_NUM_THREADS": "1",
            ENV_LOG: str(log)}


def _start_guarded_engine(model_dir: Path, log_dir: Path, log: Path) -> EngineProcess:
    port = free_port()
    out_path = log_dir / f"engine-{port}.log"
    with out_path.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.producers.cpu_engine", str(model_dir), "--host", "127.0.0.1", "--port",
             str(port), "--enable-return-routed-experts", "--num-threads", "1", "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=_guarded_env(log))
    engine = EngineProcess(proc, f"http://127.0.0.1:{port}", port, out_path)
    try:
        asyncio.run(wait_healthy(engine))
    except BaseException:
        engine.stop()
        raise
    return engine


_RANK = textwrap.dedent("""
    import sys, datetime
    import torch.distributed as dist
    from pipeline.consumers.trainer.loop import broadcast_msgpack
    from pipeline.queue.codec import decode_samples
    rank, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    payload = {"entries": [open(path, "rb").read()]} if rank == 0 else None
    got = broadcast_msgpack(payload, dist.group.WORLD)
    samples = decode_samples(got["entries"][0])
    assert len(samples) > 0 and samples[0].num_response_tokens > 0
    dist.destroy_process_group()
    print("rank", rank, "decoded", len(samples))
""")


def _broadcast_between_two_guarded_ranks(entry: bytes, tmp: Path, log: Path) -> None:
    """The trainer ranks share rank 0's batch as msgpack over gloo (``broadcast_msgpack``); both ranks guarded."""
    path = tmp / "entry.bin"
    path.write_bytes(entry)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(port), str(path)], env=_guarded_env(log),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0].decode(errors="replace"))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), outs


@pytest.mark.slow
def test_no_data_or_sync_path_unpickles(model_dir: Path, queue: SampleQueue, tmp_path: Path) -> None:
    log = tmp_path / "unpickled.log"
    engine = _start_guarded_engine(model_dir, tmp_path, log)
    from safetensors.torch import load_file

    from pipeline.models.tiny import init_tiny_model

    other = sorted(load_file(str(init_tiny_model("qwen3-moe", tmp_path / "other", seed=3) / "model.safetensors"))
                   .items())
    for name in ("trainer", "archive", "eval"):
        queue.create_group(name, "0")
    with refusing_pickle():  # the guard works: pickle.loads of anything, and torch.load, are refused
        with pytest.raises(Unpickled):
            pickle.loads(pickle.dumps([1, 2]))
        with pytest.raises(Unpickled):
            torch.load(tmp_path / "nothing.pt")
    try:
        with refusing_pickle(str(log)):
            async def produce_push_produce() -> None:
                client = SGLangClient(engine.url)
                producer = Producer(
                    ProducerConfig(group_size=2, concurrency=2, sampling=SamplingConfig(max_new_tokens=6)),
                    name="p0", queue=queue, engine=client, prompts=synthetic("addition", size=16, seed=2),
                    tokenize=load_tokenize(model_dir), reward_fn=lambda p, r: (1.0, {"text": r}), pacing=None,
                    num_experts=read_num_experts(model_dir))
                try:
                    await producer.run(max_groups=2)
                    pusher = await WeightPusher.connect([client], master_address="127.0.0.1",
                                                        master_port=free_port(), group_name="nopickle", timeout_s=60)
                    await pusher.push(other, weight_version=1)  # the engine receives it, guarded
                    await pusher.close()
                    await producer.run(max_groups=3)  # one more (the count is cumulative)
                finally:
                    await client.close()

            asyncio.run(produce_push_produce())
            drainer = Drainer(queue, Ledger(tmp_path / "ledger"), StalenessConfig(max_lag=4), block_ms=50)
            drainer.recover()
            batch = drainer.next_batch(3, step=0, version=lambda: 1)
            assert len(batch.groups) == 3
            assert {int(s.version_max or 0) for g in batch.groups for s in g} == {0, 1}  # before and after the push
            report = Evaluator(queue, EvaluatorConfig(block_ms=50, batch_entries=4)).run(until_idle_s=0)
            assert report.counted_entries == 3
            Archiver(queue, tmp_path / "archive", segment_samples=4, block_ms=20).run(idle_exit_s=0.2)
            assert sum(1 for _ in ArchiveReader(tmp_path / "archive").samples()) == 6
            assert sum(len(g) for _, g in archive_records(tmp_path / "archive", None)) == 6
            write_run_file(tmp_path / "run", queue.run, _url(queue))
            assert sum(len(g) for _, g in stream_records(tmp_path / "run", None)) == 6
            pkey = queue.redis.xrange(queue.keys.samples, count=1)[0][1][b"pkey"].decode()
            entry = queue.fetch_payloads([pkey])[pkey]
            _broadcast_between_two_guarded_ranks(entry, tmp_path, log)
    finally:
        engine.stop()
    assert not log.exists(), log.read_text()[-3000:]
    assert "error" not in engine.log.read_text().lower()


def _url(queue: SampleQueue) -> str:
    kw = queue.redis.get_connection_kwargs()
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw['port']}/{kw.get('db', 0)}"


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def test_a_malicious_pickle_in_the_stream_is_dead_lettered_without_running(queue: SampleQueue,
                                                                           tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Evil(marker))
    with refusing_pickle(str(tmp_path / "unpickled.log")):
        queue.create_group("trainer", "0")
        queue.create_group("eval", "0")
        rng = np.random.default_rng(0)
        from tests.helpers.samples import make_group

        # As the envelope's data, and as a whole entry's data with a plausible header; then a good entry, which the
        # drain reaches only past the two.
        evil = [queue.redis.xadd(queue.keys.samples, {"v": 2, "n": 1, "vmin": 0, "vmax": 0, "data": payload}),
                queue.redis.xadd(queue.keys.samples, {"v": 2, "n": 1, "vmin": 0, "vmax": 0,
                                                      "data": encode_samples(make_group(rng, 1))[:8] + payload})]
        good = queue.put(make_group(rng, 2))
        drainer = Drainer(queue, Ledger(tmp_path / "ledger"), StalenessConfig(max_lag=4), block_ms=50)
        drainer.recover()
        batch = drainer.next_batch(1, step=0, version=lambda: 0)
        assert batch.group_entries == [good]
        report = Evaluator(queue, EvaluatorConfig(block_ms=50, batch_entries=4)).run(until_idle_s=0)
        assert report.counted_entries == 1
    assert not marker.exists()  # the payload's code never ran
    assert not (tmp_path / "unpickled.log").exists()  # and nothing even tried to unpickle it
    dead = queue.dead_letters()
    assert sorted((d["group"], d["entry_id"]) for d in dead) == sorted(
        (g, e.decode()) for g in ("trainer", "eval") for e in evil)
    assert all(d["orig:data"] in (payload, d["orig:data"]) and d["reason"] for d in dead)
    assert {d["orig:data"] for d in dead if d["entry_id"] == evil[0].decode()} == {payload}  # kept, not lost
