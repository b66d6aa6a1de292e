"""``[trainer]``: the train step (R3, micro-batching, optimizer), its loss and learning-rate schedule, and the loop's
own settings. Pure configuration: loading a recipe imports no torch (``pipeline.consumers.rl.loss``, ``schedule`` and
``train_step`` do the work)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.errors import ConfigError
from pipeline.plugins import Signature, split_ref

_ICEPOP_BOUNDS = (0.5, 5.0)
_MIS_BOUNDS = (0.0, 2.0)


class LRScheduleConfig(BaseModel):
    """Warm-up, then a decay shape, over optimizer steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    warmup_steps: int = Field(default=0, ge=0, le=100_000_000)
    """Optimizer steps over which the rate rises linearly from lr / (warmup_steps + 1) to lr; 0 = no warm-up."""
    decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: keep lr, or decay it linearly or along a half cosine down to min_lr_ratio * lr."""
    decay_steps: int | None = Field(default=None, ge=1, le=100_000_000)
    """Optimizer steps from the end of warm-up to the floor; None = the rest of the run."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """The floor of the decay, as a fraction of lr."""
    decay_unit: Literal["steps", "samples"] = "steps"
    """What the decay counts: optimizer steps, or samples trained. Runs whose steps train different numbers of
    samples (sync and async, or batches that dynamic sampling left partial) then have the same rate at the same
    number of samples, which is what a comparison at equal samples needs. The warm-up stays in optimizer steps."""
    decay_samples: int | None = Field(default=None, ge=1, le=10**12)
    """With decay_unit = "samples": samples trained from the start of the run to the floor (required). The decay's
    clock starts at sample 0, so right after a warm-up of w samples the rate is already the decay's value at w."""

    @model_validator(mode="after")
    def _check_unit(self) -> LRScheduleConfig:
        if self.decay_unit == "samples" and self.decay == "constant":
            raise ConfigError('lr_schedule.decay_unit = "samples" needs decay = "linear" or "cosine"; a constant rate '
                              "has no decay to count")
        if self.decay_unit == "samples" and self.decay_samples is None:
            raise ConfigError('lr_schedule.decay_unit = "samples" needs decay_samples (the samples trained from the '
                              "start of the run to the floor), e.g. the samples the run trains")
        if self.decay_unit == "steps" and self.decay_samples is not None:
            raise ConfigError('lr_schedule.decay_samples is set but decay_unit = "steps" ignores it; set '
                              'decay_unit = "samples", or drop decay_samples')
        return self


class AdvantageConfig(BaseModel):
    """GRPO group-normalised advantages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    normalize_std: bool = True
    """Divide by the group's reward std (GRPO); False only subtracts the group mean (Dr. GRPO)."""

    eps: float = Field(default=1e-6, gt=0.0, le=1.0)
    """Added to the std before dividing, so near-constant groups do not blow up."""

    std_unbiased: bool = True
    """Use the unbiased (n-1) std over a group, as torch.std does; False uses the population (n) std."""


