"""The RL loss against numbers worked out by hand: advantages, PPO clipping, the decoupled objective, corrections, KL,
aggregation, masking and gradient direction."""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pipeline.config.trainer import AdvantageConfig, CorrectionConfig, LossConfig
from pipeline.consumers.rl.loss import (
    aggregate,
    entropy_from_logits,
    gather_logprobs,
    grpo_advantages,
    importance_weights,
    kl_penalty,
    policy_loss,
    zero_variance_mask,
)
from pipeline.errors import ConfigError, SluiceError

torch.set_num_threads(1)

LN2 = math.log(2.0)


def lp(*probs: float) -> torch.Tensor:
    """A [1, T] row of log-probs from probabilities."""
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


def col(*probs: float) -> torch.Tensor:
    """A [B, 1] column of log-probs (one token per sequence)."""
    return torch.tensor([[math.log(p)] for p in probs], dtype=torch.float32)


def ones_mask(like: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(like, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------------------- advantages


def test_grpo_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.1, 0.1, 0.1, 0.1, 5.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 3, 3, 11])
    adv = grpo_advantages(rewards, groups, AdvantageConfig(eps=1e-6))
    # Group 7: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> (-1, 0, 1) / (1 + 1e-6).
    expected_7 = torch.tensor([-1.0, 0.0, 1.0]) / (1.0 + 1e-6)
    torch.testing.assert_close(adv[:3], expected_7)
    # Group 3: all rewards equal -> exactly 0.
    assert torch.equal(adv[3:7], torch.zeros(4))
    # Group 11: one sample, no baseline -> 0.
    assert adv[7].item() == 0.0
    assert zero_variance_mask(rewards, groups).tolist() == [False] * 3 + [True] * 5


def test_equal_float64_rewards_give_exactly_zero() -> None:
    # In float64, 0.1 + 0.1 + 0.1 = 0.30000000000000004, so a naive group mean is off by ~1e-17 and normalising by an
    # equally tiny std would turn rounding into a direction.
    rewards = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    adv = grpo_advantages(rewards, torch.zeros(3, dtype=torch.long), AdvantageConfig(eps=1e-30))
    assert adv.dtype == torch.float64 and torch.equal(adv, torch.zeros(3, dtype=torch.float64))


def test_population_std_and_dr_grpo() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    pop = grpo_advantages(rewards, groups, AdvantageConfig(std_unbiased=False, eps=1e-8))
    # Population std of (1, 2, 3) is sqrt(2/3).
    torch.testing.assert_close(pop[:3], torch.tensor([-1.0, 0.0, 1.0]) / math.sqrt(2.0 / 3.0))
    # (0, 4): population std 2 -> (-1, 1).
    torch.testing.assert_close(pop[3:], torch.tensor([-1.0, 1.0]))
    dr = grpo_advantages(rewards, groups, AdvantageConfig(normalize_std=False))
    torch.testing.assert_close(dr, torch.tensor([-1.0, 0.0, 1.0, -2.0, 2.0]))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=32)),
        min_size=1,
        max_size=30,
    )
)
def test_advantages_have_zero_mean_and_unit_std_per_group(pairs: list[tuple[int, float]]) -> None:
    groups = torch.tensor([g for g, _ in pairs])
    rewards = torch.tensor([r for _, r in pairs], dtype=torch.float32)
    adv = grpo_advantages(rewards, groups, AdvantageConfig(eps=1e-6)).double()
    for g in groups.unique():
        a, r = adv[groups == g], rewards[groups == g].double()
        assert abs(a.sum().item()) < 1e-4 * len(a)
        if len(a) > 1 and r.std().item() > 1e-3:
            assert abs(a.std().item() - 1.0) < 1e-3
        if r.max() == r.min():
            assert torch.all(a == 0)


# ---------------------------------------------------------------------------------------------------- log-probs, KL


