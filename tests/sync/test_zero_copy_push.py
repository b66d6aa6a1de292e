"""Zero-copy for large tensors on both ends of the weight push (docs/weight-push.md, "Zero-copy for large tensors").

Sender: large tensors already in the wire dtype go out of their own memory, a bucket's bytes of them under one
announcement, so no bucket buffer is taken for them and nothing is copied; smaller tensors, and tensors the push must
cast, are packed as before, in the exporter's order, into flat buckets the large ones do not close early. ``pack_all`` (the snapshot the overlapped push sends while the next step trains)
keeps copying.

Receiver: a real CPU engine (the engine class and its HTTP app, served in this process so that the test can look at
its parameters) paused in place for the push receives such a bucket straight into the parameter: the bytes land in
the parameter's own storage, the receive pool is not used for them, the weights are the pushed ones bit for bit, and
generation, also of a request that was running when the push came, gives the new weights' log-probs. A bucket whose
in-place receive fails leaves the version label where it was.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.errors import EngineError, SyncError
from pipeline.models.tiny import init_tiny_model
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.sync.base import EngineReply
from pipeline.sync.packing import ZERO_COPY_MIN_BYTES, BucketPacker, BucketSlots
from pipeline.sync.pusher import PushOptions, WeightPusher
from pipeline.sync.sources import Streamed
from tests.helpers.engines import ServedEngine, pushing
from tests.sync.test_push_consistency import PROMPT, _reference_logprobs

KB = 1 << 10
CPU = torch.device("cpu")
LOGPROB_ATOL = 1e-4  # fp32 engine vs an fp32 reference: rounding of differently shaped matmuls only


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # The in-process engine and this test share the process's intra-op threads; one keeps a 2-core machine usable.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _CountingSlots(BucketSlots):
    """Bucket buffers that remember every take."""

    def __init__(self, bucket_bytes: int) -> None:
        super().__init__(2, bucket_bytes, CPU)
        self.takes: list[int] = []

    def take(self, nbytes: int) -> torch.Tensor | None:
        self.takes.append(nbytes)
        return super().take(nbytes)


def _named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Small and large fp32 tensors interleaved, a large one last (it carries the version label)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        ("small.a", torch.randn(16, generator=gen)),
        ("big.a", torch.randn(64, 64, generator=gen)),  # 16 KB
        ("small.b", torch.randn(8, 3, generator=gen)),
        ("small.c", torch.randn(5, generator=gen)),
        ("big.b", torch.randn(32, 256, generator=gen)),  # 32 KB
        ("big.c", torch.randn(4096, generator=gen)),  # straight after another large one
        ("ids", torch.arange(4096)),  # int64, 32 KB: integers travel as they are, so their dtype is the wire's
        ("small.d", torch.randn(7, generator=gen)),
        ("big.strided", torch.randn(64, 128, generator=gen).t()),  # not contiguous: must be copied
        ("big.last", torch.randn(80, 64, generator=gen)),
    ]


def _stream(packer: BucketPacker, named: list[tuple[str, torch.Tensor]]
            ) -> list[tuple[list[str], bool, bool, list[int], dict[str, torch.Tensor]]]:
    out = []
    for bucket, last in packer.stream(named):
        tensors = {n: t.clone() for n, t in bucket.tensors()}
        sent = [t.data_ptr() for t in bucket.parts] if bucket.parts is not None else [bucket.flat.data_ptr()]
        out.append(([m.name for m in bucket.metas], last, bucket.zero_copy, sent, tensors))
        bucket.release()
    return out


# --------------------------------------------------------------------------------------------------------------------
# Sender
# --------------------------------------------------------------------------------------------------------------------


def test_large_tensors_go_out_of_their_own_memory_gathered_apart_from_the_copied_ones() -> None:
    named = _named()
    slots = _CountingSlots(64 * KB)
    packer = BucketPacker(bucket_bytes=64 * KB, dtype="float32", device=CPU, buffers=slots,
                          zero_copy_bytes=16 * KB)
    seen = _stream(packer, named)

    assert sorted(n for names, *_ in seen for n in names) == sorted(n for n, _ in named)  # each once
    assert [(names, last, zero) for names, last, zero, _, _ in seen] == [
        # Large ones under one announcement (one broadcast each) until the next would pass a bucket's bytes; the
        # small ones between them do not close the run.
        (["big.a", "big.b", "big.c"], False, True),
        # At the end, the open run before the open flat bucket: an engine receiving the run in place starts the
        # flat bucket's receive behind it (ordered_updates).
        (["ids", "big.last"], False, True),
        # The copied ones, in the exporter's order, in one flat bucket the large ones never closed early; the last
        # bucket carries the label.
        (["small.a", "small.b", "small.c", "small.d", "big.strided"], True, False),
    ]
    # Kept in the exporter's order, each of the two kinds would have gone in 7 announcements.
    assert packer.stats.buckets == 3
    by_name = dict(named)
    for names, _, zero, ptrs, tensors in seen:
        if zero:
            # The broadcasts' bytes are the tensors' own memory.
            assert ptrs == [by_name[n].data_ptr() for n in names], names
        for name in names:
            assert torch.equal(tensors[name], by_name[name]), name
    # Buffers were taken for the copied buckets only, and never for a large tensor.
    assert len(slots.takes) == sum(1 for *_, zero, _, _ in seen if not zero) == 1
    assert max(slots.takes) < 16 * KB
    zero_bytes = sum(by_name[n].numel() * by_name[n].element_size() for n in ("big.a", "big.b", "big.c", "ids",
                                                                              "big.last"))
    assert packer.stats.zero_copy_tensors == 5 and packer.stats.zero_copy_bytes == zero_bytes
    assert packer.stats.tensors == len(named) and packer.stats.buckets == len(seen)


def test_only_large_tensors_take_no_buffer_at_all_and_the_default_threshold_follows_the_device() -> None:
    gen = torch.Generator().manual_seed(1)
    named = [(f"w{i}", torch.randn(1 << 18, generator=gen)) for i in range(5)]  # 1 MiB each
    slots = _CountingSlots(4 << 20)
    packer = BucketPacker(bucket_bytes=4 << 20, dtype=None, device=CPU, buffers=slots)
    assert packer.zero_copy_bytes == 1 << 20
    # 1 MiB on CPU whatever the bucket (copies are dear there), a quarter of a bucket on GPU (copies are cheap,
    # calls are not).
    assert BucketPacker(bucket_bytes=64 << 20, dtype=None, device=CPU).zero_copy_bytes == 1 << 20
    assert BucketPacker(bucket_bytes=512 << 20, dtype=None, device=CPU).zero_copy_bytes == 1 << 20
    gpu = BucketPacker(bucket_bytes=512 << 20, dtype=None, device=torch.device("cuda"))
    assert gpu.zero_copy_bytes == 128 << 20
    seen = _stream(packer, named)
    # A bucket's bytes of them under one announcement (one broadcast each), the rest, alone, as a flat bucket.
    assert [(names, last, zero) for names, last, zero, _, _ in seen] == [
        (["w0", "w1", "w2", "w3"], False, True), (["w4"], True, True)]
    assert [len(ptrs) for *_, ptrs, _ in seen] == [4, 1]
    assert slots.takes == [] and packer.stats.peak_buffer_bytes == 0
    # Small buckets never make small tensors zero-copy: an extra bucket costs more than their copy saves.
    assert BucketPacker(bucket_bytes=64 * KB, dtype=None, device=CPU).zero_copy_bytes == ZERO_COPY_MIN_BYTES
    assert BucketPacker(bucket_bytes=64 * KB, dtype=None, device=CPU, zero_copy=False).zero_copy_bytes is None


def test_a_tensor_in_another_dtype_than_the_wire_is_cast_and_packed() -> None:
    named = [(n, t) for n, t in _named() if t.is_floating_point()]  # fp32, as a trainer holds them
    slots = _CountingSlots(64 * KB)
    packer = BucketPacker(bucket_bytes=64 * KB, dtype="bfloat16", device=CPU, buffers=slots, zero_copy_bytes=1)
    seen = _stream(packer, named)
    assert not any(zero for *_, zero, _, _ in seen) and packer.stats.zero_copy_bytes == 0
    assert len(slots.takes) == len(seen)
    got = {n: t for *_, tensors in seen for n, t in tensors.items()}
    for name, sent in named:
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], sent.to(torch.bfloat16)), name


def test_a_snapshot_copies_so_the_parameters_training_on_do_not_change_it() -> None:
    named = _named()
    before = {n: t.clone() for n, t in named}
    packer = BucketPacker(bucket_bytes=64 * KB, dtype="float32", device=CPU, slots=None, zero_copy_bytes=1)
    snapshot = packer.pack_all(named)
    assert not any(b.zero_copy for b in snapshot)
    pointers = {t.data_ptr() for _, t in named}
    assert not any(b.flat.data_ptr() in pointers for b in snapshot)
    for _, tensor in named:  # the next optimizer step
        tensor.add_(1)
    got = {n: t for b in snapshot for n, t in b.tensors()}
    assert all(torch.equal(got[n], before[n]) for n in before)


def test_a_stopped_stream_still_walks_the_exporter_with_a_zero_copy_bucket_pending() -> None:
    pulled: list[int] = []

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(6):
            pulled.append(i)
            yield f"w{i}", torch.zeros(4096)

    packer = BucketPacker(bucket_bytes=64 * KB, dtype=None, device=CPU, zero_copy_bytes=8 * KB)
    stream = packer.stream(source())
    first, last = next(stream)
    # Four fill a bucket; the fifth, pending, begins the next run.
    assert first.zero_copy and not last and [m.name for m in first.metas] == ["w0", "w1", "w2", "w3"]
    stream.close()  # the push failed after its first bucket
    assert pulled == list(range(6))


def test_the_packing_thread_hands_the_next_bucket_over_while_the_one_before_is_sent_and_packs_no_third() -> None:
    """The send of bucket k must find bucket k+1 waiting, not wake the packing thread to hand it over (a thread hop
    per bucket); and the thread must not pull a third bucket's tensors while two are unfinished."""
    pulled: list[int] = []

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(16):
            pulled.append(i)
            yield f"w{i}", torch.zeros(4096)  # 16 KB: four to a 64 KB bucket

    async def scenario() -> tuple[list[int], int, list[int], list[list[str]]]:
        packer = BucketPacker(bucket_bytes=64 * KB, dtype=None, device=CPU, buffers=BucketSlots(2, 64 * KB, CPU),
                              zero_copy=False)
        source_ = Streamed(packer, source())
        first = await source_.next()
        assert first is not None
        deadline = time.monotonic() + 10
        while source_._items.empty() and time.monotonic() < deadline:  # bucket 0 is "being sent"
            await asyncio.sleep(0.005)
        queued = source_._items.qsize()
        await asyncio.sleep(0.2)  # time enough to pull the rest, were the thread not held back
        held = list(pulled)
        # A pusher that announces ahead takes bucket 1 while bucket 0 is still on the wire: still no third.
        second = await source_.next()
        assert second is not None
        await asyncio.sleep(0.2)
        held_both = list(pulled)
        names = [[m.name for m in first[0].metas], [m.name for m in second[0].metas]]
        first[0].release()
        source_.sent()
        while (item := await source_.next()) is not None:
            names.append([m.name for m in item[0].metas])
            item[0].release()
            source_.sent()
        second[0].release()
        source_.sent()
        await source_.abort()
        assert held_both == held
        return held, queued, list(pulled), names

    held, queued, pulled_all, names = asyncio.run(scenario())
    assert queued == 1  # bucket 1 was handed over while bucket 0 was still out
    # Buckets 0 and 1 and the tensor that closed bucket 1; nothing of bucket 3, even with both taken and not sent.
    assert held == list(range(9))
    assert pulled_all == list(range(16))
    assert names == [[f"w{i}" for i in range(b, b + 4)] for b in range(0, 16, 4)]


