"""Typed configuration: one pydantic model per component, nested under ``SluiceConfig``, loaded from TOML.

Recipes are data (``recipes/*.toml``); ``--set a.b=v`` overrides any field. Everything is validated before anything
starts, and unknown keys are errors, so a typo in a recipe never silently falls back to a default.
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.consumers.evaluator import EvaluatorConfig
from pipeline.consumers.filters import FilterConfig
from pipeline.consumers.heldout import HeldoutConfig
from pipeline.consumers.sft_config import WarmStartConfig
from pipeline.consumers.staleness import StalenessConfig
from pipeline.consumers.train_config import TrainStepConfig
from pipeline.errors import ConfigError
from pipeline.producers.producer import ProducerConfig
from pipeline.producers.prompts import PromptConfig

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ArchiveConfig(_Strict):
    """The archive consumer: Parquet segments of every entry, for offline replay."""

    enabled: bool = True
    """Run an archiver (its group then holds entries until they are on disk)."""
    segment_samples: int = Field(4096, ge=1, le=10_000_000)
    """Samples per Parquet segment."""
    flush_interval_s: float = Field(30.0, gt=0)
    """Write a partial segment after this many seconds without filling one."""


class QueueConfig(_Strict):
    """The Redis-Streams sample queue."""

    redis_url: str | None = None
    """redis://, rediss:// (TLS) or unix:// URL of an external server; None starts an embedded one in the run folder."""
    appendfsync: Literal["always", "everysec"] = "everysec"
    """AOF fsync policy of the embedded server: 'always' survives a machine crash, 'everysec' a process crash."""
    capacity: int = Field(1024, ge=1)
    """Entries (prompt groups) the trainer may lag behind before producers block."""
    routing_codec: Literal["compact", "plain"] = "compact"
    """How producers write MoE routing: 'compact' (one lossless block per group, about a third of the bytes) or
    'plain' (a uint8/uint16 array per sample). Consumers read both."""
    put_timeout_s: float = Field(600.0, gt=0)
    """How long a producer waits for room before failing with QueueFullError."""
    claim_idle_ms: int = Field(60_000, ge=1000)
    """A pending entry idle this long belongs to a dead consumer and may be claimed."""
    archive: ArchiveConfig = ArchiveConfig()
    """The archive consumer."""


class RunConfig(_Strict):
    """Identity and location of a run."""

    name: str = Field("sluice", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name; namespaces every Redis key (sluice:{name}:...)."""
    run_dir: Path = Path("runs/sluice")
    """Folder for the embedded Redis, archive, checkpoints and logs."""
    seed: int = Field(0, ge=0)
    """Global seed."""


class ModelSource(_Strict):
    """The HF model both engines and trainer start from."""

    path: Path | None = None
    """An HF model folder (config.json, safetensors, tokenizer). None: a tiny model is written into the run folder."""
    init_tiny: Literal["qwen3", "qwen3-moe"] = "qwen3-moe"
    """With path unset: the architecture of the tiny model sluice writes (CPU recipes)."""
    init_overrides: dict[str, int | float | bool | str] = {}
    """HF config overrides for the tiny model (e.g. num_hidden_layers = 4)."""
    init_seed: int = Field(0, ge=0)
    """Seed of the tiny model's initial weights."""


class EngineConfig(_Strict):
    """Rollout engines."""

    type: Literal["cpu", "sglang"] = "cpu"
    """cpu: sluice starts its CPU engines; sglang: connect to SGLang servers at urls."""
    count: int = Field(1, ge=1, le=1024)
    """CPU engines to start."""
    urls: list[str] = []
    """Base URLs of running SGLang servers (type = sglang)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the CPU engine (bfloat16 reproduces the rollout/train mismatch R3 removes)."""
    max_batch: int = Field(32, ge=1, le=4096)
    """Sequences one CPU engine decodes together."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """How long to wait for an engine's /health."""


class TrainerConfig(TrainStepConfig):
    """The Megatron-core trainer: the train step's settings (lr, r3, micro-batching, loss, ...) plus the loop's."""

    steps: int = Field(20, ge=1)
    """Optimizer steps (one weight push each) to run."""
    batch_groups: int = Field(4, ge=1)
    """Prompt groups per step (the global batch; split across data-parallel ranks)."""
    world_size: int = Field(1, ge=1, le=4096)
    """Trainer ranks (torch.distributed processes)."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel size."""
    ep: int = Field(1, ge=1)
    """Expert-parallel size."""
    checkpoint_every: int = Field(5, ge=1)
    """Commit (checkpoint, ledger, acks) every this many steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    drain_block_ms: int = Field(1000, ge=1)
    """How long one queue read waits for entries."""
    overlap_push: bool = True
    """Push each step's weights in the background while the next batch is drained and trained (the version still
    advances only once every engine has them); false pushes before the next drain."""


class SyncConfig(_Strict):
    """Weight push from trainer to engines."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: NCCL on GPU, gloo on CPU."""
    bucket_mb: int | None = Field(None, ge=1, le=65536)
    """Bucket size; None: 64 MB on CPU, 512 MB on GPU."""
    master_port: int = Field(0, ge=0, le=65535)
    """Port of the trainer's weight-group store; 0: the trainer binds one the OS picks and tells the engines."""
    timeout_s: float = Field(300.0, gt=0)
    """Timeout of the weight group's collectives."""


