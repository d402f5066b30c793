"""GRAFT's objective (eq. 10) as a loss, its sequence-ratio and LUFFY variants, and SGT's NLL term."""

import math

import pytest
import torch
from support.optional import from_verl

from graft_exp.algorithms import (
    graft_policy_loss,
    luffy_policy_loss,
    sequence_ratio_policy_loss,
    sgt_nll_loss,
)


def log_probs_from_ratios(ratios, old=-1.0):
    """(log_prob leaf with grad, old_log_prob) such that exp(log_prob - old) = ratios."""
    ratios = torch.as_tensor(ratios, dtype=torch.float64)
    old_log_prob = torch.full_like(ratios, old)
    return (old_log_prob + ratios.log()).requires_grad_(True), old_log_prob


def hand_batch():
    """Row 0 own (A=+1, 3 tokens), row 1 peer (w=0.5, A=-1, 2 tokens), row 2 peer removed (w=0)."""
    ratios = torch.tensor([[1.0, 1.5, 0.5], [0.7, 1.2, 1.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([1.0, -1.0, 5.0], dtype=torch.float64)
    weights = torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)
    is_peer = torch.tensor([False, True, True])
    return ratios, mask, advantages, weights, is_peer


def test_graft_loss_hand_computed():
    ratios, mask, advantages, weights, is_peer = hand_batch()
    log_prob, old = log_probs_from_ratios(ratios)
    loss, metrics = graft_policy_loss(log_prob, old, advantages, weights, mask, 0.2, 0.28, is_peer=is_peer)
    # row 0: min(1, 1) + min(1.5, 1.28) + min(0.5, 0.8) = 2.78
    # row 1: 0.5 * (min(-0.7, -0.8) + min(-1.2, -1.2)) = -1.0 ; row 2 removed: 5 tokens in the denominator
    assert loss.item() == pytest.approx(-(2.78 - 1.0) / 5)
    expected = {
        "tokens_self": 3, "tokens_peer": 2, "clipped_tokens_self": 1, "clipped_tokens_peer": 1,
        "clipfrac_self": 1 / 3, "clipfrac_peer": 1 / 2, "clipfrac": 2 / 5, "removed_sequences": 1,
        "ratio_mean": (1.0 + 1.5 + 0.5 + 0.7 + 1.2) / 5, "pg_loss": -(2.78 - 1.0) / 5,
    }
    for key, value in expected.items():
        assert float(metrics[key]) == pytest.approx(value), key
    assert float(metrics["ppo_kl"]) == pytest.approx(-sum(math.log(r) for r in (1, 1.5, 0.5, 0.7, 1.2)) / 5)


def test_clipped_token_definition_is_sign_aware():
    # A > 0 with ratio < 1 - eps_low, and A < 0 with ratio > 1 + eps_high, are *not* clipped (Appendix H).
    log_prob, old = log_probs_from_ratios([[0.5, 1.5]])
    for advantage, expected in ((1.0, 1), (-1.0, 1)):
        _, metrics = graft_policy_loss(log_prob, old, torch.tensor([advantage]), torch.ones(1), torch.ones(1, 2))
        assert float(metrics["clipped_tokens_self"]) == expected
    _, metrics = graft_policy_loss(log_prob, old, torch.tensor([0.0]), torch.ones(1), torch.ones(1, 2))
    assert float(metrics["clipped_tokens_self"]) == 0


def test_gradient_at_ratio_one_is_minus_weight_times_advantage_over_token_count():
    log_prob = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4, [1] * 5 + [0]])
    advantages = torch.tensor([0.7, -1.3, 2.0, 0.4], dtype=torch.float64)
    weights = torch.tensor([1.0, 0.85, 0.0, 1.0], dtype=torch.float64)
    loss, _ = graft_policy_loss(log_prob, log_prob.detach(), advantages, weights, mask)
    loss.backward()
    num_tokens = 6 + 4 + 5  # row 2 (weight 0) is out of the denominator
    expected = -(weights * advantages).unsqueeze(1) * mask / num_tokens
    torch.testing.assert_close(log_prob.grad, expected)


def test_token_level_advantages_equal_broadcast_ones():
    ratios, mask, advantages, weights, is_peer = hand_batch()
    log_prob, old = log_probs_from_ratios(ratios)
    per_row, _ = graft_policy_loss(log_prob, old, advantages, weights, mask, is_peer=is_peer)
    per_token, _ = graft_policy_loss(log_prob, old, advantages[:, None].expand(3, 3), weights, mask, is_peer=is_peer)
    assert per_row.item() == per_token.item()