def test_gather_logprobs_with_temperature() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    tokens = torch.tensor([[1]])
    torch.testing.assert_close(gather_logprobs(logits, tokens), torch.tensor([[math.log(0.75)]]))
    # T = 2: logits (0, ln3 / 2) -> p(1) = sqrt(3) / (1 + sqrt(3)).
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(gather_logprobs(logits, tokens, 2.0), torch.tensor([[math.log(s3 / (1 + s3))]]))
    torch.testing.assert_close(entropy_from_logits(torch.zeros(1, 1, 4)), torch.tensor([[math.log(4.0)]]))
    with pytest.raises(ConfigError):
        gather_logprobs(logits, tokens, 0.0)


def test_kl_estimators_by_hand() -> None:
    cur, ref = lp(0.5), lp(0.25)
    # log(pi/ref) = ln 2.
    torch.testing.assert_close(kl_penalty(cur, ref, "k1"), torch.tensor([[LN2]]))
    torch.testing.assert_close(kl_penalty(cur, ref, "k2"), torch.tensor([[0.5 * LN2 * LN2]]))
    # k3 = ref/pi - 1 - ln(ref/pi) = 0.5 - 1 + ln 2.
    torch.testing.assert_close(kl_penalty(cur, ref, "k3"), torch.tensor([[0.5 - 1.0 + LN2]]))
    estimators: tuple[Literal["k1", "k2", "k3"], ...] = ("k1", "k2", "k3")
    for est in estimators:
        assert kl_penalty(cur, cur, est).item() == 0.0


def test_k1_and_k3_are_unbiased_for_kl() -> None:
    """Averaged over pi's own distribution, k1 and k3 give KL(pi || ref) exactly; k3 is never negative."""
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    kl = 0.5 * math.log(2.5) + 0.2 * math.log(0.4)  # the 0.3 term is 0
    logp, logq = p.log().unsqueeze(0), q.log().unsqueeze(0)
    unbiased: tuple[Literal["k1", "k3"], ...] = ("k1", "k3")
    for est in unbiased:
        values = kl_penalty(logp, logq, est)
        assert abs((p * values[0]).sum().item() - kl) < 1e-6
    assert torch.all(kl_penalty(logp, logq, "k3") >= 0)
    assert kl_penalty(logp, logq, "k1").min() < 0


def test_kl_term_in_loss_and_its_gradient() -> None:
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k3", correction=CorrectionConfig(type="none"))
    cur = lp(0.5).requires_grad_()
    out = policy_loss(cur, lp(0.5), torch.zeros(1), ones_mask(cur), cfg, ref=lp(0.25))
    k3 = 0.5 - 1.0 + LN2
    assert out.loss.item() == pytest.approx(0.1 * k3, rel=1e-6)
    assert out.metrics["kl_ref"] == pytest.approx(k3, rel=1e-6)
    out.loss.backward()
    # d k3 / d log pi = 1 - ref/pi = 0.5: descending moves pi toward ref.
    assert cur.grad is not None and cur.grad.item() == pytest.approx(0.1 * 0.5, rel=1e-6)
    with pytest.raises(ConfigError, match="ref"):
        policy_loss(cur, lp(0.5), torch.zeros(1), ones_mask(cur), cfg)


# ------------------------------------------------------------------------------------------------------- PPO clipping


def ppo_cfg(dual_clip: float | None = None) -> LossConfig:
    return LossConfig(clip_low=0.2, clip_high=0.3, dual_clip=dual_clip, correction=CorrectionConfig(type="none"))