class CorrectionConfig(BaseModel):
    """How the importance weight proximal/behaviour is corrected (see the module docstring for the formulas)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["none", "is", "tis", "mis", "icepop"] = "tis"
    """The correction: none, raw IS, truncated IS, masked IS, or IcePop's two-sided token mask."""

    level: Literal["token", "sequence"] = "token"
    """For tis and mis: one weight per token, or one per sequence shared by its tokens (icepop is token-only)."""

    sequence_weight: Literal["product", "geometric_mean"] = "geometric_mean"
    """At sequence level: exp(sum of log w) (exact, explodes on long sequences) or exp(mean of log w)."""

    cap: float = Field(default=2.0, gt=0.0, le=1e6)
    """TIS truncation C: the weight is min(w, C)."""

    low: float | None = Field(default=None, ge=0.0, le=1e6)
    """MIS/IcePop lower bound on w (tokens below are masked); None = 0.0 for mis, 0.5 for icepop."""

    high: float | None = Field(default=None, gt=0.0, le=1e6)
    """MIS/IcePop upper bound on w (tokens above are masked); None = 2.0 for mis, 5.0 for icepop."""

    @model_validator(mode="after")
    def _check(self) -> CorrectionConfig:
        if self.type == "icepop" and self.level == "sequence":
            raise ConfigError(
                "correction.type='icepop' masks single tokens; level='sequence' does not apply. Use type='mis' with "
                "level='sequence' for a sequence-level mask, or set level='token'."
            )
        if self.type in ("none", "is") and self.level == "sequence":
            raise ConfigError(
                f"correction.type={self.type!r} has no sequence level (level='sequence' applies to 'tis' and 'mis'): "
                "a sequence's untruncated weight is the product of its tokens', which overflows on long responses. "
                "Use type='tis' or 'mis' with level='sequence', or set level='token'."
            )
        # Moved off its default, but read by no correction of this type: a recipe that sets it expects an effect it
        # would not get. (Defaults, not the fields a recipe named: a run's resolved config names every field.)
        unused = {"cap": self.type != "tis", "low": self.type not in ("mis", "icepop"),
                  "high": self.type not in ("mis", "icepop"), "sequence_weight": self.level != "sequence"}
        ignored = sorted(name for name, skip in unused.items()
                         if skip and getattr(self, name) != type(self).model_fields[name].default)
        if ignored:
            raise ConfigError(
                f"correction {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} set but correction.type = "
                f"{self.type!r}, level = {self.level!r} does not use {'it' if len(ignored) == 1 else 'them'} "
                "(cap: tis; low, high: mis and icepop; sequence_weight: level = 'sequence'); remove "
                f"{'it' if len(ignored) == 1 else 'them'} or change the type"
            )
        low, high = self.bounds()
        if low >= high:
            raise ConfigError(f"correction bounds low={low} >= high={high}; the kept interval [low, high] is empty")
        return self

    def bounds(self) -> tuple[float, float]:
        """The [low, high] interval of kept weights for mis/icepop, with the type's defaults filled in."""
        default = _ICEPOP_BOUNDS if self.type == "icepop" else _MIS_BOUNDS
        return (
            default[0] if self.low is None else self.low,
            default[1] if self.high is None else self.high,
        )


#: The call sluice makes to a loss plug-in (a term or the replacement): one ``LossInputs`` (docs/plugins.md).
LOSS_PLUGIN_SIGNATURE = Signature(args=(None,), described="(inputs: LossInputs) -> (scalar tensor, dict[str, float])",
                                  awaitable=False)


class LossTermConfig(BaseModel):
    """One ``[[trainer.loss.terms]]`` entry: a user term added to the policy loss, ``coef * fn(inputs)``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fn: str
    """The term, 'package.module:function', called with a LossInputs per micro-batch; returns (scalar, metrics)."""

    coef: float = Field(default=1.0, ge=-1e6, le=1e6)
    """Multiplies the term before it is added to the loss (negative: the term is maximised)."""

    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    """Its metrics go under loss/<name>/; None = the function's name."""

    def label(self) -> str:
        """The name its metrics go under."""
        return self.name or plugin_name(self.fn)


def plugin_name(ref: str) -> str:
    """The default metrics name of a loss plug-in: the function's own name (``pkg.mod:length_penalty`` ->
    ``length_penalty``)."""
    return ref.rpartition(":")[2].rpartition(".")[2] or ref


