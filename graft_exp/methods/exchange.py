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
      rows            = method.peer_loss.assemble(...)              own groups, selected groups replaced by S's
                        whole group with S's advantages (w = 0 rows removed; pooled variant keeps both groups;
                        HACPO pools every prompt, SGT adds an NLL term: graft_exp.methods.peer_losses)
      minibatches     = method.order(peer groups)                   peer-last by default (method.peer_position)

Everything numeric is delegated to ``graft_exp.algorithms``; this module only routes by the answers
of the method's components (``graft_exp.methods``, ``graft_exp.methods.peer_losses``). Scoring needs the receiver's
model, so the backend passes a ``Scorer``: given prompt indices and the source's responses, it returns the
receiver-old summed log-probs and token counts of their re-tokenizations (it may cache the per-token values it
computes for the update that follows).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from graft_exp.algorithms import resolve_sources
from graft_exp.methods import Method
from graft_exp.methods.receiver import Scorer
from graft_exp.rollouts import Rollouts
from graft_exp.scores import rescue_candidate

#: The source of a receiver's transfers from a replayed log (stored replay) in ``plan_step``'s transfer masks.
REPLAYED = "replayed"
#: ``at_once(fn, roles) -> {role: fn(role)}``: the receivers' work run at the same time where their models sit on
#: disjoint devices (the driver's ``Driver.each``); by default one after the other.
AtOnce = Callable[[Callable, list[str]], dict]


def one_after_another(fn: Callable, roles: list[str]) -> dict:
    return {role: fn(role) for role in roles}


def select_prompts(method: Method, k_a: torch.Tensor, k_b: torch.Tensor, n: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a_to_b, b_to_a)`` bool [P]: on which prompts each receiver gets the source's group, by the
    method's selection rule (``methods.SELECTIONS``)."""
    return method.selection.rule(k_a, k_b, n, generator)


def plan_step(method: Method, rollouts: dict[str, Rollouts], scorers: dict[str, Scorer], generator: torch.Generator,
              *, replayed: dict[str, Rollouts] | None = None, capability_ratios: dict[str, float] | None = None,
              at_once: AtOnce = one_after_another):
    """Every receiver's batch for one training step of any method, by where its peer rows come from: the
    other members' rollouts of this step (``plan_exchange``), a replayed log (``replayed[R]``: the peer
    rollouts receiver R replays, one direction, ``method.source`` = stored), or nowhere (single-model
    methods: own groups only, the peer loss's ``assemble`` with nothing selected).

    Returns (batch of each receiver, the source Rollouts of each receiver's peer rows (None: no peer), the
    transferred-prompt mask of every ordered (source, receiver) pair of an exchange among the members; a
    replayed log's source is ``REPLAYED``).
    """
    if replayed:
        batches, transfers = {}, {}
        for role, own in rollouts.items():
            to_receiver, _ = select_prompts(method, replayed[role].k, own.k, own.n, generator)
            batches[role] = method.peer_loss.assemble(method, own, replayed[role], to_receiver, scorers[role],
                                                      generator)
            transfers[REPLAYED, role] = to_receiver
        return batches, dict(replayed), transfers
    if method.co_train:
        return plan_exchange(method, rollouts, scorers, generator, capability_ratios, at_once)
    batches = {role: method.peer_loss.assemble(method, own, own, torch.zeros(own.rewards.shape[0], dtype=torch.bool),
                                               scorers[role], generator) for role, own in rollouts.items()}
    return batches, dict.fromkeys(rollouts), {}


