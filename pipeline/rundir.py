"""The run folder's layout, in one place: where every file of a run lives, and the readers of its JSONL files.

The run folder (``RUN_DIR``) is the system's real interface: the launcher, every process of the run, ``sluice
status``/``plot``/``eval``/``export`` and any script read and write the same paths, so they are named here once::

    config.json               the resolved recipe (Redis URL redacted)       CONFIG_FILE, config_path
    run.json                  run name and Redis URL (pipeline.queue.rundir)  RUN_FILE, run_file_path
    plugins.json              the plug-ins' records                          PLUGINS_FILE, plugins_path
    engines.json              the engines' URLs, written by the launcher     ENGINES_FILE, engines_path
    model/                    the tiny model a run starts from by default    MODEL_DIR, base_model_dir
    metrics/trainer.jsonl     one line per trainer step                      trainer_metrics_path, trainer_rows
    metrics/producer-N.jsonl  one line per producer report                   producer_metrics_path(s)
    metrics/warmstart.jsonl   the warm start's lines                         warmstart_metrics_path
    eval/metrics.jsonl        stream evaluator ("eval") and held-out         eval_metrics_path, read_heldout
                              ("heldout") lines
    checkpoints/step-N        Megatron checkpoints (``.tmp`` while written)  checkpoint_path, run_checkpoints
    snapshots/vNNNNNNNN       HF weight snapshots for held-out evaluation    snapshot_path, list_snapshots
    ledger/                   the trainer's exactly-once ledger              ledger_dir
    logs/NAME.log             each process's log                             log_path, port_path
    logs/placements.jsonl     where Ray placed each process                  placements_path
    warmstart/model           the warm-started HF model                      warmstart_model_dir
    plots/ archive/ redis/ tensorboard/ wandb/ profiles/                     plots_dir, archive_dir, ...

Low on purpose: the standard library only at import time (the recipe schema, ``pipeline.config``, is imported when a
config is loaded), so any stage, the queue, an observer or a script may import it without torch, Redis, pydantic or
the queue.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.config import SluiceConfig
    from pipeline.config.model import ModelSource

log = logging.getLogger(__name__)

PathLike = str | Path

CONFIG_FILE = "config.json"
RUN_FILE = "run.json"
PLUGINS_FILE = "plugins.json"
ENGINES_FILE = "engines.json"
MODEL_DIR = "model"
METRICS_DIR = "metrics"
TRAINER_METRICS_FILE = "trainer.jsonl"
WARMSTART_METRICS_FILE = "warmstart.jsonl"
EVAL_DIR = "eval"
EVAL_GROUP = "eval"  # the stream evaluator's default consumer group, whose lines go to eval/metrics.jsonl
EVAL_METRICS_FILE = "metrics.jsonl"
HELDOUT_KIND = "heldout"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step-"
SNAPSHOTS_DIR = "snapshots"
LEDGER_DIR = "ledger"
LOGS_DIR = "logs"
PLACEMENTS_FILE = "placements.jsonl"
WARMSTART_DIR = "warmstart"
WARMSTART_DONE_FILE = "done.json"
PLOTS_DIR = "plots"
ARCHIVE_DIR = "archive"
REDIS_DIR = "redis"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
PROFILES_DIR = "profiles"
TMP_SUFFIX = ".tmp"  # a folder or file still being written; readers skip it


# ------------------------------------------------------------------------------------------------ top-level files
def config_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / CONFIG_FILE


def run_file_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / RUN_FILE


def plugins_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / PLUGINS_FILE


def engines_path(run_dir: PathLike) -> Path:
    """``engines.json``: the engines' URLs, whole or not at all (the launcher renames it into place)."""
    return Path(run_dir) / ENGINES_FILE


def base_model_dir(run_dir: PathLike) -> Path:
    """``model/``: the tiny model a run starts from when ``model.path`` is unset (and where a replay writes its
    model)."""
    return Path(run_dir) / MODEL_DIR


# -------------------------------------------------------------------------------------------------------- metrics
def metrics_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / METRICS_DIR


