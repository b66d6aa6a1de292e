"""Loss plug-ins: user terms added to the policy loss, or a user function that replaces it (docs/plugins.md).

A plug-in is called once per micro-batch with one :class:`LossInputs` and returns ``(value, metrics)``: a 0-dim
tensor and a ``dict[str, float]``. ``value`` is the plug-in's **mean over this micro-batch** (what
:meth:`LossInputs.mean` computes). The train step, not the plug-in, scales it to the micro-batch's share of the
optimizer step:

    contribution = coef * value * share,  share = units of this micro-batch / units of the whole mini-batch

where the units are those the built-in loss normalises by (``loss.aggregation``): loss tokens (``token_mean``),
sequences with loss tokens (``sequence_mean``) or samples (``constant_norm``), counted over every micro-batch of the
optimizer step on every data-parallel rank. Gradients add up over micro-batches and the data-parallel all-reduce sums
them, so the update holds the gradient of ``coef * (the term over the whole mini-batch)``, however the mini-batch was
split; for a value computed with :meth:`LossInputs.mean` that is exactly the built-in aggregation of the per-token
values over the mini-batch. Metrics are scaled the same way, so ``loss/<name>/<key>`` is the mini-batch's mean
(averaged over the step's optimizer steps, as ``loss`` is). A micro-batch without loss tokens (a rank's placeholder,
all samples failed) is not passed to plug-ins.

A wrong answer (not a pair, a value that is not a 0-dim tensor or not finite, a metric that is not a number) raises
:class:`LossPluginError` naming the plug-in and its recipe field: training on a NaN would poison the weights, so the
step stops rather than skipping the term.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pipeline.config.trainer import LOSS_PLUGIN_SIGNATURE, LossConfig, plugin_name
from pipeline.errors import SluiceError
from pipeline.plugins import resolve

log = logging.getLogger(__name__)
Tensor = torch.Tensor
LossFn = Callable[["LossInputs"], Any]


class LossPluginError(SluiceError):
    """A loss plug-in answered with something the loss cannot use (the message names it)."""


@dataclass(frozen=True)
class LossInputs:
    """What a loss plug-in gets for one micro-batch; every tensor is on the model's device.

    Per-token tensors are ``[B, T-1]``: column ``t`` is the prediction of token ``t + 1`` of the row (the layout of
    ``pipeline/consumers/rl/batch.py``), and only ``loss_mask`` columns are response tokens to train on; values
    elsewhere are padding or prompt, and may be anything. Per-sample tensors are ``[B]``. Rows whose ``sample_ids``
    entry is empty are padding rows (no loss tokens).
    """

    logprobs: Tensor
    """[B, T-1] float32: log-probs of ``targets`` under the current weights, WITH gradient (the only such input,
    besides ``entropy`` when it was asked for)."""
    proximal: Tensor
    """[B, T-1]: the same tokens scored by the weights before this batch's first optimizer step (no grad)."""
    behaviour: Tensor
    """[B, T-1]: the rollout engine's log-probs (no grad)."""
    advantages: Tensor
    """[B]: GRPO group-normalised advantages."""
    loss_mask: Tensor
    """[B, T-1] bool: response tokens that are trained on."""
    sample_weights: Tensor
    """[B]: each sample's group-filter weight (1 unless a filter reweighted its group; docs/plugins.md)."""
    token_versions: Tensor
    """[B, T-1] int64: the policy version that produced each response token (-1 elsewhere)."""
    rewards: Tensor
    """[B] float32."""
    group_index: Tensor
    """[B] int64: the sample's prompt group (equal ids = same prompt)."""
    targets: Tensor
    """[B, T-1] int64: the token each column predicts."""
    ref: Tensor | None
    """[B, T-1]: the frozen reference model's log-probs when ``loss.kl_coef > 0``, else None."""
    entropy: Tensor | None
    """[B, T-1]: entropy of the (temperature-scaled) next-token distribution; with gradient only when
    ``loss.entropy_grad`` or ``loss.entropy_coef > 0``."""
    aux_losses: Mapping[str, Tensor]
    """The model's own auxiliary losses by name. Empty for sluice's models: megatron's MoE load-balancing loss is off
    (``moe_aux_loss_coeff = 0``), and megatron would add its gradient inside backward rather than return it."""
    sample_ids: tuple[str, ...]
    """Row order; empty for padding rows."""
    aggregation: Literal["token_mean", "sequence_mean", "constant_norm"] = "token_mean"
    """The built-in loss's aggregation, which :meth:`mean` follows."""
    norm_length: int = 1
    """The constant length of ``constant_norm``."""
    share: float = 1.0
    """This micro-batch's share of the optimizer step (for information: the train step applies it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free for plug-ins' own use; sluice puts nothing here."""

    @property
    def num_tokens(self) -> int:
        """Loss tokens in this micro-batch."""
        return int(self.loss_mask.sum().item())

    def mean(self, values: Tensor, *, weighted: bool = True) -> Tensor:
        """Per-token ``[B, T-1]`` (or per-sample ``[B]``, spread over each sample's loss tokens) values reduced over
        the loss tokens of this micro-batch the way the built-in loss is: token mean, mean of sequence means, or sum
        over (samples x norm_length). ``weighted`` multiplies each sample by its group-filter weight (the normaliser
        stays unweighted, as in the built-in loss)."""
        mask = self.loss_mask.bool()
        if values.dim() == 1:
            values = values.unsqueeze(-1).expand(mask.shape)
        if values.shape != mask.shape:
            raise LossPluginError(f"LossInputs.mean got values of shape {tuple(values.shape)}; it takes [B, T-1] = "
                                  f"{tuple(mask.shape)} or [B] = ({mask.shape[0]},)")
        masked = torch.where(mask, values.float(), 0.0)
        if weighted:
            masked = masked * self.sample_weights.float().unsqueeze(-1)
        per_row_tokens = mask.sum(-1).float()
        if self.aggregation == "token_mean":
            return masked.sum() / per_row_tokens.sum().clamp(min=1.0)
        if self.aggregation == "sequence_mean":
            per_seq = masked.sum(-1) / per_row_tokens.clamp(min=1.0)
            return per_seq.sum() / (per_row_tokens > 0).sum().clamp(min=1).float()
        rows = max(sum(1 for s in self.sample_ids if s), 1)
        return masked.sum() / float(rows * self.norm_length)