# --------------------------------------------------------------------------------------------------------------------
# Receiver: no forward pass while a parameter is written in place
# --------------------------------------------------------------------------------------------------------------------


class _SlowGenerator:
    """What the scheduler needs of a generator; each forward pass blocks until the test lets it finish."""

    def __init__(self) -> None:
        self.rows: list[object] = []
        self.num_tokens = 0
        self.tokens_generated = 0
        self.forward_passes = 0
        self.in_pass = threading.Event()
        self.finish = threading.Event()

    def admit(self, seqs: list[object]) -> list[object]:
        self.rows.extend(seqs)
        return []

    def step(self) -> list[object]:
        self.in_pass.set()
        self.finish.wait(30)
        self.forward_passes += 1
        time.sleep(0.002)  # once released, a pass per 2 ms rather than a spinning core
        return []

    def abort(self, predicate: Any, message: str) -> list[object]:
        return []


def test_holding_forward_passes_waits_for_the_pass_in_flight_and_lets_none_start() -> None:
    from pipeline.producers.cpu_engine.scheduler import Scheduler

    gen = _SlowGenerator()
    scheduler = Scheduler(gen, max_batch=4)  # type: ignore[arg-type]
    scheduler.start()
    holding, done = threading.Event(), threading.Event()
    passes_while_held: list[int] = []

    def receive_in_place() -> None:
        with scheduler.hold_passes():
            holding.set()
            before = gen.forward_passes
            scheduler.set_paused(False)  # a /continue_generation that comes mid-receive changes nothing
            time.sleep(0.3)
            passes_while_held.append(gen.forward_passes - before)
        done.set()

    try:
        scheduler.submit([object()])  # type: ignore[list-item]
        assert gen.in_pass.wait(30)  # a forward pass is running
        scheduler.set_paused(True)  # the pusher's pause in place: the pass in flight still runs to its end
        writer = threading.Thread(target=receive_in_place, daemon=True)
        writer.start()
        assert not holding.wait(0.3)  # the hold waits for the pass in flight
        gen.finish.set()
        assert holding.wait(30) and done.wait(30)
        assert passes_while_held == [0]
        deadline = time.monotonic() + 30
        passes = gen.forward_passes
        while gen.forward_passes == passes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gen.forward_passes > passes  # released, and continued meanwhile: generation goes on
    finally:
        gen.finish.set()
        scheduler.stop()