def trainer_metrics_path(run_dir: PathLike) -> Path:
    return metrics_dir(run_dir) / TRAINER_METRICS_FILE


def producer_metrics_path(run_dir: PathLike, name: str) -> Path:
    """``metrics/<name>.jsonl`` of the producer called ``name`` (``producer-0``)."""
    return metrics_dir(run_dir) / f"{name}.jsonl"


def producer_metrics_paths(run_dir: PathLike) -> list[Path]:
    """Every producer's metrics file present, sorted by name."""
    return sorted(metrics_dir(run_dir).glob("producer-*.jsonl"))


def warmstart_metrics_path(run_dir: PathLike) -> Path:
    """The warm start's metrics, one JSON line per ``log_every`` steps."""
    return metrics_dir(run_dir) / WARMSTART_METRICS_FILE


def eval_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / EVAL_DIR


def eval_metrics_path(run_dir: PathLike, group: str = EVAL_GROUP) -> Path:
    """``eval/metrics.jsonl`` for the default group, ``metrics-<group>.jsonl`` beside it for others."""
    name = EVAL_METRICS_FILE if group == EVAL_GROUP else f"metrics-{group}.jsonl"
    return eval_dir(run_dir) / name


def heldout_export_path(run_dir: PathLike, version: int) -> Path:
    """Where held-out evaluation converts a checkpoint of policy ``version`` to HF (removed once evaluated)."""
    return eval_dir(run_dir) / "checkpoint-hf" / snapshot_name(version)


# ----------------------------------------------------------------------------------------- checkpoints, snapshots
def checkpoints_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoint_name(step: int) -> str:
    """``step-00000042`` for step 42 (zero-padded so names sort by step)."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_path(run_dir: PathLike, step: int) -> Path:
    return checkpoints_dir(run_dir) / checkpoint_name(step)


def run_checkpoints(run_dir: PathLike) -> list[Path]:
    """The run's complete Megatron checkpoints (``checkpoints/step-N``), oldest first; ``.tmp`` folders are
    unfinished saves and are ignored."""
    root = checkpoints_dir(run_dir)
    return sorted(p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and not p.name.endswith(TMP_SUFFIX))


def latest_checkpoint(run_dir: PathLike) -> Path | None:
    """The run's newest complete checkpoint, or None."""
    done = run_checkpoints(run_dir)
    return done[-1] if done else None


def snapshots_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / SNAPSHOTS_DIR


def snapshot_name(version: int) -> str:
    """``v00000042`` for version 42 (zero-padded so names sort by version)."""
    return f"v{version:08d}"


def list_snapshots(root: PathLike) -> list[tuple[int, Path]]:
    """The complete snapshots under ``root`` (a run's ``snapshots/``) as (version, folder), oldest first; ``.tmp``
    folders are ignored."""
    out: list[tuple[int, Path]] = []
    base = Path(root)
    if not base.is_dir():
        return out
    for p in base.iterdir():
        name = p.name
        if p.is_dir() and name.startswith("v") and name[1:].isdigit():
            out.append((int(name[1:]), p))
    return sorted(out)


def ledger_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / LEDGER_DIR


# ----------------------------------------------------------------------------------------------------------- logs
def logs_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / LOGS_DIR


def log_path(run_dir: PathLike, name: str) -> Path:
    """``logs/<name>.log``: the log of the process called ``name`` (``trainer-0``, ``heldout-engine``)."""
    return logs_dir(run_dir) / f"{name}.log"


def port_path(run_dir: PathLike, name: str) -> Path:
    """``logs/.<name>.port``: where the process ``name`` writes the port it bound."""
    return logs_dir(run_dir) / f".{name}.port"


def placements_path(run_dir: PathLike) -> Path:
    return logs_dir(run_dir) / PLACEMENTS_FILE


# --------------------------------------------------------------------------------------------------- warm start
def warmstart_dir(run_dir: PathLike) -> Path:
    """Where a run's warm start writes its checkpoint, HF model and done marker."""
    return Path(run_dir) / WARMSTART_DIR


def warmstart_model_dir(run_dir: PathLike) -> Path:
    """The warm-started HF model folder (with tokenizer) that engines and trainer start from."""
    return warmstart_dir(run_dir) / MODEL_DIR


