"""graft_exp.methods.exchange: each method's receiver batch from two models' rollouts (paper §3, App. B/G).

The scorer is the backend's job; here it is a plain function returning chosen receiver log-prob sums,
which makes the compatibility scores exact and known."""

import math

import torch
from omegaconf import OmegaConf

from graft_exp.config import MethodConfig
from graft_exp.methods import resolve
from graft_exp.methods.exchange import peer_solved_frac, plan_exchange, select_prompts
from graft_exp.methods.receiver import PEER, SELF
from graft_exp.rollouts import Rollouts

N = 4


def assemble(method, *args):
    """The receiver batch, as the method's peer loss builds it (``peer_losses.PeerLoss.assemble``)."""
    return method.peer_loss.assemble(method, *args)


def plan_pair(method, a, b, scorers, generator, ratios=None):
    """``plan_exchange`` on a pair, in the order of the two-model API: (batch of A, batch of B, (a_to_b, b_to_a))."""
    batches, _, transfers = plan_exchange(method, {"A": a, "B": b}, dict(zip("AB", scorers)), generator,
                                          None if ratios is None else dict(zip("AB", ratios)))
    return batches["A"], batches["B"], (transfers["A", "B"], transfers["B", "A"])


def method(**overrides):
    """The components of GRAFT's config with ``overrides`` (what the exchange reads)."""
    return resolve(OmegaConf.merge(OmegaConf.structured(MethodConfig(name="test")), overrides))


def rollouts(model: str, k: list[int], logp_mean: float = -1.0) -> Rollouts:
    rewards = torch.tensor([[1.0] * kq + [0.0] * (N - kq) for kq in k])
    from graft_exp.algorithms import grpo_advantages
    return Rollouts(model, [f"q{i}" for i in range(len(k))], [[f"{model}-{q}-{i}" for i in range(N)] for q in range(len(k))],
                    rewards, grpo_advantages(rewards), torch.full(rewards.shape, logp_mean * 10, dtype=torch.float64),
                    torch.full(rewards.shape, 10), torch.ones(rewards.shape, dtype=torch.bool))


def scorer_with(mean_logp: list[float]):
    """Receiver-old mean log-prob per response index (same for every prompt)."""
    def score(prompts, source):
        sums = torch.tensor([[m * 5 for m in mean_logp] for _ in prompts], dtype=torch.float64)
        return sums, torch.full(sums.shape, 5)
    return score


GEN = torch.Generator().manual_seed(0)
# Prompt 0: A fails, B partial -> B->A candidate. Prompt 1: B fails, A partial -> A->B candidate.
# Prompt 2: both partial. Prompt 3: B fails, A all correct (not a GRAFT candidate; SGT takes it).
K_A, K_B = [0, 3, 2, 4], [2, 0, 1, 0]


def test_graft_replaces_the_failed_group_with_the_source_group():
    a, b = rollouts("A", K_A), rollouts("B", K_B)
    # s = exp(receiver mean - source mean): source mean is -1; receiver means give s = 1, 0.9, 0.5, e^0.5.
    scores = [-1.0, -1.0 + math.log(0.9), -1.0 + math.log(0.5), -0.5]
    batch_a, batch_b, (a_to_b, b_to_a) = plan_pair(method(), a, b, (scorer_with(scores), scorer_with(scores)), GEN)
    assert a_to_b.tolist() == [False, True, False, False] and b_to_a.tolist() == [True, False, False, False]
    peer_rows = [r for r in batch_b.rows if r.origin == PEER]
    assert {r.prompt for r in peer_rows} == {1}
    assert not [r for r in batch_b.rows if r.origin == SELF and r.prompt == 1]    # replaced, not pooled
    # s <= 0.8 is removed; s > 1 capped at 1; the source's own advantages are kept.
    assert [(r.sample, round(r.weight, 6)) for r in peer_rows] == [(0, 1.0), (1, 0.9), (3, 1.0)]
    assert [r.advantage for r in peer_rows] == [float(a.advantages[1, i]) for i in (0, 1, 3)]
    assert batch_b.group_is_peer.tolist() == [False, True, False, False]
    assert batch_b.metrics["peer_groups"] == 1 and batch_b.metrics["peer_admitted"] == 3
    assert len([r for r in batch_a.rows if r.origin == SELF]) == 3 * N


def test_balanced_selection_keeps_ties_and_caps_by_the_smaller_direction():
    k_a, k_b = torch.tensor([0, 3, 2, 3, 1]), torch.tensor([2, 0, 0, 0, 0])
    a_to_b, b_to_a = select_prompts(method(), k_a, k_b, N, GEN)
    assert b_to_a.tolist() == [True, False, False, False, False]
    assert a_to_b.tolist() == [False, True, False, True, False]          # m = 1, tie at k = 3 kept
    a_to_b, _ = select_prompts(method(selection="complementary"), k_a, k_b, N, GEN)
    assert int(a_to_b.sum()) == 4


