"""Which prompts exchange groups: GRAFT's complementary, balanced selection (§3.1, Alg. 1) and the
selection rules of the baselines and ablations (SGT, count-matched random prompts, DAPO filter).

Conventions: ``k_a``/``k_b`` are integer success counts per prompt, shape [P], values in [0, n].
A direction mask ``a_to_b[q]`` means that on prompt q the receiver B trains on A's group.
"""

from __future__ import annotations

import torch

from graft_exp.scores import rescue_candidate

from ._checks import check_binary, check_finite, check_group_size, check_ndim, check_success_counts


def _check_pair(k_a: torch.Tensor, k_b: torch.Tensor, n: int) -> None:
    check_group_size(n)
    check_success_counts("k_a", k_a, n)
    check_success_counts("k_b", k_b, n)
    if k_a.shape != k_b.shape:
        raise ValueError(f"k_a has shape {tuple(k_a.shape)} but k_b has {tuple(k_b.shape)}; one count per prompt each")


def complementary_candidates(k_source: torch.Tensor, k_receiver: torch.Tensor, n: int) -> torch.Tensor:
    """C_{S->R} of eq. (3): the receiver failed all n rollouts and the source has 1 <= k < n."""
    _check_pair(k_source, k_receiver, n)
    return rescue_candidate(k_receiver, k_source) & (k_source < n)


def select_with_ties(candidates: torch.Tensor, k_src: torch.Tensor, m: int) -> torch.Tensor:
    """SelectWithTies of Alg. 1: rank candidates by ``k_src`` descending, keep the first m and every
    candidate tied with the m-th. Returns a bool mask over prompts; empty when m = 0, all candidates
    when m >= their number. The kept count may exceed m.
    """
    check_ndim("candidates", candidates, 1)
    check_ndim("k_src", k_src, 1)
    if candidates.dtype != torch.bool:
        raise ValueError(f"candidates must be a bool mask, got dtype {candidates.dtype}")
    if candidates.shape != k_src.shape:
        raise ValueError(f"candidates has shape {tuple(candidates.shape)} but k_src has {tuple(k_src.shape)}")
    if not isinstance(m, int) or m < 0:
        raise ValueError(f"m must be a non-negative int, got {m!r}")
    num_candidates = int(candidates.sum())
    if m == 0 or num_candidates == 0:
        return torch.zeros_like(candidates)
    if m >= num_candidates:
        return candidates.clone()
    ranked = torch.sort(k_src[candidates], descending=True).values
    boundary = ranked[m - 1]
    return candidates & (k_src >= boundary)