def warmstart_done_path(run_dir: PathLike) -> Path:
    """The warm start's done marker, written last."""
    return warmstart_dir(run_dir) / WARMSTART_DONE_FILE


# ------------------------------------------------------------------------------------------------- other folders
def plots_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / PLOTS_DIR


def archive_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / ARCHIVE_DIR


def redis_dir(run_dir: PathLike) -> Path:
    """The embedded Redis's folder (AOF, socket, ``redis.json`` state)."""
    return Path(run_dir) / REDIS_DIR


def tensorboard_dir(run_dir: PathLike, process: str) -> Path:
    return Path(run_dir) / TENSORBOARD_DIR / process


def wandb_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / WANDB_DIR


def profiles_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / PROFILES_DIR


# -------------------------------------------------------------------------------------------------- the recipe
def base_model_folder(cfg: SluiceConfig) -> Path:
    """The HF model a run starts from before any warm start: model.path, else the tiny model in the run folder."""
    return base_model_source_dir(cfg.run.run_dir, cfg.model)


def base_model_source_dir(run_dir: PathLike, model: ModelSource) -> Path:
    """``model.path``, else the run folder's ``model/`` (for callers holding only the ``[model]`` section)."""
    return Path(model.path) if model.path is not None else base_model_dir(run_dir)


def model_folder(cfg: SluiceConfig) -> Path:
    """The HF model engines, producers' tokenizer and trainer (and its KL reference) start from: the warm-started
    one when warmstart.enabled, else the base model."""
    if cfg.warmstart.enabled:
        return warmstart_model_dir(cfg.run.run_dir)
    return base_model_folder(cfg)


UrlResolver = Callable[[Path, str | None], str | None]


def load_run_config(run_dir: PathLike, resolve_url: UrlResolver | None = None) -> SluiceConfig:
    """The run's resolved config (``config.json``).

    Its Redis URL is stored redacted when it holds a password. Processes that open the queue pass
    ``pipeline.queue.credentials.resolve_url`` as ``resolve_url`` to get the real one back; without it the URL stays
    as stored (enough for everything that does not connect to Redis). Taken as an argument so this module imports no
    queue code.
    """
    from pipeline.config import SluiceConfig

    cfg = SluiceConfig.model_validate(json.loads(config_path(run_dir).read_text()))
    if resolve_url is not None:
        url = resolve_url(Path(run_dir), cfg.queue.redis_url)
        if url != cfg.queue.redis_url:
            cfg.queue.redis_url = url
    return cfg


# ------------------------------------------------------------------------------------------------ JSONL readers
def read_jsonl(path: PathLike) -> list[dict[str, Any]]:
    """The lines of a metrics file; a line cut short by a writer killed mid-write (the last one) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def trainer_rows(metrics_path: PathLike) -> list[dict[str, Any]]:
    """The trainer's lines (``metrics/trainer.jsonl``) by step, oldest first; a step redone after a restart: the
    last line counts."""
    rows = {int(d["step"]): d for d in read_jsonl(metrics_path) if "step" in d}
    return [rows[s] for s in sorted(rows)]


def read_heldout(path: PathLike) -> dict[int, dict[str, Any]]:
    """The held-out lines (``"kind": "heldout"``) of an eval metrics file by version, in version order (the last
    line of a version wins); the stream evaluator's lines in the same file are passed over."""
    out: dict[int, dict[str, Any]] = {}
    p = Path(path)
    if not p.is_file():
        return out
    for n, raw in enumerate(p.read_text().splitlines()):
        if f'"{HELDOUT_KIND}"' not in raw:  # cheap: most lines are the stream evaluator's
            continue
        try:
            d = json.loads(raw)
        except json.JSONDecodeError:
            log.warning("%s:%d is not a complete JSON line (a write cut short?); ignored", p, n + 1)
            continue
        if isinstance(d, dict) and d.get("kind") == HELDOUT_KIND and isinstance(d.get("version"), int):
            out[d["version"]] = d
    return dict(sorted(out.items()))
