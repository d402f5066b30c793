"""The exchange among a group of K > 2 models (docs/exchange-k.md): per-pair selection (eq. 3 with each
pair's balancing), one source per contested prompt by ``method.source_rule``, and the K = 2 case equal to
the pair's exchange. Hand-computed cases on n = 4."""

import math

import pytest
import torch
from test_exchange import method, plan_pair, rollouts, scorer_with

from graft_exp.algorithms import resolve_sources
from graft_exp.methods.exchange import plan_exchange
from graft_exp.methods.receiver import PEER

# Prompt 0: A fails; B (k=3) and C (k=2) both qualify for A. Prompt 1: A fails, only C qualifies.
# Prompt 2: B and C fail, A (k=2) qualifies for both. Prompt 3: A all correct: no candidate anywhere.
# Pair (A,B): C_BA = {0}, C_AB = {2}, m = 1. Pair (A,C): C_CA = {0, 1} (tied k_C = 2), C_AC = {2}, m = 1,
# SelectWithTies keeps both ties. Pair (B,C): no candidates.
K = {"A": [0, 0, 2, 4], "B": [3, 0, 0, 0], "C": [2, 2, 0, 0]}


def group(**ks):
    return {role: rollouts(role, k) for role, k in (ks or K).items()}


def transfers_of(rule, scorers=None, ks=None, seed=0):
    rolls = group(**(ks or {}))
    scorers = scorers or {role: scorer_with([-1.0] * 4) for role in rolls}
    batches, sources, transfers = plan_exchange(method(source_rule=rule), rolls, scorers,
                                                torch.Generator().manual_seed(seed))
    return rolls, batches, sources, {pair: mask.nonzero().flatten().tolist() for pair, mask in transfers.items()}


def test_most_successes_takes_the_contested_prompt_from_the_source_with_more_successes():
    rolls, batches, sources, moved = transfers_of("most_successes")
    assert moved == {("B", "A"): [0], ("C", "A"): [1], ("A", "B"): [2], ("C", "B"): [],
                     ("A", "C"): [2], ("B", "C"): []}
    # A's peer rows: prompt 0 is B's whole group with B's advantages, prompt 1 is C's.
    peer_rows = [r for r in batches["A"].rows if r.origin == PEER]
    assert {r.prompt for r in peer_rows} == {0, 1}
    assert sources["A"].responses[0] == rolls["B"].responses[0] and sources["A"].responses[1] == rolls["C"].responses[1]
    assert [r.advantage for r in peer_rows if r.prompt == 0] == rolls["B"].advantages[0].tolist()
    assert [r.advantage for r in peer_rows if r.prompt == 1] == rolls["C"].advantages[1].tolist()
    assert batches["A"].metrics["peer_groups"] == 2


def test_compatibility_takes_the_source_the_receiver_finds_most_likely():
    # A's old policy gives C's responses mean log-prob -1 (s = 1) and B's -3 (s = e^-2): C wins prompt 0.
    def scorer_a(prompts, source):
        mean = -1.0 if source.model == "C" else -3.0
        sums = torch.full((len(prompts), 4), mean * 5, dtype=torch.float64)
        return sums, torch.full(sums.shape, 5)
    scorers = {"A": scorer_a, "B": scorer_with([-1.0] * 4), "C": scorer_with([-1.0] * 4)}
    _, _, _, moved = transfers_of("compatibility", scorers)
    assert moved[("B", "A")] == [] and moved[("C", "A")] == [0, 1]


def test_random_and_tied_sources_are_drawn_from_the_generator():
    seen = {transfers_of("random", seed=seed)[3][("B", "A")] == [0] for seed in range(20)}
    assert seen == {True, False}                         # both sources win prompt 0 for some seed
    tied = {"A": [0, 0, 2, 4], "B": [2, 0, 0, 0], "C": [2, 2, 0, 0]}
    winners = {transfers_of("most_successes", ks=tied, seed=seed)[3][("B", "A")] == [0] for seed in range(20)}
    assert winners == {True, False}
    assert transfers_of("random", seed=3)[3] == transfers_of("random", seed=3)[3]   # reproducible


def test_resolve_sources_hand_case():
    offered = torch.tensor([[True, False, True, False], [True, True, True, False]])
    preference = torch.tensor([[3.0, 0.0, 1.0, 0.0], [2.0, 5.0, 4.0, 0.0]])
    assert resolve_sources(offered, preference, torch.Generator()).tolist() == [0, 1, 1, -1]


def test_a_pair_draws_nothing_extra_and_equals_the_pair_exchange():
    a, b = rollouts("A", [0, 3, 2, 4]), rollouts("B", [2, 0, 1, 0])
    scores = [-1.0, -1.0 + math.log(0.9), -1.0 + math.log(0.5), -0.5]
    for rule in ("most_successes", "compatibility", "random"):
        gen = torch.Generator().manual_seed(7)
        _, _, (a_to_b, b_to_a) = plan_pair(method(source_rule=rule), a, b,
                                           (scorer_with(scores), scorer_with(scores)), gen)
        assert a_to_b.tolist() == [False, True, False, False] and b_to_a.tolist() == [True, False, False, False]
        assert torch.equal(gen.get_state(), torch.Generator().manual_seed(7).get_state())   # no draw spent


def test_sgt_rescues_from_one_source_per_prompt():
    rolls = group()
    sgt = method(selection="rescue", peer_loss="nll", gate=False)
    batches, sources, transfers = plan_exchange(sgt, rolls, {r: None for r in rolls}, torch.Generator().manual_seed(0))
    # A failed prompts 0 and 1: B (k=3) beats C (k=2) on 0; only C solved 1. One correct response each.
    assert transfers["B", "A"].nonzero().flatten().tolist() == [0]
    assert transfers["C", "A"].nonzero().flatten().tolist() == [1]
    assert [q for q, _ in batches["A"].nll] == [0, 1]
    assert all(sources["A"].rewards[q, i] == 1 for q, i in batches["A"].nll)


@pytest.mark.parametrize("name", ["hacpo", "hacpo_which", "graft_stored"])
def test_two_model_methods_refuse_a_group(compose_cfg, name):
    from graft_exp.config import ConfigError, validate
    with pytest.raises(ConfigError, match=f"method={name} trains exactly two models"):
        validate(compose_cfg("group=tiny3", f"method={name}"))