def test_ppo_clip_both_sides_and_both_signs() -> None:
    # Four one-token sequences; behaviour 0.4, current 0.6 / 0.2 -> ratio 1.5 or 0.5.
    beh = col(0.4, 0.4, 0.4, 0.4)
    cur = col(0.6, 0.2, 0.2, 0.6).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    out = policy_loss(cur, beh, adv, ones_mask(cur), ppo_cfg())
    # A=+1, r=1.5: -min(1.5, 1.3) = -1.3 (clipped high, no gradient)
    # A=+1, r=0.5: -min(0.5, 0.8) = -0.5 (unclipped; d/dlogpi = -r = -0.5)
    # A=-1, r=0.5: -min(-0.5, -0.8) = 0.8 (clipped low, no gradient)
    # A=-1, r=1.5: -min(-1.5, -1.3) = 1.5 (unclipped: PPO never clips this side; d/dlogpi = r = 1.5)
    assert out.loss.item() == pytest.approx((-1.3 - 0.5 + 0.8 + 1.5) / 4, rel=1e-5)
    out.loss.backward()
    assert cur.grad is not None
    torch.testing.assert_close(cur.grad[:, 0], torch.tensor([0.0, -0.5, 0.0, 1.5]) / 4)
    assert out.metrics["clip_fraction"] == pytest.approx(0.5)
    assert out.metrics["clip_high_fraction"] == pytest.approx(0.25)
    assert out.metrics["clip_low_fraction"] == pytest.approx(0.25)


def test_asymmetric_clip_uses_the_right_bound() -> None:
    # r = 1.25 sits inside [0.8, 1.3] but outside a symmetric 0.2 clip.
    beh, cur = col(0.4), col(0.5)
    adv = torch.tensor([1.0])
    assert policy_loss(cur, beh, adv, ones_mask(cur), ppo_cfg()).loss.item() == pytest.approx(-1.25, rel=1e-5)
    sym = LossConfig(clip_low=0.2, clip_high=0.2, correction=CorrectionConfig(type="none"))
    assert policy_loss(cur, beh, adv, ones_mask(cur), sym).loss.item() == pytest.approx(-1.2, rel=1e-5)


def test_dual_clip_caps_negative_advantage_loss() -> None:
    beh, cur = col(0.1), col(0.5).requires_grad_()  # r = 5
    adv = torch.tensor([-1.0])
    plain = policy_loss(cur, beh, adv, ones_mask(cur), ppo_cfg())
    assert plain.loss.item() == pytest.approx(5.0, rel=1e-5)
    out = policy_loss(cur, beh, adv, ones_mask(cur), ppo_cfg(dual_clip=3.0))
    assert out.loss.item() == pytest.approx(3.0, rel=1e-5)
    out.loss.backward()
    assert cur.grad is not None and cur.grad.item() == 0.0


# -------------------------------------------------------------------------------------------------------- corrections