def test_padding_and_removed_rows_cannot_poison_loss_or_gradient():
    log_prob = torch.tensor([[-1.0, float("nan")], [float("inf"), -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, float("-inf")], [-1.0, -2.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    # a non-finite log-prob inside a response is an upstream bug, rejected even in a removed row ...
    with pytest.raises(ValueError, match="log_prob contains NaN or inf"):
        graft_policy_loss(log_prob, old, torch.ones(2), torch.tensor([1.0, 0.0]), mask)
    # ... while padding may hold anything: it reaches neither the loss nor the gradient
    log_prob = torch.tensor([[-1.0, float("nan")], [-1.5, -2.0]], requires_grad=True)
    loss, _ = graft_policy_loss(log_prob, old, torch.ones(2), torch.tensor([1.0, 0.0]), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    assert log_prob.grad[0, 1] == 0 and (log_prob.grad[1] == 0).all()


def test_micro_batches_with_global_token_count_sum_to_the_minibatch_loss():
    ratios, mask, advantages, weights, is_peer = hand_batch()
    log_prob, old = log_probs_from_ratios(ratios)
    full, _ = graft_policy_loss(log_prob, old, advantages, weights, mask, is_peer=is_peer)
    parts = [
        graft_policy_loss(log_prob[rows], old[rows], advantages[rows], weights[rows], mask[rows],
                          is_peer=is_peer[rows], num_tokens=5)[0]
        for rows in (slice(0, 1), slice(1, 3))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())


def test_equals_verl_vanilla_token_mean_loss_without_peers():
    compute_policy_loss_vanilla = from_verl("verl.trainer.ppo.core_algos").compute_policy_loss_vanilla
    ActorConfig = from_verl("verl.workers.config").ActorConfig

    config = ActorConfig(
        strategy="fsdp", clip_ratio_low=0.2, clip_ratio_high=0.28, ppo_micro_batch_size_per_gpu=1, rollout_n=8
    )
    g = torch.Generator().manual_seed(0)
    B, T = 16, 12
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # ratios in [0.5, 1.6]: both clip sides are exercised; verl's dual clip (ratio > 3) is not
    ratios = 0.5 + 1.1 * torch.rand(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    log_prob_ours = (old + ratios.log()).requires_grad_(True)
    log_prob_verl = (old + ratios.log()).requires_grad_(True)

    ours, metrics = graft_policy_loss(log_prob_ours, old, advantages, torch.ones(B, dtype=torch.float64), mask)
    theirs, verl_metrics = compute_policy_loss_vanilla(
        old, log_prob_verl, advantages[:, None].expand(B, T), mask, "token-mean", config
    )
    torch.testing.assert_close(ours, theirs)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(log_prob_ours.grad, log_prob_verl.grad)
    assert float(metrics["clipfrac"]) == pytest.approx(verl_metrics["actor/pg_clipfrac"])
    assert float(metrics["ppo_kl"]) == pytest.approx(verl_metrics["actor/ppo_kl"])


def test_sequence_ratio_variant_hand_computed():
    # row 0: token log-ratios (log 2, 0) -> s = sqrt(2), A = +1 -> clipped at 1.28 on both tokens
    # row 1: token ratios (0.9, 0.9, 0.9) -> s = 0.9, A = -1 -> min(-0.9, -0.9) = -0.9 per token
    log_prob, old = log_probs_from_ratios([[2.0, 1.0, 1.0], [0.9, 0.9, 0.9]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metrics = sequence_ratio_policy_loss(log_prob, old, advantages, torch.ones(2, dtype=torch.float64), mask)
    assert loss.item() == pytest.approx(-(2 * 1.28 + 3 * -0.9) / 5)
    assert float(metrics["clipped_tokens_self"]) == 2
    assert float(metrics["ratio_mean"]) == pytest.approx((2 * math.sqrt(2) + 3 * 0.9) / 5)


def test_sequence_ratio_gradient_is_shared_by_the_tokens_of_a_sequence():
    # Unclipped sequence with unequal token ratios: each token's gradient is -w*A*s/N (token-level: -w*A*r_t/N).
    log_prob, old = log_probs_from_ratios([[1.1, 0.95, 1.0]])
    loss, _ = sequence_ratio_policy_loss(log_prob, old, torch.tensor([2.0]), torch.tensor([0.5]), torch.ones(1, 3))
    loss.backward()
    s = (1.1 * 0.95) ** (1 / 3)
    torch.testing.assert_close(log_prob.grad, torch.full((1, 3), -0.5 * 2.0 * s / 3, dtype=torch.float64))


def test_luffy_peer_tokens_use_shaped_probability_without_clip():
    # own row: ratio 1.5, A = 1 -> clipped to 1.28. peer row: pi = 0.5, old_log_prob irrelevant (-50),
    # f = 0.5 / 0.6, A = 1, no clip even though the receiver-old ratio is huge.
    log_prob = torch.tensor([[math.log(1.5) - 1.0], [math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0], [-50.0]], dtype=torch.float64)
    is_peer = torch.tensor([False, True])
    loss, metrics = luffy_policy_loss(
        log_prob, old, torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), torch.ones(2, 1),
        is_peer=is_peer,
    )
    assert loss.item() == pytest.approx(-(1.28 + 0.5 / 0.6) / 2)
    assert float(metrics["clipped_tokens_peer"]) == 0 and float(metrics["clipped_tokens_self"]) == 1
    loss.backward()
    # d f(pi)/d log pi = gamma * pi / (pi + gamma)^2
    assert log_prob.grad[1, 0].item() == pytest.approx(-(0.1 * 0.5 / 0.6**2) / 2)
    assert log_prob.grad[0, 0].item() == 0.0


def test_luffy_without_peers_equals_graft():
    ratios, mask, advantages, weights, _ = hand_batch()
    log_prob, old = log_probs_from_ratios(ratios)
    assert luffy_policy_loss(log_prob, old, advantages, weights, mask)[0].item() == pytest.approx(
        graft_policy_loss(log_prob, old, advantages, weights, mask)[0].item()
    )


#: The clipped policy losses, which share one signature (``objective.OBJECTIVES`` wraps each the same way).
POLICY_LOSSES = (graft_policy_loss, sequence_ratio_policy_loss, luffy_policy_loss)


def test_policy_losses_share_one_signature():
    ratios, mask, advantages, weights, is_peer = hand_batch()
    log_prob, old = log_probs_from_ratios(ratios)
    for fn in POLICY_LOSSES:
        loss, metrics = fn(log_prob, old, advantages, weights, mask, 0.2, 0.28, is_peer=is_peer, num_tokens=5)
        assert loss.ndim == 0 and {"clipfrac_self", "clipfrac_peer", "tokens_peer"} <= set(metrics)


def test_sgt_nll_term():
    log_prob = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = sgt_nll_loss(log_prob, mask, coef=0.1)
    assert loss.item() == pytest.approx(0.1 * 6 / 3)
    assert float(metrics["nll_mean"]) == pytest.approx(2.0) and float(metrics["nll_tokens"]) == 3
    loss.backward()
    torch.testing.assert_close(log_prob.grad, -0.1 * mask / 3)
    empty, _ = sgt_nll_loss(torch.zeros(0, 4, requires_grad=True), torch.zeros(0, 4))
    assert empty.item() == 0.0 and empty.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"weights": torch.tensor([1.0, -0.5])}, "weights must be >= 0"),
        ({"weights": torch.tensor([1.0, float("nan")])}, "weights contains NaN"),
        ({"weights": torch.ones(3)}, r"weights must have shape \(2,\)"),
        ({"advantages": torch.ones(2, 2)}, "advantages must have shape"),
        ({"advantages": torch.tensor([1.0, float("inf")])}, "advantages contains NaN"),
        ({"old_log_prob": torch.zeros(2, 4)}, "old_log_prob has shape"),
        ({"response_mask": torch.ones(2, 4)}, "response_mask has shape"),
        ({"is_peer": torch.ones(3, dtype=torch.bool)}, "is_peer must have shape"),
        ({"num_tokens": 0}, "num_tokens"),
    ],
)
def test_policy_losses_reject_bad_input(kwargs, message):
    args = {
        "log_prob": torch.zeros(2, 3), "old_log_prob": torch.zeros(2, 3), "advantages": torch.ones(2),
        "weights": torch.ones(2), "response_mask": torch.ones(2, 3),
    }
    args.update(kwargs)
    for fn in POLICY_LOSSES:
        with pytest.raises(ValueError, match=message):
            fn(**args)


def _vanilla_config(clip_low: float, clip_high: float, clip_ratio_c: float):
    """verl's own ActorConfig with the clip settings (the config compute_policy_loss_vanilla reads)."""
    ActorConfig = from_verl("verl.workers.config").ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, use_dynamic_bsz=True,
                       ppo_max_token_len_per_gpu=64,
                       clip_ratio=clip_low, clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                       clip_ratio_c=clip_ratio_c, loss_agg_mode="token-mean")


@pytest.mark.parametrize("seed", range(5))
def test_graft_without_peers_equals_verl_vanilla_bit_for_bit(seed):
    """GRAFT with unit weights and no peer rows is verl's GRPO loss (compute_policy_loss_vanilla, dual clip
    3, token-mean), value and gradient identical bit for bit, on random inputs where negative advantages
    meet ratios far above 3 (the dual clip acts) and below 1 - 0.2."""
    compute_policy_loss_vanilla = from_verl("verl.trainer.ppo.core_algos").compute_policy_loss_vanilla

    gen = torch.Generator().manual_seed(seed)
    rows, width = 16, 24
    old = -torch.rand(rows, width, generator=gen) * 4
    log_prob = (old + torch.randn(rows, width, generator=gen) * 1.5).requires_grad_(True)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).float()
    advantages = torch.randn(rows, generator=gen).unsqueeze(1) * mask
    ratio = torch.exp(log_prob.detach() - old)
    assert bool(((advantages < 0) & (ratio > 3) & mask.bool()).any())       # the dual clip has work to do

    ours, _ = graft_policy_loss(log_prob, old, advantages, torch.ones(rows), mask, 0.2, 0.28, clip_ratio_c=3.0)
    (our_grad,) = torch.autograd.grad(ours, log_prob)
    theirs, _ = compute_policy_loss_vanilla(old, log_prob, advantages, mask, "token-mean",
                                            _vanilla_config(0.2, 0.28, 3.0))
    (their_grad,) = torch.autograd.grad(theirs, log_prob)
    assert torch.equal(ours, theirs)
    assert torch.equal(our_grad, their_grad)
    # without the dual clip the two differ (so the test above is not vacuous)
    plain, _ = graft_policy_loss(log_prob, old, advantages, torch.ones(rows), mask, 0.2, 0.28)
    assert not torch.equal(plain, theirs)


