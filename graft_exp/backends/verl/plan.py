"""Which rows each receiver trains on, per method (paper §3, Alg. 1, App. B/G), from per-prompt tensors.

All calls go to ``graft_exp.algorithms``; this module only routes the method config to them and turns
their masks and weights into ``ReceiverRows`` (row indices of the receiver's own rollouts, prompt-major
``p * n + i``, and of its re-tokenized peer batch, which holds the selected prompts' whole source groups
in prompt order). Two phases, because compatibility scores need the receiver's log-probs of the peer
responses: ``select_prompts`` (from success counts), then ``receiver_rows`` (from scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graft_exp.algorithms import (
    EXCHANGE_RULES,
    PEER_WEIGHTINGS,
    complementary_candidates,
    count_matched_random_exchange,
    draw_one_correct_response,
    hacpo_which_advantages,
    pooled_group_advantages,
    random_admission_weights,
    success_only_weights,
)
from graft_exp.backends.verl.batch import ReceiverRows


def select_prompts(method, k_a: torch.Tensor, k_b: torch.Tensor, n: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_to_b, b_to_a): prompts whose source group each receiver gets. HACPO pools every prompt (its
    ``_which`` variant gets the balanced selection, used for its advantages); stored replay selects in one
    direction (A is the stored source, B the receiver) without balancing."""
    if method.selection == "all":
        every = torch.ones_like(k_a, dtype=torch.bool)
        return every, every
    if method.source == "stored":
        return complementary_candidates(k_a, k_b, n), torch.zeros_like(k_a, dtype=torch.bool)
    # Count-matched random prompts draw as many prompts as GRAFT's balanced selection would take.
    rule = "balanced" if method.selection == "random_prompts" else method.selection
    a_to_b, b_to_a = EXCHANGE_RULES[rule](k_a, k_b, n)
    if method.selection == "random_prompts":
        a_to_b, b_to_a = count_matched_random_exchange(a_to_b, b_to_a, generator)
    return a_to_b, b_to_a


@dataclass
class RowsAndStats:
    rows: ReceiverRows
    stats: dict[str, float]


def receiver_rows(method, *, own_rewards: torch.Tensor, own_advantages: torch.Tensor, peer_rewards: torch.Tensor,
                  peer_advantages: torch.Tensor, selected: torch.Tensor, scores: torch.Tensor,
                  generator: torch.Generator, hacpo_selected: torch.Tensor | None = None) -> RowsAndStats:
    """One receiver's rows. ``own_*`` / ``peer_*`` are [P, n] rewards and advantages (the peer's are
    source-computed; for HACPO both are its pooled capability-aware ones); ``selected`` [P] the prompts
    whose peer group was re-tokenized; ``scores`` [S, n] the compatibility score s of those responses
    (S = selected prompts, in prompt order). ``hacpo_selected``: ``hacpo_which``'s balanced prompts."""
    prompts, n = own_rewards.shape
    chosen = torch.nonzero(selected).flatten()
    own_index = torch.arange(prompts * n).view(prompts, n)
    peer_index = torch.arange(len(chosen) * n).view(len(chosen), n)
    src_rewards, src_adv = peer_rewards[chosen], peer_advantages[chosen]
    keep_own = torch.ones(prompts, dtype=torch.bool)
    own_adv = own_advantages.clone()
    sft = torch.zeros(len(chosen), n, dtype=torch.bool)
    if method.peer_loss == "hacpo":
        weights = torch.ones(len(chosen), n)
        if hacpo_selected is not None:
            src_adv = hacpo_which_advantages(src_adv, hacpo_selected[chosen])
    elif method.peer_loss == "nll":
        draw = draw_one_correct_response(src_rewards, torch.ones(len(chosen), dtype=torch.bool), generator)
        sft[torch.arange(len(chosen)), draw] = True
        weights, src_adv = torch.zeros(len(chosen), n), torch.zeros(len(chosen), n)
    else:
        if method.advantages == "pooled":
            own_adv[chosen], src_adv = pooled_group_advantages(own_rewards[chosen], src_rewards, method.adv_eps)
        else:
            keep_own[chosen] = False
        if method.admission == "random":
            weights = random_admission_weights(scores, method.delta, generator)
        else:
            weights = PEER_WEIGHTINGS["gated" if method.gate else "ungated"](scores, method.delta)
        if method.peer_responses == "success":
            weights = success_only_weights(weights, src_rewards)
    peer_rows = peer_index.flatten() if method.peer_loss != "nll" else peer_index[sft]
    rows = ReceiverRows(
        own=own_index[keep_own].flatten(), own_advantage=own_adv[keep_own].flatten(),
        peer=peer_rows, peer_advantage=(src_adv.flatten() if method.peer_loss != "nll" else src_adv[sft]),
        peer_weight=(weights.flatten() if method.peer_loss != "nll" else weights[sft]),
        peer_sft=(sft.flatten() if method.peer_loss != "nll" else sft[sft]))
    k_own, k_peer = (own_rewards > 0).sum(1), (peer_rewards > 0).sum(1)
    all_fail = k_own == 0
    stats = {
        "train/reward_mean": float(own_rewards.float().mean()),
        "train/all_fail_frac": float(all_fail.float().mean()),
        "train/peer_solved_frac": float((k_peer[all_fail] >= 1).float().mean()) if bool(all_fail.any()) else 0.0,
        "train/peer_groups": float(len(chosen)),
        "train/peer_admitted": float((rows.peer_weight > 0).sum() if method.peer_loss != "nll" else len(rows.peer)),
        "train/compat_mean": float(scores.float().mean()) if scores.numel() else 0.0,
    }
    return RowsAndStats(rows, stats)