# --------------------------------------------------------------------------------------------------------------------
# Both ends: a push into a real CPU engine
# --------------------------------------------------------------------------------------------------------------------


class _RecordingClient(SGLangClient):
    """A real client that remembers the names of every bucket it announced."""

    announced: list[list[str]]
    formats: list[str | None]

    async def update_weights_from_distributed(self, **kw: Any) -> Any:  # type: ignore[override]
        self.announced.append(list(kw["names"]))
        self.formats.append(kw.get("load_format"))
        return await super().update_weights_from_distributed(**kw)


@pytest.mark.slow
def test_a_push_sends_large_tensors_zero_copy_and_a_paused_engine_receives_them_in_place(tmp_path: Path) -> None:
    import transformers

    old_dir = init_tiny_model("qwen3", tmp_path / "old", seed=0)
    new_dir = init_tiny_model("qwen3", tmp_path / "new", seed=1)
    old = transformers.AutoModelForCausalLM.from_pretrained(old_dir, dtype=torch.float32).eval()
    new = transformers.AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    # Resident clones, as a trainer's live parameters; sorted, then a large one last, so that it ends the last run,
    # which goes out just before the labelled bucket (the last flat one).
    weights = [(n, t.clone()) for n, t in sorted(load_file(str(new_dir / "model.safetensors")).items())]
    tail = "model.layers.1.mlp.up_proj.weight"
    weights = [w for w in weights if w[0] != tail] + [w for w in weights if w[0] == tail]
    threshold = 16 * KB  # the MLP (32 KB) and q/o projections (16 KB) go zero-copy; norms, k/v, embeddings do not
    big = {n for n, t in weights if t.numel() * t.element_size() >= threshold}
    small = {n for n, _ in weights} - big
    assert len(big) >= 8 and len(small) >= 8
    nbytes = {n: t.numel() * t.element_size() for n, t in weights}

    served = ServedEngine(old_dir)
    params = served.engine.model.state_dict()
    pointers = {n: params[n].data_ptr() for n, _ in weights}

    pulled = 0
    broadcasts: list[tuple[int, int, int]] = []  # (data_ptr, bytes, tensors pulled from the exporter by then)

    def exporter() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal pulled
        for item in weights:
            pulled += 1
            yield item

    async def scenario() -> dict[str, Any]:
        client = _RecordingClient(served.url, retry=NO_RETRY)
        client.announced, client.formats = [], []
        pusher = await WeightPusher.connect([client], master_address="127.0.0.1", backend="gloo", timeout_s=60,
                                            options=PushOptions(bucket_bytes=64 * KB, zero_copy_bytes=threshold))
        send = pusher.group.issue

        def recording(tensors: list[torch.Tensor], src: int = 0, **kw: Any) -> Any:
            # Every broadcast starts in issue (a flat bucket's alone, a run's tensors together).
            broadcasts.extend((t.data_ptr(), t.numel() * t.element_size(), pulled) for t in tensors)
            return send(tensors, src, **kw)

        pusher.group.issue = recording  # type: ignore[method-assign]
        takes: list[int] = []
        take = pusher._buffers.take
        pusher._buffers.take = lambda n: takes.append(n) or take(n)  # type: ignore[method-assign]
        greedy = {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}
        try:
            # A request running when the push comes: the engine pauses it in place, a forward pass in flight
            # finishes under the old weights, and no pass may see a parameter half-received.
            running = asyncio.ensure_future(client.generate(PROMPT, greedy))
            while (await client.get_load()).total("tokens_generated") < 30:
                await asyncio.sleep(0.005)
            scheduler = served.engine.scheduler
            call = scheduler.call
            loads: list[Any] = []  # what the push queued for the scheduler thread
            scheduler.call = lambda action: loads.append(action) or call(action)  # type: ignore[method-assign]
            try:
                stats = await pusher.push(exporter(), 1)
            finally:
                scheduler.call = call  # type: ignore[method-assign]
            first_takes, first_broadcasts = list(takes), len(broadcasts)
            result = await running
            after = await client.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True})
            load = await client.get_load()
            landed = {n: params[n].clone() for n, _ in weights}  # the engine is idle: nothing writes them now
            # The failure case: the last run of a second push fails after its receive, and only once the labelled
            # (flat) bucket after it was received behind it: the run handed its turn on when its receives started.
            # That bucket must not move the label.
            loader = served.engine.weights
            receive, buffered = loader.receive_in_place, loader.bytes_buffered  # one push's, the first

            def failing(group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                        flat: bool = True, on_issued: Any = None) -> Any:
                got = receive(group, names, dtypes, shapes, flat=flat, on_issued=on_issued)
                if tail in names:
                    deadline = time.monotonic() + 10
                    while loader.bytes_buffered < 2 * buffered and time.monotonic() < deadline:
                        time.sleep(0.005)
                    raise RuntimeError("injected: the transfer broke")
                return got

            served.engine.weights.receive_in_place = failing  # type: ignore[method-assign]
            with pytest.raises(SyncError, match="weight_version stays 1"):
                await pusher.push(exporter(), 2)
            failed_load = await client.get_load()
            version_after_failure = await client.weight_version()
            return {"stats": stats, "result": result, "after": after, "load": load, "takes": first_takes,
                    "loads": len(loads),
                    "broadcasts": first_broadcasts, "landed": landed,
                    "announced": client.announced, "formats": client.formats, "failed_load": failed_load,
                    "version_after_failure": version_after_failure}
        finally:
            await pusher.close()
            await client.close()

    try:
        out = asyncio.run(scenario())
    finally:
        served.stop()

    stats, load = out["stats"], out["load"]
    first_push = out["announced"][: stats.buckets]
    # Sender: each name once; large tensors never share a bucket with small ones and the small ones keep the
    # exporter's order; large ones share announcements (one broadcast each, from the parameter's own memory), and
    # buffers are taken only for the small ones.
    wire = [n for names in first_push for n in names]
    assert sorted(wire) == sorted(n for n, _ in weights) and len(wire) == len(weights)
    assert [n for n in wire if n in small] == [n for n, _ in weights if n in small]
    runs = [names for names in first_push if names[0] in big]
    assert all(set(names) <= big for names in runs)
    assert any(len(names) > 1 for names in runs), runs  # the q/o projections and the MLP come in runs
    # A run of several goes on SGLang's per-tensor wire; every other bucket is one flat broadcast.
    formats = out["formats"][: stats.buckets]
    assert [f is None for f in formats] == [names in runs and len(names) > 1 for names in first_push]
    # Gathered apart, neither kind closes the other's bucket early: every bucket but the last of its kind is full
    # up to the next tensor of that kind (with the exporter's order kept, small and large alternate in this model,
    # and most buckets would hold a few KB). The push's first bucket is full at a sixteenth of a bucket.
    assert sum(nbytes[n] for n in first_push[0]) <= 64 * KB // 16 or len(first_push[0]) == 1
    for kind in (small, big):
        mine = [names for names in first_push if names[0] in kind]
        following = [n for n in wire if n in kind]
        for names in mine[:-1]:
            after = following[following.index(names[-1]) + 1]
            full = 64 * KB // 16 if names is first_push[0] else 64 * KB
            assert sum(nbytes[n] for n in names) + nbytes[after] > full, (names, after)
    pushed = broadcasts[: out["broadcasts"]]
    by_ptr = {t.data_ptr(): n for n, t in weights}
    sent_zero_copy = {by_ptr[ptr] for ptr, size, _ in pushed if by_ptr.get(ptr) in big and size == nbytes[by_ptr[ptr]]}
    assert sent_zero_copy == big
    assert stats.zero_copy_bytes == sum(nbytes[n] for n in big)
    buckets_with_small = sum(1 for names in first_push if names[0] in small)
    assert len(out["takes"]) == buckets_with_small and max(out["takes"]) <= sum(nbytes[n] for n in small)
    # The exporter is never pulled far ahead of the send: at each broadcast, what was pulled beyond the buckets sent
    # so far is at most the open flat bucket, the open run, one packed bucket waiting, and the tensor in hand. Zero-copy
    # buckets take no buffer, so only the packer's bounds stop it from gathering the whole model ahead.
    pulled_bytes = [0]
    for name, _ in weights:
        pulled_bytes.append(pulled_bytes[-1] + nbytes[name])
    through = [sum(nbytes[n] for names in first_push[: i + 1] for n in names) for i in range(len(first_push))]
    sent_in = [i for i, names in enumerate(first_push) for _ in (names if names[0] in big else [0])]
    assert len(sent_in) == len(pushed)  # per broadcast, its bucket
    ahead = [pulled_bytes[seen] - through[b] for b, (_, _, seen) in zip(sent_in, pushed)]
    assert max(ahead) <= 3 * 64 * KB + max(nbytes.values()), ahead

    # Receiver: every weight the pushed one, bit for bit, in the same storage; every large tensor and every bucket of
    # one tensor (a small one that ended up alone between two runs) received in place, the pool used for the others
    # only.
    for name, sent in weights:
        assert torch.equal(out["landed"][name].view(torch.uint8), sent.view(torch.uint8)), name
        assert params[name].data_ptr() == pointers[name], name
    alone = {names[0] for names in first_push if len(names) == 1}
    in_place = sum(nbytes[n] for n in big | alone)
    loader = served.engine.weights
    assert loader.bytes_in_place == 2 * in_place  # both pushes, the failed one's run too
    assert loader.bytes_buffered == 2 * (sum(nbytes.values()) - in_place)
    assert load.ranks[0]["weight_bytes_received_in_place"] == in_place
    assert load.total("weight_bytes_received") == sum(nbytes.values()) == stats.bytes
    # Only buckets with something to load go to the scheduler thread: the buffered ones, and the labelled one
    # (whose load moves the label); an unlabelled bucket received in place queues nothing that the end would wait
    # for after the last byte.
    received_in_place = [names for names in first_push if names in runs or len(names) == 1]
    labelled_in_place = first_push[-1] in received_in_place
    assert len(received_in_place) >= 2
    assert out["loads"] == stats.buckets - len(received_in_place) + labelled_in_place

    # Generation: the request that straddled the push matches the old model up to the switch and the new one after
    # it (over the old model's KV cache, as pausing in place leaves it); a request after the push, the new model.
    result = out["result"]
    spans = [(s.version, s.start, s.end) for s in result.weight_versions]
    assert [v for v, _, _ in spans] == ["0", "1"], spans
    tokens = result.output_ids.tolist()
    expected = _reference_logprobs(old, new, tokens, spans[0][2])
    assert np.abs(np.asarray(result.output_logprobs) - expected).max() < LOGPROB_ATOL
    after = out["after"]
    assert [s.version for s in after.weight_versions] == ["1"]
    expected_after = _reference_logprobs(old, new, after.output_ids.tolist(), 0)
    assert np.abs(np.asarray(after.output_logprobs) - expected_after).max() < LOGPROB_ATOL

    # A push whose run failed in place, the labelled bucket received behind it: the label stays, generation stays
    # paused until a whole push.
    assert out["version_after_failure"] == "1"
    assert out["failed_load"].ranks[0]["paused"] is True


