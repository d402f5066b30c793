"""One GRAFT step's exchange, backend-agnostic: from both models' rollouts on the shared prompt batch
to each receiver's training batch (paper §3, Alg. 1; baselines App. B; variants App. G).

The whole step, for receiver R and source S (``plan_step`` routes every method: ``plan_exchange`` runs it
in both directions of every pair of the group's members, stored replay in one direction from the peer's
log, single-model methods not at all; with K > 2 a receiver offered a prompt by several sources takes one, by
``method.source_rule``: docs/exchange-k.md)::

    k_A, k_B          = successes per prompt                       (Rollouts.k)
    (A->B, B->A)      = method.selection.rule(k_A, k_B)             eq. (3) + SelectWithTies / variants
    for R, S:
      s(o|q)          = score(S's responses on selected q)          eq. (8), receiver-old vs source-old
      w(o|q)          = method.weights(s, rewards)                  eq. (9) / no gate / random / success
      rows            = own groups, selected groups replaced by S's whole group with S's advantages
                        (w = 0 rows removed; pooled variant keeps both groups, HACPO pools everything)
      minibatches     = method.order(peer groups)                   peer-last by default (method.peer_position)

Everything numeric is delegated to ``graft_exp.algorithms``; this module only routes by the answers
of the method's components (``graft_exp.methods``). Scoring needs the receiver's model, so the backend passes a ``Scorer``: given prompt indices
and the source's responses, it returns the receiver-old summed log-probs and token counts of their
re-tokenizations (it may cache the per-token values it computes for the update that follows).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graft_exp.algorithms import (
    compatibility_score,
    draw_one_correct_response,
    hacpo_advantages,
    hacpo_which_advantages,
    pooled_group_advantages,
    resolve_sources,
)
from graft_exp.methods import Method
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

    def minibatches(self, method: Method, groups_per_minibatch: int, generator: torch.Generator) -> list[list[int]]:
        """Group indices of each minibatch, in processing order (peer-last / first / uniform)."""
        order = method.order(self.group_is_peer, groups_per_minibatch, generator)
        return [groups.tolist() for groups in order]

    def rows_in(self, groups: list[int]) -> list[Row]:
        """The rows of those groups, in batch order."""
        wanted = set(groups)
        return [row for row in self.rows if row.group in wanted]

    def nll_in(self, groups: list[int]) -> list[tuple[int, int]]:
        """SGT's (prompt, peer sample) pairs whose prompt's group is among ``groups``."""
        wanted = set(groups)
        return [(q, i) for q, i in self.nll if q in wanted]


def select_prompts(method: Method, k_a: torch.Tensor, k_b: torch.Tensor, n: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a_to_b, b_to_a)`` bool [P]: on which prompts each receiver gets the source's group, by the
    method's selection rule (``methods.SELECTIONS``)."""
    return method.selection.rule(k_a, k_b, n, generator)


