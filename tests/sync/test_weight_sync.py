"""Bucketed weight broadcast over gloo between real processes (pipeline.sync.weights).

The receiving side runs as a separate process started from this file (``python tests/sync/test_weight_sync.py receive``).
It joins the weight group with ``init_weight_group``, takes update announcements as JSON lines on stdin, receives them
with ``receive_tensors`` and writes what it got to a safetensors file, which the test compares byte for byte. The
small adapter that turns the pusher's engine calls into those JSON lines is test plumbing; the component under test
(group, bucket planning, pusher, receiver) is the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.errors import SyncError
from pipeline.net import free_port
from pipeline.sync.base import EngineReply, TensorMeta, check_announcement, meta_of, validate_metas
from pipeline.sync.packing import BucketPacker
from pipeline.sync.pusher import PushOptions, WeightPusher
from pipeline.sync.weights import (
    BROADCAST_WINDOW,
    GLOO_THREADS,
    bind_weight_store,
    init_weight_group,
    plan_buckets,
    receive_flat,
    receive_tensors,
)
from tests.helpers.engines import RecordingImpl

REPO_ROOT = Path(__file__).resolve().parents[2]


def _bits(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, so that NaN payloads and -0.0 count too."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------------------------------------------------
# The receiver process
# --------------------------------------------------------------------------------------------------------------------


def _receiver_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master-address", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--group-name", required=True)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    def answer(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    group = init_weight_group(
        args.master_address, args.master_port, args.rank, args.world_size, args.group_name, "gloo", args.timeout_s
    )
    answer({"success": True, "message": f"joined as rank {group.rank}"})
    received: dict[str, torch.Tensor] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "update":
            if cmd.get("refuse"):
                answer({"success": False, "message": "refused on purpose by the test"})
                continue
            count = 0
            receive = receive_flat if cmd.get("load_format") == "flattened_bucket" else receive_tensors
            for name, tensor in receive(group, cmd["names"], cmd["dtypes"], cmd["shapes"]):
                received[name] = tensor.clone()
                count += 1
            answer({"success": True, "message": f"loaded {count} tensors"})
        elif op == "dump":
            save_file(received, cmd["path"])
            answer({"success": True, "message": cmd["path"]})
        elif op == "exit":
            group.close()
            answer({"success": True, "message": "bye"})
            return


class _ReceiverEngine:
    """Drives one receiver process through the pusher's engine calls (test plumbing, see module docstring)."""

    def __init__(self, label: str, *, refuse_updates: bool = False) -> None:
        self.label = label
        self.refuse_updates = refuse_updates
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def name(self) -> str:
        return self.label

    async def _ask(self, obj: dict[str, Any]) -> EngineReply:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            return EngineReply(False, f"receiver exited with {await self.proc.wait()}")
        reply = json.loads(line)
        return EngineReply(bool(reply["success"]), str(reply["message"]))

    async def init_weights_update_group(self, **kw: Any) -> EngineReply:
        self.calls.append(("init", kw))
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "receive",
            "--master-address", kw["master_address"], "--master-port", str(kw["master_port"]),
            "--rank", str(kw["rank_offset"]), "--world-size", str(kw["world_size"]), "--group-name", kw["group_name"],
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            return EngineReply(False, f"receiver exited with {await self.proc.wait()}")
        return EngineReply(True, json.loads(line)["message"])

    async def begin_weight_update(self) -> EngineReply:
        self.calls.append(("begin", {}))
        return EngineReply(True, "")

    async def update_weights_from_distributed(self, **kw: Any) -> EngineReply:
        self.calls.append(("update", kw))
        cmd = {"op": "update", "names": kw["names"], "dtypes": kw["dtypes"], "shapes": kw["shapes"],
               "load_format": kw.get("load_format")}
        return await self._ask({**cmd, "refuse": self.refuse_updates})

    async def end_weight_update(self) -> EngineReply:
        self.calls.append(("end", {}))
        return EngineReply(True, "")

    async def pause_generation(self, mode: str = "abort") -> EngineReply:
        self.calls.append(("pause", {"mode": mode}))
        return EngineReply(True, "")

    async def continue_generation(self) -> EngineReply:
        self.calls.append(("continue", {}))
        return EngineReply(True, "")

    async def destroy_weights_update_group(self, group_name: str) -> EngineReply:
        self.calls.append(("destroy", {"group_name": group_name}))
        return await self._ask({"op": "exit"})

    async def dump(self, path: Path) -> None:
        reply = await self._ask({"op": "dump", "path": str(path)})
        assert reply.success, reply.message

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            await asyncio.wait_for(self._ask({"op": "exit"}), 10)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass  # it already left (destroy_weights_update_group) or hangs; wait, then kill below
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()  # the process this test started, by its handle
            await self.proc.wait()