@pytest.mark.slow
def test_a_bucket_that_fails_to_load_keeps_the_label_though_a_later_bucket_carries_it(tmp_path: Path) -> None:
    """Buckets load in arrival order while later ones arrive; the label rides on the last one. If an earlier one's
    load fails, the last one's load must not move the label over weights that are partly old."""
    model_dir = init_tiny_model("qwen3", tmp_path / "model", seed=0)
    weights = [(n, t.clone()) for n, t in sorted(load_file(str(model_dir / "model.safetensors")).items())]
    # The push's first bucket (a sixteenth of a bucket) holds the first tensor alone and is received in place; the
    # second tensor opens the first full bucket, of several tensors, loaded from a buffer.
    second = weights[1][0]
    served = ServedEngine(model_dir)
    apply = served.engine.weights.apply

    def failing(tensors: list[tuple[str, torch.Tensor]]) -> None:
        if any(name == second for name, _ in tensors):
            raise RuntimeError("injected: the load broke")
        apply(tensors)

    served.engine.weights.apply = failing  # type: ignore[method-assign]

    async def scenario() -> tuple[str, str, int]:
        async with pushing(served.url, options=PushOptions(bucket_bytes=64 * KB, zero_copy=False)) as (client, pusher):
            with pytest.raises(SyncError, match="loading a received bucket failed"):
                await pusher.push(weights, 7)
            failed = str(await client.weight_version())
            served.engine.weights.apply = apply  # type: ignore[method-assign]
            stats = await pusher.push(weights, 8)  # a whole push after it moves the label again
            return failed, str(await client.weight_version()), stats.buckets

    try:
        failed, after, buckets = asyncio.run(scenario())
    finally:
        served.stop()
    assert buckets > 2  # the failing bucket (the second, of several tensors: loaded from buffers) was not the last
    assert failed == "0" and after == "8"


