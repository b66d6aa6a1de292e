"""The streamed push holds about two buckets on rank 0, whatever the model's size; packing the whole model first (what
the trainer did before, gathering and cloning every weight) holds the model.

Rank 0 is this test process: its weights are loaded before the measurement (they stand for the trainer's live
parameters), then the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``) and read after the push. The
receiver is a real CPU engine serving a Qwen3 of the same shape, which loads every bucket.

Each measurement runs in a fresh process: in one process the allocator hands a later measurement pages an earlier one
freed but kept resident, and the packed reference then grew the RSS by 60 MB for a 160 MB model (CI, stop 18)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from pipeline.models.tiny import init_tiny_model
from pipeline.producers.sglang_client import NO_RETRY, SGLangClient
from pipeline.sync.pusher import PushOptions, WeightPusher
from tests.helpers.engines import start_engine

pytestmark = pytest.mark.slow
MB = 1 << 20
BUCKET = 8 * MB
SHAPE = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
         "intermediate_size": 2048}  # 16 MB of fp32 per layer, the largest tensor 4 MB


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _push_peak(model_dir: Path, tmp_path: Path, snapshot: bool) -> dict[str, int]:
    """One measurement in a child process of its own (this file run as a script)."""
    # Its own session: a timeout kills it and the engine it started together.
    proc = subprocess.Popen([sys.executable, __file__, str(model_dir), str(tmp_path), str(int(snapshot))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _measure(model_dir: Path, tmp_path: Path, snapshot: bool) -> dict[str, int]:
    # Cloned out of safetensors' file mapping: resident now, as a trainer's parameters are (a mapped file's pages would
    # be counted only as the push first reads them).
    weights = [(name, t.clone()) for name, t in sorted(load_file(str(model_dir / "model.safetensors")).items())]
    engine = start_engine(model_dir, tmp_path)

    async def push() -> Any:
        client = SGLangClient(engine.url, retry=NO_RETRY)
        pusher = await WeightPusher.connect([client], master_address="127.0.0.1", backend="gloo", timeout_s=120,
                                            options=PushOptions(bucket_bytes=BUCKET))
        try:
            await pusher.push(weights[:1], 1)  # warm up connections and buffers outside the measurement
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
            before = _status("VmRSS")
            stats = await pusher.push(pusher.pack(weights) if snapshot else weights, 2)
            return _status("VmHWM") - before, stats
        finally:
            await pusher.close()
            await client.close()

    try:
        extra, stats = asyncio.run(push())
    finally:
        engine.stop()
    return {"extra": extra, "peak_buffer_bytes": stats.peak_buffer_bytes, "buckets": stats.buckets,
            "size": sum(t.numel() * t.element_size() for _, t in weights)}


def test_the_streamed_push_peak_stays_at_about_two_buckets_as_the_model_grows(tmp_path: Path) -> None:
    small = init_tiny_model("qwen3", tmp_path / "small", num_hidden_layers=2, **SHAPE)
    large = init_tiny_model("qwen3", tmp_path / "large", num_hidden_layers=10, **SHAPE)
    runs = {(name, snap): _push_peak(folder, tmp_path, snap)
            for name, folder in (("small", small), ("large", large)) for snap in (False, True)}
    for (name, snap), m in runs.items():
        print(f"{name} model {m['size'] / MB:.0f} MB, {'snapshot' if snap else 'streamed'}: peak extra RSS "
              f"{m['extra'] / MB:.1f} MB, bucket buffers {m['peak_buffer_bytes'] / MB:.1f} MB, {m['buckets']} buckets")
    small_run, large_run = runs[("small", False)], runs[("large", False)]
    s_extra, l_extra, s_size, l_size = small_run["extra"], large_run["extra"], small_run["size"], large_run["size"]
    assert l_size - s_size > 100 * MB
    # Streamed: two bucket buffers, never more, whatever the model; the process's peak follows.
    assert small_run["peak_buffer_bytes"] <= 2 * BUCKET and large_run["peak_buffer_bytes"] <= 2 * BUCKET
    assert l_extra < 2 * BUCKET + 8 * MB, l_extra
    assert l_extra - s_extra < BUCKET, (s_extra, l_extra)
    # The reference in the same run: the whole model packed first grows with it.
    snap_small, snap_large = runs[("small", True)]["extra"], runs[("large", True)]["extra"]
    assert snap_large - snap_small > 0.8 * (l_size - s_size), (snap_small, snap_large)


if __name__ == "__main__":
    print(json.dumps(_measure(Path(sys.argv[1]), Path(sys.argv[2]), bool(int(sys.argv[3])))))