class EvalConfig(EvaluatorConfig):
    """The evaluator consumer attached to the run (its fields, plus whether to run one)."""

    enabled: bool = True
    """Run an evaluator beside the trainer."""
    heldout: HeldoutConfig = HeldoutConfig()
    """Held-out evaluation by generation on weight snapshots (off by default)."""


class RoleResources(_Strict):
    """What Ray reserves for one process of a role; custom resources pin it to the nodes that offer them."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = {}
    """Custom Ray resources, e.g. {rollout = 1} for a node started with --resources='{"rollout": 8}'."""


class RayConfig(_Strict):
    """Where the run's processes go. Every process is a Ray actor's child; Ray places, sluice supervises."""

    address: str | None = None
    """An existing cluster ("auto", "HOST:PORT"); None starts a private Ray instance on this machine for the run.
    `sluice run --ray-address` sets it too."""
    dashboard: bool = False
    """Start the dashboard with the private instance (about 300 MB and a few seconds more); a cluster's own
    dashboard is printed whenever it has one."""
    trainer_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of the trainer ranks (and of nothing else)."""
    engine: RoleResources = RoleResources(num_cpus=1.0)
    producer: RoleResources = RoleResources(num_cpus=0.5)
    trainer: RoleResources = RoleResources(num_cpus=1.0)
    """Per trainer rank, and for the warm start."""
    evaluator: RoleResources = RoleResources(num_cpus=0.5)
    archiver: RoleResources = RoleResources(num_cpus=0.25)
    restart_limit: int = Field(5, ge=0)
    """Restarts a process (or the trainer group) may take within restart_window_s before the run gives up."""
    restart_window_s: float = Field(300.0, gt=0)
    """The window of restart_limit; a process that stayed up this long starts with a fresh budget and backoff."""
    startup_timeout_s: float = Field(180.0, gt=0)
    """How long a process may take to be placed and started (a node with its resources may have to join first)."""