def test_dual_clip_bounds_negative_advantage_tokens():
    """A < 0 and ratio 5 > c = 3: the term is c * A with no gradient; A > 0 is untouched by c."""
    log_prob, old = log_probs_from_ratios([[5.0], [5.0]])
    mask = torch.ones(2, 1)
    for advantage, expected, grad in ((-1.0, 3.0, 0.0), (1.0, -1.28, 0.0)):
        lp = log_prob[:1].detach().clone().requires_grad_(True)
        loss, _ = graft_policy_loss(lp, old[:1], torch.tensor([advantage], dtype=torch.float64), torch.ones(1),
                                    mask[:1], 0.2, 0.28, clip_ratio_c=3.0)
        assert loss.item() == pytest.approx(expected)
        (g,) = torch.autograd.grad(loss, lp)
        assert g.item() == grad
    # ratio 2 < c under A < 0: the ordinary surrogate (-2 * -1 = 2) and its gradient
    lp, old2 = log_probs_from_ratios([[2.0]])
    loss, _ = graft_policy_loss(lp, old2, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1), torch.ones(1, 1),
                                clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(2.0)
    for fn in POLICY_LOSSES:
        with pytest.raises(ValueError, match="clip_ratio_c"):
            fn(lp, old2, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1), torch.ones(1, 1), clip_ratio_c=1.0)


def test_dual_clip_in_sequence_ratio_and_luffy_own_tokens():
    log_prob, old = log_probs_from_ratios([[5.0, 5.0]])
    args = (torch.tensor([-1.0], dtype=torch.float64), torch.ones(1), torch.ones(1, 2), 0.2, 0.28)
    for fn in (sequence_ratio_policy_loss, luffy_policy_loss):
        bounded, _ = fn(log_prob, old, *args, clip_ratio_c=3.0)
        plain, _ = fn(log_prob, old, *args)
        assert bounded.item() == pytest.approx(3.0) and plain.item() == pytest.approx(5.0)