class _RecordingEngine:
    """An engine that must never be reached: it records every call (for the reject-before-send tests)."""

    name = "recording-engine"

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def init_weights_update_group(self, **kw: Any) -> EngineReply:
        self.calls.append("init")
        return EngineReply(True, "")

    async def begin_weight_update(self) -> EngineReply:
        self.calls.append("begin")
        return EngineReply(True, "")

    async def update_weights_from_distributed(self, **kw: Any) -> EngineReply:
        self.calls.append("update")
        return EngineReply(True, "")

    async def end_weight_update(self) -> EngineReply:
        self.calls.append("end")
        return EngineReply(True, "")

    async def pause_generation(self, mode: str = "abort") -> EngineReply:
        self.calls.append("pause")
        return EngineReply(True, "")

    async def continue_generation(self) -> EngineReply:
        self.calls.append("continue")
        return EngineReply(True, "")

    async def destroy_weights_update_group(self, group_name: str) -> EngineReply:
        self.calls.append("destroy")
        return EngineReply(True, "")


def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, 3.5])
    return [
        ("model.embed_tokens.weight", torch.randn(97, 64, generator=gen)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_norm.weight", torch.randn(16, generator=gen).to(torch.float16)),
        ("model.layers.0.mlp.gate.weight", torch.randn(8, 64, generator=gen)),
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(3, 5, 7, generator=gen).to(torch.bfloat16)),
        ("special.values", special),
        ("special.bf16", special.to(torch.bfloat16)),
        ("counts.int64", torch.randint(-(2**62), 2**62, (33,), generator=gen, dtype=torch.int64)),
        ("scalar", torch.tensor(2.5)),
        ("model.norm.weight", torch.randn(64, generator=gen)),
        ("lm_head.weight", torch.randn(97, 64, generator=gen).to(torch.float16)),
    ]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


# --------------------------------------------------------------------------------------------------------------------
# Bucket planning
# --------------------------------------------------------------------------------------------------------------------


