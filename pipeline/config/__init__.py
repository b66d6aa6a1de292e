"""The recipe schema: one pydantic model per section, nested under ``SluiceConfig``, loaded from TOML.

A leaf: it imports pydantic, the standard library and sluice's own leaves (``errors``, ``plugins``, ``net``) only, so
loading and validating a recipe (``sluice run --dry-run``, every process's start) imports no torch, megatron, Redis
client, HTTP stack or Arrow (tests/config/test_config_leaf.py). What a check needs from the heavy modules (the synthetic
tasks' sizes, the built-in rewards' names, the plug-in signatures) is kept here, and the heavy modules take it from
here.

Sections, one module each: ``run`` (with ``[plugins]``), ``model``, ``engine``, ``producer`` (sampling, rewards),
``prompts``, ``staleness``, ``filters``, ``trainer`` (train step, loss, lr schedule), ``warmstart``, ``sync``,
``queue`` (with its archive), ``eval`` (stream evaluator, held-out), ``hooks``, ``metrics``, ``ray``, ``hardware``;
the root and the loading in ``root``. Components take their own sections, not the root:
only the composition roots (the launcher's processes and the CLI) hold the whole ``SluiceConfig``.
"""

from pipeline.config.engine import EngineConfig
from pipeline.config.eval import EvalConfig, EvaluatorConfig, HeldoutConfig
from pipeline.config.filters import FilterConfig
from pipeline.config.hardware import HardwareConfig
from pipeline.config.hooks import HooksConfig
from pipeline.config.metrics import MetricsConfig
from pipeline.config.model import ModelSource
from pipeline.config.producer import ProducerConfig, RewardConfig, SamplingConfig
from pipeline.config.prompts import PromptConfig
from pipeline.config.queue import ArchiveConfig, QueueConfig
from pipeline.config.ray import RayConfig, RoleResources
from pipeline.config.root import SluiceConfig, apply_overrides, dump_config, load_config, public_dict
from pipeline.config.run import PluginsConfig, RunConfig
from pipeline.config.staleness import StalenessConfig
from pipeline.config.sync import SyncConfig
from pipeline.config.trainer import (
    AdvantageConfig,
    CorrectionConfig,
    LossConfig,
    LossTermConfig,
    LRScheduleConfig,
    TrainerConfig,
    TrainStepConfig,
)
from pipeline.config.warmstart import WarmStartConfig

__all__ = [
    "AdvantageConfig",
    "ArchiveConfig",
    "CorrectionConfig",
    "EngineConfig",
    "EvalConfig",
    "EvaluatorConfig",
    "FilterConfig",
    "HardwareConfig",
    "HeldoutConfig",
    "HooksConfig",
    "LRScheduleConfig",
    "LossConfig",
    "LossTermConfig",
    "MetricsConfig",
    "ModelSource",
    "PluginsConfig",
    "ProducerConfig",
    "PromptConfig",
    "QueueConfig",
    "RayConfig",
    "RewardConfig",
    "RoleResources",
    "RunConfig",
    "SamplingConfig",
    "SluiceConfig",
    "StalenessConfig",
    "SyncConfig",
    "TrainStepConfig",
    "TrainerConfig",
    "WarmStartConfig",
    "apply_overrides",
    "dump_config",
    "load_config",
    "public_dict",
]
