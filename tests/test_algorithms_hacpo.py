"""HACPO baseline, hand-computed from a reading of the official code (recipe/hacpo in the HACPO
repository HACRL-code): recipe/hacpo/hacpo_core_algos.py (compute_hacpo_advantages, compute_hacpo_loss,
HacpoLossConfig.cross_clip_lower, CapabilityTracker), recipe/hacpo/hacpo_workers.py (hacpo_ppo_loss:
KL over self rows; MinibatchUpdateCounter: m resets each step), recipe/hacpo/hacpo_ray_trainer.py
(_update_target: capability-weighted rewards, self-first trajectory order) and
recipe/hacpo/run_hacpo_math_8gpu.sh (low_var_kl, coefficient 1e-3, 64-prompt minibatches)."""

import math

import pytest
import torch
from support.optional import from_verl

from graft_exp.algorithms import (
    HACPO_KL_COEF,
    balanced_exchange,
    hacpo_advantages,
    hacpo_capability,
    hacpo_capability_ratio,
    hacpo_cross_clip_lower,
    hacpo_kl_loss,
    hacpo_policy_loss,
    hacpo_positive_rate,
    hacpo_which_advantages,
    kl_estimate,
    peer_last_minibatches,
)
from graft_exp.hyperparameters import HACPO_MINIBATCH_PROMPTS


def test_capability_is_windowed_mean_of_positive_rates():
    # CapabilityTracker: per-step positive rate, floored at 1e-8, mean over the last 5 steps
    assert hacpo_positive_rate(torch.tensor([[1.0, 0.0], [0.0, 0.0]])).item() == pytest.approx(0.25)
    assert hacpo_capability([0.2, 0.4, 0.6, 0.8, 1.0, 0.0]) == pytest.approx((0.4 + 0.6 + 0.8 + 1.0 + 1e-8) / 5)
    assert hacpo_capability([]) == 1.0
    # ratio(source -> target) = clamp(cap_s / cap_t, 0.1, 10)
    assert hacpo_capability_ratio(0.5, 0.25) == pytest.approx(2.0)
    assert hacpo_capability_ratio(0.01, 1.0) == pytest.approx(0.1)
    assert hacpo_capability_ratio(1.0, 0.01) == pytest.approx(10.0)


def test_capability_aware_advantages_hand_computed():
    # peer twice as capable (ratio 2): peer rewards weigh 1/2 in the baseline.
    # weighted rewards (0,0,0,0, .5,.5,0,0): baseline 1/8; pooled 2n = 8 rewards with two 1s:
    # unbiased std = sqrt((2 * 0.75^2 + 6 * 0.25^2) / 7) = sqrt(1.5 / 7)
    own, peer = hacpo_advantages(torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 0.0, 0.0]]), capability_ratio=2.0)
    std = math.sqrt(1.5 / 7)
    torch.testing.assert_close(own, torch.full((1, 4), -0.125 / std), atol=1e-5, rtol=0)
    torch.testing.assert_close(peer, torch.tensor([[0.875, 0.875, -0.125, -0.125]]) / std, atol=1e-5, rtol=0)


def test_binary_baseline_guard_falls_back_to_own_mean():
    # weaker peer (ratio 0.5): peer rewards weigh 2; weighted mean (1+1+1+0+2*4)/8 = 1.375 > 1
    # -> baseline = own mean 0.75; pooled (seven 1s, one 0): std = sqrt(1/8)
    own, peer = hacpo_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), torch.ones(1, 4), capability_ratio=0.5)
    std = math.sqrt(1 / 8)
    torch.testing.assert_close(own, torch.tensor([[0.25, 0.25, 0.25, -0.75]]) / std, atol=1e-5, rtol=0)
    torch.testing.assert_close(peer, torch.full((1, 4), 0.25 / std), atol=1e-5, rtol=0)


def test_uniform_pooled_group_has_zero_advantage_whatever_the_capabilities():
    # without the uniform-reward rule, the weighted baseline (4 + 4/2)/8 = 0.75 over std 0 would explode
    own, peer = hacpo_advantages(torch.ones(2, 4), torch.ones(2, 4), capability_ratio=2.0)
    assert torch.equal(own, torch.zeros(2, 4)) and torch.equal(peer, torch.zeros(2, 4))