class LossConfig(BaseModel):
    """The policy-gradient loss."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """PPO clip below: the ratio current/proximal is clipped at 1 - clip_low."""

    clip_high: float = Field(default=0.2, ge=0.0, le=100.0)
    """PPO clip above: the ratio is clipped at 1 + clip_high (DAPO raises it, e.g. 0.28, to keep exploring)."""

    dual_clip: float | None = Field(default=None, gt=1.0, le=100.0)
    """For negative advantages, cap the token loss at dual_clip * |A| (dual-clip PPO); None = off."""

    kl_coef: float = Field(default=0.0, ge=0.0, le=100.0)
    """Weight of the KL penalty to the reference policy, added to the loss; 0 = no reference model needed."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL(current || ref) estimator per token: k1, k2 or k3 (see :func:`kl_penalty`); k3 is GRPO's. Each token's value
    is bounded to [-10, 10] in the loss, so a token far from the reference adds at most 10 * kl_coef and no
    gradient."""

    entropy_coef: float = Field(default=0.0, ge=0.0, le=100.0)
    """Weight of an entropy bonus subtracted from the loss; needs logits or entropy; 0 = metric only."""

    aggregation: Literal["token_mean", "sequence_mean", "constant_norm"] = "token_mean"
    """How token losses become one number: mean over all batch tokens, mean of per-sequence means, or Dr. GRPO's
    sum over (sequences * norm_length)."""

    norm_length: int | None = Field(default=None, ge=1, le=10_000_000)
    """The constant length L of aggregation='constant_norm', in response tokens: Dr. GRPO's fixed generation budget.
    A recipe that leaves it unset gets producer.sampling.max_new_tokens; the train step refuses constant_norm
    without it (a length taken from each batch would count prompt tokens and change from step to step)."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """GRPO advantage settings."""

    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    """The off-policy correction of the importance weight proximal/behaviour."""

    terms: list[LossTermConfig] = []
    """Auxiliary loss terms, each {fn = "package.module:function", coef = 0.01}, added to the policy loss."""

    replace: str | None = None
    """'package.module:function' computing the whole policy loss instead of the built-in one (the terms are still
    added); None = the built-in decoupled PPO loss."""

    entropy_grad: bool = False
    """Hand loss plug-ins an entropy that carries gradient (a term that raises entropy needs it); it keeps the
    [B, T, V] softmax graph alive, so it is off unless asked for (entropy_coef > 0 turns it on anyway)."""

    @model_validator(mode="after")
    def _check_norm_length(self) -> LossConfig:
        if self.norm_length is not None and self.aggregation != "constant_norm":
            raise ConfigError(f"trainer.loss.norm_length = {self.norm_length} is only read by aggregation = "
                              f"'constant_norm', not {self.aggregation!r}; remove it or change the aggregation")
        return self

    @model_validator(mode="after")
    def _check_plugins(self) -> LossConfig:
        for i, term in enumerate(self.terms):
            split_ref(term.fn, f"trainer.loss.terms[{i}].fn")
        if self.replace is not None:
            split_ref(self.replace, "trainer.loss.replace")
            if self.entropy_coef > 0:
                raise ConfigError(
                    f"trainer.loss.entropy_coef = {self.entropy_coef} belongs to the built-in loss, which "
                    f"trainer.loss.replace = {self.replace!r} replaces; set it to 0 and add the bonus in the "
                    "replacement (inputs.entropy, with trainer.loss.entropy_grad = true) or as a term"
                )
        names = [t.label() for t in self.terms] + ([plugin_name(self.replace)] if self.replace else [])
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"loss plug-ins share the metrics name(s) {twice}; give each [[trainer.loss.terms]] "
                              "entry its own name = \"...\"")
        return self

    @property
    def has_plugins(self) -> bool:
        """Whether any user term or a replacement is configured."""
        return bool(self.terms) or self.replace is not None

    def plugin_refs(self, prefix: str = "trainer.loss") -> list[tuple[str, str, Signature]]:
        """(recipe field, import path, call) of every loss plug-in, for ``SluiceConfig.plugin_refs``."""
        refs = [(f"{prefix}.terms[{i}].fn", t.fn, LOSS_PLUGIN_SIGNATURE) for i, t in enumerate(self.terms)]
        if self.replace is not None:
            refs.append((f"{prefix}.replace", self.replace, LOSS_PLUGIN_SIGNATURE))
        return refs


class TrainStepConfig(BaseModel):
    """The training step: R3, micro-batching, optimizer and loss."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    r3: bool = True
    """Replay the rollout's MoE routing (R3) in the proximal and training forwards; ignored for dense models."""
    measure_r3: bool = True
    """One extra no-grad forward per micro-batch to measure mismatch and routing agreement the other way."""
    temperature: float | None = Field(default=None, gt=0.0, le=100.0)
    """Score tokens at this temperature; None = each sample's own sampling temperature."""
    micro_batch_samples: int = Field(default=8, ge=1, le=1 << 20)
    """Most samples in one forward/backward."""
    micro_batch_tokens: int | None = Field(default=None, ge=1, le=1 << 30)
    """Most padded tokens (rows x padded length) in one forward/backward; None = no token budget."""
    mini_batches: int = Field(default=1, ge=1, le=4096)
    """Optimizer steps per drained batch: its samples are shuffled and split into this many mini-batches. With more
    than one, the decoupled ratio current/proximal moves away from 1 after the first, and the PPO clip acts."""
    epochs: int = Field(default=1, ge=1, le=64)
    """Passes over each drained batch (each split into ``mini_batches``); proximal log-probs are computed once."""
    lr: float = Field(default=1e-6, gt=0.0, le=1.0)
    """Peak AdamW learning rate."""
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    """Warm-up and decay of the learning rate, over optimizer steps (trainer steps x epochs x mini_batches)."""
    optimizer: Literal["auto", "local", "megatron"] = "auto"
    """auto: megatron's DDP + distributed optimizer on CUDA, torch AdamW with an explicit all-reduce on CPU (fp32
    master weights for bf16/fp16 parameters in both); local or megatron force one."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """AdamW first-moment decay."""
    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    """AdamW second-moment decay."""
    adam_eps: float = Field(default=1e-8, gt=0.0, le=1.0)
    """AdamW denominator epsilon."""
    expert_bias_update_rate: float = Field(default=1e-3, ge=0.0, le=1.0)
    """Per optimizer step, how far each expert's routing bias moves toward balance (megatron's
    moe_router_bias_update_rate); only for routers with an expert bias (DeepSeek-V3). 0 keeps the bias as loaded."""
    grad_clip: float | None = Field(default=1.0, gt=0.0, le=1e6)
    """Clip the global gradient norm (over all ranks, experts included) to this; None = no clipping."""
    failed_in_group_stats: bool = True
    """Failed/aborted samples (never trained on) still count in their group's GRPO reward mean and std."""
    pad_token_id: int = Field(default=0, ge=0, le=1 << 22)
    """Token id written into padding (never scored)."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy-gradient loss."""