def plan_exchange(method: Method, rollouts: dict[str, Rollouts], scorers: dict[str, Scorer],
                  generator: torch.Generator, capability_ratios: dict[str, float] | None = None,
                  at_once: AtOnce = one_after_another):
    """Every receiver's batch for one co-training step of a pair or a group (docs/exchange-k.md).

    The selection rule runs once per unordered pair of members, in member order, on that pair's own
    success counts (eq. 3 and its balancing); a receiver offered one prompt by several sources takes
    it from the one ``method.source_rule`` prefers (``source_for``). ``scorers[R]`` scores responses
    under R's old policy. The peer loss takes R's offers before its source is chosen (``receive``: HACPO
    takes every prompt and remembers which ones the selection offered); ``capability_ratios[R]`` = the ratio
    of R's peer to R from what the peer loss tracks (``peer_losses.PeerLoss.capability_ratios``).

    A pair's receivers score their peer's groups at the same time (``at_once``, ``scored_at_once``), before the
    receivers' batches are assembled one after the other: the same calls with the same results, in the same
    random stream.

    Returns (batch of each receiver, the source Rollouts each receiver's peer rows come from, the
    transferred-prompt mask of every ordered (source, receiver) pair).
    """
    roles = list(rollouts)
    offers = {}
    for x, y in itertools.combinations(roles, 2):
        offers[x, y], offers[y, x] = select_prompts(method, rollouts[x].k, rollouts[y].k, rollouts[x].n, generator)
    peers_of = {receiver: [s for s in roles if s != receiver] for receiver in roles}
    # each receiver's take of its offers (it changes only its own): known before any receiver is assembled
    received = {receiver: method.peer_loss.receive(method, receiver, peers_of[receiver], offers, capability_ratios)
                for receiver in roles}
    if len(roles) == 2 and method.peer_loss.scores_selected:
        scorers = scored_at_once(scorers, {r: (offers[peers_of[r][0], r], rollouts[peers_of[r][0]]) for r in roles},
                                 at_once)
    batches, sources, transfers = {}, {}, {}
    for receiver in roles:
        peers = peers_of[receiver]
        if len(peers) == 1:
            source, selected = rollouts[peers[0]], offers[peers[0], receiver]
            transfers[peers[0], receiver] = selected
        else:
            pick = source_for(method, receiver, [rollouts[s] for s in peers],
                              torch.stack([offers[s, receiver] for s in peers]), scorers[receiver], generator)
            source, selected = composite_source([rollouts[s] for s in peers], pick), pick >= 0
            transfers.update({(s, receiver): pick == j for j, s in enumerate(peers)})
        batches[receiver] = method.peer_loss.assemble(method, rollouts[receiver], source, selected, scorers[receiver],
                                                      generator, received[receiver])
        sources[receiver] = source
    return batches, sources, transfers


def scored_at_once(scorers: dict[str, Scorer], selections: dict[str, tuple[torch.Tensor, Rollouts]],
                   at_once: AtOnce) -> dict[str, Scorer]:
    """``scorers`` with the call each receiver's batch will make first (its source's groups on its selected prompts,
    ``PeerLoss.assemble``) already made, the receivers' at the same time: one pool scores while the other does,
    instead of in turn. A scorer answers that call from what it computed, any other call as before."""
    def score(role: str):
        selected, source = selections[role]
        chosen = torch.nonzero(selected).flatten().tolist()
        return (chosen, source, scorers[role](chosen, source)) if chosen else None

    done = at_once(score, list(selections))

    def answering(role: str) -> Scorer:
        if done.get(role) is None:
            return scorers[role]
        pending = [done[role]]

        def scorer(prompts: list[int], source: Rollouts):
            if pending and pending[0][0] == prompts and pending[0][1] is source:
                return pending.pop()[2]
            return scorers[role](prompts, source)
        return scorer
    return {role: answering(role) for role in scorers}


def source_for(method: Method, receiver: str, candidates: list[Rollouts], offered: torch.Tensor, scorer: Scorer,
               generator: torch.Generator) -> torch.Tensor:
    """long [P]: which of ``candidates`` the receiver takes each prompt from (-1: none), by the method's
    source rule (eq. K2 of docs/exchange-k.md)."""
    preference = method.source_rule.preference(candidates, offered, scorer)
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
    solved = torch.stack([rescue_candidate(own.k, peer.k)[all_fail] for peer in peers]).any(dim=0)
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