def test_gate_variants():
    a, b = rollouts("A", K_A), rollouts("B", K_B)
    low = [-3.0] * N                                                     # s = e^-2 for every response
    for variant, expected in [({}, 0), ({"gate": False}, N), ({"delta": 0.0}, N), ({"peer_loss": "luffy", "gate": False}, N)]:
        batch = assemble(method(**variant), b, a, torch.tensor([False, True, False, False]), scorer_with(low), GEN)
        assert batch.metrics["peer_admitted"] == expected, variant
    batch = assemble(method(delta=0.0), b, a, torch.tensor([False, True, False, False]), scorer_with(low), GEN)
    assert all(math.isclose(r.weight, math.exp(-2), rel_tol=1e-5) for r in batch.rows if r.origin == PEER)


def test_success_only_keeps_source_advantages_of_successes():
    a, b = rollouts("A", K_A), rollouts("B", K_B)
    batch = assemble(method(peer_responses="success"), b, a, torch.tensor([False, True, False, False]),
                     scorer_with([-1.0] * N), GEN)
    peer = [r for r in batch.rows if r.origin == PEER]
    assert [r.sample for r in peer] == [0, 1, 2] and all(r.advantage == float(a.advantages[1, 0]) for r in peer)


def test_pooled_keeps_the_receiver_group_with_negative_advantages():
    a, b = rollouts("A", K_A), rollouts("B", K_B)
    batch = assemble(method(advantages="pooled"), b, a, torch.tensor([False, True, False, False]),
                     scorer_with([-1.0] * N), GEN)
    own = [r for r in batch.rows if r.origin == SELF and r.prompt == 1]
    peer = [r for r in batch.rows if r.origin == PEER]
    assert len(own) == N and all(r.advantage < 0 for r in own)
    assert len(peer) == N and sum(r.advantage > 0 for r in peer) == 3


def test_sgt_adds_one_correct_peer_response_and_keeps_own_groups():
    a, b = rollouts("A", K_A), rollouts("B", K_B)
    sgt = method(selection="rescue", peer_loss="nll", gate=False)
    _, batch_b, (a_to_b, _) = plan_pair(sgt, a, b, (None, None), GEN)
    assert a_to_b.tolist() == [False, True, False, True]                 # k_A = n counts for SGT
    assert len(batch_b.rows) == 4 * N and all(r.origin == SELF for r in batch_b.rows)
    assert [q for q, _ in batch_b.nll] == [1, 3]
    assert all(a.rewards[q, i] == 1 for q, i in batch_b.nll)
    # GRPO + NLL: the rescued prompts are not packed last; the minibatches are GRPO's (in batch order).
    assert not batch_b.group_is_peer.any()
    grpo = assemble(method(selection="none", peer_loss="none"), b, b, torch.zeros(4, dtype=torch.bool), None, GEN)
    seed = lambda: torch.Generator().manual_seed(1)
    assert batch_b.minibatches(sgt, 2, seed()) == grpo.minibatches(sgt, 2, seed()) == [[0, 1], [2, 3]]


def test_hacpo_pools_every_prompt_in_separate_groups():
    a, b = rollouts("A", K_A), rollouts("B", K_B)
    hacpo = method(selection="all", peer_loss="hacpo", gate=False)
    batch_a, _, _ = plan_pair(hacpo, a, b, (scorer_with([-1.0] * N),) * 2, GEN, ratios=(1.0, 1.0))
    assert len(batch_a.group_is_peer) == 8 and batch_a.group_is_peer.tolist() == [False] * 4 + [True] * 4
    assert len([r for r in batch_a.rows if r.origin == PEER]) == 4 * N
    which = method(selection="balanced", peer_loss="hacpo", gate=False)
    batch_a, _, _ = plan_pair(which, a, b, (scorer_with([-1.0] * N),) * 2, GEN, ratios=(1.0, 1.0))
    assert {r.prompt for r in batch_a.rows if r.origin == PEER and r.advantage != 0} == {0}


def test_minibatches_put_peer_groups_last():
    a, b = rollouts("A", K_A), rollouts("B", K_B)
    batch = assemble(method(), b, a, torch.tensor([False, True, False, False]), scorer_with([-1.0] * N), GEN)
    assert batch.minibatches(method(), 1, GEN) == [[0], [2], [3], [1]]
    assert batch.minibatches(method(peer_position="first"), 1, GEN) == [[1], [0], [2], [3]]


def test_peer_solved_frac():
    a, b = rollouts("A", K_A), rollouts("B", K_B)
    assert peer_solved_frac(b, [a]) == 1.0            # B failed prompts 1 and 3; A solved both
    assert peer_solved_frac(a, [b]) == 1.0
    assert math.isnan(peer_solved_frac(rollouts("A", [1, 1, 1, 1]), [b]))
    # a group: B's all-fail prompts 1 and 3; C solved neither, A both: any peer -> 1, C alone -> 0
    c = rollouts("C", [1, 0, 0, 0])
    assert peer_solved_frac(b, [a, c]) == 1.0 and peer_solved_frac(b, [c]) == 0.0
