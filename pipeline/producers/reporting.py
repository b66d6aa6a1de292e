"""A producer's metrics: every ``metrics.producer_every_s`` one line of its counters and throughput.

``RUN_DIR/metrics/<producer>.jsonl``, mirrored into ``RUN_DIR/tensorboard/<producer>/``. The counters of
``ProducerStats`` live in memory and start again at 0 when the launcher restarts a producer, so each line also has
``samples_total``/``groups_total``, carried over from the file's last line: the TensorBoard step is
``samples_total``, which only grows, across restarts too.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.config.metrics import MetricsConfig
from pipeline.metrics import open_sinks
from pipeline.producers.producer import Producer
from pipeline.rundir import producer_metrics_path


def _last_line(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    lines = path.read_text().splitlines()
    return json.loads(lines[-1]) if lines and lines[-1].strip() else {}


def _clients(engine: Any) -> list[Any]:
    """The engine clients behind a producer's engine (a pool of them, or one)."""
    return list(getattr(engine, "clients", [engine]))


class ProducerReporter:
    """Appends the producer's lines; ``report`` takes one, ``run`` takes one every ``producer_every_s``."""

    def __init__(self, producer: Producer, run_dir: Path, cfg: MetricsConfig, run_name: str = "sluice") -> None:
        self.producer = producer
        self.path = producer_metrics_path(run_dir, producer.name)
        self.every_s = cfg.producer_every_s
        before = _last_line(self.path)
        self._base_samples = int(before.get("samples_total", 0))
        self._base_groups = int(before.get("groups_total", 0))
        self._last = (time.monotonic(), 0)
        self.sinks = open_sinks(Path(run_dir), producer.name, cfg, run_name)

    def report(self) -> dict[str, Any]:
        stats = self.producer.stats
        now = time.monotonic()
        since, samples_then = self._last
        self._last = (now, stats.samples_put)
        row = {"time": time.time(), "producer": self.producer.name, **asdict(stats),
               # The scorer's counters (retries, timeouts, errors): a failing reward shows here, not just in logs.
               **{f"reward_{k}": v for k, v in asdict(self.producer.scorer.stats).items()},
               "samples_total": self._base_samples + stats.samples_put,
               "groups_total": self._base_groups + stats.groups_put,
               "samples_per_s": (stats.samples_put - samples_then) / max(now - since, 1e-9),
               # Requests sent again because a push overtook their prefix-cache key (SGLangClient.key_retries).
               "engine_key_retries": sum(getattr(c, "key_retries", 0) for c in _clients(self.producer.engine)),
               "policy_version": self.producer.queue.policy_version()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.sinks.add(row, row["samples_total"])
        return row

    async def run(self, stop: asyncio.Event) -> None:
        """Report every ``every_s`` until ``stop``, then once more (the last counts of this life)."""
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), self.every_s)
                except TimeoutError:
                    await asyncio.to_thread(self.report)
            await asyncio.to_thread(self.report)
        finally:
            self.sinks.close()
