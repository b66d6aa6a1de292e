"""Per-step training metrics: partial sums on each rank, reduced over the data-parallel ranks.

Token means (clip fraction, IS weights, mismatch) are combined weighted by each micro-batch's loss tokens, over every
mini-batch of the step, so they describe all the updates of a drained batch; loss terms are the mean per optimizer
step. A quantity that could not be measured (no routing, a dense model) is left out rather than reported as 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# Means over loss tokens that policy_loss reports per micro-batch; combined weighted by each micro-batch's tokens.
_TOKEN_MEANS = (
    "mismatch_k3",
    "mismatch_k1",
    "policy_kl_k3",
    "clip_fraction",
    "clip_high_fraction",
    "clip_low_fraction",
    "is_weight_mean",
    "is_weight_applied_mean",
    "masked_fraction",
    "is_capped_fraction",
)
# Loss terms already divided by the global count: they add up over micro-batches and ranks.
_ADDITIVE = ("loss", "pg_loss", "entropy", "kl_ref")
_COUNTS = (
    "num_tokens",
    "scored_tokens",
    "num_samples",
    "num_trainable_samples",
    "num_groups",
    "padded_tokens",
    "micro_batches",
    "reward_sum",
    "advantage_abs_sum",
    "r3_replayed_samples",
    "r3_unreplayed_samples",
    "r3_unreplayed_micro_batches",
    "agree_free_hits",
    "agree_free_total",
    "agree_train_hits",
    "agree_train_total",
    "mismatch_replay_sum",
    "mismatch_replay_tokens",
    "mismatch_free_sum",
    "mismatch_free_tokens",
    "mismatch_lag0_sum",
    "mismatch_lag0_tokens",
    "builtin_loss_calls",
)
_SUMS = _ADDITIVE + tuple(f"w.{k}" for k in _TOKEN_MEANS) + _COUNTS
_MAXES = ("is_weight_max", "neg.is_weight_min", "time/step_s")


@dataclass
class Accumulator:
    """Per-rank partial sums, maxima and minima; ``reduce`` combines them over the data-parallel ranks."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_SUMS, 0.0))
    maxes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_MAXES, -math.inf))
    plugin_sums: dict[str, float] = field(default_factory=dict)
    """``loss/<name>/<key>`` metrics of loss plug-ins, already scaled by each micro-batch's share: they add up."""

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self.sums[key] += float(value)

    def add_loss_metrics(self, metrics: dict[str, float]) -> None:
        tokens = metrics.get("num_tokens", 0.0)
        for key in _ADDITIVE:
            self.sums[key] += metrics.get(key, 0.0)
        for key, value in metrics.items():
            if key.startswith("loss/"):
                self.plugin_sums[key] = self.plugin_sums.get(key, 0.0) + value
        if "pg_loss" not in metrics:
            return  # loss.replace: the built-in loss and its diagnostics did not run
        self.sums["builtin_loss_calls"] += 1
        if tokens > 0:
            for key in _TOKEN_MEANS:
                self.sums[f"w.{key}"] += metrics[key] * tokens
            self.maxes["is_weight_max"] = max(self.maxes["is_weight_max"], metrics["is_weight_max"])
            self.maxes["neg.is_weight_min"] = max(self.maxes["neg.is_weight_min"], -metrics["is_weight_min"])
        # Every epoch scores each token again: these weight the token means; num_tokens counts the batch's once.
        self.sums["scored_tokens"] += tokens

    def reduce(self, group: Any) -> tuple[dict[str, float], dict[str, float]]:
        sums = torch.tensor([self.sums[k] for k in _SUMS], dtype=torch.float64)
        maxes = torch.tensor([self.maxes[k] for k in _MAXES], dtype=torch.float64)
        plugin_keys = sorted(self.plugin_sums)
        distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        if distributed:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
            plugin_keys = _union_keys(plugin_keys, group)
        plugin = torch.tensor([self.plugin_sums.get(k, 0.0) for k in plugin_keys], dtype=torch.float64)
        if distributed and plugin_keys:
            dist.all_reduce(plugin, op=dist.ReduceOp.SUM, group=group)
        out = dict(zip(_SUMS, sums.tolist(), strict=True))
        out.update(zip(plugin_keys, plugin.tolist(), strict=True))
        return out, dict(zip(_MAXES, maxes.tolist(), strict=True))