def local_units(loss_mask: Tensor, sample_ids: tuple[str, ...], aggregation: str) -> float:
    """This micro-batch's count of what the loss normaliser counts (see the module docstring)."""
    if aggregation == "token_mean":
        return float(loss_mask.sum().item())
    if aggregation == "sequence_mean":
        return float((loss_mask.sum(-1) > 0).sum().item())
    return float(sum(1 for s in sample_ids if s))


@dataclass(frozen=True)
class _Plugin:
    field: str
    ref: str
    name: str
    coef: float
    fn: LossFn


class LossPlugins:
    """The loss plug-ins a :class:`LossConfig` names, resolved once (the recipe's ``plugins.paths`` must be active,
    as they are in any process that loaded the recipe)."""

    def __init__(self, cfg: LossConfig, prefix: str = "trainer.loss") -> None:
        def load(fld: str, ref: str) -> LossFn:
            return resolve(ref, field=fld, signature=LOSS_PLUGIN_SIGNATURE)

        self.terms = [_Plugin(f"{prefix}.terms[{i}].fn", t.fn, t.label(), t.coef, load(f"{prefix}.terms[{i}].fn", t.fn))
                      for i, t in enumerate(cfg.terms)]
        self.replace = None if cfg.replace is None else _Plugin(
            f"{prefix}.replace", cfg.replace, plugin_name(cfg.replace), 1.0, load(f"{prefix}.replace", cfg.replace))
        self._warned: set[str] = set()

    @property
    def active(self) -> bool:
        return bool(self.terms) or self.replace is not None

    def replacement(self, inputs: LossInputs) -> tuple[Tensor, dict[str, float]]:
        """(the replacement's loss scaled by the share, its ``loss/<name>/...`` metrics)."""
        assert self.replace is not None
        return self._call(self.replace, inputs, needs_grad=True)

    def add_terms(self, inputs: LossInputs) -> tuple[Tensor | None, dict[str, float]]:
        """(sum of coef x term x share, or None without terms; their ``loss/<name>/...`` metrics)."""
        total: Tensor | None = None
        metrics: dict[str, float] = {}
        for term in self.terms:
            value, m = self._call(term, inputs, needs_grad=False)
            metrics.update(m)
            total = term.coef * value if total is None else total + term.coef * value
        return total, metrics

    def _call(self, plugin: _Plugin, inputs: LossInputs, *, needs_grad: bool) -> tuple[Tensor, dict[str, float]]:
        what = f"loss plug-in {plugin.ref!r} ({plugin.field})"
        try:
            out = plugin.fn(inputs)
        except Exception as e:  # re-raised naming the plug-in: a bare traceback from user code names no recipe field
            raise LossPluginError(f"{what} raised {type(e).__name__}: {e}") from e
        if not isinstance(out, tuple | list) or len(out) != 2:
            raise LossPluginError(f"{what} returned {type(out).__name__}; it must return (value, metrics): a 0-dim "
                                  "tensor and a dict[str, float]")
        value, metrics = out
        if not isinstance(value, Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise LossPluginError(f"{what} returned a value of shape {shape}; it must be a 0-dim tensor (reduce it "
                                  "with inputs.mean(values), or .mean())")
        if not bool(torch.isfinite(value.detach()).item()):
            raise LossPluginError(f"{what} returned {float(value.item())} on a micro-batch of {inputs.num_tokens} "
                                  f"loss tokens (samples {[s for s in inputs.sample_ids if s][:4]}); the step stops "
                                  "rather than train on it")
        if not value.requires_grad:
            if needs_grad:
                raise LossPluginError(f"{what} returned a value without gradient; a replacement loss must be computed "
                                      "from inputs.logprobs (or inputs.entropy with trainer.loss.entropy_grad = true)")
            if plugin.field not in self._warned:
                self._warned.add(plugin.field)
                log.warning("%s returned a value without gradient: it changes the reported loss, not the update", what)
        if not isinstance(metrics, Mapping):
            raise LossPluginError(f"{what} returned metrics of type {type(metrics).__name__}; return a dict[str, "
                                  "float] (or {})")
        scaled = {f"loss/{plugin.name}/value": float(value.detach().item()) * inputs.share}
        for key, v in metrics.items():
            try:
                number = float(v)
            except (TypeError, ValueError):
                raise LossPluginError(f"{what} returned metric {key!r} = {v!r}; metrics must be numbers") from None
            if not isinstance(key, str) or not math.isfinite(number):
                raise LossPluginError(f"{what} returned metric {key!r} = {v!r}; metrics need str keys and finite "
                                      "values")
            scaled[f"loss/{plugin.name}/{key}"] = number * inputs.share
        return value * inputs.share, scaled
