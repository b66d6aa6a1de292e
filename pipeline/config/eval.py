"""``[eval]``: the stream evaluator attached to the run (``pipeline.consumers.evaluator``) and held-out evaluation by
generation (``[eval.heldout]``, ``pipeline.heldout.evaluate``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.errors import ConfigError


class EvaluatorConfig(BaseModel):
    """How the evaluator reads its group and judges a sample."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group: str = Field(default="eval", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Consumer group to read through; the aggregates are kept per group."""

    consumer: str = Field(default="evaluator", min_length=1, max_length=128)
    """Consumer name in the group; a restart under the same name re-reads its own pending entries at once."""

    start: str = "0"
    """Where a new group starts: "0" covers the history kept in the stream, "$" only entries added from now on."""

    @field_validator("start")
    @classmethod
    def _check_start(cls, start: str) -> str:
        ms, sep, seq = start.partition("-")
        if start != "$" and not (ms.isdigit() and (not sep or seq.isdigit())):
            raise ConfigError(f"evaluator start={start!r} is not '0', '$' or a stream id like '1700000000000-0'")
        return start

    pass_threshold: float = 0.0
    """A sample without ``reward_info["pass"]`` passes when its reward is above this."""

    batch_entries: int = Field(default=64, ge=1, le=10_000)
    """Entries read, and committed in one atomic ack-and-count, per step."""

    block_ms: int = Field(default=500, ge=1, le=60_000)
    """How long one read waits for new entries (the loop's idle poll period)."""

    claim_idle_ms: int = Field(default=60_000, ge=0, le=86_400_000)
    """Entries another consumer of the group has held this long are taken over (that evaluator is presumed dead)."""

    claim_interval_s: float = Field(default=30.0, gt=0, le=86_400)
    """How often a running evaluator looks for entries left by dead peers."""


class HeldoutConfig(BaseModel):
    """Held-out evaluation by generation (``[eval.heldout]``): which versions, how many samples, which engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Write weight snapshots and evaluate them on the held-out split (needs prompts.heldout or heldout_path)."""
    live: bool = True
    """Evaluate while the run goes, in the evaluator process; false only writes snapshots (`sluice eval --heldout`)."""
    every_versions: int = Field(20, ge=1, le=1_000_000)
    """Snapshot and evaluate every this many policy versions; version 0 and the run's last one always."""
    samples: int = Field(4, ge=1, le=1024)
    """Sampled responses per prompt (the n of pass@k), besides the one greedy response."""
    pass_k: list[int] = Field(default_factory=lambda: [1, 4], min_length=1, max_length=32)
    """The k of the reported pass@k figures, each between 1 and samples."""
    temperature: float | None = Field(None, gt=0.0, le=10.0)
    """Temperature of the sampled responses; None = producer.sampling.temperature (greedy is always evaluated too)."""
    max_new_tokens: int | None = Field(None, ge=1, le=1_000_000)
    """Longest response; None = producer.sampling.max_new_tokens."""
    max_prompts: int | None = Field(None, ge=1, le=10_000_000)
    """Evaluate only the first this many held-out prompts; None = the whole split."""
    seed: int = Field(0, ge=0)
    """Base sampling seed: sample j of held-out prompt i uses seed + i * samples + j."""
    keep_snapshots: int = Field(3, ge=1, le=100_000)
    """Snapshots kept on disk; older ones go once evaluated or skipped (with live = false, regardless)."""
    engine_url: str | None = None
    """An SGLang-protocol server used for evaluation only (required with engine.type = 'sglang'); None = a private
    CPU engine the evaluator starts."""
    max_batch: int = Field(32, ge=1, le=4096)
    """Sequences the private CPU engine decodes together."""
    concurrency: int = Field(16, ge=1, le=4096)
    """Held-out prompts in flight at once (each one greedy and one sampled request)."""
    poll_s: float = Field(2.0, gt=0, le=3600)
    """How often a live evaluator looks for a new snapshot."""
    nice: int = Field(10, ge=0, le=19)
    """CPU priority drop (os.nice) of the evaluator process and its engine, so that they yield to the trainer."""
    final_wait_s: float = Field(600.0, ge=0, le=86_400)
    """How long `sluice run` waits after the last step for the final snapshot to be evaluated."""
    startup_timeout_s: float = Field(120.0, gt=0, le=3600)
    """How long to wait for the private engine's /health."""

    @field_validator("pass_k")
    @classmethod
    def _sorted_unique(cls, ks: list[int]) -> list[int]:
        if any(k < 1 for k in ks):
            raise ConfigError(f"eval.heldout.pass_k={ks}: every k must be >= 1")
        return sorted(set(ks))

    @field_validator("engine_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ConfigError(f"eval.heldout.engine_url={url!r} must be an http:// or https:// base URL")
        return None if url is None else url.rstrip("/")

    @model_validator(mode="after")
    def _k_within_samples(self) -> HeldoutConfig:
        too_big = [k for k in self.pass_k if k > self.samples]
        if too_big:
            raise ConfigError(f"eval.heldout.pass_k has k={too_big} above eval.heldout.samples={self.samples}: "
                              "pass@k needs at least k samples per prompt; raise samples or lower pass_k")
        return self


class EvalConfig(EvaluatorConfig):
    """The evaluator consumer attached to the run (its fields, plus whether to run one)."""

    enabled: bool = True
    """Run an evaluator beside the trainer."""
    heldout: HeldoutConfig = HeldoutConfig()
    """Held-out evaluation by generation on weight snapshots (off by default)."""
