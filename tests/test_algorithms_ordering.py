"""Minibatch formation and order (§3.2 peer-last updates; App. G peer minibatch position)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_exp.algorithms import (
    pack_minibatches,
    peer_first_minibatches,
    peer_last_minibatches,
    uniform_minibatches,
)
from graft_exp.methods import PEER_POSITIONS, UnknownName

IS_PEER = torch.tensor([0, 1, 0, 1, 0, 0, 1, 0], dtype=torch.bool)


def as_lists(minibatches):
    return [mb.tolist() for mb in minibatches]


def test_packing_keeps_prompt_order_within_each_kind():
    # own groups 0,2,4,5,7 then peer groups 1,3,6, in chunks of 3
    assert as_lists(pack_minibatches(IS_PEER, 3)) == [[0, 2, 4], [5, 7, 1], [3, 6]]


def test_peer_last_and_first():
    assert as_lists(peer_last_minibatches(IS_PEER, 3)) == [[0, 2, 4], [5, 7, 1], [3, 6]]
    assert as_lists(peer_first_minibatches(IS_PEER, 3)) == [[5, 7, 1], [3, 6], [0, 2, 4]]
    # paper setting: 128 prompts, 32 per minibatch, 10 peer groups -> 3 own-only minibatches, then 1 mixed
    is_peer = torch.zeros(128, dtype=torch.bool)
    is_peer[torch.arange(5, 128, 12)[:10]] = True
    last = peer_last_minibatches(is_peer, 32)
    assert [bool(is_peer[mb].any()) for mb in last] == [False, False, False, True]
    assert [bool(is_peer[mb].any()) for mb in peer_first_minibatches(is_peer, 32)] == [True, False, False, False]


def test_no_peers_is_the_plain_batch_order():
    assert as_lists(peer_last_minibatches(torch.zeros(6, dtype=torch.bool), 2)) == [[0, 1], [2, 3], [4, 5]]


def test_uniform_order_under_a_seed():
    orders = {
        tuple(tuple(mb) for mb in as_lists(uniform_minibatches(IS_PEER, 3, torch.Generator().manual_seed(seed))))
        for seed in range(60)
    }
    minibatches = [tuple(mb) for mb in as_lists(peer_last_minibatches(IS_PEER, 3))]
    assert orders == set(itertools.permutations(minibatches))  # the same minibatches, every order reachable
    g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    assert as_lists(uniform_minibatches(IS_PEER, 3, g1)) == as_lists(uniform_minibatches(IS_PEER, 3, g2))
    # a fresh draw every step: one generator, consecutive steps, not all the same order
    g = torch.Generator().manual_seed(0)
    assert len({tuple(map(tuple, as_lists(uniform_minibatches(IS_PEER, 3, g)))) for _ in range(20)}) > 1
    with pytest.raises(ValueError, match="Generator"):
        uniform_minibatches(IS_PEER, 3)


def test_peer_positions_order_as_their_rules():
    """``method.peer_position`` names these orderings (``methods.PEER_POSITIONS``), the generator included."""
    for name, rule in (("last", peer_last_minibatches), ("first", peer_first_minibatches),
                       ("uniform", uniform_minibatches)):
        ours = PEER_POSITIONS.get(name)(None)(IS_PEER, 3, torch.Generator().manual_seed(1))
        assert as_lists(ours) == as_lists(rule(IS_PEER, 3, torch.Generator().manual_seed(1))), name
    with pytest.raises(UnknownName, match="method.peer_position='middle' is not one of last, first, uniform"):
        PEER_POSITIONS.get("middle")


def test_bad_input():
    with pytest.raises(ValueError, match="groups_per_minibatch"):
        pack_minibatches(IS_PEER, 0)
    with pytest.raises(ValueError, match="bool mask"):
        pack_minibatches(IS_PEER.long(), 2)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=60), st.integers(1, 16))
def test_packing_is_a_partition_with_fewest_peer_minibatches(flags, size):
    is_peer = torch.tensor(flags, dtype=torch.bool)
    last = peer_last_minibatches(is_peer, size)
    assert sorted(torch.cat(last).tolist()) == list(range(len(flags)))
    contains_peer = [bool(is_peer[mb].any()) for mb in last]
    assert contains_peer == sorted(contains_peer)  # own-only first, then peer-containing
    # fewest possible: an own-only chunk holds at most `size` own groups
    num_own = len(flags) - sum(flags)
    fewest = math.ceil(len(flags) / size) - num_own // size if any(flags) else 0
    assert sum(contains_peer) == fewest
    first = peer_first_minibatches(is_peer, size)
    assert sorted(as_lists(first)) == sorted(as_lists(last))
