"""The root of a recipe (``SluiceConfig``), and loading one from TOML with ``--set`` overrides.

Recipes are data (``recipes/*.toml``); ``--set a.b=v`` overrides any field. Everything is validated before anything
starts, and unknown keys are errors, so a typo in a recipe never silently falls back to a default. The checks that
span sections live here; each section's own are in its module.
"""

from __future__ import annotations

import json
import logging
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError, model_validator

from pipeline import plugins
from pipeline.config.base import Strict
from pipeline.config.engine import EngineConfig
from pipeline.config.eval import EvalConfig
from pipeline.config.filters import FILTER_SIGNATURE, FilterConfig
from pipeline.config.hardware import HardwareConfig
from pipeline.config.hooks import HooksConfig
from pipeline.config.metrics import MetricsConfig
from pipeline.config.model import ENGINE_PATCH_SIGNATURE, SPEC_SIGNATURE, ModelSource
from pipeline.config.producer import (
    BUILTIN_REWARD_NAMES,
    BUILTIN_ROLLOUT,
    GROUP_REWARD_SIGNATURE,
    REWARD_SIGNATURE,
    ROLLOUT_SIGNATURE,
    ProducerConfig,
    SamplingConfig,
)
from pipeline.config.prompts import SYNTHETIC_TASK_SPACES, PromptConfig
from pipeline.config.queue import QueueConfig
from pipeline.config.ray import RayConfig
from pipeline.config.run import PluginsConfig, RunConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.config.sync import SyncConfig
from pipeline.config.trainer import TrainerConfig
from pipeline.config.warmstart import WarmStartConfig
from pipeline.errors import ConfigError
from pipeline.net import public_url
from pipeline.plugins import Signature

log = logging.getLogger(__name__)


class SluiceConfig(Strict):
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

    @model_validator(mode="before")
    @classmethod
    def _constant_norm_budget(cls, data: Any) -> Any:
        """Dr. GRPO's constant is the generation budget: constant_norm without a norm_length takes the producers'
        max_new_tokens, so that the denominator is the same every step and counts no prompt token."""
        if not isinstance(data, dict):
            return data
        trainer = data.get("trainer") if isinstance(data.get("trainer"), dict) else {}
        loss = trainer.get("loss") if isinstance(trainer.get("loss"), dict) else {}
        if loss.get("aggregation") != "constant_norm" or loss.get("norm_length") is not None:
            return data
        producer = data.get("producer") if isinstance(data.get("producer"), dict) else {}
        sampling = producer.get("sampling") if isinstance(producer.get("sampling"), dict) else {}
        budget = sampling.get("max_new_tokens", SamplingConfig.model_fields["max_new_tokens"].default)
        return {**data, "trainer": {**trainer, "loss": {**loss, "norm_length": budget}}}

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
        problems += self._lora_problems()
        problems += self._fp8_problems()
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
        space = SYNTHETIC_TASK_SPACES.get(p.task)
        if space is None:
            return [f"prompts.task = {p.task!r} is not a synthetic task; choose one of {sorted(SYNTHETIC_TASK_SPACES)}"]
        if p.size + p.heldout <= space(p.digits):
            return []
        return [f"prompts.size + prompts.heldout = {p.size + p.heldout} is more than the {space(p.digits)} "
                f"distinct prompts of synthetic task {p.task!r} with digits={p.digits}; lower them or raise "
                "prompts.digits"]

    def plugin_refs(self) -> list[tuple[str, str, Signature]]:
        """Every user plug-in the recipe names: (field, import path, the call sluice makes)."""
        refs: list[tuple[str, str, Signature]] = []
        if self.producer.reward not in BUILTIN_REWARD_NAMES:
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

    def _fp8_problems(self) -> list[str]:
        """FP8 rollout settings that could not work, refused before anything starts."""
        if self.engine.weight_dtype != "fp8":
            return []
        problems = []
        if self.engine.type == "cpu" and self.engine.dtype != "float32":
            problems.append("engine.weight_dtype = 'fp8' with engine.dtype = 'bfloat16': the CPU engine computes in "
                            "float32 from the FP8 values, as FP8 kernels accumulate; set engine.dtype = 'float32'")
        if self.trainer.lora is not None:
            problems.append("engine.weight_dtype = 'fp8' with [trainer.lora]: FP8 engines quantize whole weights, "
                            "and a pushed adapter has nothing to merge into; remove one of the two")
        if self.sync.wire != "flat":
            problems.append("engine.weight_dtype = 'fp8' with sync.wire = 'tensors': gloo cannot broadcast float8 "
                            "tensors, which travel as the bytes of flat buckets; set sync.wire = 'flat'")
        return problems

    def _lora_problems(self) -> list[str]:
        """Adapters the engines could not serve, refused before anything starts (``--dry-run`` included)."""
        from pipeline.config.trainer import LORA_EXPERT_TARGETS

        lora = self.trainer.lora
        if lora is None:
            return []
        problems = []
        experts = [t for t in lora.targets if t in LORA_EXPERT_TARGETS]
        if self.engine.type == "cpu" and lora.serve == "adapter" and experts:
            problems.append(f"trainer.lora.targets {experts} with serve = 'adapter': sluice's CPU engine keeps the "
                            "routed experts fused in one tensor per layer and applies adapters to single "
                            "projections only; use serve = 'merge' or drop the expert targets")
        if self.engine.type == "sglang":
            if lora.serve != "adapter":
                problems.append("trainer.lora.serve = 'merge' with engine.type = 'sglang': SGLang cannot merge a "
                                "pushed adapter into the weights it serves; set trainer.lora.serve = 'adapter' (each "
                                "push is loaded beside the base with /load_lora_adapter)")
            if experts:
                problems.append(f"trainer.lora.targets {experts} with engine.type = 'sglang': the push hands SGLang "
                                "PEFT folders, and expert adapters have no PEFT form (transformers keeps a layer's "
                                "experts in one fused tensor); drop the expert targets, or use engine.type = 'cpu'")
        return problems

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
    data = cfg.model_dump(mode="json")
    data["queue"]["redis_url"] = public_url(cfg.queue.redis_url)
    return data


def dump_config(cfg: SluiceConfig) -> str:
    """``--dry-run``'s output: the resolved config, credentials redacted."""
    return json.dumps(public_dict(cfg), indent=2)


F = TypeVar("F", bound=Callable[..., Any])