class _RefusingBegin(SGLangClient):
    """A real client whose engine refuses to open its update window while ``refuse`` is set (the refusal is made
    here, so that engine never sees the request)."""

    refuse: bool = True

    async def begin_weight_update(self) -> EngineReply:
        if self.refuse:
            return EngineReply(False, "injected: this engine refuses the update window")
        return await super().begin_weight_update()


class _RecordingBegin(SGLangClient):
    """A real client that remembers its engine's answers to ``/begin_weight_update``."""

    begun: list[bool]

    async def begin_weight_update(self) -> EngineReply:
        reply = await super().begin_weight_update()
        self.begun.append(reply.success)
        return reply


@pytest.mark.slow
def test_an_engine_that_refuses_begin_leaves_no_other_engines_window_open(tmp_path: Path) -> None:
    """Every engine is asked to open its window at once; when one refuses, those that opened theirs must be closed
    again, or they answer announcements of no push and keep the window's state into the next."""
    model_dir = init_tiny_model("qwen3", tmp_path / "model", seed=0)
    weights = [(n, t.clone()) for n, t in sorted(load_file(str(model_dir / "model.safetensors")).items())]
    served = [ServedEngine(model_dir), ServedEngine(model_dir)]

    async def scenario() -> tuple[list[bool], list[bool], list[str]]:
        opener, refuser = _RecordingBegin(served[0].url, retry=NO_RETRY), _RefusingBegin(served[1].url, retry=NO_RETRY)
        opener.begun = []
        pusher = await WeightPusher.connect([opener, refuser], master_address="127.0.0.1", backend="gloo",
                                            timeout_s=60, options=PushOptions(bucket_bytes=64 * KB))
        try:
            with pytest.raises(SyncError, match="refuses the update window"):
                await pusher.push(weights, 1)
            windows, begun = [s.engine.update_window_open for s in served], list(opener.begun)
            refuser.refuse = False
            await pusher.push(weights, 2)  # the group is whole: nothing was announced
            return begun, windows, [str(await c.weight_version()) for c in (opener, refuser)]
        finally:
            await pusher.close()
            for c in (opener, refuser):
                await c.close()

    try:
        begun, windows, versions = asyncio.run(scenario())
    finally:
        for s in served:
            s.stop()
    assert begun == [True]  # the first engine did open its window in the failed push
    assert windows[0] is False
    assert versions == ["2", "2"]