def balanced_exchange(
    k_a: torch.Tensor, k_b: torch.Tensor, n: int, balance: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRAFT's *which* (§3.1): returns ``(a_to_b, b_to_a)`` bool masks over prompts.

    Candidates follow eq. (3) in each direction. With ``balance``, m = min(|C_{A->B}|, |C_{B->A}|)
    and each direction keeps ``select_with_ties(C, k_source, m)``; without it (``graft_no_balance``,
    "SGT + GRAFT how"), every candidate is kept.
    """
    a_to_b = complementary_candidates(k_a, k_b, n)
    b_to_a = complementary_candidates(k_b, k_a, n)
    if not balance:
        return a_to_b, b_to_a
    return balanced(a_to_b, b_to_a, k_a, k_b)


def balanced(a_to_b: torch.Tensor, b_to_a: torch.Tensor, k_a: torch.Tensor,
             k_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """§3.1's balancing of candidate masks: m = min(|C_{A->B}|, |C_{B->A}|), each direction keeping
    ``select_with_ties(C, k_source, m)``. Returns ``(a_to_b, b_to_a)``."""
    m = min(int(a_to_b.sum()), int(b_to_a.sum()))
    return select_with_ties(a_to_b, k_a, m), select_with_ties(b_to_a, k_b, m)


def top_fraction_exchange(k_a, k_b, n, fraction):
    """eq. (3)'s candidates C_{S->R}, kept where k_S(q) is among the top ``fraction`` of S's prompts by
    successes (ties at the cut kept), then balanced as GRAFT (§3.1). Returns ``(a_to_b, b_to_a)``."""
    def top(k):
        cut = torch.sort(k, descending=True).values[max(1, round(fraction * len(k))) - 1]
        return k >= cut
    return balanced(complementary_candidates(k_a, k_b, n) & top(k_a),
                    complementary_candidates(k_b, k_a, n) & top(k_b), k_a, k_b)


def sgt_rescue_prompts(k_a: torch.Tensor, k_b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGT's selection (App. B): the receiver has no success and the peer at least one (k = n included),
    both directions, no balancing. Returns ``(a_to_b, b_to_a)``."""
    _check_pair(k_a, k_b, n)
    return rescue_candidate(k_b, k_a), rescue_candidate(k_a, k_b)



def random_prompts_like(selected: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Count-matched random prompts (App. G): as many prompts as ``selected`` holds, drawn uniformly
    without replacement from the whole batch, irrespective of rewards."""
    check_ndim("selected", selected, 1)
    if selected.dtype != torch.bool:
        raise ValueError(f"selected must be a bool mask, got dtype {selected.dtype}")
    order = torch.randperm(selected.numel(), generator=generator, device=generator.device)
    chosen = torch.zeros(selected.numel(), dtype=torch.bool, device=generator.device)
    chosen[order[: int(selected.sum())]] = True
    return chosen.to(selected.device)


def count_matched_random_exchange(
    a_to_b: torch.Tensor, b_to_a: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``graft_random_prompts``: replace each direction's GRAFT selection by the same number of prompts
    drawn uniformly from the batch. The two directions are drawn independently (A->B first), so a prompt
    may be drawn in both; the paper samples "irrespective of either model's rewards"."""
    if a_to_b.shape != b_to_a.shape:
        raise ValueError(f"a_to_b has shape {tuple(a_to_b.shape)} but b_to_a has {tuple(b_to_a.shape)}")
    return random_prompts_like(a_to_b, generator), random_prompts_like(b_to_a, generator)


def draw_one_correct_response(
    rewards: torch.Tensor, selected: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """SGT: for each selected prompt, the index of one correct response drawn uniformly from the source
    group ``rewards`` [P, n] (binary); -1 for prompts not selected. A selected prompt without a correct
    response is an error (the selection rule guarantees one)."""
    check_ndim("rewards", rewards, 2)
    check_finite("rewards", rewards)
    check_binary("rewards", rewards)
    check_ndim("selected", selected, 1)
    if selected.shape[0] != rewards.shape[0]:
        raise ValueError(f"selected has {selected.shape[0]} prompts but rewards has {rewards.shape[0]}")
    correct = rewards == 1
    if bool((selected & ~correct.any(dim=1)).any()):
        raise ValueError("a selected prompt has no correct response to draw; select only prompts with k >= 1")
    # Uniform draw among correct entries: argmax of i.i.d. uniforms restricted to them.
    keys = torch.rand(rewards.shape, generator=generator, device=generator.device).to(rewards.device)
    keys = torch.where(correct, keys, torch.full_like(keys, -1.0))
    index = keys.argmax(dim=1)
    return torch.where(selected, index, torch.full_like(index, -1))


def resolve_sources(offered: torch.Tensor, preference: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One receiver of a group of K > 2 models (docs/exchange-k.md, eq. K2): the source it takes each
    prompt from.

    ``offered`` bool [S, P]: source s's pairwise selection (eq. 3 with the pair's balancing) offers its group
    on prompt q. ``preference`` float [S, P]: the source rule's ranking (k_S(q) for ``most_successes``, the
    mean eq. (8) score of S's group under the receiver for ``compatibility``, zeros for ``random``). Returns
    long [P]: the index of the offering source with the highest preference, ties broken by a uniform draw;
    -1 where no source offers. The generator is used only when some prompt has tied offering sources, so a
    pair (one source) draws nothing.
    """
    check_ndim("offered", offered, 2)
    if offered.dtype != torch.bool:
        raise ValueError(f"offered must be a bool mask, got dtype {offered.dtype}")
    if preference.shape != offered.shape:
        raise ValueError(f"preference has shape {tuple(preference.shape)} but offered has {tuple(offered.shape)}")
    ranked = torch.where(offered, preference.double(), torch.full_like(preference, -torch.inf, dtype=torch.float64))
    best = offered & (ranked == ranked.max(dim=0).values)
    if bool((best.sum(dim=0) > 1).any()):
        draw = torch.rand(best.shape, generator=generator, dtype=torch.float64)
        ranked = torch.where(best, draw, torch.full_like(draw, -1.0))
    else:
        ranked = best.double()
    return torch.where(offered.any(dim=0), ranked.argmax(dim=0), torch.full_like(ranked[0], -1, dtype=torch.long))


def dynamic_sampling_group_mask(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: True for groups with nonzero reward variance (0 < k < n for binary
    rewards). ``rewards`` is [P, n]."""
    check_ndim("rewards", rewards, 2)
    check_group_size(rewards.shape[1])
    check_finite("rewards", rewards)
    return ~(rewards == rewards[:, :1]).all(dim=1)


def dynamic_sampling_batch_full(num_kept_groups: int, batch_size: int) -> bool:
    """DAPO dynamic sampling: the accumulated kept groups fill the batch (the trainer then keeps the
    first ``batch_size`` of them and stops sampling more prompt batches)."""
    if batch_size <= 0 or num_kept_groups < 0:
        raise ValueError(f"need batch_size > 0 and num_kept_groups >= 0, got {batch_size}, {num_kept_groups}")
    return num_kept_groups >= batch_size