def test_plan_buckets_keeps_order_and_bound() -> None:
    metas = [TensorMeta(f"t{i}", "float32", (size,)) for i, size in enumerate([10, 10, 10, 30, 5, 5, 40, 1])]
    buckets = plan_buckets(metas, bucket_bytes=100)
    assert [m.name for b in buckets for m in b] == [m.name for m in metas]
    assert all(len(b) == 1 or sum(m.nbytes for m in b) <= 100 for b in buckets)
    assert [[m.name for m in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"], ["t7"]]


def test_plan_buckets_oversize_tensor_gets_its_own_bucket() -> None:
    items = [("a", torch.zeros(4)), ("big", torch.zeros(100)), ("b", torch.zeros(4)), ("c", torch.zeros(4))]
    buckets = plan_buckets(items, bucket_bytes=32)
    assert [[name for name, _ in b] for b in buckets] == [["a"], ["big"], ["b", "c"]]


def test_plan_buckets_uses_dtype_sizes_and_rejects_bad_input() -> None:
    bf16 = [("x", torch.zeros(8, dtype=torch.bfloat16)), ("y", torch.zeros(8, dtype=torch.bfloat16))]
    assert len(plan_buckets(bf16, bucket_bytes=32)) == 1
    assert len(plan_buckets([(n, t.float()) for n, t in bf16], bucket_bytes=32)) == 2
    assert plan_buckets([], bucket_bytes=10) == []
    with pytest.raises(SyncError):
        plan_buckets(bf16, bucket_bytes=0)
    with pytest.raises(SyncError):
        plan_buckets(["not a tensor"], bucket_bytes=10)


def test_packer_streams_in_order_with_an_oversize_tensor_alone_and_two_buffers_at_most() -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [("a", torch.randn(4, generator=gen)), ("big", torch.randn(100, generator=gen)),
               ("b", torch.randn(3, generator=gen)), ("ids", torch.arange(2)), ("c", torch.randn(1, generator=gen))]
    packer = BucketPacker(bucket_bytes=32, dtype="bfloat16", device=torch.device("cpu"))
    seen = []
    for bucket, last in packer.stream(tensors):
        # Flat: the bucket's bytes are its tensors' bytes back to back, floats cast to the wire dtype.
        assert bucket.nbytes == sum(m.nbytes for m in bucket.metas)
        seen.append(([m.name for m in bucket.metas], last, [(n, t.clone()) for n, t in bucket.tensors()]))
        bucket.release()
    assert [(names, last) for names, last, _ in seen] == [(["a"], False), (["big"], False),
                                                         (["b", "ids", "c"], True)]
    got = dict(t for _, _, ts in seen for t in ts)
    for name, sent in tensors:
        want = sent.to(torch.bfloat16) if sent.is_floating_point() else sent
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    # "ids" (int64) sits at byte 6 of its bucket: not aligned to 8, so it came back through a copy, bit-exact.
    assert packer.stats.peak_buffer_bytes <= 32 + 200  # a standard buffer and the oversize tensor's own


def test_packer_exhausts_its_source_when_the_consumer_stops_early() -> None:
    pulled = []

    def source() -> Any:
        for i in range(10):
            pulled.append(i)
            yield f"w{i}", torch.zeros(8)

    packer = BucketPacker(bucket_bytes=32, dtype=None, device=torch.device("cpu"))
    stream = packer.stream(source())
    first, _ = next(stream)
    first.release()
    stream.close()  # the push failed after its first bucket
    assert pulled == list(range(10))  # a trainer's exporter is a collective: every rank walks it to the end


# --------------------------------------------------------------------------------------------------------------------
# Validation before anything is sent
# --------------------------------------------------------------------------------------------------------------------


def test_announcement_checks() -> None:
    with pytest.raises(SyncError, match="must match"):
        check_announcement(["a", "b"], ["float32"], [[1], [2]])
    with pytest.raises(SyncError, match="more than once"):
        check_announcement(["a", "a"], ["float32", "float32"], [[1], [1]])
    with pytest.raises(SyncError, match="does not carry"):
        check_announcement(["a"], ["complex64"], [[1]])
    metas = check_announcement(["a"], ["bfloat16"], [[2, 3]])
    assert metas == [TensorMeta("a", "bfloat16", (2, 3))] and metas[0].nbytes == 12

    expected = {"w": TensorMeta("w", "float32", (4, 4)), "b": TensorMeta("b", "float32", (4,))}
    validate_metas([TensorMeta("w", "float32", (4, 4))], expected)
    with pytest.raises(SyncError) as err:
        validate_metas(
            [TensorMeta("w", "float32", (4, 5)), TensorMeta("zz", "float32", (1,)), TensorMeta("b", "float16", (4,))],
            expected,
        )
    message = str(err.value)
    assert "w: shape [4, 5] but the model has [4, 4]" in message
    assert "zz: not a parameter" in message and "b: dtype float16" in message
    validate_metas([TensorMeta("b", "float16", (4,))], expected, match_dtype=False)


@pytest.mark.parametrize(
    "case",
    ["shape_mismatch", "unknown_name", "bad_dtype", "duplicate", "empty"],
)
def test_pusher_rejects_before_any_announcement_or_broadcast(case: str) -> None:
    """The first bucket is packed while the engines pause, and no window opens before it is: a tensor it refuses
    fails the push before any begin or announcement, so no weight changed and generation continues at once."""
    group = init_weight_group("127.0.0.1", free_port(), 0, 1, "solo", timeout_s=10)
    engine = _RecordingEngine()
    expected = {"w": TensorMeta("w", "float32", (4, 4))}
    pusher = WeightPusher(group, [engine], PushOptions(expected=expected))
    tensors = {
        "shape_mismatch": [("w", torch.zeros(4, 5))],
        "unknown_name": [("w", torch.zeros(4, 4)), ("extra", torch.zeros(1))],
        "bad_dtype": [("w", torch.zeros(4, 4, dtype=torch.complex64))],
        "duplicate": [("w", torch.zeros(4, 4)), ("w", torch.zeros(4, 4))],
        "empty": [],
    }[case]
    with pytest.raises(SyncError):
        _run(pusher.push(tensors, weight_version=1))
    assert engine.calls == ["pause", "continue"]
    group.close()


def test_init_weight_group_rejects_bad_arguments() -> None:
    with pytest.raises(SyncError, match="backend"):
        init_weight_group("127.0.0.1", free_port(), 0, 1, "g", backend="mpi")
    with pytest.raises(SyncError, match="outside"):
        init_weight_group("127.0.0.1", free_port(), 2, 2, "g")


def test_broadcast_all_keeps_several_in_flight_and_every_tensor_arrives_in_order() -> None:
    """On gloo one broadcast at a time left the wire idle between them (16 MB ones moved at half the rate of one big
    broadcast); ``broadcast_all`` issues the next before the one before has finished, up to its window."""
    import threading

    port = free_port()
    groups: dict[int, Any] = {}
    joins = [threading.Thread(target=lambda r=r: groups.setdefault(r, init_weight_group(
        "127.0.0.1", port, r, 2, "window", timeout_s=30))) for r in (0, 1)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(30)
    sent = [torch.full((1 << 18,), float(i)) for i in range(10)]  # 1 MiB each, each its own value
    got = [torch.empty_like(t) for t in sent]
    events: list[str] = []
    groups[0]._impl = RecordingImpl(groups[0]._impl, events)
    try:
        receiving = threading.Thread(target=groups[1].broadcast_all, args=(got, 0))
        receiving.start()
        groups[0].broadcast_all(sent, 0, window=4)
        receiving.join(30)
    finally:
        for g in groups.values():
            g.close()
    assert all(torch.equal(a, b) for a, b in zip(got, sent))
    # Four in flight at once, never more: each broadcast is seen done (waited for, or found finished before the
    # next is issued) once.
    unfinished, most = 0, 0
    for event in events:
        unfinished += 1 if event.startswith("issue") else -1
        most = max(most, unfinished)
    assert most == 4, events
    assert events.count("done 9") == 1 and unfinished == 0


def test_every_member_of_a_gloo_weight_group_runs_sixteen_workers() -> None:
    """A gloo op holds a worker until its bytes are through: with torch's two, only two broadcasts overlap however
    many are in flight, and both ends need more (docs/weight-push.md, "Sixteen gloo workers"). Every member, the
    trainer's (which binds the store) and an engine's, is made by ``init_weight_group``."""
    import threading

    store = bind_weight_store(2, 30)
    groups: dict[int, Any] = {}
    joining = threading.Thread(target=lambda: groups.setdefault(1, init_weight_group(
        "127.0.0.1", int(store.port), 1, 2, "workers", timeout_s=30)))
    joining.start()
    groups[0] = init_weight_group("127.0.0.1", int(store.port), 0, 2, "workers", timeout_s=30, store=store)
    joining.join(30)
    try:
        assert [groups[r]._impl.options._threads for r in (0, 1)] == [GLOO_THREADS, GLOO_THREADS]
        assert GLOO_THREADS > 2 and BROADCAST_WINDOW >= GLOO_THREADS
        sent = torch.arange(1 << 16, dtype=torch.float32)
        got = torch.zeros_like(sent)
        receiving = threading.Thread(target=groups[1].broadcast, args=(got, 0))
        receiving.start()
        groups[0].broadcast(sent, 0)
        receiving.join(30)
        assert torch.equal(got, sent)  # and the group so made works
    finally:
        for g in groups.values():
            g.close()


# --------------------------------------------------------------------------------------------------------------------
# Real broadcasts between processes
# --------------------------------------------------------------------------------------------------------------------


def test_push_mixed_dtypes_to_two_receivers_is_bit_identical(tmp_path: Path) -> None:
    tensors = _mixed_tensors()
    engines = [_ReceiverEngine("receiver-a"), _ReceiverEngine("receiver-b")]

    async def scenario() -> Any:
        try:
            pusher = await WeightPusher.connect(
                engines, master_address="127.0.0.1", master_port=free_port(), group_name="mixed",
                timeout_s=60, options=PushOptions(bucket_bytes=20_000),
            )  # fmt: skip
            stats = await pusher.push(tensors, weight_version=7)
            for i, engine in enumerate(engines):
                await engine.dump(tmp_path / f"recv{i}.safetensors")
            await pusher.close()
            for engine in engines:
                assert engine.proc is not None and await asyncio.wait_for(engine.proc.wait(), 10) == 0
            return stats
        finally:
            for engine in engines:
                await engine.stop()

    stats = _run(scenario())
    from safetensors.torch import load_file

    assert stats.tensors == len(tensors) and stats.buckets > 2 and stats.weight_version == "7"
    assert [kw["rank_offset"] for _, kw in (e.calls[0] for e in engines)] == [1, 2]
    assert all(kw["world_size"] == 3 for _, kw in (e.calls[0] for e in engines))
    for i, engine in enumerate(engines):
        got = load_file(str(tmp_path / f"recv{i}.safetensors"))
        assert set(got) == {name for name, _ in tensors}
        for name, sent in tensors:
            assert got[name].dtype == sent.dtype and got[name].shape == sent.shape, name
            assert _bits(got[name]) == _bits(sent), name
        updates = [kw for op, kw in engine.calls if op == "update"]
        assert [n for kw in updates for n in kw["names"]] == [name for name, _ in tensors]
        # The version rides on the last bucket only; the cache is not flushed under requests paused in place.
        assert [kw["weight_version"] for kw in updates] == [None] * (len(updates) - 1) + ["7"]
        assert [kw["flush_cache"] for kw in updates] == [False] * len(updates)
        assert all(kw["abort_all_requests"] is False and kw["load_format"] == "flattened_bucket" for kw in updates)
        ops = [op for op, _ in engine.calls]
        assert ops[1:3] == ["pause", "begin"] and ops[-3:] == ["end", "continue", "destroy"]
        assert ops.count("update") == stats.buckets and engine.calls[1][1] == {"mode": "in_place"}


def test_push_casts_to_engine_dtype(tmp_path: Path) -> None:
    tensors = [("w", torch.randn(32, 32)), ("ids", torch.arange(10))]
    engine = _ReceiverEngine("receiver")

    async def scenario() -> None:
        try:
            pusher = await WeightPusher.connect(
                [engine], master_address="127.0.0.1", master_port=free_port(), group_name="cast", timeout_s=60,
                options=PushOptions(dtype="bfloat16"),
            )  # fmt: skip
            await pusher.push(tensors, weight_version="v1")
            await engine.dump(tmp_path / "recv.safetensors")
            pusher.group.close()
        finally:
            await engine.stop()

    _run(scenario())
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "recv.safetensors"))
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], tensors[0][1].to(torch.bfloat16))
    assert got["ids"].dtype == torch.int64 and torch.equal(got["ids"], tensors[1][1])


