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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline import plugins
from pipeline.consumers.evaluator import EvaluatorConfig
from pipeline.consumers.filters import FilterConfig
from pipeline.consumers.heldout import HeldoutConfig
from pipeline.consumers.hooks import HooksConfig
from pipeline.consumers.megatron.plan import HardwareConfig
from pipeline.consumers.sft_config import WarmStartConfig
from pipeline.consumers.staleness import StalenessConfig
from pipeline.consumers.train_config import TrainStepConfig
from pipeline.errors import ConfigError
from pipeline.metrics import MetricsConfig
from pipeline.plugins import Signature
from pipeline.producers.producer import ProducerConfig
from pipeline.producers.prompts import SYNTHETIC_TASKS, PromptConfig

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
    durability: Literal["standard", "safe"] = "standard"
    """'safe': no acknowledged write is ever lost, even in a machine crash (the embedded server fsyncs its AOF
    before each reply: appendfsync = 'always'; an external server is checked for it at start). 'standard': the
    appendfsync below (docs/faults.md says what each promises)."""
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

    @model_validator(mode="before")
    @classmethod
    def _safe_means_always(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("durability") != "safe":
            return data
        if data.get("appendfsync", "always") != "always":
            raise ValueError(f"queue.durability = 'safe' fsyncs every write (appendfsync = 'always'), but "
                             f"queue.appendfsync = {data['appendfsync']!r}; drop one of the two")
        return {**data, "appendfsync": "always"}

    @field_validator("redis_url")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        # The message names the scheme only: pydantic's own errors would echo the whole URL, password included.
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            scheme = url.split(":", 1)[0] if ":" in url else "(none)"
            raise ValueError(f"scheme {scheme!r} is not a Redis URL scheme; use redis://, rediss:// (TLS) or unix://")
        return url


class PluginsConfig(_Strict):
    """Where user code comes from (``pipeline.plugins``; docs/plugins.md)."""

    paths: list[Path] = []
    """Folders user modules are imported from, relative to the working directory (made absolute when the recipe
    loads). A plug-in whose module lies anywhere else, installed packages aside, is refused."""

    @field_validator("paths")
    @classmethod
    def _folders(cls, paths: list[Path]) -> list[Path]:
        missing = [str(p) for p in paths if not Path(p).is_dir()]
        if missing:
            raise ValueError(f"{', '.join(missing)}: not a folder; plugins.paths lists folders holding user modules")
        return [Path(p).resolve() for p in paths]


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
    init_tiny: Literal["qwen3", "qwen3-moe", "deepseek-v3"] = "qwen3-moe"
    """With path unset: the architecture of the tiny model sluice writes (CPU recipes; pipeline.models.families)."""
    init_overrides: dict[str, int | float | bool | str] = {}
    """HF config overrides for the tiny model (e.g. num_hidden_layers = 4)."""
    init_seed: int = Field(0, ge=0)
    """Seed of the tiny model's initial weights."""
    spec: str | None = None
    """``package.module:function`` returning the megatron-core layer spec with user modules swapped in; called with a
    ``pipeline.models.spec.SpecContext`` at every model build (docs/plugins.md, model specs). None: the family's."""
    engine_patch: str | None = None
    """``package.module:function`` called with the CPU engines' transformers model as it loads, giving it the modules
    model.spec adds (and their weights, by their HF names); needed when the spec adds weights and engine.type = cpu."""


class EngineConfig(_Strict):
    """Rollout engines."""

    type: Literal["cpu", "sglang"] = "cpu"
    """cpu: sluice starts its CPU engines; sglang: SGLang servers, at urls or started by sluice (launch)."""
    count: int = Field(1, ge=1, le=1024)
    """Engines to start (CPU engines, or SGLang servers with launch = true)."""
    urls: list[str] = []
    """Base URLs of running SGLang servers (type = sglang, launch = false)."""
    launch: bool = False
    """type = sglang: sluice starts `count` SGLang servers itself, each a supervised Ray process with
    ray.engine's resources (GPUs), serving the run's model folder (the warm start's output when there is one)."""
    launch_module: str = Field("sglang.launch_server", pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")
    """The server's Python module, run as `python -m MODULE --host H --port P --model-path M --weight-version 0
    [--enable-return-routed-experts] LAUNCH_ARGS`; any server with SGLang's command line and protocol may stand in."""
    launch_args: list[str] = []
    """Further server flags, e.g. ["--tp-size", "8", "--mem-fraction-static", "0.7"]."""
    python: str | None = None
    """launch = true: the interpreter that runs the server (`PYTHON -m launch_module ...`): a path, or a command on the
    engine node's PATH, e.g. the python of the virtual environment SGLang is installed in (SGLang pins its own torch
    and kernels, so it usually lives apart from sluice). None: sluice's own interpreter."""
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
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size. Only 1 runs: sluice's train step calls the model directly instead of driving
    megatron's pipeline schedules, so every rank holds every layer (larger models spread over ep and tp)."""
    checkpoint_every: int = Field(5, ge=1)
    """Commit (checkpoint, ledger, acks) every this many steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    drain_block_ms: int = Field(1000, ge=1)
    """How long one queue read waits for entries."""
    overlap_push: bool = True
    """Push each step's weights in the background while the next batch is drained and trained (the version still
    advances only once every engine has them); false pushes before the next drain."""
    profile_steps: tuple[int, int] | None = None
    """[a, b]: run torch.profiler over trainer steps a..b (inclusive) and write a Chrome/Perfetto trace per rank to
    RUN_DIR/profiles/ (open it at ui.perfetto.dev); None profiles nothing."""

    @model_validator(mode="after")
    def _profile_window(self) -> TrainerConfig:
        if self.profile_steps is not None:
            first, last = self.profile_steps
            if not 1 <= first <= last:
                raise ValueError(f"trainer.profile_steps = [{first}, {last}]: give [a, b] with 1 <= a <= b (trainer "
                                 "steps count from 1), e.g. [10, 12]")
        return self


class SyncConfig(_Strict):
    """Weight push from trainer to engines."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: NCCL on GPU, gloo on CPU."""
    bucket_mb: int | None = Field(None, ge=1, le=65536)
    """Bucket size; None: 256 MB on CPU, 512 MB on GPU."""
    master_port: int = Field(0, ge=0, le=65535)
    """Port of the trainer's weight-group store; 0: the trainer binds one the OS picks and tells the engines."""
    timeout_s: float = Field(300.0, gt=0)
    """Timeout of the weight group's collectives."""
    stall_timeout_s: float = Field(120.0, gt=0)
    """The longest a push may keep generation paused: one not done by then is abandoned (its update windows closed,
    generation continued if no weight had changed yet) and made again on a rebuilt group. Keep it under SGLang's
    --watchdog-timeout (300 s by default), which kills a server whose scheduler stayed paused that long, and above
    the time a whole push takes (big models on GPU: raise both)."""
    wire: Literal["flat", "tensors"] = "flat"
    """flat: one broadcast per bucket (SGLang's load_format "flattened_bucket"); tensors: one per tensor."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype the weights travel in. auto: the engines' own (their /model_info or /get_server_info, else the model's
    config.json), so an fp32 trainer sends a bf16 engine half the bytes; the engine casts on load either way."""


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
    metrics: MetricsConfig = MetricsConfig()
    """TensorBoard files (on by default) and Weights & Biases (when asked for) beside the JSONL metrics."""
    hardware: HardwareConfig = HardwareConfig()
    """What a GPU recipe expects to run on; `--dry-run` plans one trainer rank's memory against it."""
    plugins: PluginsConfig = PluginsConfig()
    """Where user modules (rewards, rollouts, losses, filters, hooks, model specs) are imported from."""
    hooks: HooksConfig = HooksConfig()
    """User functions the trainer calls with each step's metrics, after each step and after each commit."""

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
        if self.engine.type == "sglang" and not self.engine.urls and not self.engine.launch:
            problems.append("engine.type = 'sglang' needs engine.urls (base URLs of running SGLang servers), or "
                            "engine.launch = true for sluice to start them")
        if self.engine.launch and self.engine.urls:
            problems.append("engine.launch = true starts the servers, engine.urls names running ones; give one")
        if self.engine.type == "cpu" and self.engine.urls:
            problems.append("engine.urls is only read with engine.type = 'sglang'; remove it or switch the type")
        if self.engine.type == "cpu" and self.engine.launch:
            problems.append("engine.launch is for engine.type = 'sglang' (CPU engines are always started by sluice)")
        if self.engine.python is not None and not self.engine.launch:
            problems.append("engine.python names the interpreter of servers sluice starts (engine.launch = true); "
                            "remove it, or set engine.launch = true")
        if self.trainer.r3 and not self.producer.return_routed_experts:
            problems.append("trainer.r3 replays routing the engines record; set producer.return_routed_experts = "
                            "true, or trainer.r3 = false")
        if self.producer.sampling.temperature == 0:
            problems.append("producer.sampling.temperature = 0 is greedy: every sample of a group is the same and "
                            "GRPO learns nothing; use a temperature > 0")
        if self.filters.zero_variance and self.producer.group_size == 1:
            problems.append("filters.zero_variance with producer.group_size = 1 drops every group (one reward has no "
                            "variance) and the trainer would wait forever; raise group_size or turn the filter off")
        if self.trainer.pp > 1:
            problems.append(f"trainer.pp={self.trainer.pp}: pipeline parallelism is refused, because sluice's train "
                            "step runs each micro-batch's forward and backward itself rather than megatron's "
                            "pipeline schedules, which PP needs; spread the model with trainer.ep and trainer.tp")
        dp = self.trainer.world_size // max(self.trainer.tp, 1)
        if self.trainer.world_size % self.trainer.tp:
            problems.append(f"trainer.world_size={self.trainer.world_size} is not divisible by tp={self.trainer.tp}")
        elif self.trainer.batch_groups % dp:
            problems.append(f"trainer.batch_groups={self.trainer.batch_groups} must be a multiple of the "
                            f"data-parallel size {dp}, so every rank gets the same number of groups")
        if self.trainer.world_size % self.trainer.ep:
            # Checked here rather than when the trainer builds its model: by then the run has started every process.
            problems.append(f"trainer.ep={self.trainer.ep} must divide trainer.world_size={self.trainer.world_size} "
                            "(expert-parallel ranks are drawn from the trainer's ranks)")
        problems += self._prompt_problems()
        if self.ray.address is not None and self.queue.redis_url is None:
            problems.append("ray.address puts the run on a Ray cluster, but the embedded Redis listens on this "
                            "machine's loopback only; start a redis-server the nodes can reach and set "
                            "queue.redis_url")
        problems += self._heldout_problems()
        problems += self._plugin_problems()
        if self.warmstart.enabled and self.engine.type == "sglang" and not self.engine.launch:
            problems.append("warmstart.enabled with engine.type = 'sglang': SGLang servers serve the weights they were "
                            "started with, not the warm-started ones; run `sluice sft` first, start SGLang on "
                            "RUN_DIR/warmstart/model, and set model.path to it with warmstart.enabled = false (or "
                            "let sluice start them after the warm start: engine.launch = true)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _prompt_problems(self) -> list[str]:
        """Sizes a synthetic task cannot meet, found before anything starts rather than by a producer that crashes
        at start-up until its restart budget runs out."""
        p = self.prompts
        if p.type != "synthetic":
            return []
        task = SYNTHETIC_TASKS.get(p.task)
        if task is None:
            return [f"prompts.task = {p.task!r} is not a synthetic task; choose one of {sorted(SYNTHETIC_TASKS)}"]
        if p.size + p.heldout <= task.space(p.digits):
            return []
        return [f"prompts.size + prompts.heldout = {p.size + p.heldout} is more than the {task.space(p.digits)} "
                f"distinct prompts of synthetic task {p.task!r} with digits={p.digits}; lower them or raise "
                "prompts.digits"]

    def plugin_refs(self) -> list[tuple[str, str, Signature]]:
        """Every user plug-in the recipe names: (field, import path, the call sluice makes)."""
        from pipeline.consumers.filters import FILTER_SIGNATURE
        from pipeline.models.spec import ENGINE_PATCH_SIGNATURE, SPEC_SIGNATURE
        from pipeline.producers.rewards import BUILTIN_REWARDS, GROUP_REWARD_SIGNATURE, REWARD_SIGNATURE
        from pipeline.producers.rollout import BUILTIN_ROLLOUT, ROLLOUT_SIGNATURE

        refs: list[tuple[str, str, Signature]] = []
        if self.producer.reward not in BUILTIN_REWARDS:
            refs.append(("producer.reward", self.producer.reward, REWARD_SIGNATURE))
        if self.producer.group_reward is not None:
            refs.append(("producer.group_reward", self.producer.group_reward, GROUP_REWARD_SIGNATURE))
        if self.producer.rollout != BUILTIN_ROLLOUT:
            refs.append(("producer.rollout", self.producer.rollout, ROLLOUT_SIGNATURE))
        refs += [(f"filters.user[{i}]", ref, FILTER_SIGNATURE) for i, ref in enumerate(self.filters.user)]
        refs += self.hooks.refs()
        refs += self.trainer.loss.plugin_refs("trainer.loss")
        if self.model.spec is not None:
            refs.append(("model.spec", self.model.spec, SPEC_SIGNATURE))
        if self.model.engine_patch is not None:
            refs.append(("model.engine_patch", self.model.engine_patch, ENGINE_PATCH_SIGNATURE))
        return refs

    def _plugin_problems(self) -> list[str]:
        """Each plug-in imported and its signature checked now, so that a typo fails before anything starts."""
        plugins.activate(self.plugins.paths)
        problems = []
        for field, ref, signature in self.plugin_refs():
            try:
                plugins.resolve(ref, field=field, signature=signature)
            except ConfigError as e:
                problems.append(str(e))
        return problems

    def plugin_records(self) -> list[dict[str, str | None]]:
        """Each plug-in's import path, source file and SHA-256 (what ``RUN_DIR/plugins.json`` holds)."""
        return [plugins.record(ref, field=field).as_dict() for field, ref, _ in self.plugin_refs()]

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


def public_dict(cfg: SluiceConfig) -> dict[str, Any]:
    """The resolved config as plain data with every credential redacted: what may be printed or written to a run's
    files (``--dry-run``, ``RUN_DIR/config.json``). The run's processes get the secret another way
    (``pipeline.queue.credentials``)."""
    from pipeline.queue.credentials import public_url

    data = cfg.model_dump(mode="json")
    data["queue"]["redis_url"] = public_url(cfg.queue.redis_url)
    return data


def dump_config(cfg: SluiceConfig) -> str:
    """``--dry-run``'s output: the resolved config, credentials redacted."""
    return json.dumps(public_dict(cfg), indent=2)
