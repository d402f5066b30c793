"""Compatibility score and weight (eqs. 7-9) and the peer-weight rules of Appendix G: no gate, no floor,
random admission, success-only; pooled-group advantages."""

import math

import pytest
import torch

from graft_exp.algorithms import (
    compatibility_score,
    compatibility_weight,
    grpo_advantages,
    pooled_group_advantages,
    random_admission_weights,
    sequence_log_prob_sums,
    success_only_weights,
    ungated_weight,
)


def test_compatibility_score_uses_each_tokenizations_own_mean():
    # row 0: receiver mean -2/4, source mean -3/2 -> e^1; row 1: receiver mean -6/3, source mean -3/1 -> e^1
    # (a ratio of summed log-probs would give e^-3 there); row of the second call: e^{-1/2 + 1} (summed: e^-2).
    s = compatibility_score(
        torch.tensor([-2.0, -6.0]), torch.tensor([4, 3]), torch.tensor([-3.0, -3.0]), torch.tensor([2, 1])
    )
    torch.testing.assert_close(s, torch.tensor([math.e, math.exp(-2.0 + 3.0)]))
    s = compatibility_score(torch.tensor([-4.0]), torch.tensor([8]), torch.tensor([-2.0]), torch.tensor([2]))
    torch.testing.assert_close(s, torch.tensor([math.exp(-0.5 + 1.0)]))


def test_sequence_log_prob_sums_feed_the_score():
    log_prob = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    total, count = sequence_log_prob_sums(log_prob, mask)
    torch.testing.assert_close(total, torch.tensor([-3.0, -1.5]))
    assert count.tolist() == [2, 3]


def test_compatibility_score_rejects_empty_and_non_finite():
    one, zero = torch.tensor([1]), torch.tensor([0])
    with pytest.raises(ValueError, match="token counts"):
        compatibility_score(torch.tensor([-1.0]), zero, torch.tensor([-1.0]), one)
    with pytest.raises(ValueError, match="NaN"):
        compatibility_score(torch.tensor([float("-inf")]), one, torch.tensor([-1.0]), one)
    with pytest.raises(ValueError, match="shape"):
        compatibility_score(torch.tensor([-1.0, -1.0]), one, torch.tensor([-1.0]), one)


def test_compatibility_weight_floor_and_cap():
    score = torch.tensor([0.8, 0.8001, 0.5, 1.5, 0.9, 1.0])
    # s exactly at delta is dropped; s > 1 is capped at 1.
    torch.testing.assert_close(compatibility_weight(score, 0.8), torch.tensor([0.0, 0.8001, 0.0, 1.0, 0.9, 1.0]))
    assert compatibility_weight(torch.tensor([0.8], dtype=torch.float64), 0.8).item() == 0.0
    # no floor (delta = 0): every response admitted with min(s, 1)
    torch.testing.assert_close(compatibility_weight(score, 0.0), score.clamp(max=1.0))
    assert torch.equal(ungated_weight(score), torch.ones(6))


@pytest.mark.parametrize("delta", [-0.1, 1.5])
def test_compatibility_weight_rejects_delta_outside_unit_interval(delta):
    with pytest.raises(ValueError, match=r"delta must lie in \[0, 1\]"):
        compatibility_weight(torch.tensor([0.9]), delta)


def test_compatibility_weight_rejects_bad_scores():
    with pytest.raises(ValueError, match="NaN"):
        compatibility_weight(torch.tensor([float("nan")]), 0.8)
    with pytest.raises(ValueError, match=">= 0"):
        compatibility_weight(torch.tensor([-0.1]), 0.8)


def test_random_admission_admits_exactly_the_gated_count_without_floor():
    score = torch.tensor([[0.9, 0.5, 0.85, 2.0], [0.1, 0.95, 0.3, 0.2]])
    num_gated = int((score > 0.8).sum())  # 4
    admitted_any = torch.zeros_like(score, dtype=torch.bool)
    for seed in range(200):
        w = random_admission_weights(score, 0.8, torch.Generator().manual_seed(seed))
        admitted = w > 0
        assert int(admitted.sum()) == num_gated
        # admitted responses keep min(s, 1) even below the floor; the others weigh 0
        torch.testing.assert_close(w[admitted], score[admitted].clamp(max=1.0))
        admitted_any |= admitted
    assert admitted_any.all()  # low-score responses do get admitted sometimes
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(random_admission_weights(score, 0.8, g1), random_admission_weights(score, 0.8, g2))


def test_random_admission_is_uniform():
    score = torch.tensor([0.9, 0.1, 0.1, 0.1])  # one admission among four
    g = torch.Generator().manual_seed(0)
    hits = torch.stack([random_admission_weights(score, 0.8, g) > 0 for _ in range(2000)]).float().mean(0)
    assert torch.all((hits - 0.25).abs() < 0.05)


def test_success_only_removes_failed_peer_responses():
    weights = torch.tensor([0.9, 0.0, 1.0, 0.85])
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    torch.testing.assert_close(success_only_weights(weights, rewards), torch.tensor([0.9, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="binary"):
        success_only_weights(weights, torch.tensor([1.0, 0.5, 0.0, 0.0]))
    with pytest.raises(ValueError, match="shape"):
        success_only_weights(weights, torch.tensor([1.0, 0.0]))


def test_success_only_keeps_advantages_from_the_full_source_group():
    # The advantage of a success is computed with the failures still in the group (k = 1 of 4):
    source_rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    adv = grpo_advantages(source_rewards)
    assert adv[0, 0].item() == pytest.approx(1.5, abs=1e-5)  # not 0, as a success-only group would give


def test_pooled_group_advantages_hand_computed():
    receiver = torch.zeros(1, 4)
    peer = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    receiver_adv, peer_adv = pooled_group_advantages(receiver, peer)
    # pooled mean k_A / 2n = 1/8, unbiased std = sqrt(1/8)
    std = math.sqrt(1 / 8)
    torch.testing.assert_close(receiver_adv, torch.full((1, 4), -0.125 / std), atol=1e-5, rtol=0)
    torch.testing.assert_close(peer_adv, torch.tensor([[0.875, -0.125, -0.125, -0.125]]) / std, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="same prompts"):
        pooled_group_advantages(torch.zeros(2, 4), torch.zeros(1, 4))
