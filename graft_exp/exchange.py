"""One GRAFT step's exchange, backend-agnostic: from both models' rollouts on the shared prompt batch
to each receiver's training batch (paper §3, Alg. 1; baselines App. B; variants App. G).

The whole step, for receiver R and source S (``plan_step`` runs it in both directions)::

    k_A, k_B          = successes per prompt                       (Rollouts.k)
    (A->B, B->A)      = select_prompts(method, k_A, k_B)            eq. (3) + SelectWithTies / variants
    for R, S:
      s(o|q)          = score(S's responses on selected q)          eq. (8), receiver-old vs source-old
      w(o|q)          = peer_weights(method, s, rewards)            eq. (9) / no gate / random / success
      rows            = own groups, selected groups replaced by S's whole group with S's advantages
                        (w = 0 rows removed; pooled variant keeps both groups, HACPO pools everything)
      minibatches     = ordering(method.peer_position)              peer-last by default

Everything numeric is delegated to ``graft_exp.algorithms``; this module only routes the method
config. Scoring needs the receiver's model, so the backend passes a ``Scorer``: given prompt indices
and the source's responses, it returns the receiver-old summed log-probs and token counts of their
re-tokenizations (it may cache the per-token values it computes for the update that follows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graft_exp.algorithms import (
    EXCHANGE_RULES,
    MINIBATCH_ORDERINGS,
    PEER_WEIGHTINGS,
    compatibility_score,
    complementary_candidates,
    count_matched_random_exchange,
    draw_one_correct_response,
    grpo_advantages,
    hacpo_advantages,
    hacpo_which_advantages,
    pooled_group_advantages,
    random_admission_weights,
    success_only_weights,
)
from graft_exp.rollouts import Rollouts

SELF, PEER = "self", "peer"


#: ``scorer(prompts [S], source) -> (logp_sum [S, n], num_tokens [S, n])``: receiver-old log-prob sums
#: and token counts of the re-tokenized responses ``source.responses[q]`` for q in ``prompts``.
Scorer = Callable[[list[int], Rollouts], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Row:
    """One response in a receiver's update: whose it is, its advantage and its weight."""

    group: int          # position of its prompt's group in the batch (a minibatch is a set of groups)
    origin: str         # SELF | PEER
    prompt: int         # prompt index in the batch
    sample: int         # response index within that model's group
    advantage: float
    weight: float       # 1 for own responses; w(o|q) for peer ones (always > 0: removed rows are absent)


@dataclass
class ReceiverBatch:
    """What one receiver trains on at this step."""

    rows: list[Row]
    group_is_peer: torch.Tensor                    # bool [P]: the group of prompt q contains peer rows
    nll: list[tuple[int, int]] = field(default_factory=list)   # SGT: (prompt, peer sample) pairs
    metrics: dict[str, float] = field(default_factory=dict)

    def minibatches(self, method, groups_per_minibatch: int, generator: torch.Generator) -> list[list[int]]:
        """Group indices of each minibatch, in processing order (peer-last / first / uniform)."""
        order = MINIBATCH_ORDERINGS[method.peer_position](self.group_is_peer, groups_per_minibatch, generator)
        return [groups.tolist() for groups in order]

    def rows_in(self, groups: list[int]) -> list[Row]:
        """The rows of those groups, in batch order."""
        wanted = set(groups)
        return [row for row in self.rows if row.group in wanted]

    def nll_in(self, groups: list[int]) -> list[tuple[int, int]]:
        """SGT's (prompt, peer sample) pairs whose prompt's group is among ``groups``."""
        wanted = set(groups)
        return [(q, i) for q, i in self.nll if q in wanted]


def select_prompts(method, k_a: torch.Tensor, k_b: torch.Tensor, n: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a_to_b, b_to_a)`` bool [P]: on which prompts each receiver gets the source's group.

    balanced: eq. (3) + SelectWithTies to m = min(|C_AB|, |C_BA|) (GRAFT, sgt_which, hacpo_which);
    complementary: eq. (3) in each direction, unbalanced (stored replay: one direction anyway);
    rescue: receiver k = 0 and source k >= 1 (SGT; graft_no_balance); random_prompts: as many prompts
    as ``balanced`` takes, drawn uniformly; all: every prompt (HACPO); none: no exchange.
    """
    if method.selection == "none":
        nothing = torch.zeros_like(k_a, dtype=torch.bool)
        return nothing, nothing.clone()
    if method.selection == "all":
        every = torch.ones_like(k_a, dtype=torch.bool)
        return every, every.clone()
    if method.selection == "complementary":
        return complementary_candidates(k_a, k_b, n), complementary_candidates(k_b, k_a, n)
    if method.selection == "rescue":
        return EXCHANGE_RULES["rescue"](k_a, k_b, n)
    a_to_b, b_to_a = EXCHANGE_RULES["balanced"](k_a, k_b, n)
    if method.selection == "random_prompts":
        a_to_b, b_to_a = count_matched_random_exchange(a_to_b, b_to_a, generator)
    return a_to_b, b_to_a


def peer_weights(method, score: torch.Tensor, rewards: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """w(o|q) of the transferred responses ([S, n]): eq. (9), or the variant's rule. 0 = removed."""
    if method.peer_loss in ("luffy", "hacpo") or not method.gate:
        weights = PEER_WEIGHTINGS["ungated"](score, method.delta)
    elif method.admission == "random":
        weights = random_admission_weights(score, method.delta, generator)
    else:
        weights = PEER_WEIGHTINGS["gated"](score, method.delta)
    if method.peer_responses == "success":
        weights = success_only_weights(weights, rewards)
    return weights