def test_advantages_with_equal_capabilities_are_grpo_on_the_pooled_group():
    from graft_exp.algorithms import pooled_group_advantages

    own_r, peer_r = torch.tensor([[0.0, 1, 0, 0], [1, 1, 0, 1]]), torch.tensor([[1.0, 1, 0, 0], [0, 0, 0, 1]])
    for ours, pooled in zip(hacpo_advantages(own_r, peer_r, 1.0), pooled_group_advantages(own_r, peer_r)):
        torch.testing.assert_close(ours, pooled)


def test_cross_clip_lower_bound_grows_per_minibatch_and_saturates():
    assert hacpo_cross_clip_lower(0) == pytest.approx(0.8)
    assert hacpo_cross_clip_lower(2) == pytest.approx(0.85)
    assert hacpo_cross_clip_lower(8) == 1.0
    assert hacpo_cross_clip_lower(20) == 1.0
    with pytest.raises(ValueError, match="minibatch_index"):
        hacpo_cross_clip_lower(-1)


def test_self_first_minibatches_give_the_official_update_index():
    # 128 prompts, own groups 0..127 then peer groups 128..255, 64 per minibatch: m = 0, 1 own; 2, 3 peer
    P = 128
    is_peer_group = torch.cat([torch.zeros(P, dtype=torch.bool), torch.ones(P, dtype=torch.bool)])
    minibatches = peer_last_minibatches(is_peer_group, HACPO_MINIBATCH_PROMPTS)
    assert [bool(is_peer_group[mb].all()) for mb in minibatches] == [False, False, True, True]
    assert [hacpo_cross_clip_lower(m) for m in (2, 3)] == pytest.approx([0.85, 0.875])


def test_hacpo_policy_loss_hand_computed():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    log_prob = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0], [-1.0, 0.0, 0.0]], dtype=torch.float64,
                            requires_grad=True)
    source_mean = torch.tensor([-1.1, -1.9, -1.5], dtype=torch.float64)
    advantages = torch.tensor([1.0, 0.5, -1.0], dtype=torch.float64)
    is_peer = torch.tensor([False, True, True])
    loss, metrics = hacpo_policy_loss(
        log_prob, mask, source_mean, advantages, is_peer, capability_ratio=2.0, minibatch_index=2
    )
    # row 0 (own): r = e^0.1 > 1 + 4e-4 with A > 0 -> min(r, 1.0004) * 1 = 1.0004 (clipped)
    # row 1 (peer): r = e^-0.1 in [L_2 = 0.85, 1] -> r * sg(r) * 2 * 0.5 = e^-0.2
    # row 2 (peer): r = e^0.5 clamped to 1 -> 1 * 1 * 2 * (-1) = -2
    objectives = [1.0004, math.exp(-0.2), -2.0]
    assert loss.item() == pytest.approx(-sum(objectives) / 3)
    assert float(metrics["clipped_seqs_self"]) == 1 and float(metrics["clipped_seqs_peer"]) == 1
    assert float(metrics["clipfrac_peer"]) == pytest.approx(0.5)
    assert float(metrics["cross_clip_lower"]) == pytest.approx(0.85)
    loss.backward()
    # only row 1 has a gradient: d/dlogp_t [r * sg(r) * c * A] = r^2 * c * A / |o|, then / 3 sequences
    expected_row1 = -math.exp(-0.2) * 2 * 0.5 / 3 / 3
    torch.testing.assert_close(
        log_prob.grad,
        torch.tensor([[0.0, 0.0, 0.0], [expected_row1] * 3, [0.0, 0.0, 0.0]], dtype=torch.float64),
    )


