"""Collate prompt groups of Samples into the padded tensors the trainer's forward and loss take.

Alignment (the one thing every consumer of a ``TrainBatch`` must agree on): row ``b`` holds ``prompt + response``
right-padded to ``T`` tokens. Per-position tensors have ``T - 1`` columns and column ``t`` describes the prediction
made AT input position ``t`` of the token at ``t + 1``. Response token ``j`` of a sample with ``P`` prompt tokens sits
at input position ``P + j`` and is therefore scored in column ``P + j - 1``; its loss-mask bit, behaviour log-prob and
policy version land there too. This is exactly the layout of ``forward_logprobs`` and of the engine's routing, whose
row ``t`` is the routing of input position ``t`` (``P + R - 1`` rows: the last sampled token is never fed back).

Failed and aborted samples: their tokens get loss mask 0 (the engine's output is incomplete or meaningless), but by
default their reward still counts in their group's GRPO mean and std (``failed_in_group_stats``). A prompt that
makes generation fail is then a prompt whose successful answers are compared against a baseline that includes the
failures' (usually zero) reward, instead of a baseline computed as if the failures never happened, which would
inflate every other sample's advantage in exactly the groups the engine struggles with. Set it False to drop them
from the statistics as well.

Routing: a MoE batch carries ``routing`` ``[B, T, layers, topk]`` (megatron's input positions, engine order) with
filler experts ``0..topk-1`` at padding and at each row's last position, and ``routing_mask`` marking the positions
whose routing came from the sample. A sample without routing (an engine started without
``--enable-return-routed-experts``, a replayed archive from a dense run) has ``has_routing`` False and filler rows;
the trainer cannot replay a micro-batch containing one, so :func:`split_micro_batches` keeps such samples in
micro-batches of their own and the trainer runs those without replay (counted in its metrics).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from pipeline.config.trainer import AdvantageConfig
from pipeline.consumers.megatron.router_replay import pad_routing, to_megatron_layers
from pipeline.consumers.rl.loss import grpo_advantages
from pipeline.errors import ConfigError, SampleError
from pipeline.queue.sample import Sample, SampleStatus

Tensor = torch.Tensor

#: Statuses whose tokens are trained on; the others are masked out of the loss.
TRAINABLE_STATUSES = frozenset({SampleStatus.COMPLETED, SampleStatus.TRUNCATED})


@dataclass(frozen=True)
class RoutingShape:
    """The MoE layout the routing must match: MoE layers, experts per token, experts per layer."""

    num_layers: int
    topk: int
    num_experts: int


@dataclass(frozen=True)
class TrainBatch:
    """A right-padded batch of samples; see the module docstring for the column alignment."""

    input_ids: Tensor
    """[B, T] int64: prompt then response tokens, then ``pad_token_id``."""
    attention_mask: Tensor
    """[B, T] int64: 1 on real tokens, 0 on padding."""
    targets: Tensor
    """[B, T-1] int64: the token each position predicts (``input_ids[:, 1:]``)."""
    loss_mask: Tensor
    """[B, T-1] bool: response tokens that are trained on (the sample's loss mask, and its status is trainable)."""
    behaviour_logprobs: Tensor
    """[B, T-1] float32: the rollout log-probs at the response columns, 0 elsewhere."""
    token_versions: Tensor
    """[B, T-1] int64: the policy version of each response token, -1 elsewhere."""
    advantages: Tensor
    """[B] float32: GRPO group-normalised advantages (0 for samples left out of their group's statistics)."""
    rewards: Tensor
    """[B] float32."""
    sample_weights: Tensor
    """[B] float32: the group-filter weight of each sample's group (1 = as is; it scales the sample's loss)."""
    temperatures: Tensor
    """[B] float32: the temperature each sample is scored at (its sampling temperature unless overridden)."""
    group_index: Tensor
    """[B] int64: position of the sample's group in the collated list of groups."""
    trainable: Tensor
    """[B] bool: status completed or truncated."""
    prompt_lens: Tensor
    """[B] int64."""
    response_lens: Tensor
    """[B] int64."""
    has_routing: Tensor
    """[B] bool: the sample carried routing for this model (always False for a dense model)."""
    routing_mask: Tensor
    """[B, T] bool: input positions whose routing came from the sample."""
    routing: Tensor | None
    """[B, T, layers, topk] int64 for a MoE model, None for a dense one."""
    sample_ids: tuple[str, ...]
    """The samples' ids, row order."""

    @property
    def num_rows(self) -> int:
        """Rows, padding rows included."""
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        """Padded length T of the input rows."""
        return int(self.input_ids.shape[1])

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that carry loss."""
        return int(self.loss_mask.sum().item())

    @property
    def real_rows(self) -> Tensor:
        """[B] bool: rows that hold a sample (not padding rows added by ``padded_to`` or ``empty_like``)."""
        return torch.tensor([bool(sid) for sid in self.sample_ids], dtype=torch.bool)

    @property
    def all_routed(self) -> bool:
        """Whether the batch can be replayed: a MoE batch whose samples all carry routing (padding rows replay their
        filler experts)."""
        return self.routing is not None and bool((self.has_routing | ~self.real_rows).all().item())

    def megatron_routing(self, *, sp_rank: int = 0, sp_size: int = 1) -> list[Tensor]:
        """The routing as megatron's per-layer ``[T * B, topk]`` tensors, tokens flattened sequence-major."""
        if self.routing is None:
            raise ConfigError("this batch has no routing: it was collated for a dense model (routing_shape=None)")
        return to_megatron_layers(self.routing, sp_rank=sp_rank, sp_size=sp_size)

    def select(self, rows: Sequence[int], *, pad_multiple: int = 1) -> TrainBatch:
        """The given rows, trimmed to their own longest row (rounded up to ``pad_multiple``)."""
        index = torch.as_tensor(list(rows), dtype=torch.int64)
        longest = int(self.attention_mask[index].sum(-1).max().item()) if len(index) else 1
        seq = min(self.seq_len, _round_up(max(longest, 2), pad_multiple))
        values: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sample_ids":
                values[f.name] = tuple(value[i] for i in index.tolist())
            elif value is None:
                values[f.name] = None
            elif f.name in _PER_INPUT_POSITION:
                values[f.name] = value[index, :seq]
            elif f.name in _PER_COLUMN:
                values[f.name] = value[index, : seq - 1]
            else:
                values[f.name] = value[index]
        return TrainBatch(**values)

    def padded_to(self, rows: int, seq: int, *, pad_token_id: int = 0) -> TrainBatch:
        """This batch grown to ``[rows, seq]`` with padding rows/columns that carry no loss and no routing.

        Used to give every rank the same micro-batch count and shapes where a collective inside the forward (EP
        token dispatch) needs it.
        """
        if rows < self.num_rows or seq < self.seq_len:
            raise ConfigError(f"cannot pad a [{self.num_rows}, {self.seq_len}] batch down to [{rows}, {seq}]")
        add_rows, add_cols = rows - self.num_rows, seq - self.seq_len
        fill = {
            "input_ids": pad_token_id,
            "targets": pad_token_id,
            "token_versions": -1,
        }
        values: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sample_ids":
                values[f.name] = value + ("",) * add_rows
            elif value is None:
                values[f.name] = None
            elif f.name == "routing":
                values[f.name] = _pad_routing_tensor(value, add_rows, add_cols)
            elif f.name == "temperatures":
                values[f.name] = torch.cat([value, torch.ones(add_rows, dtype=value.dtype)])
            elif f.name in _PER_INPUT_POSITION or f.name in _PER_COLUMN:
                values[f.name] = _pad_2d(value, add_rows, add_cols, fill.get(f.name, 0))
            else:
                values[f.name] = torch.cat([value, torch.zeros(add_rows, dtype=value.dtype)])
        return TrainBatch(**values)

    def response_values(self, per_column: Tensor) -> list[np.ndarray]:
        """Slice a ``[B, T-1]`` per-column tensor (e.g. log-probs) into each real sample's ``[R]`` response values."""
        out = []
        values = per_column.detach().float().cpu().numpy()
        for b in range(self.num_rows):
            if not self.sample_ids[b]:
                continue  # a padding row
            p, r = int(self.prompt_lens[b]), int(self.response_lens[b])
            out.append(values[b, p - 1 : p - 1 + r].astype(np.float32))
        return out


# Which TrainBatch fields are indexed by input position [B, T] and which by predicted column [B, T-1].
_PER_INPUT_POSITION = frozenset({"input_ids", "attention_mask", "routing_mask", "routing"})
_PER_COLUMN = frozenset({"targets", "loss_mask", "behaviour_logprobs", "token_versions"})


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pad_2d(value: Tensor, add_rows: int, add_cols: int, fill: int) -> Tensor:
    rows, cols = value.shape[0] + add_rows, value.shape[1] + add_cols
    out = torch.full((rows, cols), fill, dtype=value.dtype)
    out[: value.shape[0], : value.shape[1]] = value
    return out


def _pad_routing_tensor(routing: Tensor, add_rows: int, add_cols: int) -> Tensor:
    batch, seq, layers, topk = routing.shape
    # Padding tokens are dispatched like any other token, so they need valid, distinct experts.
    out = torch.arange(topk, dtype=routing.dtype).expand(batch + add_rows, seq + add_cols, layers, topk).clone()
    out[:batch, :seq] = routing
    return out


def collate(
    groups: Sequence[Sequence[Sample]],
    *,
    advantage: AdvantageConfig | None = None,
    routing_shape: RoutingShape | None = None,
    temperature: float | None = None,
    pad_token_id: int = 0,
    pad_multiple: int = 1,
    failed_in_group_stats: bool = True,
    group_weights: Sequence[float] | None = None,
) -> TrainBatch:
    """Collate prompt groups (each a list of Samples of one prompt) into a :class:`TrainBatch`.

    ``group_weights`` (one per group, default 1) are the group filters' weights, copied to each sample of the group.

    ``routing_shape`` is the model's MoE layout (None for a dense model: routing is then ignored). ``temperature``
    overrides every sample's sampling temperature when given. ``pad_multiple`` rounds T up (sequence parallelism
    needs T divisible by the TP size).
    """
    samples = [s for group in groups for s in group]
    if not samples:
        raise SampleError("collate got no samples; every rank needs at least one prompt group per step")
    if pad_multiple < 1:
        raise ConfigError(f"pad_multiple={pad_multiple}; it must be >= 1")
    lengths = [s.num_prompt_tokens + s.num_response_tokens for s in samples]
    seq = _round_up(max(max(lengths), 2), pad_multiple)
    batch = len(samples)

    input_ids = torch.full((batch, seq), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros(batch, seq, dtype=torch.int64)
    loss_mask = torch.zeros(batch, seq - 1, dtype=torch.bool)
    behaviour = torch.zeros(batch, seq - 1, dtype=torch.float32)
    versions = torch.full((batch, seq - 1), -1, dtype=torch.int64)
    routing_mask = torch.zeros(batch, seq, dtype=torch.bool)
    trainable = torch.tensor([s.status in TRAINABLE_STATUSES for s in samples], dtype=torch.bool)
    for b, s in enumerate(samples):
        p, r = s.num_prompt_tokens, s.num_response_tokens
        input_ids[b, :p] = torch.from_numpy(s.prompt_ids.astype(np.int64))
        input_ids[b, p : p + r] = torch.from_numpy(s.response_ids.astype(np.int64))
        attention_mask[b, : p + r] = 1
        # Response token j is predicted at input position p + j - 1 (see the module docstring).
        columns = slice(p - 1, p - 1 + r)
        sample_mask = np.asarray(s.loss_mask, dtype=bool)  # Sample fills in all-ones when none was given
        loss_mask[b, columns] = torch.from_numpy(sample_mask) & bool(trainable[b])
        behaviour[b, columns] = torch.from_numpy(s.rollout_logprobs.astype(np.float32))
        versions[b, columns] = torch.from_numpy(s.token_versions.astype(np.int64))

    routing, has_routing = _collate_routing(samples, seq, routing_shape)
    if routing is not None:
        for b, s in enumerate(samples):
            if has_routing[b]:
                routing_mask[b, : s.num_prompt_tokens + s.num_response_tokens - 1] = True

    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    if group_weights is not None and len(group_weights) != len(groups):
        raise SampleError(f"{len(group_weights)} group weights for {len(groups)} groups; give one per group")
    weights = [1.0] * len(groups) if group_weights is None else [float(w) for w in group_weights]
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise SampleError(f"group weights {weights} must be finite and >= 0")
    sample_weights = torch.tensor([weights[g] for g, group in enumerate(groups) for _ in group], dtype=torch.float32)
    group_index = torch.tensor([g for g, group in enumerate(groups) for _ in group], dtype=torch.int64)
    in_stats = trainable | failed_in_group_stats
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=input_ids[:, 1:].clone(),
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        token_versions=versions,
        advantages=_advantages(rewards, group_index, in_stats, advantage or AdvantageConfig()),
        rewards=rewards,
        sample_weights=sample_weights,
        temperatures=_temperatures(samples, temperature),
        group_index=group_index,
        trainable=trainable,
        prompt_lens=torch.tensor([s.num_prompt_tokens for s in samples], dtype=torch.int64),
        response_lens=torch.tensor([s.num_response_tokens for s in samples], dtype=torch.int64),
        has_routing=has_routing,
        routing_mask=routing_mask,
        routing=routing,
        sample_ids=tuple(s.sample_id for s in samples),
    )


def _advantages(rewards: Tensor, group_index: Tensor, in_stats: Tensor, cfg: AdvantageConfig) -> Tensor:
    out = torch.zeros_like(rewards)
    if bool(in_stats.any()):
        out[in_stats] = grpo_advantages(rewards[in_stats], group_index[in_stats], cfg)
    return out


def _temperatures(samples: Sequence[Sample], override: float | None) -> Tensor:
    if override is not None:
        if override <= 0:
            raise ConfigError(f"temperature={override}; it must be > 0 (log-probs of greedy decoding are undefined)")
        return torch.full((len(samples),), float(override), dtype=torch.float32)
    temps = torch.tensor([s.sampling.temperature for s in samples], dtype=torch.float32)
    if bool((temps <= 0).any()):
        bad = samples[int(torch.nonzero(temps <= 0)[0, 0])]
        raise SampleError(
            f"sample {bad.sample_id} was sampled at temperature {bad.sampling.temperature}; greedy samples have no "
            "behaviour log-probs to train against. Sample with temperature > 0 or set the trainer's temperature"
        )
    return temps


def _collate_routing(
    samples: Sequence[Sample], seq: int, shape: RoutingShape | None
) -> tuple[Tensor | None, Tensor]:
    if shape is None:
        return None, torch.zeros(len(samples), dtype=torch.bool)
    has = torch.tensor([s.routed_experts is not None for s in samples], dtype=torch.bool)
    rows = []
    for s in samples:
        arr = s.routed_experts if s.routed_experts is not None else np.zeros((0, shape.num_layers, shape.topk), "u1")
        try:
            rows.append(pad_routing([arr], seq, num_layers=shape.num_layers, topk=shape.topk,
                                    num_experts=shape.num_experts))
        except SampleError as err:
            raise SampleError(
                f"sample_id {s.sample_id}: {err}; was it generated by a model with a different MoE layout?"
            ) from err
    routing = torch.cat(rows)
    return routing, has


def split_rows(
    batch: TrainBatch, *, max_samples: int, max_tokens: int | None = None, pad_multiple: int = 1,
    rows: Sequence[int] | None = None,
) -> list[list[int]]:
    """Row indices of micro-batches of at most ``max_samples`` rows and ``max_tokens`` padded tokens (rows x length),
    over ``rows`` (default: all, in order).

    Row order is kept, except that on a MoE batch samples without routing go after those with it, so only the
    micro-batches that hold them lose replay. A single sample longer than ``max_tokens`` forms a micro-batch alone.
    """
    if max_samples < 1:
        raise ConfigError(f"max_samples={max_samples}; a micro-batch needs at least one sample")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"max_tokens={max_tokens}; it must be >= 1 or None")
    lengths = batch.attention_mask.sum(-1).tolist()
    order = list(range(batch.num_rows)) if rows is None else list(rows)
    runs = [order]
    if batch.routing is not None and not batch.all_routed:
        routed = batch.has_routing.tolist()
        runs = [[b for b in order if routed[b]], [b for b in order if not routed[b]]]
    chunks: list[list[int]] = []
    for run in runs:
        current: list[int] = []
        longest = 0
        for b in run:
            length = _round_up(max(int(lengths[b]), 2), pad_multiple)
            grown = max(longest, length)
            over_tokens = max_tokens is not None and (len(current) + 1) * grown > max_tokens
            if current and (len(current) >= max_samples or over_tokens):
                chunks.append(current)
                current, grown = [], length
            current.append(b)
            longest = grown
        if current:
            chunks.append(current)
    return chunks


