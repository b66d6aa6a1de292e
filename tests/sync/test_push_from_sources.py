"""A push from two sources (two gloo "trainer" ranks, each sending half the tensors over a weight group of its own)
into two real CPU engines.

Checked against a third engine that got the same weights from one source: both engines then generate the same
tokens with bit-identical log-probs, which the old weights do not. A source that fails (a tensor the engines refuse)
leaves both engines on the old label, and the next push lands whole; sources that take turns (as SGLang engines
need) land the same way. A source SIGKILLed mid-push leaves the label where it was, and a push from rank 0 alone
then lands on every engine (what a restarted trainer does).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from pipeline.benchmarks.sync_sources import engine_labels  # noqa: E402 - the benchmark's reading of every label
from pipeline.net import free_port  # noqa: E402
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient  # noqa: E402
from pipeline.sync.pusher import PushOptions  # noqa: E402
from tests.helpers.engines import pushing, start_engine  # noqa: E402
from tests.helpers.train_samples import finish_ranks, start_ranks  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [11, 12, 13, 14, 15, 16]


def _shares(new_dir: Path, rank: int) -> list[tuple[str, torch.Tensor]]:
    named = sorted(load_file(str(new_dir / "model.safetensors")).items())
    return named[rank::2]


def _failing(new_dir: Path, rank: int) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """An exporter that fails half-way through this rank's share, after some of its buckets went out."""
    def export() -> Iterator[tuple[str, torch.Tensor]]:
        share = _shares(new_dir, rank)
        yield from share[: len(share) // 2]
        raise RuntimeError("the exporter failed half-way")

    return export


def _rank(rank: int, port: int, urls: list[str], new_dir: Path, out: Path, scenario: str) -> None:
    import logging

    import torch.distributed as dist

    from pipeline.sync.pusher import PushOptions, WeightPusher
    from pipeline.sync.share_sender import ShareSender
    from pipeline.sync.sources_push import ControlChannel, SourcesLead

    logging.basicConfig(level=logging.DEBUG, filename=str(out / f"rank{rank}.log"),
                        format=f"rank{rank} %(asctime)s %(name)s %(message)s")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    control = ControlChannel.create(timeout_s=60)
    loop = asyncio.new_event_loop()
    options = PushOptions(bucket_bytes=64 * 1024, dtype="bfloat16" if scenario == "sglang" else None)
    if rank == 1:
        sender = ShareSender(control, lambda url: SGLangClient(url, retry=NO_RETRY), master_address="127.0.0.1",
                             backend="gloo", timeout_s=60, options=options)
        if scenario == "kill":
            sent = WeightPusher._push_bucket

            async def killed_after_one(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                await sent(self, *args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            WeightPusher._push_bucket = killed_after_one  # type: ignore[method-assign]
        pushes = {"steps": [False, True, False, False], "rotation": [False, False]}.get(scenario, [False])
        for bad in pushes:
            sender.serve(_failing(new_dir, 1) if bad else _shares(new_dir, 1), loop)
        sender.close(loop)
        return

    if scenario == "rotation":
        loop.run_until_complete(_rotation_lead(control, urls, new_dir, out, options))
        os._exit(0)

    async def lead() -> dict[str, object]:
        clients = [SGLangClient(u, retry=NO_RETRY) for u in urls]
        pusher = await WeightPusher.connect(clients, master_address="127.0.0.1", backend="gloo", timeout_s=60,
                                            options=options, sources=SourcesLead(control))
        results: dict[str, object] = {}
        versions = ["1", "2", "3", "4"] if scenario == "steps" else ["1"]
        for version in versions:
            if version == "4":
                pusher._concurrent = False  # as SGLang engines: the sources take turns
            try:
                stats = await pusher.push(_shares(new_dir, 0), version)
                results[version] = {"ok": True, "bytes": [r.bytes for r in pusher.last_reports],
                                    "rank0_bytes": stats.bytes}
            except Exception as exc:  # noqa: BLE001 - the test reads what happened
                results[version] = {"ok": False, "error": str(exc)}
            if not (scenario == "kill"):
                await pusher.sources.done()  # type: ignore[union-attr]
            results[f"labels-{version}"] = await engine_labels(urls)
            print(f"push {version}: {results[version]}, labels {results[f'labels-{version}']}", flush=True)
        if scenario == "kill":
            # The restarted trainer's push: rank 0 alone, over its own group (the dead source's group is gone).
            pusher.sources = None
            stats = await pusher.push(_shares(new_dir, 0) + _shares(new_dir, 1), "2")
            results["alone"] = {"bytes": stats.bytes, "labels": await engine_labels(urls)}
        else:
            await pusher.close()  # the engines leave the group: a later pusher may take its name
        for c in clients:
            await c.close()
        return results

    results = loop.run_until_complete(lead())
    (out / f"{scenario}.json").write_text(json.dumps(results))
    os._exit(0)  # the dead peer's group would hold up a clean teardown


async def _rotation_lead(control: object, urls: list[str], new_dir: Path, out: Path, options: object) -> None:
    """Rank 0 over an ``EngineRotation``: push 1 lands on both engines; then (the test kills engine 1) push 2
    fails on the dead engine, the rotation rebuilds over the live one, the other source joins the new group, and
    push 2 lands there."""
    from pipeline.sync.pusher import WeightPusher
    from pipeline.sync.rotation import EngineRotation
    from pipeline.sync.sources_push import SourcesLead

    lead = SourcesLead(control)  # type: ignore[arg-type]

    async def connect(members: list) -> WeightPusher:  # type: ignore[type-arg]
        return await WeightPusher.connect(members, master_address="127.0.0.1", backend="gloo", timeout_s=60,
                                          options=options, sources=lead)  # type: ignore[arg-type]

    clients = [SGLangClient(u, retry=NO_RETRY) for u in urls]
    rotation = await EngineRotation.start(clients, connect, wait_s=30)
    results: dict[str, object] = {}
    await rotation.push(_shares(new_dir, 0), "1")
    await lead.done()
    results["labels-1"] = await engine_labels(urls)
    (out / "pushed-1").touch()
    while not (out / "killed").exists():
        await asyncio.sleep(0.05)
    await rotation.push(_shares(new_dir, 0), "2")
    await lead.done()
    results["labels-2"] = await engine_labels(urls[:1])
    results["members"] = [e.name for e in rotation.engines]
    results["rebuilds"] = rotation.rebuilds
    (out / "rotation.json").write_text(json.dumps(results))


async def _generate(url: str) -> tuple[list[int], list[float]]:
    async with SGLangClient(url, retry=NO_RETRY) as client:
        reply = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0.0})
        assert reply.output_logprobs is not None
        return [int(t) for t in reply.output_ids], [float(v) for v in reply.output_logprobs]


@pytest.fixture()
def models(tmp_path: Path) -> tuple[Path, Path]:
    from pipeline.models.tiny import init_tiny_model

    return (init_tiny_model("qwen3-moe", tmp_path / "old", seed=0),
            init_tiny_model("qwen3-moe", tmp_path / "new", seed=1))


@pytest.mark.sglang
def test_two_sources_take_turns_into_a_real_sglang_server(models: tuple[Path, Path], tmp_path: Path) -> None:
    """Stock SGLang 0.5.23 takes a group per source (``group_name``) but receives one update at a time, so the
    sources take turns; the label moves once, and the weights are those one source's push gives."""
    from tests.helpers.sglang_server import require_sglang, start_server

    python = require_sglang()
    old_dir, new_dir = models
    server = start_server(old_dir, tmp_path / "sglang", python=python)
    try:
        async def says_concurrent() -> bool:
            async with SGLangClient(server.url, retry=NO_RETRY) as client:
                return await client.concurrent_sources()

        assert not asyncio.run(says_concurrent())
        before = asyncio.run(_generate(server.url))
        procs = start_ranks(__file__, [str(free_port()), json.dumps([server.url]), str(new_dir), str(tmp_path),
                                       "sglang"])
        finish_ranks(procs, timeout_s=300)
        results = json.loads((tmp_path / "sglang.json").read_text())
        print(json.dumps(results, indent=1))
        assert results["1"]["ok"] and results["labels-1"] == ["1"]
        assert all(b > 0 for b in results["1"]["bytes"]), "each source sends its own share"
        two_sources = asyncio.run(_generate(server.url))
        assert two_sources != before, "the push changed nothing the check could see"

        async def single() -> None:
            client = SGLangClient(server.url, retry=NO_RETRY)
            async with pushing(server.url, client, PushOptions(dtype="bfloat16")) as (_c, pusher):
                await pusher.push(_shares(new_dir, 0) + _shares(new_dir, 1), "2")

        asyncio.run(single())
        assert asyncio.run(_generate(server.url)) == two_sources, "two sources did not give one source's weights"
    finally:
        server.stop()


def test_two_sources_land_as_one_and_a_failed_source_moves_no_label(models: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    old_dir, new_dir = models
    engines = [start_engine(old_dir, tmp_path) for _ in range(3)]
    try:
        urls = [e.url for e in engines[:2]]
        before = asyncio.run(_generate(urls[0]))
        procs = start_ranks(__file__, [str(free_port()), json.dumps(urls), str(new_dir), str(tmp_path), "steps"])
        finish_ranks(procs, timeout_s=240)
        results = json.loads((tmp_path / "steps.json").read_text())
        print(json.dumps(results, indent=1))
        assert results["1"]["ok"] and results["labels-1"] == ["1", "1"]
        both = results["1"]["bytes"]
        assert both[0] > 0 and both[1] > 0, "each source sends its own share"
        assert not results["2"]["ok"] and "rank 1" in results["2"]["error"]
        assert results["labels-2"] == ["1", "1"], "a failed source moved the label"
        assert results["3"]["ok"] and results["labels-3"] == ["3", "3"]
        assert results["4"]["ok"] and results["labels-4"] == ["4", "4"], "sources taking turns did not land"

        async def reference() -> None:
            async with pushing(engines[2].url) as (_client, pusher):
                await pusher.push(_shares(new_dir, 0) + _shares(new_dir, 1), "4")

        asyncio.run(reference())
        single = asyncio.run(_generate(engines[2].url))
        assert single != before, "the new weights generate as the old did: the check would see nothing"
        for url in urls:
            assert asyncio.run(_generate(url)) == single, "two sources did not give the weights one source gives"
    finally:
        for e in engines:
            e.stop()


def test_an_engine_that_dies_between_pushes_is_routed_around_and_every_source_follows(
        models: tuple[Path, Path], tmp_path: Path) -> None:
    old_dir, new_dir = models
    engines = [start_engine(old_dir, tmp_path) for _ in range(2)]
    try:
        urls = [e.url for e in engines]
        procs = start_ranks(__file__, [str(free_port()), json.dumps(urls), str(new_dir), str(tmp_path), "rotation"])
        deadline = time.monotonic() + 120
        while not (tmp_path / "pushed-1").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "push 1 did not land"
            time.sleep(0.05)
        engines[1].stop(signal.SIGKILL)
        (tmp_path / "killed").touch()
        finish_ranks(procs, timeout_s=240)
        results = json.loads((tmp_path / "rotation.json").read_text())
        print(json.dumps(results, indent=1))
        assert results["labels-1"] == ["1", "1"]
        assert results["labels-2"] == ["2"] and results["members"] == [urls[0]] and results["rebuilds"] >= 1
    finally:
        for e in engines:
            e.stop()


def test_a_source_killed_mid_push_moves_no_label_and_the_next_push_lands(models: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    old_dir, new_dir = models
    engines = [start_engine(old_dir, tmp_path) for _ in range(2)]
    try:
        urls = [e.url for e in engines]
        procs = start_ranks(__file__, [str(free_port()), json.dumps(urls), str(new_dir), str(tmp_path), "kill"])
        procs[1].wait(120)
        assert procs[1].returncode == -signal.SIGKILL
        finish_ranks(procs[:1], timeout_s=180)
        results = json.loads((tmp_path / "kill.json").read_text())
        print(json.dumps(results, indent=1))
        assert not results["1"]["ok"]
        assert "1" not in results["labels-1"], "an engine took the new label from a push whose source died"
        assert results["alone"]["labels"] == ["2", "2"]
    finally:
        for e in engines:
            e.stop()


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]),
          sys.argv[6])