def test_tis_truncates_token_weights() -> None:
    beh = col(0.1, 0.4)
    prox = col(0.3, 0.2)  # w = 3 and 0.5
    cur = prox.clone()  # r = 1: no clipping, loss per token = -w_c * A
    cfg = LossConfig(correction=CorrectionConfig(type="tis", cap=2.0))
    out = policy_loss(cur, beh, torch.tensor([1.0, 1.0]), ones_mask(cur), cfg, proximal=prox)
    torch.testing.assert_close(out.weights.applied[:, 0], torch.tensor([2.0, 0.5]))
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2, rel=1e-5)
    assert out.metrics["is_weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert out.metrics["is_weight_min"] == pytest.approx(0.5, rel=1e-5)
    assert out.metrics["is_weight_mean"] == pytest.approx(1.75, rel=1e-5)
    assert out.metrics["is_weight_applied_mean"] == pytest.approx(1.25, rel=1e-5)
    assert out.metrics["masked_fraction"] == 0.0


def test_tis_sequence_level_product_vs_geometric_mean() -> None:
    beh, prox = lp(0.1, 0.1), lp(0.2, 0.2)  # token weights 2, 2
    mask = ones_mask(beh)
    product_cfg = CorrectionConfig(type="tis", level="sequence", sequence_weight="product", cap=3.0)
    product = importance_weights(prox, beh, mask, product_cfg)
    geo = importance_weights(prox, beh, mask, CorrectionConfig(type="tis", level="sequence", cap=3.0))
    # product: 2 * 2 = 4 -> capped at 3 for both tokens; geometric mean: 2.
    torch.testing.assert_close(product.raw, torch.tensor([[4.0, 4.0]]))
    torch.testing.assert_close(product.applied, torch.tensor([[3.0, 3.0]]))
    torch.testing.assert_close(geo.applied, torch.tensor([[2.0, 2.0]]))


def test_the_capped_share_counts_the_tokens_tis_cut() -> None:
    beh = lp(0.4, 0.2, 0.1)
    prox = lp(0.1, 0.3, 0.3)  # w = 0.25, 1.5, 3: one of three above a cap of 2
    cur = prox.clone().requires_grad_()
    tis = policy_loss(cur, beh, torch.ones(1), ones_mask(cur), LossConfig(correction=CorrectionConfig(cap=2.0)),
                      proximal=prox)
    assert tis.metrics["is_capped_fraction"] == pytest.approx(1 / 3)
    none = policy_loss(cur, beh, torch.ones(1), ones_mask(cur), LossConfig(correction=CorrectionConfig(type="none")),
                       proximal=prox)
    assert none.metrics["is_capped_fraction"] == 0.0


def test_mis_token_level_masks_outside_bounds() -> None:
    beh = lp(0.4, 0.2, 0.1)
    prox = lp(0.1, 0.3, 0.3)  # w = 0.25, 1.5, 3
    cfg = LossConfig(correction=CorrectionConfig(type="mis", low=0.5, high=2.0))
    cur = prox.clone().requires_grad_()
    out = policy_loss(cur, beh, torch.ones(1), ones_mask(cur), cfg, proximal=prox)
    torch.testing.assert_close(out.weights.applied, torch.tensor([[0.0, 1.5, 0.0]]))
    assert out.weights.kept.tolist() == [[False, True, False]]
    # Masked tokens stay in the token count: -(0 + 1.5 + 0) / 3.
    assert out.loss.item() == pytest.approx(-0.5, rel=1e-5)
    assert out.metrics["masked_fraction"] == pytest.approx(2 / 3)
    out.loss.backward()
    assert cur.grad is not None
    assert cur.grad[0, 0].item() == 0.0 and cur.grad[0, 2].item() == 0.0 and cur.grad[0, 1].item() < 0


def test_mis_default_bounds_are_one_sided() -> None:
    w = importance_weights(lp(0.01), lp(0.5), ones_mask(lp(0.5)), CorrectionConfig(type="mis"))  # w = 0.02
    assert w.kept.item() and w.applied.item() == pytest.approx(0.02, rel=1e-5)


def test_mis_sequence_level_product_vs_geometric_mean() -> None:
    # Sequence 0: token weights 2, 2. Sequence 1: 4 and 0.25 (product 1, geometric mean 1).
    beh = torch.log(torch.tensor([[0.1, 0.1], [0.1, 0.4]]))
    prox = torch.log(torch.tensor([[0.2, 0.2], [0.4, 0.1]]))
    mask = ones_mask(beh)
    geo = importance_weights(prox, beh, mask, CorrectionConfig(type="mis", level="sequence", low=0.5, high=2.0))
    prod = importance_weights(
        prox, beh, mask, CorrectionConfig(type="mis", level="sequence", sequence_weight="product", low=0.5, high=2.0)
    )
    # geometric mean 2 <= high: kept at weight 2; product 4 > high: the whole sequence masked.
    torch.testing.assert_close(geo.applied, torch.tensor([[2.0, 2.0], [1.0, 1.0]]))
    torch.testing.assert_close(prod.applied, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    # Token level would have masked the 4 in sequence 1.
    tok = importance_weights(prox, beh, mask, CorrectionConfig(type="mis", low=0.5, high=2.0))
    torch.testing.assert_close(tok.applied, torch.tensor([[2.0, 2.0], [0.0, 0.0]]))


def test_sequence_weight_ignores_padding() -> None:
    beh = torch.log(torch.tensor([[0.1, 0.1, 0.5]]))
    prox = torch.log(torch.tensor([[0.2, 0.2, 0.05]]))  # the pad token would have w = 0.1
    mask = torch.tensor([[True, True, False]])
    w = importance_weights(prox, beh, mask, CorrectionConfig(type="tis", level="sequence", cap=10.0))
    torch.testing.assert_close(w.applied, torch.tensor([[2.0, 2.0, 0.0]]))


def test_icepop_two_sided_token_mask() -> None:
    w = torch.tensor([[0.4, 0.5, 4.9, 5.1, 1.0]])
    beh = torch.full_like(w, math.log(0.1))
    prox = beh + w.log()
    out = importance_weights(prox, beh, ones_mask(w), CorrectionConfig(type="icepop"))  # default [0.5, 5]
    assert out.kept.tolist() == [[False, True, True, False, True]]
    torch.testing.assert_close(out.applied, torch.tensor([[0.0, 0.5, 4.9, 0.0, 1.0]]))
    narrow = importance_weights(prox, beh, ones_mask(w), CorrectionConfig(type="icepop", low=0.8, high=1.25))
    assert narrow.kept.tolist() == [[False, False, False, False, True]]


def test_raw_is_and_none() -> None:
    beh, prox = col(0.1), col(0.5)  # w = 5
    mask = ones_mask(beh)
    assert importance_weights(prox, beh, mask, CorrectionConfig(type="is")).applied.item() == pytest.approx(5.0)
    assert importance_weights(prox, beh, mask, CorrectionConfig(type="none")).applied.item() == 1.0


# ---------------------------------------------------------------------------------------------- decoupled objective


@pytest.mark.parametrize("correction", ["none", "is", "tis", "mis", "icepop"])
def test_decoupled_with_proximal_equal_behaviour_is_plain_ppo(correction: str) -> None:
    torch.manual_seed(0)
    beh = torch.log_softmax(torch.randn(3, 5, 7), -1)[..., 0]
    cur = (beh + 0.4 * torch.randn(3, 5)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.ones(3, 5, dtype=torch.bool)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, correction=CorrectionConfig.model_validate({"type": correction}))
    decoupled = policy_loss(cur, beh, adv, mask, cfg, proximal=beh.clone())
    # Plain PPO, written out: ratio current/behaviour, clipped, token mean.
    r = torch.exp(cur - beh)
    a = adv[:, None].expand(3, 5)
    plain = torch.maximum(-r * a, -r.clamp(0.8, 1.28) * a).mean()
    torch.testing.assert_close(decoupled.loss, plain)
    (g1,) = torch.autograd.grad(decoupled.loss, cur)
    (g2,) = torch.autograd.grad(plain, cur)
    torch.testing.assert_close(g1, g2)
    assert decoupled.metrics["is_weight_mean"] == pytest.approx(1.0)
    assert decoupled.metrics["masked_fraction"] == 0.0


def test_decoupled_clips_around_proximal_and_weights_by_proximal_over_behaviour() -> None:
    beh = col(0.25, 0.25)
    prox = col(0.5, 0.5)  # w = 2
    cur = col(0.55, 0.7).requires_grad_()  # r = 1.1 (inside), 1.4 (over 1 + 0.2)
    adv = torch.tensor([1.0, 1.0])
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, correction=CorrectionConfig(type="is"))
    out = policy_loss(cur, beh, adv, ones_mask(cur), cfg, proximal=prox)
    # Token 0: -2 * 1.1; token 1: clipped, -2 * 1.2. Clipping against behaviour would have given r = 2.2, 2.8.
    assert out.loss.item() == pytest.approx((-2.2 - 2.4) / 2, rel=1e-5)
    out.loss.backward()
    assert cur.grad is not None
    torch.testing.assert_close(cur.grad[:, 0], torch.tensor([-2.2 / 2, 0.0]))
    assert out.metrics["clip_high_fraction"] == pytest.approx(0.5)
    # TIS with cap 1.5 scales the same surrogate by 1.5 instead of 2.
    tis = LossConfig(clip_low=0.2, clip_high=0.2, correction=CorrectionConfig(type="tis", cap=1.5))
    out_tis = policy_loss(cur, beh, adv, ones_mask(cur), tis, proximal=prox)
    assert out_tis.loss.item() == pytest.approx((-1.5 * 1.1 - 1.5 * 1.2) / 2, rel=1e-5)
    # Without a proximal pass the same current is clipped against behaviour: -1.2 per token.
    plain = policy_loss(cur, beh, adv, ones_mask(cur), cfg)
    assert plain.loss.item() == pytest.approx(-1.2, rel=1e-5)


def test_mismatch_metric_by_hand() -> None:
    beh, prox = col(0.5), col(0.25)
    cur = prox.clone()
    out = policy_loss(cur, beh, torch.ones(1), ones_mask(cur), LossConfig(), proximal=prox)
    # KL(mu || pi) by k3 with r = pi/mu = 0.5: r - 1 - ln r.
    assert out.metrics["mismatch_k3"] == pytest.approx(0.5 - 1.0 + LN2, rel=1e-5)
    assert out.metrics["mismatch_k1"] == pytest.approx(LN2, rel=1e-5)
    assert out.metrics["policy_kl_k3"] == pytest.approx(0.0, abs=1e-7)


# --------------------------------------------------------------------------------------------- aggregation, masking


def test_aggregation_normalisations_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(values, mask, "sequence_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(values, mask, "constant_norm").item() == pytest.approx(10 / (2 * 3))
    assert aggregate(values, mask, "constant_norm", norm_length=5).item() == pytest.approx(10 / 10)
    assert aggregate(values, mask, "token_mean", normalizer=8).item() == pytest.approx(10 / 8)
    assert aggregate(values, mask, "sequence_mean", normalizer=4).item() == pytest.approx(6 / 4)
    # A sequence with no trained tokens is not counted in sequence_mean.
    empty = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert aggregate(values, empty, "sequence_mean").item() == pytest.approx(2.0)
    assert aggregate(values, torch.zeros_like(mask), "token_mean").item() == 0.0


def test_policy_loss_aggregation_options() -> None:
    # With current = behaviour (r = 1) a token's loss is -A, so per-token advantages set the token losses.
    token_losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    logp = torch.full((2, 3), -1.0)
    for how, expected in (("token_mean", 2.5), ("sequence_mean", 3.0), ("constant_norm", 10 / 6)):
        cfg = LossConfig(aggregation=how)  # type: ignore[arg-type]
        assert policy_loss(logp, logp, -token_losses, mask, cfg).loss.item() == pytest.approx(expected, rel=1e-6)


def test_each_aggregation_weighs_long_and_short_responses_as_its_paper_says() -> None:
    """The effect, through the gradient: one long and one short response with the same advantage. token_mean gives
    every token the same weight (the long response pulls 4x harder in total, DAPO); sequence_mean gives every
    response the same total weight (GRPO); constant_norm weighs tokens equally with a denominator that does not
    move with the batch's token count (Dr. GRPO), so adding a response leaves the others' gradients unchanged."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0])

    def token_grads(how: str, m: torch.Tensor = mask, a: torch.Tensor = adv) -> torch.Tensor:
        cur = torch.full(m.shape, -1.0, requires_grad=True)
        policy_loss(cur, cur.detach(), a, m, LossConfig(aggregation=how)).loss.backward()  # type: ignore[arg-type]
        assert cur.grad is not None
        return -cur.grad

    tok = token_grads("token_mean")
    assert tok[0, 0] == pytest.approx(tok[1, 0]) and tok[0].sum() == pytest.approx(4 * tok[1].sum())
    seq = token_grads("sequence_mean")
    assert seq[0].sum() == pytest.approx(seq[1].sum()) and seq[1, 0] == pytest.approx(4 * seq[0, 0])
    const = token_grads("constant_norm")
    assert const[0, 0] == pytest.approx(const[1, 0])
    # A third, long response: token_mean dilutes the first two (more tokens in the mean); constant_norm only adds
    # a row to S (as sequence_mean does), whatever its length.
    wider = torch.cat([mask, torch.ones(1, 4, dtype=torch.bool)])
    more = torch.cat([adv, torch.tensor([1.0])])
    assert token_grads("token_mean", wider, more)[1, 0] == pytest.approx(tok[1, 0] * 5 / 9)
    assert token_grads("constant_norm", wider, more)[1, 0] == pytest.approx(const[1, 0] * 2 / 3)


def test_padding_is_ignored_even_when_nan() -> None:
    beh = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, math.nan, math.nan]])
    cur = torch.tensor([[-0.9, -2.1, -0.4], [-1.2, math.nan, math.inf]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, math.nan, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    cfg = LossConfig(correction=CorrectionConfig(type="tis"))
    out = policy_loss(cur, beh, adv, mask, cfg, proximal=beh)
    assert math.isfinite(out.loss.item()) and all(math.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert cur.grad is not None and torch.all(torch.isfinite(cur.grad))
    assert torch.equal(cur.grad[1, 1:], torch.zeros(2))
    # The same loss as the four real tokens alone, as one flat sequence.
    flat = policy_loss(
        torch.tensor([[-0.9, -2.1, -0.4, -1.2]]),
        torch.tensor([[-1.0, -2.0, -0.5, -1.5]]),
        torch.tensor([[1.0, 1.0, 1.0, -1.0]]),
        torch.ones(1, 4, dtype=torch.bool),
        cfg,
    )
    assert out.loss.item() == pytest.approx(flat.loss.item(), rel=1e-6)
    assert out.metrics["num_tokens"] == 4.0


# ------------------------------------------------------------------------------------------------ gradient direction


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_step_moves_logprob_with_advantage_sign(sign: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 3, 11, requires_grad=True)
    tokens = torch.tensor([[2, 5, 9]])
    opt = torch.optim.SGD([logits], lr=0.5)
    before = gather_logprobs(logits, tokens).detach()
    out = policy_loss(
        gather_logprobs(logits, tokens),
        before,
        torch.tensor([sign]),
        torch.ones(1, 3, dtype=torch.bool),
        LossConfig(),
        logits=logits,
    )
    assert out.metrics["entropy"] > 0
    out.loss.backward()
    opt.step()
    after = gather_logprobs(logits, tokens).detach()
    assert torch.all((after - before) * sign > 0)


def test_entropy_bonus_and_metric() -> None:
    logits = torch.zeros(1, 2, 4, requires_grad=True)
    logp = gather_logprobs(logits, torch.tensor([[0, 1]]))
    cfg = LossConfig(entropy_coef=0.1, correction=CorrectionConfig(type="none"))
    out = policy_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), cfg, logits=logits)
    assert out.metrics["entropy"] == pytest.approx(math.log(4.0), rel=1e-6)
    assert out.loss.item() == pytest.approx(-0.1 * math.log(4.0), rel=1e-6)
    with pytest.raises(ConfigError, match="entropy_coef"):
        policy_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), cfg)


# ------------------------------------------------------------------------------------------------------- validation


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="icepop"):
        CorrectionConfig(type="icepop", level="sequence")
    with pytest.raises(ConfigError, match="empty"):
        CorrectionConfig(type="mis", low=2.0, high=1.0)
    with pytest.raises(ConfigError, match="empty"):
        CorrectionConfig(type="icepop", low=6.0)  # above the default high 5
    with pytest.raises(ValidationError):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValidationError):
        LossConfig(aggregation="sum")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        LossConfig(clip=0.2)  # type: ignore[call-arg]
    assert CorrectionConfig(type="icepop").bounds() == (0.5, 5.0)
    assert CorrectionConfig(type="mis").bounds() == (0.0, 2.0)


def test_shape_errors_name_the_tensors() -> None:
    with pytest.raises(SluiceError, match="behaviour"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), LossConfig())
    with pytest.raises(SluiceError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), LossConfig())
    with pytest.raises(SluiceError, match="integer"):
        grpo_advantages(torch.zeros(2), torch.zeros(2), AdvantageConfig())
    with pytest.raises(SluiceError, match="NaN"):
        grpo_advantages(torch.tensor([1.0, math.nan]), torch.zeros(2, dtype=torch.long), AdvantageConfig())
