"""Weight snapshots for the held-out evaluator: ``RUN_DIR/snapshots/v{version:08d}/``, written by trainer rank 0.

A snapshot is a complete HF folder (``config.json``, the tokenizer files, ``model.safetensors``) that any engine can
load with ``/update_weights_from_disk``, so evaluation never needs the trainer's Megatron state and never touches the
rollout engines. Versions written: 0 (the starting weights: the model folder itself, hard-linked where the file
system allows, else copied), every ``every`` versions, and the final one, so the end of a run is always evaluated.

Atomic: a snapshot is assembled in ``v….tmp`` and renamed into place, so a reader sees a whole folder or none; a
crash leaves only a ``.tmp`` folder, which readers ignore and the next writer removes.

Pruning keeps the newest ``keep`` snapshots. With ``protect_unevaluated`` an older one is removed only once the
evaluator has put its mark in it (``evaluated.json``: evaluated, or skipped because a newer one was due), which costs
one ``stat`` per snapshot. So a stalled or dead evaluator makes snapshots pile up rather than silently lose
versions; switch the protection off (``eval.heldout.live = false``) to bound the disk instead.

The tensors are written in a background thread so the trainer does not wait for the disk; at most one write is in
flight (the next ``maybe_write`` waits for it), which bounds the extra memory to one copy of the weights. On GPU that
copy is the push's clones, held on the device until the thread has moved them to the host and written them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.errors import ConfigError
from pipeline.rundir import list_snapshots, snapshot_name, snapshots_dir

if TYPE_CHECKING:
    import torch

    from pipeline.config.eval import HeldoutConfig

log = logging.getLogger(__name__)

DONE_MARK = "evaluated.json"
META_FILE = "snapshot.json"
WEIGHTS_FILE = "model.safetensors"
_TMP = ".tmp"

Weights = Sequence[tuple[str, "torch.Tensor"]]


def mark_done(folder: str | Path, status: Literal["evaluated", "skipped"]) -> None:
    """Tell the writer it may prune this snapshot (written by the evaluator, atomically)."""
    path = Path(folder)
    tmp = path / f"{DONE_MARK}{_TMP}"
    try:
        tmp.write_text(json.dumps({"status": status, "time": time.time()}))
        tmp.replace(path / DONE_MARK)
    except FileNotFoundError:
        pass  # pruned meanwhile (protection off): nothing left to mark


def is_done(folder: str | Path) -> bool:
    """Whether the evaluator has marked the snapshot as evaluated or skipped."""
    return (Path(folder) / DONE_MARK).exists()


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class SnapshotWriter:
    """Writes snapshots at versions 0, every ``every``, and the final one, and prunes them to ``keep``."""

    def __init__(self, root: str | Path, model_dir: str | Path, *, every: int, keep: int,
                 protect_unevaluated: bool = True, background: bool = True) -> None:
        if every < 1 or keep < 1:
            raise ConfigError(f"snapshots need every >= 1 and keep >= 1, got every={every}, keep={keep} "
                              "(eval.heldout.every_versions, eval.heldout.keep_snapshots)")
        self.root = Path(root)
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ConfigError(f"{self.model_dir} has no config.json; snapshots copy the model folder's config and "
                              "tokenizer")
        self.every, self.keep, self.protect = every, keep, protect_unevaluated
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"v*{_TMP}"):
            shutil.rmtree(stale, ignore_errors=True)  # a write cut short by a crash
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot") if background else None
        self._pending: Future[Path] | None = None
        self.written: list[int] = []

    @classmethod
    def for_run(cls, run_dir: str | Path, model_dir: str | Path, held: HeldoutConfig, version: int) -> SnapshotWriter:
        """The trainer's writer for ``[eval.heldout]``; at version 0 it starts the snapshot of the starting weights."""
        writer = cls(snapshots_dir(run_dir), model_dir, every=held.every_versions, keep=held.keep_snapshots,
                     protect_unevaluated=held.live)
        if version == 0:
            writer.maybe_write(0)
        return writer

    def due(self, version: int, final: bool = False) -> bool:
        """Whether ``version`` gets a snapshot: version 0, every ``every``-th, and the final one."""
        return final or version % self.every == 0

    def maybe_write(self, version: int, weights: Weights | None = None, final: bool = False) -> bool:
        """Write the snapshot of ``version`` if it is due and not there yet; returns whether one was started.

        ``weights`` are the HF-named tensors (clones: they must not change while written); None means the model
        folder's own weights, which is right only for version 0 (nothing trained yet).
        """
        if not self.due(version, final):
            return False
        if weights is None and version != 0:
            raise ConfigError(f"snapshot v{version} needs the weights: only version 0 is the model folder itself")
        if (self.root / snapshot_name(version)).exists():
            return False
        self.flush()
        if self._pool is None:
            self._write(version, weights)
        else:
            self._pending = self._pool.submit(self._write, version, weights)
        return True

    def flush(self) -> None:
        """Wait for the write in flight, and raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish the write in flight (the final snapshot must land before the trainer exits)."""
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def _write(self, version: int, weights: Weights | None) -> Path:
        start = time.perf_counter()
        final = self.root / snapshot_name(version)
        tmp = final.with_name(final.name + _TMP)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if weights is None:
            for f in self.model_dir.iterdir():
                if f.is_file():
                    _link_or_copy(f, tmp / f.name)
        else:
            for f in self.model_dir.iterdir():
                # Only the config and tokenizer: the weights are the trainer's, in one file, with no shard index.
                if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                    shutil.copy2(f, tmp / f.name)
            _save(weights, tmp / WEIGHTS_FILE, version)
        (tmp / META_FILE).write_text(json.dumps({"version": version, "time": time.time(),
                                                 "source": "model" if weights is None else "trainer"}))
        tmp.rename(final)
        self.written.append(version)
        log.info("snapshot %s written in %.2fs", final.name, time.perf_counter() - start)
        self.prune()
        return final

    def prune(self) -> list[Path]:
        """Remove snapshots older than the newest ``keep`` (with protection, only those the evaluator marked)."""
        removed = []
        for _, folder in list_snapshots(self.root)[:-self.keep]:
            if not self.protect or is_done(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        return removed


def _save(weights: Weights, path: Path, version: int) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in weights:
        if name in tensors:
            raise ConfigError(f"snapshot v{version}: tensor {name!r} given twice")
        t = t.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory (tied weights exported twice): give each its own.
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    # "format": "pt" is what transformers checks before it loads a safetensors file.
    save_file(tensors, str(path), metadata={"format": "pt", "sluice_weight_version": str(version)})