def test_refusing_engine_fails_the_push_with_its_name(tmp_path: Path) -> None:
    engine = _ReceiverEngine("stubborn-engine", refuse_updates=True)

    async def scenario() -> None:
        try:
            pusher = await WeightPusher.connect(
                [engine], master_address="127.0.0.1", master_port=free_port(), group_name="refuse", timeout_s=10
            )
            with pytest.raises(SyncError, match="stubborn-engine.*refused on purpose"):
                await pusher.push([("w", torch.ones(1000))], weight_version=2)
            # The update window was closed again but generation stays paused (the engine holds part of a push), and
            # the group may not be reused half-way through a bucket.
            assert [op for op, _ in engine.calls][-1] == "end" and "continue" not in [op for op, _ in engine.calls]
            with pytest.raises(SyncError, match="unusable"):
                pusher.group.broadcast(torch.ones(1000))
            calls = len(engine.calls)
            with pytest.raises(SyncError, match="unusable.*connect a new one"):
                await pusher.push([("w", torch.ones(1000))], weight_version=3)
            assert len(engine.calls) == calls  # refused before asking any engine
        finally:
            engine.proc.kill() if engine.proc and engine.proc.returncode is None else None
            if engine.proc:
                await engine.proc.wait()

    _run(scenario())


def test_gloo_throughput(tmp_path: Path) -> None:
    """Push 256 MiB of fp32 in the default 256 MiB CPU buckets and report MiB/s (no timing assertion here)."""
    gen = torch.Generator().manual_seed(0)
    tensors = [(f"layer.{i}.weight", torch.randn(4096, 2048, generator=gen)) for i in range(8)]
    engine = _ReceiverEngine("receiver")

    async def scenario() -> Any:
        try:
            pusher = await WeightPusher.connect(
                [engine], master_address="127.0.0.1", master_port=free_port(), group_name="speed", timeout_s=120
            )
            await pusher.push(tensors[:1], weight_version=0)  # warm the connections
            stats = await pusher.push(tensors, weight_version=1)
            await engine.dump(tmp_path / "recv.safetensors")
            pusher.group.close()
            return stats
        finally:
            await engine.stop()

    stats = _run(scenario())
    print(f"\ngloo weight push: {stats.bytes / 2**20:.0f} MiB in {stats.buckets} buckets, "
          f"{stats.seconds:.3f} s, {stats.mb_per_s:.0f} MiB/s")  # fmt: skip
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "recv.safetensors"))
    # Each 32 MiB tensor is fp32 on the wire, over 1 MiB: sent from its own memory. The first bucket closes at a
    # sixteenth of a bucket (16 MiB), so the first tensor goes alone; the other seven share one announcement.
    assert stats.buckets == 2 and stats.zero_copy_bytes == stats.bytes
    assert all(torch.equal(got[name], t) for name, t in tensors)


def test_meta_of_names_dtypes_like_sglang() -> None:
    assert meta_of("x", torch.zeros(2, 3, dtype=torch.bfloat16)) == TensorMeta("x", "bfloat16", (2, 3))
    with pytest.raises(SyncError):
        meta_of("x", torch.zeros(1, dtype=torch.complex64))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "receive":
    _receiver_main(sys.argv[2:])
