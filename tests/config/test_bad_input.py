"""Bad input: each case gets a clear message and loses nothing (docs/security.md lists the cases and the tests that
existed before these). An engine behind a misbehaving HTTP proxy (garbage, truncated JSON, a wrong log-prob count,
HTTP 500 while other groups are in flight) in front of the real producer; a reward that hangs on some prompts;
entries with an unknown schema or inconsistent headers; recipes with unknown keys, wrong types or impossible sizes;
a full disk under the archive and under the trainer's checkpoints (a file-size limit, RLIMIT_FSIZE, in the
process that writes)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import ClientSession, web

from pipeline.config import load_config
from pipeline.config.producer import ProducerConfig, SamplingConfig
from pipeline.data.prompts import synthetic
from pipeline.errors import ConfigError
from pipeline.producers.engine_pool import EnginePool
from pipeline.producers.producer import Producer, load_tokenize, read_num_experts
from pipeline.producers.sglang_client import NO_RETRY, ExponentialBackoff, Retry, SGLangClient
from pipeline.queue.archive import ArchiveReader, load_index
from pipeline.queue.codec import encode_samples
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.sample import SampleStatus
from tests.helpers.engines import EngineProcess, free_port
from tests.helpers.samples import make_group

ROOT = Path(__file__).parents[2]


# ---------------------------------------------------------------------------------------------------- stream entries
def test_an_unknown_schema_or_inconsistent_header_is_dead_lettered_with_its_bytes(queue: SampleQueue) -> None:
    rng = np.random.default_rng(3)
    queue.create_group("trainer")
    group = make_group(rng, 2, version=3)
    good = queue.put(group)
    data = encode_samples(group)  # as an entry of schema 1 or 2 carried it inline
    unknown = queue.redis.xadd(queue.keys.samples, {"v": 99, "n": 2, "vmin": 3, "vmax": 3, "data": data})
    versions = queue.redis.xadd(queue.keys.samples, {"v": 2, "n": 2, "vmin": 0, "vmax": 7, "data": data})
    got = queue.read("trainer", "c", count=10)
    assert [e.id for e in got] == [good]
    dead = {d["entry_id"]: d for d in queue.dead_letters()}
    assert "schema v=99 unknown" in dead[unknown.decode()]["reason"]
    assert "versions [0, 7] but its samples span [3, 3]" in dead[versions.decode()]["reason"]
    assert all(d["orig:data"] == data for d in dead.values())  # the bytes are kept: nothing is lost


# ---------------------------------------------------------------------------------------------------- recipes
@pytest.mark.parametrize(("overrides", "match"), [
    (["queue.archive.segmnt_samples=8"], "queue.archive.segmnt_samples: Extra inputs are not permitted"),
    (["ray.trainer.num_gpu=1"], "ray.trainer.num_gpu: Extra inputs are not permitted"),
    (['trainer.steps="ten"'], "trainer.steps: Input should be a valid integer"),
    (["producer.sampling.top_p=[1]"], "producer.sampling.top_p: Input should be a valid number"),
    (["trainer.batch_groups=1.5"], "trainer.batch_groups: Input should be a valid integer"),
    (["trainer.ep=3"], "trainer.ep=3 must divide trainer.world_size=1"),
    (["prompts.heldout=20000"], "29000 is more than the 10000 distinct prompts of synthetic task 'addition'"),
    (["prompts.task=chess"], "prompts.task = 'chess' is not a synthetic task"),
    (["eval.heldout.pass_k=[8]"], "above eval.heldout.samples=4"),
    (["trainer.world_size=3", "trainer.batch_groups=4"], "multiple of the data-parallel size 3"),
])
def test_a_recipe_with_unknown_keys_wrong_types_or_impossible_sizes_is_refused(overrides: list[str],
                                                                               match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "recipes" / "cpu-moe.toml", overrides)


# ---------------------------------------------------------------------------------------------------- the engine
class MisbehavingProxy:
    """A real aiohttp server in front of a real CPU engine: it forwards every call, and spoils the /generate answers
    the script names by their 1-based order (``faults``)."""

    def __init__(self, upstream: str, faults: dict[int, str]) -> None:
        self.upstream, self.faults = upstream, faults
        self.generates = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None

    async def start(self) -> MisbehavingProxy:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        self._session = ClientSession()
        return self

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        fault = None
        if request.path == "/generate":
            self.generates += 1
            fault = self.faults.get(self.generates)
        body = await request.read()
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers={"Content-Type": request.content_type}) as up:
            raw, status, ctype = await up.read(), up.status, up.content_type
        if fault == "500":  # the engine did the work, then failed: other groups are in flight meanwhile
            return web.json_response({"error": {"message": "internal error, scripted"}}, status=500)
        if fault == "garbage":
            return web.Response(body=b"<html>502 bad gateway, or so</html>", content_type="text/html")
        if fault == "truncated":
            return web.Response(body=raw[: len(raw) // 2], content_type="application/json")
        if fault == "logprobs":
            answer = json.loads(raw)
            answer[0]["meta_info"]["output_token_logprobs"].pop()
            return web.json_response(answer)
        return web.Response(body=raw, status=status, content_type=ctype)


def _producer(queue: SampleQueue, engine: Any, model_dir: Path, reward: Callable[..., Any], **cfg: Any) -> Producer:
    config = ProducerConfig(sampling=SamplingConfig(max_new_tokens=4), engine_retry_s=0.05, **cfg)
    return Producer(config, name="p0", queue=queue, engine=engine, prompts=synthetic("addition", size=64, seed=1),
                    tokenize=load_tokenize(model_dir), reward_fn=reward, pacing=None,
                    num_experts=read_num_experts(model_dir))


def _prompt_ids(queue: SampleQueue) -> list[str]:
    out = []
    for _, entry in queue.scan():
        assert not isinstance(entry, Exception), entry
        assert len({s.prompt_id for s in entry.samples}) == 1
        for s in entry.samples:  # every sample that landed is whole: one log-prob per response token
            assert len(s.rollout_logprobs) == s.num_response_tokens
        out.append(entry.samples[0].prompt_id)
    return out


def test_an_engine_that_misbehaves_mid_batch_loses_no_prompt(engine: EngineProcess, model_dir: Path,
                                                             queue: SampleQueue,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    groups = 8
    faults = {2: "garbage", 3: "truncated", 5: "logprobs", 6: "500"}

    async def scenario() -> tuple[Producer, MisbehavingProxy]:
        proxy = await MisbehavingProxy(engine.url, faults).start()
        pool = EnginePool([SGLangClient(proxy.url, retry=NO_RETRY, routed_experts_shape=None)],
                          retry=Retry(ExponentialBackoff(0.01, 0.05, False), retries=3),
                          probe_backoff=ExponentialBackoff(0.02, 0.05, jitter=False))
        producer = _producer(queue, pool, model_dir, lambda p, r: 1.0, group_size=2, concurrency=3)
        try:
            await asyncio.wait_for(producer.run(max_groups=groups), 120)
        finally:
            await pool.close()
            await proxy.stop()
        return producer, proxy

    producer, proxy = asyncio.run(scenario())
    # Every spoiled answer failed its group's generation and handed its prompt back, and the retry landed it once;
    # the 500 was ridden out by the pool's retry on the spot (an engine's 5xx is transient).
    assert producer.stats.engine_errors == 3 and producer.stats.prompts_retried == 3
    assert proxy.generates == groups + 3 + 1
    taken = _prompt_ids(queue)
    assert len(taken) == groups and len(set(taken)) == groups  # each prompt once: the spoiled ones came back
    assert queue.redis.llen(queue.keys.prompt_retry) == 0
    messages = caplog.text
    assert "'<html>502 bad gateway, or so</html>', not a JSON object" in messages
    assert "sent malformed JSON" in messages and "3 output_token_logprobs for 4 output_ids" in messages


def test_a_reward_that_hangs_times_out_and_later_samples_are_still_scored(engine: EngineProcess, model_dir: Path,
                                                                          queue: SampleQueue) -> None:
    """Half the prompts hang their verifier for good (longer than the test). Twelve hung calls outnumber a shared
    thread pool's workers (six on two cores); with one, every later sample timed out waiting for a worker."""
    release = threading.Event()

    def hangs_on_even_prompts(prompt: Any, response: str) -> float:
        if int(prompt.prompt_id.split("-")[-1]) % 2 == 0:
            release.wait(120)
        return 1.0

    async def scenario() -> Producer:
        client = SGLangClient(engine.url)
        producer = _producer(queue, client, model_dir, hangs_on_even_prompts, group_size=2, concurrency=4,
                             reward_timeout_s=0.5)
        try:
            await asyncio.wait_for(producer.run(max_groups=12), 120)
        finally:
            await client.close()
        return producer

    try:
        producer = asyncio.run(scenario())
    finally:
        release.set()
    seen = 0
    for _, entry in queue.scan():
        for s in entry.samples:
            seen += 1
            if int(s.prompt_id.split("-")[-1]) % 2 == 0:
                assert s.status == SampleStatus.FAILED and "timed out after 0.5s" in s.reward_info["error"]
            else:
                assert s.status != SampleStatus.FAILED and s.reward == 1.0, s.reward_info
    assert seen == 24 and producer.stats.samples_failed_reward >= 12


