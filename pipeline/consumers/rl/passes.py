"""The forwards of a train step: the policy (free or under replayed routing), the frozen reference, the router
probe, and what they measure (rollout/train mismatch with and without R3, routing agreement).

:class:`Passes` owns megatron's router-replay state for the policy and the reference; the train step only decides
which micro-batches run and in what order (train_step.py's docstring has the protocol).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.config.trainer import LossConfig, TrainStepConfig
from pipeline.consumers.megatron.config import ModelConfig
from pipeline.consumers.megatron.model import forward_logits, model_device
from pipeline.consumers.megatron.router_replay import RouterReplay, topk_match
from pipeline.consumers.megatron.scoring import (
    RouterProbe,
    install_replay_hooks,
    replay_hooks,
    replay_registry,
    score_tokens,
)
from pipeline.consumers.rl.batch import TrainBatch
from pipeline.consumers.rl.loss import aggregate, kl_penalty, policy_loss
from pipeline.consumers.rl.loss_plugins import LossInputs, LossPlugins, local_units
from pipeline.consumers.trainer.metrics import Accumulator
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)
Tensor = torch.Tensor


def _check_reference(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    if reference is model:
        raise ConfigError(
            "the reference model is the policy model itself; build a second model (build_gpt_model with the same "
            "layout) and load the starting weights into it"
        )
    policy = {name: tuple(p.shape) for name, p in model.named_parameters()}
    ref = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    if policy != ref:
        diff = sorted(set(policy.items()) ^ set(ref.items()))[:4]
        raise ConfigError(
            f"the reference model's parameters differ from the policy's (first differences: {diff}); build it with "
            "the same ModelConfig and ParallelConfig as the policy"
        )


@dataclass(frozen=True)
class Norms:
    """Global-batch counts that make micro-batch and per-rank losses add up to the global-batch loss."""

    tokens: float
    normalizer: float
    loss_cfg: LossConfig


class Passes:
    """Runs and measures the forwards of one policy (and its optional KL reference) for the train step."""

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, cfg: TrainStepConfig,
                 reference: torch.nn.Module | None) -> None:
        self.model, self.model_cfg, self.cfg = model, model_cfg, cfg
        self.policy_version: int | None = None
        """The version of the weights being trained, when the trainer says (for the lag-0 mismatch)."""
        replay_capable = model_cfg.is_moe and bool(getattr(model.config, "moe_enable_routing_replay", False))
        if cfg.r3 and model_cfg.is_moe and not replay_capable:
            raise ConfigError(
                "r3=True needs a model built with build_gpt_model(..., r3=True) (megatron's "
                "moe_enable_routing_replay); rebuild the model or set r3=false"
            )
        if cfg.r3 and not model_cfg.is_moe:
            log.warning("r3=True is ignored: the model is dense, there is no routing to replay")
        if replay_capable:
            # Building another model (the reference, say) resets megatron's replay list; the policy's hooks go back.
            install_replay_hooks(replay_hooks(model))
        self._replay = RouterReplay.for_model(model_cfg) if replay_capable else None
        self.reference, self._reference_hooks = self._adopt_reference(reference)
        self._probe = RouterProbe(model, model_cfg.moe_topk) if model_cfg.is_moe else None
        self.plugins = LossPlugins(cfg.loss)

    def _adopt_reference(self, reference: torch.nn.Module | None) -> tuple[torch.nn.Module | None, list[Any]]:
        """(the frozen reference or None, its replay hooks): checks it fits the config and the policy."""
        kl_coef = self.cfg.loss.kl_coef
        if reference is None:
            if kl_coef > 0:
                raise ConfigError(
                    f"loss.kl_coef={kl_coef} needs a reference model to take the KL against: pass reference= (a "
                    "second build_gpt_model like the policy, loaded with the starting weights), or set loss.kl_coef=0"
                )
            return None, []
        if kl_coef == 0:
            # Keeping it would cost a forward per micro-batch for a term that is multiplied by 0.
            log.warning("a reference model was passed but loss.kl_coef=0: it is ignored and not run")
            return None, []
        _check_reference(self.model, reference)
        hooks = replay_hooks(reference)
        if self._replay is not None and self.cfg.r3 and len(hooks) != self.model_cfg.num_moe_layers:
            raise ConfigError(
                "r3=True with a KL penalty needs the reference built with build_gpt_model(..., r3=True) too, so it "
                "scores under the same replayed routing as the policy; rebuild the reference or set r3=false"
            )
        reference.requires_grad_(False)
        return reference, hooks

    @property
    def replay_capable(self) -> bool:
        """Whether the policy was built with megatron's routing replay (a MoE model with r3 hooks)."""
        return self._replay is not None

    def close(self) -> None:
        """Remove the router hooks and leave megatron's router replay switched off."""
        if self._probe is not None:
            self._probe.close()
        if self._replay is not None:
            self._replay.off()

    def sp(self) -> tuple[int, int]:
        """(rank, size) of the sequence-parallel split of the tokens the routers see."""
        if not getattr(self.model.config, "sequence_parallel", False):
            return 0, 1
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()

    def replays(self, mb: TrainBatch) -> bool:
        return self.cfg.r3 and self._replay is not None and mb.all_routed

    def forward(
        self,
        mb: TrainBatch,
        *,
        replay: bool,
        grad: bool = False,
        entropy: bool = False,
        probe: bool = False,
        model: torch.nn.Module | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(log-probs [B, T-1], entropy or None, dispatched routing [B, T, layers, topk] or None) of ``model``
        (default: the policy); the probe watches the policy's routers only."""
        model = self.model if model is None else model
        device = model_device(model)
        if self._replay is not None:
            if replay:
                assert mb.routing is not None  # replay is only requested for all-routed micro-batches
                sp_rank, sp_size = self.sp()
                self._replay.replay_forward(mb.routing, sp_rank=sp_rank, sp_size=sp_size)
            else:
                self._replay.off()
        probing = probe and self._probe is not None
        if probing:
            self._probe.start()  # type: ignore[union-attr]
        try:
            # Under replay the routers count (for the expert-bias update) only positions whose experts the engine
            # chose: each row's last token has filler experts (the engine never fed it), and padding has too.
            counted = mb.routing_mask if replay else mb.attention_mask.bool()
            with torch.set_grad_enabled(grad):
                logits = forward_logits(model, mb.input_ids.to(device), mb.attention_mask.to(device),
                                        padding_mask=~counted.to(device))
                logprobs, ent = score_tokens(
                    logits,
                    mb.targets,
                    mb.temperatures,
                    entropy=entropy,
                    entropy_grad=self.cfg.loss.entropy_coef > 0
                    or (self.cfg.loss.entropy_grad and self.cfg.loss.has_plugins),
                )
        finally:
            if not grad and self._replay is not None:
                self._replay.off()
        used = self._probe.take(mb.num_rows) if probing else None  # type: ignore[union-attr]
        return logprobs, ent, used

    def _agreement(self, used: Tensor, mb: TrainBatch) -> tuple[float, float]:
        """(matching (token, layer) top-k sets, pairs compared) of dispatched vs sample routing."""
        assert mb.routing is not None
        sp_rank, sp_size = self.sp()
        chunk = mb.seq_len // sp_size
        cols = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
        mask = mb.routing_mask[:, cols]
        match = topk_match(used, mb.routing[:, cols])  # [B, T/sp, layers]
        hits = (match & mask.unsqueeze(-1)).sum()
        return float(hits), float(mask.sum()) * match.shape[-1]

    def _mismatch(self, logprobs: Tensor, mb: TrainBatch) -> tuple[float, float]:
        """(sum over loss tokens of k3 KL(behaviour || trainer), loss tokens)."""
        k3 = kl_penalty(mb.behaviour_logprobs, logprobs.detach().float().cpu(), "k3")
        return float(torch.where(mb.loss_mask, k3, 0.0).sum()), float(mb.loss_mask.sum())

    def _mismatch_lag0(self, proximal: Tensor, mb: TrainBatch, acc: Accumulator) -> None:
        """The mismatch over the tokens sampled by exactly the weights being trained (``policy_version``): their
        gap is the engine's numerics alone, so a rise there means an engine computed them from something else, such
        as a prefix it cached under older weights."""
        if self.policy_version is None:
            return
        k3 = kl_penalty(mb.behaviour_logprobs, proximal.detach().float().cpu(), "k3")
        fresh = mb.loss_mask & (mb.token_versions == self.policy_version)
        acc.add(mismatch_lag0_sum=float(torch.where(fresh, k3, 0.0).sum()), mismatch_lag0_tokens=float(fresh.sum()))

    def proximal_pass(self, mb: TrainBatch, acc: Accumulator) -> tuple[Tensor, Tensor | None]:
        """(proximal, reference or None) log-probs of ``mb`` (both replayed when R3 applies), plus the
        with/without-replay measurements."""
        replayed = self.replays(mb)
        with torch.no_grad():
            proximal, _, used = self.forward(mb, replay=replayed, probe=not replayed)
            self._record_pass(mb, proximal, used, replayed=replayed, acc=acc)
            self._mismatch_lag0(proximal, mb, acc)
            reference = self._reference_pass(mb, replay=replayed)
            if self.cfg.measure_r3 and self._replay is not None:
                # Unconditional, so that every EP rank runs the same number of (collective) forwards.
                other = not replayed and mb.all_routed
                logprobs, _, used = self.forward(mb, replay=other, probe=not other)
                if other or replayed:
                    self._record_pass(mb, logprobs, used, replayed=other, acc=acc)
        if any(mb.sample_ids):
            real = sum(1 for s in mb.sample_ids if s)
            key = "r3_replayed_samples" if replayed else "r3_unreplayed_samples"
            if self.cfg.r3 and self._replay is not None:
                acc.add(**{key: real})
                if not replayed:
                    acc.add(r3_unreplayed_micro_batches=1)
        return proximal.detach(), reference

    def _reference_pass(self, mb: TrainBatch, *, replay: bool) -> Tensor | None:
        """The frozen reference's log-probs of ``mb`` under the same routing as the proximal pass (None without a
        reference). Every rank runs it for every micro-batch, padding included, as EP's collectives require."""
        if self.reference is None:
            return None
        with replay_registry(self._reference_hooks), torch.no_grad():
            logprobs, _, _ = self.forward(mb, replay=replay and bool(self._reference_hooks), model=self.reference)
        return logprobs.detach()

    def _record_pass(
        self, mb: TrainBatch, logprobs: Tensor, used: Tensor | None, *, replayed: bool, acc: Accumulator
    ) -> None:
        total, tokens = self._mismatch(logprobs, mb)
        if replayed:
            acc.add(mismatch_replay_sum=total, mismatch_replay_tokens=tokens)
            return
        acc.add(mismatch_free_sum=total, mismatch_free_tokens=tokens)
        if used is not None:
            hits, pairs = self._agreement(used, mb)
            acc.add(agree_free_hits=hits, agree_free_total=pairs)

    def train_micro_batch(
        self, mb: TrainBatch, proximal: Tensor, reference: Tensor | None, norms: Norms, acc: Accumulator
    ) -> None:
        device = model_device(self.model)
        try:
            logprobs, ent, used = self.forward(
                mb, replay=self.replays(mb), grad=True, entropy=True, probe=mb.routing is not None
            )
            prox = proximal.to(device)
            ref = None if reference is None else reference.to(device)
            if self.plugins.replace is None:
                out = policy_loss(
                    logprobs,
                    mb.behaviour_logprobs.to(device),
                    mb.advantages.to(device),
                    mb.loss_mask.to(device),
                    norms.loss_cfg,
                    proximal=prox,
                    ref=ref,
                    entropy=ent,
                    normalizer=norms.normalizer,
                    sample_weights=mb.sample_weights.to(device),
                )
                loss, metrics = out.loss, out.metrics
            else:
                loss, metrics = self._replaced_loss(mb, logprobs, ent, norms)
            if self.plugins.active and mb.num_loss_tokens > 0:
                loss, metrics = self._with_plugins(mb, logprobs, prox, ref, ent, norms, loss, metrics)
            loss.backward()
        finally:
            # megatron keeps the replay indices (and a backward-replay list) until cleared.
            if self._replay is not None:
                self._replay.off()
        acc.add_loss_metrics(metrics)
        if used is not None:
            hits, pairs = self._agreement(used, mb)
            acc.add(agree_train_hits=hits, agree_train_total=pairs)

    # ------------------------------------------------------------------------------------------------ loss plug-ins

    def _replaced_loss(self, mb: TrainBatch, logprobs: Tensor, ent: Tensor | None,
                       norms: Norms) -> tuple[Tensor, dict[str, float]]:
        """Under ``loss.replace``: no built-in loss, only its token count and entropy metric. The zero keeps the
        graph connected for a micro-batch that holds no loss tokens (a rank's placeholder still runs backward)."""
        mask = mb.loss_mask.to(logprobs.device)
        loss = torch.where(mask, logprobs, 0.0).sum() * 0.0
        metrics = {"num_tokens": float(mb.num_loss_tokens)}
        if ent is not None:
            cfg = norms.loss_cfg
            metrics["entropy"] = float(aggregate(ent.detach().float(), mask, cfg.aggregation,
                                                 norm_length=cfg.norm_length, normalizer=norms.normalizer).item())
        return loss, metrics

    def _with_plugins(self, mb: TrainBatch, logprobs: Tensor, prox: Tensor, ref: Tensor | None, ent: Tensor | None,
                      norms: Norms, loss: Tensor, metrics: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
        """The loss with the replacement and the terms, each scaled by this micro-batch's share of the step."""
        device = logprobs.device
        cfg = norms.loss_cfg
        inputs = LossInputs(
            logprobs=logprobs, proximal=prox, behaviour=mb.behaviour_logprobs.to(device),
            advantages=mb.advantages.to(device), loss_mask=mb.loss_mask.to(device),
            sample_weights=mb.sample_weights.to(device), token_versions=mb.token_versions.to(device),
            rewards=mb.rewards.to(device), group_index=mb.group_index.to(device), targets=mb.targets.to(device),
            ref=ref, entropy=ent, aux_losses={}, sample_ids=mb.sample_ids, aggregation=cfg.aggregation,
            norm_length=cfg.norm_length or 1,  # read by constant_norm alone, which the train step makes set it
            share=local_units(mb.loss_mask, mb.sample_ids, cfg.aggregation) / norms.normalizer,
        )
        metrics = dict(metrics)
        if self.plugins.replace is not None:
            loss, extra = self.plugins.replacement(inputs)
            metrics.update(extra)
        terms, extra = self.plugins.add_terms(inputs)
        metrics.update(extra)
        if terms is not None:
            loss = loss + terms
        metrics["loss"] = float(loss.detach().item())
        return loss, metrics
