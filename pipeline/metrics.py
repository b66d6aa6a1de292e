"""Metrics for the tools people already use: TensorBoard event files beside the JSONL, and Weights & Biases on demand.

The JSONL files stay the record (``metrics/trainer.jsonl``, ``eval/metrics.jsonl``, ``metrics/producer-N.jsonl``):
everything sluice itself reads (the live view, the plots, ``sluice status``) reads them. Each process also mirrors
its numeric values into ``RUN_DIR/tensorboard/<process>/`` so that ``tensorboard --logdir RUN_DIR/tensorboard``
shows the trainer, the evaluator and every producer as runs side by side.

TensorBoard's own ``tensorboard.summary.Writer`` writes the files: it needs numpy only, so producers and the
evaluator, which never import torch, do not start importing it for this. A value's TensorBoard tag is its JSONL key
(``reward_mean``, ``time/drain_s``); a nested dict becomes ``key/subkey`` (``pass_at_k/4``).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from pipeline.config.metrics import MetricsConfig
from pipeline.errors import ConfigError
from pipeline.rundir import tensorboard_dir, wandb_dir

log = logging.getLogger(__name__)

# Bookkeeping that is no curve: the step (an evaluator's version) is the x axis, the time every event's wall time.
_SKIP = frozenset({"step", "time", "version"})


class ScalarSink(Protocol):
    """Somewhere numeric values go, keyed by a step."""

    def add(self, row: Mapping[str, Any], step: int, prefix: str = "") -> None: ...

    def close(self) -> None: ...


def scalars(row: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The numeric values of a metrics line as (tag, value); nested dicts flatten to ``key/subkey``."""
    return _flatten({k: v for k, v in row.items() if k not in _SKIP}, prefix)


def _flatten(row: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, float]]:
    for key, value in row.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{tag}/")
        elif isinstance(value, bool):
            yield tag, float(value)
        elif isinstance(value, int | float) and math.isfinite(value):
            yield tag, float(value)


class TensorBoardSink:
    """One event-file writer in ``folder``. Not thread-safe: one per thread that writes."""

    def __init__(self, folder: Path, flush_every_s: float = 5.0) -> None:
        from tensorboard.summary import Writer

        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._writer = Writer(str(folder))
        self._flush_every_s = flush_every_s
        self._flushed = time.monotonic()

    def add(self, row: Mapping[str, Any], step: int, prefix: str = "") -> None:
        wall = float(row.get("time", time.time()))
        for tag, value in scalars(row, prefix):
            self._writer.add_scalar(tag, value, step, wall_time=wall)
        # Flushed every few seconds, not every line: a live TensorBoard sees a step within that, at a fraction
        # of the writes.
        if time.monotonic() - self._flushed > self._flush_every_s:
            self._writer.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run for one process of the sluice run."""

    def __init__(self, run_dir: Path, run_name: str, process: str, cfg: MetricsConfig) -> None:
        import wandb

        folder = wandb_dir(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=cfg.wandb_project, group=run_name, name=f"{run_name}/{process}",
                               dir=str(folder), mode=cfg.wandb_mode)

    def add(self, row: Mapping[str, Any], step: int, prefix: str = "") -> None:
        self._run.log(dict(scalars(row, prefix)), step=step)

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """Every sink of one process, written together."""

    def __init__(self, sinks: list[ScalarSink]) -> None:
        self.sinks = sinks

    def add(self, row: Mapping[str, Any], step: int, prefix: str = "") -> None:
        for sink in self.sinks:
            sink.add(row, step, prefix)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def check_metrics_config(cfg: MetricsConfig) -> None:
    """Fail before anything starts when the recipe asks for a tool that is not installed."""
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.wandb = true but wandb is not installed here; `pip install wandb`, or set "
                          "metrics.wandb = false (TensorBoard files are written either way)")
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("metrics.tensorboard = true but the tensorboard package is not installed; "
                          "`pip install tensorboard` (sluice depends on it), or set metrics.tensorboard = false")


def open_sinks(run_dir: Path, process: str, cfg: MetricsConfig, run_name: str = "sluice") -> Sinks:
    """The sinks of ``process`` (``trainer``, ``evaluator``, ``producer-0``) in a run folder, as the recipe asks."""
    check_metrics_config(cfg)
    sinks: list[ScalarSink] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(tensorboard_dir(run_dir, process)))
    if cfg.wandb:
        sinks.append(WandbSink(Path(run_dir), run_name, process, cfg))
    return Sinks(sinks)
