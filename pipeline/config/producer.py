"""``[producer]``: one producer process, its sampling parameters and how it scores samples (a per-sample reward, a
group judge or a reward service), with the plug-in calls those fields name.

The built-in rewards and rollout are named here, not imported: ``pipeline.producers.rewards`` and ``rollout`` hold
them (tests/config/test_config_leaf.py checks that the two agree).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.net import has_secret
from pipeline.plugins import Signature

#: The names ``producer.reward`` may take besides an import path (``pipeline.producers.rewards.BUILTIN_REWARDS``).
BUILTIN_REWARD_NAMES = frozenset({"exact_match", "integer_match", "prefix_match"})

REWARD_SIGNATURE = Signature(args=(None, ""), described="(prompt, response_text)")
GROUP_REWARD_SIGNATURE = Signature(args=(None, []), described="(prompt, responses: list[str])")

BUILTIN_ROLLOUT = "pipeline.producers.rollout:single_turn"
ROLLOUT_SIGNATURE = Signature(args=(None,), described="(ctx: RolloutContext) -> list[Trajectory]", awaitable=True)

ENV_PREFIX = "env:"
"""A ``reward_url`` or ``reward_headers`` value ``env:NAME`` is read from the environment variable NAME, so that a
secret stays out of the recipe and of ``RUN_DIR/config.json``."""
_PASSED_PREFIX = "SLUICE_"  # only these variables reach the run's processes (pipeline.launch.launcher._env)


def _env_ref(value: str, field: str) -> str | None:
    """The variable ``value`` names (``env:NAME``), checked; None for a literal value."""
    if not value.startswith(ENV_PREFIX):
        return None
    name = value[len(ENV_PREFIX):]
    if not name.startswith(_PASSED_PREFIX) or not name.replace("_", "").isalnum():
        raise ValueError(f"{field} = {value!r}: name a variable SLUICE_*, e.g. 'env:SLUICE_REWARD_TOKEN' (only "
                         "SLUICE_* variables reach the run's processes)")
    if name not in os.environ:
        raise ValueError(f"{field} = {value!r}: the environment variable {name} is not set; export it before "
                         "starting sluice")
    return name


def expand_env(value: str) -> str:
    """``value``, or the environment variable it names when it is ``env:NAME``."""
    return os.environ[value[len(ENV_PREFIX):]] if value.startswith(ENV_PREFIX) else value


class RewardConfig(BaseModel):
    """How a producer scores its samples: a per-sample function, a group function, or an HTTP reward service."""

    model_config = ConfigDict(extra="forbid")

    reward: str = "exact_match"
    """Built-in reward name or 'package.module:function', called with (prompt, response_text) for each sample."""
    group_reward: str | None = None
    """'package.module:function' called once per prompt group with (prompt, responses: list[str]), returning one
    float (or (float, info)) per response: pairwise, ranking or generative judges. Replaces producer.reward."""
    reward_url: str | None = None
    """http(s) URL of a reward service, POSTed one JSON request per group (docs/plugins.md). Replaces
    producer.reward. 'env:SLUICE_NAME' reads it from that environment variable (use that when it holds a password)."""
    reward_headers: dict[str, str] = {}
    """HTTP headers sent to reward_url; a value 'env:SLUICE_NAME' is read from that environment variable, so a token
    (Authorization = 'env:SLUICE_REWARD_TOKEN') is never written to the run's files or logs."""
    reward_timeout_s: float = Field(default=30.0, gt=0)
    """One reward call (a sample's, a group's, one HTTP attempt) running longer marks its samples failed (an HTTP
    attempt is retried)."""
    reward_concurrency: int = Field(default=64, ge=1, le=65536)
    """Reward calls in flight at once across all the producer's groups (function calls or HTTP requests)."""
    reward_retries: int = Field(default=3, ge=0, le=100)
    """HTTP attempts repeated after a connection error, a timeout or a 5xx answer, before the group's samples are
    marked failed."""
    reward_backoff_s: float = Field(default=0.2, ge=0, le=60)
    """Sleep after the first failed HTTP attempt; it doubles after each further one (capped at 30 s, jittered)."""

    @field_validator("reward_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is None or _env_ref(url, "producer.reward_url") is not None:
            return url
        if not url.startswith(("http://", "https://")):
            raise ValueError("producer.reward_url must start with http:// or https://")
        if has_secret(url) or urlsplit(url).query:
            # The resolved config is written to RUN_DIR/config.json and printed by --dry-run: no password in it, and
            # no query string, where services take their API keys.
            raise ValueError("producer.reward_url holds a password or a query string (which may hold a key), which "
                             "would be written to RUN_DIR/config.json; "
                             "set reward_url = 'env:SLUICE_REWARD_URL' and export the URL in that variable, or pass "
                             "the credential as a header (reward_headers = {Authorization = "
                             "'env:SLUICE_REWARD_TOKEN'})")
        return url

    @field_validator("reward_headers")
    @classmethod
    def _header_refs(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            _env_ref(value, f"producer.reward_headers.{name}")
        return headers

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        chosen = [f for f, on in (("producer.group_reward", self.group_reward is not None),
                                  ("producer.reward_url", self.reward_url is not None)) if on]
        default = type(self).model_fields["reward"].default
        if self.reward != default:
            chosen.insert(0, "producer.reward")
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)} are both set; a producer scores with one of them (leave "
                             f"producer.reward at its default {default!r} with group_reward or reward_url)")
        if self.reward_headers and self.reward_url is None:
            raise ValueError("producer.reward_headers is only sent to producer.reward_url, which is not set")
        return self


class SamplingConfig(BaseModel):
    """Sampling parameters sent to the engine with every request."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    """Sampling temperature; the trainer must score log-probs at the same temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k cut-off; -1 disables it."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Longest response."""
    stop_token_ids: list[int] = []
    """Tokens that end a response besides EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use it to fix response lengths)."""
    seed: int | None = Field(default=None, ge=0)
    """Base sampling seed; prompt index i gets seed + i * group_size (+ j for sample j), so a retry repeats itself."""


class ProducerConfig(RewardConfig):
    """One producer process (its reward fields come from ``RewardConfig``)."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(default=4, ge=1, le=1024)
    """Samples per prompt (the GRPO group)."""
    concurrency: int = Field(default=4, ge=1, le=4096)
    """Prompt groups in flight at once."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling parameters."""
    return_routed_experts: bool = True
    """Ask engines for MoE routing (needed for R3); ignored for dense models."""
    rollout: str = BUILTIN_ROLLOUT
    """'package.module:function': the async rollout function that turns a prompt into its group's trajectories
    (multi-turn, tools); the default is the built-in single request (``pipeline.producers.rollout``)."""
    rollout_timeout_s: float = Field(default=600.0, gt=0)
    """A rollout function running longer fails its group (counted in rollouts_failed; the prompt is skipped)."""
    put_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait on queue backpressure before failing."""
    admission_poll_s: float = Field(default=0.05, gt=0)
    """How often to re-check admission while paced."""
    engine_retry_s: float = Field(default=1.0, ge=0)
    """After no engine could serve a group, how long its slot stays idle before another group may start."""
    lease_ttl_s: float = Field(default=30.0, ge=0.5, le=3600.0)
    """A producer silent this long counts as dead: another producer hands its in-flight prompts back."""