class _RecordingControl(SGLangClient):
    """A real client that remembers the push's closing calls, and whose answer to ``prefix_cache`` can be set:
    ``says`` None asks the engine (the CPU engine says it keeps none), True or False is said here, and an exception
    is raised here."""

    calls: list[str]
    says: bool | BaseException | None = None

    async def prefix_cache(self) -> bool:
        self.calls.append("prefix_cache?")
        if isinstance(self.says, BaseException):
            raise self.says
        return await super().prefix_cache() if self.says is None else self.says

    async def end_weight_update(self, **kw: Any) -> EngineReply:
        self.calls.append("end+continue" if kw.get("continue_generation") else "end")
        return await super().end_weight_update(**kw)

    async def flush_cache(self) -> EngineReply:
        self.calls.append("flush")
        return await super().flush_cache()

    async def continue_generation(self) -> EngineReply:
        self.calls.append("continue")
        return await super().continue_generation()


@pytest.mark.slow
def test_a_push_flushes_only_engines_that_may_keep_a_prefix_cache_and_asks_once(tmp_path: Path) -> None:
    """A round trip per push saved where there is nothing to flush (an engine started without a prefix cache); an
    engine with a cache (SGLang's radix cache) or one that does not answer the question is still flushed, after its
    load and before generation continues."""
    model_dir = init_tiny_model("qwen3", tmp_path / "model", seed=0)
    weights = [(n, t.clone()) for n, t in sorted(load_file(str(model_dir / "model.safetensors")).items())]
    served = ServedEngine(model_dir, disable_radix_cache=True)

    async def pushes(says: bool | BaseException | None, count: int) -> tuple[list[str], str]:
        client = _RecordingControl(served.url, retry=NO_RETRY)
        client.calls, client.says = [], says
        async with pushing(served.url, client, PushOptions(bucket_bytes=64 * KB)) as (_, pusher):
            for version in range(1, count + 1):
                await pusher.push(weights, version)
            return client.calls, await client.weight_version()

    async def scenario() -> list[tuple[list[str], str]]:
        return [await pushes(None, 2), await pushes(True, 2), await pushes(EngineError("no answer"), 1)]

    try:
        (cpu, cpu_version), (cached, _), (silent, _) = asyncio.run(scenario())
    finally:
        served.stop()
    # Asked once, at the first push. With nothing to flush and one engine, the end also continues (one round trip);
    # an engine to flush is flushed between its end and the continue.
    assert cpu == ["prefix_cache?", "end+continue", "end+continue"]
    assert cpu_version == "2"
    assert cached == ["prefix_cache?", "end", "flush", "continue", "end", "flush", "continue"]
    assert silent == ["prefix_cache?", "end", "flush", "continue"]