def split_micro_batches(
    batch: TrainBatch, *, max_samples: int, max_tokens: int | None = None, pad_multiple: int = 1
) -> list[TrainBatch]:
    """The micro-batches of :func:`split_rows`, each trimmed to its own longest row."""
    chunks = split_rows(batch, max_samples=max_samples, max_tokens=max_tokens, pad_multiple=pad_multiple)
    return [batch.select(rows, pad_multiple=pad_multiple) for rows in chunks]


def empty_like(batch: TrainBatch, *, pad_token_id: int = 0) -> TrainBatch:
    """A one-row, all-padding batch shaped like ``batch`` (no loss tokens): a placeholder micro-batch for a rank
    that has run out of work while its peers still need it for a collective forward."""
    one = batch.select([0])
    blank = replace(
        one,
        input_ids=torch.full_like(one.input_ids, pad_token_id),
        attention_mask=torch.zeros_like(one.attention_mask),
        targets=torch.full_like(one.targets, pad_token_id),
        loss_mask=torch.zeros_like(one.loss_mask),
        behaviour_logprobs=torch.zeros_like(one.behaviour_logprobs),
        token_versions=torch.full_like(one.token_versions, -1),
        advantages=torch.zeros_like(one.advantages),
        rewards=torch.zeros_like(one.rewards),
        sample_weights=torch.zeros_like(one.sample_weights),
        trainable=torch.zeros_like(one.trainable),
        prompt_lens=torch.zeros_like(one.prompt_lens),
        response_lens=torch.zeros_like(one.response_lens),
        has_routing=torch.zeros_like(one.has_routing),
        routing_mask=torch.zeros_like(one.routing_mask),
        routing=None if one.routing is None else _pad_routing_tensor(one.routing[:0], 1, 0),
        sample_ids=("",),
    )
    return blank