def assemble(method: Method, receiver: Rollouts, source: Rollouts, selected: torch.Tensor, scorer: Scorer,
             generator: torch.Generator, capability: dict | None = None) -> ReceiverBatch:
    """The receiver's training batch (Alg. 1, "Replace selected groups using the original source
    rollouts"). ``capability``: {"ratio": float, "which": bool [P] or None} for a peer loss with
    capability-aware advantages (HACPO)."""
    prompts, n = receiver.rewards.shape
    chosen = torch.nonzero(selected).flatten().tolist()
    own_adv, src_adv = receiver.advantages.clone(), source.advantages.clone()
    metrics = {"peer_groups": float(len(chosen)), "peer_admitted": 0.0}
    peer_loss, adv_eps = method.peer_loss, float(method.config.adv_eps)

    if peer_loss.nll_only:
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
    weights = method.weights(score, source.rewards[chosen], generator)
    keep_own = ~selected
    if peer_loss.capability_advantages:
        # HACPO pools every prompt: own and peer groups both stay, with capability-aware advantages.
        own_adv, src_adv = hacpo_advantages(receiver.rewards, source.rewards, capability["ratio"], adv_eps)
        if capability.get("which") is not None:
            src_adv = hacpo_which_advantages(src_adv, capability["which"])
        keep_own = torch.ones(prompts, dtype=torch.bool)
    elif method.advantages.pooled_with_receiver and chosen:
        own_adv[chosen], src_adv[chosen] = pooled_group_advantages(
            receiver.rewards[chosen], source.rewards[chosen], adv_eps)
        keep_own = torch.ones(prompts, dtype=torch.bool)

    # HACPO's minibatches hold own groups (0..P-1) and peer groups (P..2P-1) separately; GRAFT's
    # variants keep a prompt's slot: a replaced (or pooled) group is one group.
    groups_per_prompt = peer_loss.groups_per_prompt
    group_is_peer = torch.zeros(groups_per_prompt * prompts, dtype=torch.bool)
    rows = []
    peer_of = {q: j for j, q in enumerate(chosen)}
    for q in range(prompts):
        if keep_own[q]:
            rows += [Row(q, SELF, q, i, float(own_adv[q, i]), 1.0) for i in range(n)]
        if q in peer_of:
            group = (groups_per_prompt - 1) * prompts + q
            group_is_peer[group] = True
            j = peer_of[q]
            rows += [Row(group, PEER, q, i, float(src_adv[q, i]), float(weights[j, i]))
                     for i in range(source.n) if weights[j, i] > 0]
    metrics["peer_admitted"] = float((weights > 0).sum())
    return ReceiverBatch(rows, group_is_peer, [], metrics)


def plan_step(method: Method, rollouts: dict[str, Rollouts], scorers: dict[str, Scorer], generator: torch.Generator,
              *, stored: dict[str, Rollouts] | None = None, capability_ratios: dict[str, float] | None = None):
    """Every receiver's batch for one training step of any method, by where its peer rows come from: the
    other members' rollouts of this step (``plan_exchange``), a replayed log (``stored[R]``: the peer
    rollouts receiver R replays, one direction, ``method.source`` = stored), or nowhere (single-model
    methods: own groups only, ``assemble`` with nothing selected).

    Returns (batch of each receiver, the source Rollouts of each receiver's peer rows (None: no peer), the
    transferred-prompt mask of every ordered (source, receiver) pair of an exchange among the members).
    """
    if method.replays_stored_log:
        batches = {}
        for role, own in rollouts.items():
            to_receiver, _ = select_prompts(method, stored[role].k, own.k, own.n, generator)
            batches[role] = assemble(method, own, stored[role], to_receiver, scorers[role], generator)
        return batches, dict(stored), {}
    if method.co_train:
        return plan_exchange(method, rollouts, scorers, generator, capability_ratios)
    batches = {role: assemble(method, own, own, torch.zeros(own.rewards.shape[0], dtype=torch.bool), scorers[role],
                              generator) for role, own in rollouts.items()}
    return batches, dict.fromkeys(rollouts), {}