def _union_keys(keys: list[str], group: Any) -> list[str]:
    """The sorted union of every rank's metric names (a rank may never have called a plug-in this step). Each rank
    writes its msgpack-encoded names into its own row and one SUM all-reduce hands every rank all rows: no pickle."""
    import msgpack

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    data = msgpack.packb(keys, use_bin_type=True)
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    rows = torch.zeros(world, int(size.item()) + 1, dtype=torch.int64)  # int64: SUM of bytes must not overflow
    rows[rank, 0] = len(data)
    rows[rank, 1 : len(data) + 1] = torch.tensor(list(data), dtype=torch.int64)
    dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    union: set[str] = set()
    for row in rows.tolist():
        union.update(msgpack.unpackb(bytes(row[1 : row[0] + 1]), raw=False))
    return sorted(union)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def final_metrics(
    sums: dict[str, float], maxes: dict[str, float], *, kl_ref: bool, updates: int = 1
) -> dict[str, float]:
    """The step's metrics from the reduced sums; ``updates`` is its optimizer steps (the same on every rank)."""
    # Each optimizer step's loss terms are divided by that mini-batch's global count; report their mean per step.
    updates = max(updates, 1)
    # Under loss.replace the built-in loss never ran: its parts and diagnostics are left out, not reported as 0.
    builtin = sums["builtin_loss_calls"] > 0
    out: dict[str, float] = {k: sums[k] / updates for k in _ADDITIVE
                             if (kl_ref or k != "kl_ref") and (builtin or k in ("loss", "entropy"))}
    out.update({k: v / updates for k, v in sums.items() if k.startswith("loss/")})
    tokens = sums["scored_tokens"]
    if tokens > 0:
        out.update({k: sums[f"w.{k}"] / tokens for k in _TOKEN_MEANS})
        out["is_weight_max"] = maxes["is_weight_max"]
        out["is_weight_min"] = -maxes["neg.is_weight_min"]
    for key in ("num_tokens", "num_samples", "num_trainable_samples", "num_groups", "padded_tokens", "micro_batches"):
        out[key] = sums[key]
    out["optimizer_steps"] = float(updates)
    samples = sums["num_samples"]
    if samples > 0:
        out["reward_mean"] = sums["reward_sum"] / samples
        out["advantage_abs_mean"] = sums["advantage_abs_sum"] / samples
    out["r3/replayed_samples"] = sums["r3_replayed_samples"]
    out["r3/unreplayed_samples"] = sums["r3_unreplayed_samples"]
    out["r3/unreplayed_micro_batches"] = sums["r3_unreplayed_micro_batches"]
    # Only what was measured: a dense model, or samples without routing, leave these out rather than invent zeros.
    derived = {
        "r3/agreement_no_replay": _ratio(sums["agree_free_hits"], sums["agree_free_total"]),
        "r3/agreement_train": _ratio(sums["agree_train_hits"], sums["agree_train_total"]),
        "r3/mismatch_k3_replay": _ratio(sums["mismatch_replay_sum"], sums["mismatch_replay_tokens"]),
        "r3/mismatch_k3_no_replay": _ratio(sums["mismatch_free_sum"], sums["mismatch_free_tokens"]),
        # Over the tokens the trained weights sampled themselves: the engine's numerics alone.
        "mismatch_k3_lag0": _ratio(sums["mismatch_lag0_sum"], sums["mismatch_lag0_tokens"]),
        "mismatch_lag0_tokens": sums["mismatch_lag0_tokens"] or None,
    }
    out.update({k: v for k, v in derived.items() if v is not None})
    return out