# ---------------------------------------------------------------------------------------------------- a full disk
def _limited(limit_bytes: int) -> Callable[[], None]:
    """preexec_fn: writes past ``limit_bytes`` fail with EFBIG (File too large), as a full disk fails with ENOSPC;
    SIGXFSZ, which would kill the process instead, is ignored."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return apply


_ARCHIVER = """
import sys
from pipeline.queue.archive import Archiver
from pipeline.queue.connection import connect
from pipeline.queue.redis_streams import SampleQueue
url, run, folder = sys.argv[1:4]
Archiver(SampleQueue(connect(url), run), folder, segment_samples=8, block_ms=20).run(idle_exit_s=0.5)
"""


def test_a_full_disk_under_the_archive_fails_the_archiver_and_loses_nothing(queue: SampleQueue, redis_url: str,
                                                                             tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    queue.create_group("archive")
    ids = queue.put_many([make_group(rng, 4, prompt_len=64, response_len=64) for _ in range(6)])
    folder = tmp_path / "archive"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = [sys.executable, "-c", _ARCHIVER, redis_url, queue.run, str(folder)]
    full = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, preexec_fn=_limited(3_000))
    assert full.returncode != 0
    assert "File too large" in full.stderr and "archive segment" in full.stderr, full.stderr[-2000:]
    assert load_index(folder) == []  # no segment half-written into the archive
    assert sorted(queue.pending_ids("archive")) == sorted(ids)  # nothing acked: the entries wait for a retry
    # With room again, a restarted archiver archives every entry exactly once.
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    archived = [entry_id for entry_id, _ in ArchiveReader(folder).entries()]
    assert sorted(set(archived)) == sorted(ids) and len(archived) == 6 * 4
    assert queue.pending_ids("archive") == [] and not list(folder.glob(".*.tmp"))


@pytest.mark.slow
def test_a_full_disk_under_the_checkpoints_fails_the_commit_and_loses_nothing(tmp_path: Path) -> None:
    """The trainer's first commit cannot write its checkpoint: the trainer fails naming it, acks nothing, and a
    trainer with room again trains every step with nothing lost or trained twice."""
    from pipeline.consumers.trainer.audit import audit_trainer
    from pipeline.launch.launcher import prepare_run
    from tests.consumers.test_trainer_crash import BATCH_GROUPS, GROUP_SIZE, STEPS, _start_trainer
    from tests.helpers.train_samples import routed_groups

    run_dir = tmp_path / "run"
    cfg = load_config(None, [
        f"run.run_dir={json.dumps(str(run_dir))}", "run.name=fulldisk", f"trainer.steps={STEPS}",
        f"trainer.batch_groups={BATCH_GROUPS}", "trainer.checkpoint_every=4", "trainer.drain_block_ms=100",
        "staleness.max_lag=1000", "eval.enabled=false", "queue.archive.enabled=false", "queue.claim_idle_ms=1000",
    ])
    handle, model_dir = prepare_run(cfg)
    try:
        (run_dir / "engines.json").write_text("[]")
        hf = json.loads((model_dir / "config.json").read_text())
        handle.queue.put_many(routed_groups(np.random.default_rng(1), STEPS * BATCH_GROUPS, GROUP_SIZE, hf["vocab_size"],
                                            hf["num_hidden_layers"], hf["num_experts_per_tok"], read_num_experts(model_dir)))
        # Room for the ledger, metrics and log lines, not for a checkpoint's shards (megatron's writer process
        # inherits the limit).
        proc = _start_trainer(run_dir, preexec_fn=_limited(400_000))
        assert proc.wait(timeout=600) != 0
        log = (run_dir / "trainer-test.log").read_text()
        assert "could not write checkpoint" in log and "step-00000004" in log and "Nothing is lost" in log, log[-3000:]
        assert not [p for p in (run_dir / "checkpoints").glob("step-*") if not p.name.endswith(".tmp")]
        assert handle.queue.redis.xpending(handle.queue.keys.samples, "trainer")["pending"] > 0  # nothing acked

        proc = _start_trainer(run_dir)
        assert proc.wait(timeout=600) == 0, (run_dir / "trainer-test.log").read_text()[-3000:]
        audit = audit_trainer(handle.queue, run_dir)
        assert audit.committed_step == STEPS and audit.lost == 0 and audit.duplicates == 0 and audit.pending == 0
        assert audit.trained == STEPS * BATCH_GROUPS * 4  # GROUP_SIZE samples a group, every one trained once
    finally:
        handle.close(stop_server=True)
