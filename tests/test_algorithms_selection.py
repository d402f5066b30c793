"""GRPO advantages and GRAFT's *which* (paper §3.1, eq. 3, Alg. 1 SelectWithTies), plus the selection
rules of the baselines: SGT rescue, count-matched random prompts, DAPO dynamic sampling."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.optional import from_verl

from graft_exp.algorithms import (
    balanced_exchange,
    complementary_candidates,
    count_matched_random_exchange,
    draw_one_correct_response,
    dynamic_sampling_batch_full,
    dynamic_sampling_group_mask,
    grpo_advantages,
    random_prompts_like,
    select_with_ties,
    sgt_rescue_prompts,
)
from graft_exp.methods import SELECTIONS


def mask(*indices, size):
    out = torch.zeros(size, dtype=torch.bool)
    out[list(indices)] = True
    return out


# --- GRPO advantages -----------------------------------------------------------------------------


def test_grpo_advantages_hand_computed():
    # r = (1,0,0,0): mean 1/4, unbiased std = sqrt((9/16 + 3/16)/3) = 1/2.
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]), atol=1e-5, rtol=0)


def test_grpo_advantages_all_fail_and_all_pass_are_exactly_zero():
    adv = grpo_advantages(torch.tensor([[0.0] * 8, [1.0] * 8, [0.3] * 8]))
    assert torch.equal(adv, torch.zeros(3, 8))


def test_grpo_advantages_match_verl():
    compute_grpo_outcome_advantage = from_verl("verl.trainer.ppo.core_algos").compute_grpo_outcome_advantage

    rewards = torch.tensor([[1.0, 0, 0, 1, 1, 0, 0, 0], [0.0] * 8, [1.0] * 8, [0, 0, 0, 0, 0, 0, 0, 1.0]])
    P, n, T = rewards.shape[0], rewards.shape[1], 3
    token_rewards = torch.zeros(P * n, T)
    token_rewards[:, -1] = rewards.reshape(-1)
    index = np.repeat(np.arange(P), n)
    verl_adv, _ = compute_grpo_outcome_advantage(token_rewards, torch.ones(P * n, T), index, epsilon=1e-6)
    torch.testing.assert_close(grpo_advantages(rewards), verl_adv[:, 0].reshape(P, n))


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        (torch.tensor([[1.0, 0.0]]).T, "group size"),  # n = 1
        (torch.tensor([1.0, 0.0]), "2-dimensional"),
        (torch.tensor([[1.0, float("nan")]]), "NaN"),
        (torch.tensor([[1.0, float("inf")]]), "NaN or inf"),
    ],
)
def test_grpo_advantages_reject_bad_input(rewards, message):
    with pytest.raises(ValueError, match=message):
        grpo_advantages(rewards)


# --- SelectWithTies ----------------------------------------------------------------------------------


def test_select_with_ties_keeps_all_ties_at_the_boundary():
    candidates = torch.ones(5, dtype=torch.bool)
    k = torch.tensor([5, 3, 3, 3, 1])
    # m = 2: the 2nd ranked has k = 3, so every candidate with k = 3 is kept too (4 > m).
    assert torch.equal(select_with_ties(candidates, k, 2), mask(0, 1, 2, 3, size=5))
    assert torch.equal(select_with_ties(candidates, k, 1), mask(0, size=5))
    assert torch.equal(select_with_ties(candidates, k, 4), mask(0, 1, 2, 3, size=5))
    assert torch.equal(select_with_ties(candidates, k, 5), candidates)
    assert torch.equal(select_with_ties(candidates, k, 9), candidates)


def test_select_with_ties_m_zero_selects_nothing():
    assert not select_with_ties(torch.ones(3, dtype=torch.bool), torch.tensor([1, 2, 3]), 0).any()


def test_select_with_ties_ignores_non_candidates_even_with_high_k():
    candidates = mask(1, 2, 3, size=4)
    k = torch.tensor([7, 2, 5, 2])
    assert torch.equal(select_with_ties(candidates, k, 1), mask(2, size=4))
    assert torch.equal(select_with_ties(candidates, k, 2), mask(1, 2, 3, size=4))


def test_select_with_ties_rejects_bad_input():
    with pytest.raises(ValueError, match="non-negative"):
        select_with_ties(torch.ones(2, dtype=torch.bool), torch.tensor([1, 1]), -1)
    with pytest.raises(ValueError, match="bool mask"):
        select_with_ties(torch.ones(2), torch.tensor([1, 1]), 1)
    with pytest.raises(ValueError, match="shape"):
        select_with_ties(torch.ones(2, dtype=torch.bool), torch.tensor([1, 1, 1]), 1)


# --- balanced exchange ---------------------------------------------------------------------------------


def test_candidates_follow_eq3_and_full_peer_groups_are_never_transferred():
    n = 8
    k_source = torch.tensor([0, 1, 7, 8, 3, 3])
    k_receiver = torch.tensor([0, 0, 0, 0, 1, 8])
    # k_S = 0 has no success; k_S = n has no reward variance; the receiver must have k_R = 0.
    assert torch.equal(complementary_candidates(k_source, k_receiver, n), mask(1, 2, size=6))


def test_balanced_exchange_hand_computed():
    n = 4
    k_a = torch.tensor([3, 2, 2, 1, 0, 0, 4, 0])
    k_b = torch.tensor([0, 0, 0, 0, 2, 3, 0, 0])
    a_to_b, b_to_a = balanced_exchange(k_a, k_b, n)
    # |C_AB| = 4 (prompt 6 has k_A = n), |C_BA| = 2, m = 2; A->B keeps k_A = 3 and the tie at k_A = 2.
    assert torch.equal(a_to_b, mask(0, 1, 2, size=8))
    assert torch.equal(b_to_a, mask(4, 5, size=8))
    a_all, b_all = balanced_exchange(k_a, k_b, n, balance=False)
    assert torch.equal(a_all, mask(0, 1, 2, 3, size=8))
    assert torch.equal(b_all, b_to_a)


def test_balanced_exchange_with_one_empty_direction_transfers_nothing():
    k_a = torch.tensor([2, 3, 0])
    k_b = torch.tensor([0, 0, 8])  # B->A: k_B = n is not a candidate, so m = 0
    a_to_b, b_to_a = balanced_exchange(k_a, k_b, 8)
    assert not a_to_b.any() and not b_to_a.any()
    assert torch.equal(balanced_exchange(k_a, k_b, 8, balance=False)[0], mask(0, 1, size=3))


@pytest.mark.parametrize(
    ("k_a", "k_b", "n", "message"),
    [
        (torch.tensor([1, 2]), torch.tensor([0, 9]), 8, r"\[0, n=8\]"),
        (torch.tensor([1, -1]), torch.tensor([0, 0]), 8, "success counts"),
        (torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), 8, "integer"),
        (torch.tensor([1, 2]), torch.tensor([0, 0, 0]), 8, "shape"),
        (torch.tensor([1, 0]), torch.tensor([0, 0]), 1, "n must be"),
    ],
)
def test_balanced_exchange_rejects_bad_input(k_a, k_b, n, message):
    with pytest.raises(ValueError, match=message):
        balanced_exchange(k_a, k_b, n)


counts = st.integers(min_value=2, max_value=8).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), min_size=0, max_size=40),
    )
)


@settings(max_examples=150, deadline=None)
@given(counts)
def test_balanced_exchange_properties(case):
    n, pairs = case
    k_a = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    k_b = torch.tensor([b for _, b in pairs], dtype=torch.long)
    a_to_b, b_to_a = balanced_exchange(k_a, k_b, n)
    c_ab, c_ba = complementary_candidates(k_a, k_b, n), complementary_candidates(k_b, k_a, n)
    m = min(int(c_ab.sum()), int(c_ba.sum()))
    for selected, candidates, k_src in ((a_to_b, c_ab, k_a), (b_to_a, c_ba, k_b)):
        assert not (selected & ~candidates).any()  # selected ⊆ candidates
        assert int(selected.sum()) >= min(m, int(candidates.sum()))
        if m == 0:
            assert not selected.any()
        if selected.any() and (candidates & ~selected).any():
            # ranking: no unselected candidate has a higher (or tied) source count than a selected one
            assert int(k_src[candidates & ~selected].max()) < int(k_src[selected].min())
            # and the surplus over m consists of ties only
            assert int(selected.sum()) == m or int(k_src[selected].min()) == int(
                torch.sort(k_src[candidates], descending=True).values[m - 1]
            )
    assert not (a_to_b & b_to_a).any()
    swapped_b_to_a, swapped_a_to_b = balanced_exchange(k_b, k_a, n)
    assert torch.equal(swapped_a_to_b, a_to_b) and torch.equal(swapped_b_to_a, b_to_a)


# --- SGT and GRAFT-variant selection rules ---------------------------------------------------------------


def test_sgt_rescue_includes_full_peer_groups_and_is_unbalanced():
    k_a = torch.tensor([8, 1, 0, 0, 3])
    k_b = torch.tensor([0, 0, 2, 0, 0])
    a_to_b, b_to_a = sgt_rescue_prompts(k_a, k_b, 8)
    assert torch.equal(a_to_b, mask(0, 1, 4, size=5))
    assert torch.equal(b_to_a, mask(2, size=5))


def test_selection_rules_by_their_config_names():
    """``method.selection`` names these rules (``methods.SELECTIONS``): SGT's rescue, eq. (3) alone, eq. (3)
    balanced."""
    k_a, k_b = torch.tensor([8, 2, 1, 0]), torch.tensor([0, 0, 0, 3])
    a_to_b = {name: SELECTIONS.get(name)(None).rule(k_a, k_b, 8, None)[0]
              for name in ("rescue", "complementary", "balanced")}
    assert torch.equal(a_to_b["rescue"], mask(0, 1, 2, size=4))
    assert torch.equal(a_to_b["complementary"], mask(1, 2, size=4))
    assert torch.equal(a_to_b["balanced"], mask(1, size=4))


def test_draw_one_correct_response():
    rewards = torch.tensor([[0.0, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    selected = mask(0, 2, size=3)
    drawn = torch.stack(
        [draw_one_correct_response(rewards, selected, torch.Generator().manual_seed(s)) for s in range(400)]
    )
    assert set(drawn[:, 0].tolist()) == {1, 3}
    assert set(drawn[:, 1].tolist()) == {-1}
    assert set(drawn[:, 2].tolist()) == {0, 1, 2, 3}
    # uniform among the correct ones: 400 draws of a fair coin stay within 5 sigma (50)
    assert abs(int((drawn[:, 0] == 1).sum()) - 200) < 50
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(draw_one_correct_response(rewards, selected, g1), draw_one_correct_response(rewards, selected, g2))


def test_draw_one_correct_response_rejects_selected_prompt_without_success_and_non_binary():
    with pytest.raises(ValueError, match="no correct response"):
        draw_one_correct_response(torch.zeros(2, 4), mask(1, size=2), torch.Generator())
    with pytest.raises(ValueError, match="binary"):
        draw_one_correct_response(torch.full((2, 4), 0.5), mask(1, size=2), torch.Generator())


def test_count_matched_random_prompts():
    a_to_b, b_to_a = mask(0, 1, 2, size=10), mask(5, size=10)
    rand_ab, rand_ba = count_matched_random_exchange(a_to_b, b_to_a, torch.Generator().manual_seed(0))
    assert int(rand_ab.sum()) == 3 and int(rand_ba.sum()) == 1
    again = count_matched_random_exchange(a_to_b, b_to_a, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], rand_ab) and torch.equal(again[1], rand_ba)
    # uniform over the batch: every prompt gets drawn at about 3/10 of the steps
    g = torch.Generator().manual_seed(1)
    hits = torch.stack([random_prompts_like(a_to_b, g) for _ in range(1000)]).float().mean(0)
    assert torch.all((hits - 0.3).abs() < 0.07)
    assert not random_prompts_like(torch.zeros(4, dtype=torch.bool), g).any()


def test_dynamic_sampling_filter():
    rewards = torch.tensor([[0.0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 1, 0]])
    assert torch.equal(dynamic_sampling_group_mask(rewards), mask(2, 3, size=4))
    assert dynamic_sampling_batch_full(128, 128) and dynamic_sampling_batch_full(130, 128)
    assert not dynamic_sampling_batch_full(127, 128)
    with pytest.raises(ValueError, match="batch_size"):
        dynamic_sampling_batch_full(3, 0)
    with pytest.raises(ValueError, match="group size"):
        dynamic_sampling_group_mask(torch.zeros(3, 1))