class SluiceConfig(_Strict):
    """The root of a recipe."""

    run: RunConfig = RunConfig()
    """Identity and location of the run."""
    mode: Literal["async", "sync"] = "async"
    """async: producers generate ahead within staleness.max_lag while the trainer trains; sync: on-policy, the same
    code with staleness.max_lag = 0, so producers stop admitting once a step's groups are started and wait, idle,
    through the step and the weight push that follows it."""
    model: ModelSource = ModelSource()
    """The starting model."""
    engine: EngineConfig = EngineConfig()
    """Rollout engines."""
    producer: ProducerConfig = ProducerConfig()
    """Rollout producers."""
    producers: int = Field(1, ge=1, le=1024)
    """Producer processes."""
    prompts: PromptConfig = PromptConfig()
    """Prompt source."""
    staleness: StalenessConfig = StalenessConfig()
    """Staleness policy (also paces producers)."""
    filters: FilterConfig = FilterConfig()
    """Group filters: drop zero-reward-variance groups (DAPO dynamic sampling) or user-named ones."""
    trainer: TrainerConfig = TrainerConfig()
    """The trainer."""
    sync: SyncConfig = SyncConfig()
    """Weight push."""
    queue: QueueConfig = QueueConfig()
    """The sample queue."""
    eval: EvalConfig = EvalConfig()
    """Evaluation consumer."""
    warmstart: WarmStartConfig = WarmStartConfig()
    """Supervised warm start (SFT) before RL; `sluice sft` runs it alone."""
    ray: RayConfig = RayConfig()
    """Placement and supervision of the run's processes on Ray."""

    @model_validator(mode="before")
    @classmethod
    def _sync_is_on_policy(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("mode") != "sync":
            return data
        staleness = data.get("staleness")
        staleness = dict(staleness) if isinstance(staleness, dict) else {}
        lag = staleness.get("max_lag", 0)
        if lag != 0:
            log.warning("mode = 'sync' is on-policy: staleness.max_lag = %s is replaced by 0 (use mode = 'async' to "
                        "train off-policy)", lag)
        staleness["max_lag"] = 0
        return {**data, "staleness": staleness}

    @model_validator(mode="after")
    def _cross_checks(self) -> SluiceConfig:
        problems = []
        if self.engine.type == "sglang" and not self.engine.urls:
            problems.append("engine.type = 'sglang' needs engine.urls (base URLs of running SGLang servers)")
        if self.engine.type == "cpu" and self.engine.urls:
            problems.append("engine.urls is only read with engine.type = 'sglang'; remove it or switch the type")
        if self.trainer.r3 and not self.producer.return_routed_experts:
            problems.append("trainer.r3 replays routing the engines record; set producer.return_routed_experts = "
                            "true, or trainer.r3 = false")
        if self.producer.sampling.temperature == 0:
            problems.append("producer.sampling.temperature = 0 is greedy: every sample of a group is the same and "
                            "GRPO learns nothing; use a temperature > 0")
        if self.filters.zero_variance and self.producer.group_size == 1:
            problems.append("filters.zero_variance with producer.group_size = 1 drops every group (one reward has no "
                            "variance) and the trainer would wait forever; raise group_size or turn the filter off")
        dp = self.trainer.world_size // max(self.trainer.tp, 1)
        if self.trainer.world_size % self.trainer.tp:
            problems.append(f"trainer.world_size={self.trainer.world_size} is not divisible by tp={self.trainer.tp}")
        elif self.trainer.batch_groups % dp:
            problems.append(f"trainer.batch_groups={self.trainer.batch_groups} must be a multiple of the "
                            f"data-parallel size {dp}, so every rank gets the same number of groups")
        if self.ray.address is not None and self.queue.redis_url is None:
            problems.append("ray.address puts the run on a Ray cluster, but the embedded Redis listens on this "
                            "machine's loopback only; start a redis-server the nodes can reach and set "
                            "queue.redis_url")
        problems += self._heldout_problems()
        if self.warmstart.enabled and self.engine.type == "sglang":
            problems.append("warmstart.enabled with engine.type = 'sglang': SGLang servers serve the weights they were "
                            "started with, not the warm-started ones; run `sluice sft` first, start SGLang on "
                            "RUN_DIR/warmstart/model, and set model.path to it with warmstart.enabled = false")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _heldout_problems(self) -> list[str]:
        held = self.eval.heldout
        if not held.enabled:
            return []
        problems = []
        if not self.prompts.has_heldout:
            problems.append("eval.heldout.enabled = true needs a held-out split: set prompts.heldout (prompts set "
                            "aside, never trained on) or prompts.heldout_path (a separate file)")
        if held.engine_url is None and self.engine.type == "sglang":
            problems.append("eval.heldout with engine.type = 'sglang' needs eval.heldout.engine_url: an SGLang server "
                            "of its own (the rollout engines are never used for evaluation)")
        if held.engine_url is not None and held.engine_url in [u.rstrip("/") for u in self.engine.urls]:
            problems.append(f"eval.heldout.engine_url {held.engine_url} is one of engine.urls; loading snapshots into "
                            "a rollout engine would change the weights the run samples from; give it its own server")
        return problems


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word is a string


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=v`` overrides (v parsed as a TOML value, else a string) to a nested dict."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set queue.capacity=256")
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> SluiceConfig:
    """Load a recipe, apply overrides and validate; raises ConfigError listing every problem."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe {p} not found")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"recipe {p} is not valid TOML: {e}") from None
    apply_overrides(data, overrides or [])
    try:
        return SluiceConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ConfigError(f"invalid recipe{f' {path}' if path else ''}:\n" + "\n".join(lines)) from None


def dump_config(cfg: SluiceConfig) -> str:
    return json.dumps(cfg.model_dump(mode="json"), indent=2)