def test_hacpo_self_rows_are_gspo_like_and_peer_clamp_tightens_with_m():
    log_prob = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    # peer ratio e^-0.17 = 0.8437: inside [0.8, 1] at m = 0, clamped to 0.85 at m = 2
    args = (torch.ones(1, 2), torch.tensor([-0.83], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64),
            torch.tensor([True]), 1.0)
    r = math.exp(-0.17)
    assert hacpo_policy_loss(log_prob, *args, minibatch_index=0)[0].item() == pytest.approx(-r * r)
    assert hacpo_policy_loss(log_prob, *args, minibatch_index=2)[0].item() == pytest.approx(-0.85 * 0.85)
    # own row with ratio inside (1 - 3e-4, 1 + 4e-4): plain r * A
    own = hacpo_policy_loss(log_prob, torch.ones(1, 2), torch.tensor([-1.0002], dtype=torch.float64),
                            torch.tensor([-2.0], dtype=torch.float64), torch.tensor([False]), 1.0, 0)[0]
    assert own.item() == pytest.approx(2.0 * math.exp(0.0002))


def test_kl_estimators_match_verl():
    kl_penalty = from_verl("verl.trainer.ppo.core_algos").kl_penalty

    log_prob = torch.tensor([[-1.0, -2.0, -0.1]])
    ref = torch.tensor([[-1.5, -2.0, -3.0]])
    assert kl_estimate(log_prob, ref, "k3")[0, 0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    for ours, theirs in (("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl"), ("low_var_kl", "k3")):
        torch.testing.assert_close(kl_estimate(log_prob, ref, ours), kl_penalty(log_prob, ref, theirs))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(log_prob, ref, "k4")


def test_hacpo_kl_loss_counts_own_rows_only_over_all_sequences():
    log_prob = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0], [-9.0, -9.0]])  # the peer row's large KL must not count
    loss, metrics = hacpo_kl_loss(log_prob, ref, torch.ones(2, 2), torch.tensor([False, True]))
    kl_own_row = (math.exp(-0.5) + 0.5 - 1 + 0.0) / 2
    assert float(metrics["kl"]) == pytest.approx(kl_own_row / 2)
    assert loss.item() == pytest.approx(HACPO_KL_COEF * kl_own_row / 2)


def test_hacpo_which_zeroes_peer_advantages_off_the_graft_selection():
    k_own, k_peer = torch.tensor([0, 0, 3]), torch.tensor([2, 5, 1])
    # one direction's selection: peer -> own on prompts where own failed and peer has 1 <= k < n
    selected, _ = balanced_exchange(k_peer, k_own, 8, balance=False)
    peer_adv = torch.tensor([[1.0, -1.0], [2.0, -2.0], [3.0, -3.0]])
    torch.testing.assert_close(
        hacpo_which_advantages(peer_adv, selected), torch.tensor([[1.0, -1.0], [2.0, -2.0], [0.0, 0.0]])
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: hacpo_advantages(torch.zeros(2, 4), torch.zeros(2, 3), 1.0), "HACPO pools equal-size groups"),
        (lambda: hacpo_advantages(torch.zeros(2, 1), torch.zeros(2, 1), 1.0), "group size"),
        (lambda: hacpo_advantages(torch.zeros(1, 4), torch.full((1, 4), float("nan")), 1.0), "NaN"),
        (lambda: hacpo_advantages(torch.zeros(1, 4), torch.zeros(1, 4), 0.0), "capability_ratio"),
        (lambda: hacpo_capability_ratio(0.0, 1.0), "capabilities"),
        (lambda: hacpo_capability([0.5], window=0), "window"),
        (lambda: hacpo_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1),
                                   torch.tensor([True]), 1.0, 0), "at least one response token"),
        (lambda: hacpo_policy_loss(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1), torch.ones(1),
                                   torch.tensor([True]), -1.0, 0), "capability_ratio must be > 0"),
        (lambda: hacpo_policy_loss(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(2), torch.ones(1),
                                   torch.tensor([True]), 1.0, 0), "source_mean_log_prob must have shape"),
        (lambda: hacpo_policy_loss(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1), torch.ones(1),
                                   torch.tensor([True]), 1.0, 0, self_clip_low=-1e-4), "self clips"),
    ],
)
def test_hacpo_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