class _Announcing(SGLangClient):
    """A real client that notes each announcement in a shared list of events."""

    events: list[str]

    async def update_weights_from_distributed(self, **kw: Any) -> Any:  # type: ignore[override]
        self.events.append("announce")
        return await super().update_weights_from_distributed(**kw)


@pytest.mark.slow
def test_the_first_bucket_goes_out_once_a_sixteenth_of_a_bucket_is_packed(tmp_path: Path) -> None:
    """With a slow exporter (a gather across ranks) the wire starts early: the first bucket closes at a sixteenth of
    a bucket, while the exporter still gathers what fills the next one. Here one bucket holds the whole model, and
    without the small first bucket nothing would be announced before the last tensor was gathered."""
    model_dir = init_tiny_model("qwen3", tmp_path / "model", seed=0)
    new_dir = init_tiny_model("qwen3", tmp_path / "new", seed=1)
    weights = sorted(load_file(str(new_dir / "model.safetensors")).items())
    total = sum(t.numel() * t.element_size() for _, t in weights)
    served = ServedEngine(model_dir)
    events: list[str] = []

    def exporter() -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, tensor) in enumerate(weights):
            time.sleep(0.01)
            events.append(f"exported {i}")
            yield name, tensor

    async def scenario() -> int:
        client = _Announcing(served.url, retry=NO_RETRY)
        client.events = events
        async with pushing(served.url, client, PushOptions(bucket_bytes=2 * total)) as (_, pusher):
            stats = await pusher.push(exporter(), 1)
            return stats.buckets

    try:
        buckets = asyncio.run(scenario())
    finally:
        served.stop()
    gathered = sum(1 for e in events[: events.index("announce")] if e.startswith("exported"))
    assert gathered < len(weights) // 2, events  # the first bucket (about 40 KB) is 3 tensors, the model 25
    assert buckets == 2
    params = served.engine.model.state_dict()
    assert all(torch.equal(params[n], t) for n, t in weights)