def plan_exchange(method: Method, rollouts: dict[str, Rollouts], scorers: dict[str, Scorer],
                  generator: torch.Generator, capability_ratios: dict[str, float] | None = None):
    """Every receiver's batch for one co-training step of a pair or a group (docs/exchange-k.md).

    The selection rule runs once per unordered pair of members, in member order, on that pair's own
    success counts (eq. 3 and its balancing); a receiver offered one prompt by several sources takes
    it from the one ``method.source_rule`` prefers (``source_for``). ``scorers[R]`` scores responses
    under R's old policy. HACPO (two models): a peer loss that pools every prompt transfers every group; a
    selection rule that singles prompts out (``hacpo_which``) then keeps the peer advantages only on the
    prompts it selected; ``capability_ratios[R]`` = the ratio of R's peer to R from HACPO's tracker.

    Returns (batch of each receiver, the source Rollouts each receiver's peer rows come from, the
    transferred-prompt mask of every ordered (source, receiver) pair).
    """
    roles = list(rollouts)
    offers = {}
    for x, y in itertools.combinations(roles, 2):
        offers[x, y], offers[y, x] = select_prompts(method, rollouts[x].k, rollouts[y].k, rollouts[x].n, generator)
    batches, sources, transfers = {}, {}, {}
    for receiver in roles:
        peers = [s for s in roles if s != receiver]
        capability = None
        if method.peer_loss.capability_advantages:
            which = None if method.selection.every_prompt else offers[peers[0], receiver]
            capability = {"ratio": capability_ratios[receiver], "which": which}
        if method.peer_loss.pools_every_prompt:
            offers.update({(s, receiver): torch.ones_like(offers[s, receiver]) for s in peers})
        if len(peers) == 1:
            source, selected = rollouts[peers[0]], offers[peers[0], receiver]
            transfers[peers[0], receiver] = selected
        else:
            pick = source_for(method, receiver, [rollouts[s] for s in peers],
                              torch.stack([offers[s, receiver] for s in peers]), scorers[receiver], generator)
            source, selected = composite_source([rollouts[s] for s in peers], pick), pick >= 0
            transfers.update({(s, receiver): pick == j for j, s in enumerate(peers)})
        batches[receiver] = assemble(method, rollouts[receiver], source, selected, scorers[receiver], generator,
                                     capability)
        sources[receiver] = source
    return batches, sources, transfers


def source_for(method: Method, receiver: str, candidates: list[Rollouts], offered: torch.Tensor, scorer: Scorer,
               generator: torch.Generator) -> torch.Tensor:
    """long [P]: which of ``candidates`` the receiver takes each prompt from (-1: none), by the method's
    source rule (eq. K2 of docs/exchange-k.md)."""
    rule = method.source_rule
    preference = torch.zeros(offered.shape, dtype=torch.float64)
    if rule.by_successes:
        preference = torch.stack([c.k for c in candidates]).double()
    elif rule.by_compatibility:
        contested = offered.sum(dim=0) > 1   # only a prompt with a choice needs the extra scoring
        for j, candidate in enumerate(candidates):
            prompts = torch.nonzero(contested & offered[j]).flatten().tolist()
            if prompts:
                recv_sum, recv_count = scorer(prompts, candidate)
                preference[j, prompts] = compatibility_score(
                    recv_sum, recv_count, candidate.logp_sum[prompts], candidate.num_tokens[prompts]).double().mean(dim=1)
    return resolve_sources(offered, preference, generator)


def composite_source(candidates: list[Rollouts], pick: torch.Tensor) -> Rollouts:
    """One source table for a receiver of a group: row q is the group of ``candidates[pick[q]]`` (the first
    candidate's where nothing transfers; those rows are never read), so the rest of the step is one-source code."""
    rows = pick.clamp(min=0).tolist()
    stack = lambda name: torch.stack([getattr(candidates[j], name)[q] for q, j in enumerate(rows)])
    return Rollouts(model=",".join(dict.fromkeys(candidates[j].model for j in rows)),
                    prompt_ids=list(candidates[0].prompt_ids),
                    responses=[candidates[j].responses[q] for q, j in enumerate(rows)],
                    rewards=stack("rewards"), advantages=stack("advantages"), logp_sum=stack("logp_sum"),
                    num_tokens=stack("num_tokens"), finished=stack("finished"))


def peer_solved_frac(own: Rollouts, peers: list[Rollouts]) -> float:
    """Of the prompts where ``own`` failed all n, the fraction some peer solved at least once (NaN if none)."""
    all_fail = own.k == 0
    if not bool(all_fail.any()):
        return float("nan")
    solved = torch.stack([peer.k[all_fail] >= 1 for peer in peers]).any(dim=0)
    return float(solved.float().mean())


def rollout_metrics(own: Rollouts) -> dict[str, float]:
    """Per-step statistics of one model's own rollouts."""
    k = own.k
    return {
        "reward_mean": float(own.rewards.float().mean()),
        "all_fail_frac": float((k == 0).float().mean()),
        "informative_frac": float(((k > 0) & (k < own.n)).float().mean()),
        "response_tokens_mean": float(own.num_tokens.float().mean()),
    }