LORA_DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_EXPERT_TARGETS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")


class LoRAConfig(BaseModel):
    """Low-rank adapters on a frozen base (``pipeline.consumers.megatron.lora``): only the adapters train, are
    checkpointed and travel to the engines."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(default=8, ge=1, le=4096)
    """r: the adapters' inner width."""
    alpha: float = Field(default=16.0, gt=0.0, le=1e6)
    """The update is (alpha / rank) * B @ A."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (the engines apply none)."""
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """HF projection names: q/k/v/o_proj; gate/up/down_proj of dense MLP layers; experts.gate/up/down_proj of the
    routed experts (every expert gets its own pair). The router is never adapted: its weights stay the base's, so
    routing moves only through the hidden states."""
    serve: Literal["merge", "adapter"] = "merge"
    """How engines take a pushed adapter. "merge": the engine writes base + (alpha / rank) * B @ A into the weights
    it serves (any target). "adapter": it keeps the base and adds the adapter's output beside each adapted
    projection, as SGLang's --enable-lora does (sluice's CPU engine: attention and dense projections only).
    SGLang engines take "adapter" only: each push is a PEFT folder they load by name
    (``pipeline.sync.adapter_push``)."""
    keep_loaded: int = Field(default=3, ge=1, le=64)
    """SGLang engines: adapter versions each engine keeps loaded (the newest and the ones before it, which requests
    started before the last pushes still run under); older ones are unloaded. Managed engines get
    ``--max-loras-per-batch`` one more than this."""
    adapter_dir: str | None = None
    """SGLang engines: the folder the pushed adapters are written to and the engines load them from; it must be the
    same path on the trainer's and every engine's machine. Default: RUN_DIR/adapters."""

    @model_validator(mode="after")
    def _known_targets(self) -> LoRAConfig:
        valid = (*LORA_DENSE_TARGETS, *LORA_EXPERT_TARGETS)
        unknown = [t for t in self.targets if t not in valid]
        if unknown or not self.targets:
            raise ValueError(f"trainer.lora.targets = {list(self.targets)}: give one or more of {list(valid)}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"trainer.lora.targets = {list(self.targets)} names a target twice")
        return self


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
    fetch: Literal["readers", "rank0"] = "readers"
    """Who fetches a step's sample payloads. "readers": rank 0 decides from the stream's headers and sends each
    data-parallel replica the keys of its share, balanced by tokens; the replica's first rank fetches them and passes
    them to its tensor-parallel peers. "rank0": rank 0 fetches every payload and broadcasts the batch to every rank
    (the older path, kept to compare against)."""
    overlap_push: bool = True
    """Push each step's weights in the background while the next batch is drained and trained (the version still
    advances only once every engine has them); false pushes before the next drain."""
    lora: LoRAConfig | None = None
    """``[trainer.lora]``: train low-rank adapters on a frozen base instead of every weight; None trains all."""
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