class _SlowPause(SGLangClient):
    """A real client whose ``/pause_generation`` reaches its engine 0.3 s late; it records when each control call
    went out and when its answer came."""

    events: list[str]

    async def pause_generation(self, mode: Any = "abort") -> EngineReply:
        self.events.append("pause sent")
        await asyncio.sleep(0.3)
        reply = await super().pause_generation(mode)
        self.events.append("pause answered")
        return reply

    async def begin_weight_update(self) -> EngineReply:
        self.events.append("begin sent")
        reply = await super().begin_weight_update()
        self.events.append("begin answered")
        return reply

    async def update_weights_from_distributed(self, **kw: Any) -> Any:  # type: ignore[override]
        self.events.append("announce")
        return await super().update_weights_from_distributed(**kw)


@pytest.mark.slow
def test_the_first_bucket_is_packed_while_the_engines_pause_and_the_window_opens_only_once_they_have(
    tmp_path: Path,
) -> None:
    """The first bucket is packed while the pause is on its way (an exporter that gathers across ranks takes a while
    for it), and the begin goes out only once the pause is answered: SGLang's begin takes its model-update writer
    lock unless the engine is already paused, and would then wait for generations the pause freezes."""
    model_dir = init_tiny_model("qwen3", tmp_path / "model", seed=0)
    weights = [(n, t.clone()) for n, t in sorted(load_file(str(model_dir / "model.safetensors")).items())]
    served = ServedEngine(model_dir)
    events: list[str] = []

    def exporter() -> Iterator[tuple[str, torch.Tensor]]:
        time.sleep(0.1)  # gathering the first tensor, while the pause takes 0.3 s
        events.append("first tensor out")
        yield from weights

    async def scenario() -> tuple[str, bool]:
        client = _SlowPause(served.url, retry=NO_RETRY)
        client.events = events
        # The CPU engine takes announcements in order: from the second push on, bucket 0 brings the pause and the
        # window itself; the first push is the one that asks the engine, and pauses and opens as SGLang needs.
        async with pushing(served.url, client, PushOptions(bucket_bytes=64 * KB)) as (_, pusher):
            await pusher.push(exporter(), 1)
            return await client.weight_version(), served.engine.scheduler.paused

    try:
        version, paused = asyncio.run(scenario())
    finally:
        served.stop()
    first = events.index("announce")
    # The first tensor came while the pause was on its way; the window opened after the pause's answer.
    assert events[0] == "pause sent", events
    assert events.index("first tensor out") < events.index("pause answered") < events.index("begin sent"), events
    assert events.index("begin answered") < first
    assert version == "1" and paused is False