def assemble(method, receiver: Rollouts, source: Rollouts, selected: torch.Tensor, scorer: Scorer,
             generator: torch.Generator, hacpo: dict | None = None) -> ReceiverBatch:
    """The receiver's training batch (Alg. 1, "Replace selected groups using the original source
    rollouts"). ``hacpo``: {"capability_ratio": float, "which": bool [P] or None} for HACPO methods."""
    prompts, n = receiver.rewards.shape
    chosen = torch.nonzero(selected).flatten().tolist()
    own_adv, src_adv = receiver.advantages.clone(), source.advantages.clone()
    metrics = {"peer_groups": float(len(chosen)), "peer_admitted": 0.0}

    if method.peer_loss == "nll":
        # SGT: own groups untouched, plus the NLL of one uniformly drawn correct peer response. It is GRPO
        # plus that term: its minibatches keep GRPO's order (no group counts as peer for the packing).
        draw = draw_one_correct_response(source.rewards, selected, generator)
        nll = [(q, int(draw[q])) for q in chosen]
        group_is_peer = torch.zeros_like(selected)
        rows = [Row(q, SELF, q, i, float(own_adv[q, i]), 1.0) for q in range(prompts) for i in range(n)]
        metrics["peer_admitted"] = float(len(nll))
        return ReceiverBatch(rows, group_is_peer, nll, metrics)

    score = torch.zeros(len(chosen), n)
    if chosen:
        recv_sum, recv_count = scorer(chosen, source)
        score = compatibility_score(recv_sum, recv_count, source.logp_sum[chosen], source.num_tokens[chosen])
        metrics["compat_mean"] = float(score.mean())
    weights = peer_weights(method, score, source.rewards[chosen], generator)
    keep_own = ~selected
    if method.peer_loss == "hacpo":
        # HACPO pools every prompt: own and peer groups both stay, with capability-aware advantages.
        own_adv, src_adv = hacpo_advantages(receiver.rewards, source.rewards, hacpo["capability_ratio"],
                                            method.adv_eps)
        if hacpo.get("which") is not None:
            src_adv = hacpo_which_advantages(src_adv, hacpo["which"])
        keep_own = torch.ones(prompts, dtype=torch.bool)
    elif method.advantages == "pooled" and chosen:
        own_adv[chosen], src_adv[chosen] = pooled_group_advantages(
            receiver.rewards[chosen], source.rewards[chosen], method.adv_eps)
        keep_own = torch.ones(prompts, dtype=torch.bool)

    # HACPO's minibatches hold own groups (0..P-1) and peer groups (P..2P-1) separately; GRAFT's
    # variants keep a prompt's slot: a replaced (or pooled) group is one group.
    separate = method.peer_loss == "hacpo"
    group_is_peer = torch.zeros(2 * prompts if separate else prompts, dtype=torch.bool)
    rows = []
    peer_of = {q: j for j, q in enumerate(chosen)}
    for q in range(prompts):
        if keep_own[q]:
            rows += [Row(q, SELF, q, i, float(own_adv[q, i]), 1.0) for i in range(n)]
        if q in peer_of:
            group = prompts + q if separate else q
            group_is_peer[group] = True
            j = peer_of[q]
            rows += [Row(group, PEER, q, i, float(src_adv[q, i]), float(weights[j, i]))
                     for i in range(source.n) if weights[j, i] > 0]
    metrics["peer_admitted"] = float((weights > 0).sum())
    return ReceiverBatch(rows, group_is_peer, [], metrics)


def plan_step(method, a: Rollouts, b: Rollouts, scorers: tuple[Scorer, Scorer], generator: torch.Generator,
              capability_ratios: tuple[float, float] | None = None
              ) -> tuple[ReceiverBatch, ReceiverBatch, tuple[torch.Tensor, torch.Tensor]]:
    """Both receivers' batches for one co-training step: (batch of A, batch of B, (a_to_b, b_to_a)).

    ``scorers`` = (A's scorer of B's responses, B's scorer of A's responses). HACPO methods pool
    every prompt; ``hacpo_which`` keeps its peer advantages only on the balanced selection, and
    ``capability_ratios`` = (ratio B->A, ratio A->B) of HACPO's capability tracker.
    """
    a_to_b, b_to_a = select_prompts(method, a.k, b.k, a.n, generator)
    hacpo_a = hacpo_b = None
    if method.peer_loss == "hacpo":
        which = method.selection != "all"
        hacpo_a = {"capability_ratio": capability_ratios[0], "which": b_to_a if which else None}
        hacpo_b = {"capability_ratio": capability_ratios[1], "which": a_to_b if which else None}
        a_to_b = b_to_a = torch.ones_like(a_to_b)
    batch_a = assemble(method, a, b, b_to_a, scorers[0], generator, hacpo_a)
    batch_b = assemble(method, b, a, a_to_b, scorers[1], generator, hacpo_b)
    return batch_a, batch_b, (a_to_b, b_to_a)


def group_advantages(rewards: torch.Tensor, method) -> torch.Tensor:
    """GRPO advantages of one model's groups (eq. 1; zero-variance groups get 0)."""
    return grpo_advantages(rewards, method.adv_eps)


def peer_solved_frac(own: Rollouts, peer: Rollouts) -> float:
    """Of the prompts where ``own`` failed all n, the fraction its peer solved at least once (NaN if none)."""
    all_fail = own.k == 0
    if not bool(all_fail.any()):
        return float("nan")
    return float((peer.k[all_fail] >= 1).float().mean())


def rollout_metrics(own: Rollouts) -> dict[str, float]:
    """Per-step statistics of one model's own rollouts."""
    k = own.k
    return {
        "reward_mean": float(own.rewards.float().mean()),
        "all_fail_frac": float((k == 0).float().mean()),
        "informative_frac": float(((k > 0) & (k < own.n)).float().mean()),
        "response_tokens_mean": float(own.num_tokens.float().mean()),
    }
