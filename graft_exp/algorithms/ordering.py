"""Minibatch formation and order for one receiver's update (§3.2 "Peer-last updates", App. G "Peer
minibatch position").

A minibatch is a set of *groups* (prompts): the paper's minibatch size is in prompts (32), and a
replaced group keeps its prompt's slot even when some of its peer responses were removed by the gate.

How minibatches are formed (the same for every ordering): own groups, in the batch's prompt order,
followed by peer groups, in the batch's prompt order, cut into consecutive chunks of
``groups_per_minibatch`` (the last chunk may be smaller). This gives own-only minibatches first, then at
most one mixed minibatch, then peer-only ones, and it minimises the number of minibatches that contain
a peer group among all packings into chunks of that size (any own-only minibatch holds at most
``groups_per_minibatch`` own groups). Keeping the prompt order within each kind leaves a no-peer batch
exactly in verl's unshuffled order. The orderings then only permute these minibatches:

- ``last`` (GRAFT): own-only minibatches, then peer-containing ones, in packing order;
- ``first``: peer-containing minibatches (in packing order), then own-only ones;
- ``uniform``: a uniformly random permutation of the same minibatches, drawn from ``generator`` anew at
  every call (i.e. every step).

Each ordering returns a list of LongTensors of group (prompt) indices, one per minibatch, in
processing order.
"""

from __future__ import annotations

import torch

from ._checks import check_ndim


def pack_minibatches(is_peer_group: torch.Tensor, groups_per_minibatch: int) -> list[torch.Tensor]:
    """Own groups then peer groups (each in prompt order), cut into chunks of ``groups_per_minibatch``."""
    check_ndim("is_peer_group", is_peer_group, 1)
    if is_peer_group.dtype != torch.bool:
        raise ValueError(f"is_peer_group must be a bool mask over groups, got dtype {is_peer_group.dtype}")
    if not isinstance(groups_per_minibatch, int) or groups_per_minibatch < 1:
        raise ValueError(f"groups_per_minibatch must be an int >= 1, got {groups_per_minibatch!r}")
    index = torch.arange(is_peer_group.numel(), device=is_peer_group.device)
    packed = torch.cat([index[~is_peer_group], index[is_peer_group]])
    return list(torch.split(packed, groups_per_minibatch))


def _split_by_kind(
    is_peer_group: torch.Tensor, groups_per_minibatch: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    minibatches = pack_minibatches(is_peer_group, groups_per_minibatch)
    own_only = [mb for mb in minibatches if not bool(is_peer_group[mb].any())]
    with_peer = [mb for mb in minibatches if bool(is_peer_group[mb].any())]
    return own_only, with_peer


def peer_last_minibatches(
    is_peer_group: torch.Tensor, groups_per_minibatch: int, generator: torch.Generator | None = None
) -> list[torch.Tensor]:
    """GRAFT: own-only minibatches first, peer-containing minibatches last. ``generator`` is unused."""
    own_only, with_peer = _split_by_kind(is_peer_group, groups_per_minibatch)
    return own_only + with_peer


def peer_first_minibatches(
    is_peer_group: torch.Tensor, groups_per_minibatch: int, generator: torch.Generator | None = None
) -> list[torch.Tensor]:
    """``graft_peer_first``: peer-containing minibatches before the own-only ones. ``generator`` unused."""
    own_only, with_peer = _split_by_kind(is_peer_group, groups_per_minibatch)
    return with_peer + own_only


def uniform_minibatches(
    is_peer_group: torch.Tensor, groups_per_minibatch: int, generator: torch.Generator | None = None
) -> list[torch.Tensor]:
    """``graft_peer_uniform``: the minibatches of ``peer_last_minibatches`` in a uniformly random order
    drawn from ``generator`` (required, so that runs are reproducible)."""
    if generator is None:
        raise ValueError("uniform minibatch order needs a torch.Generator (seeded by the run) for reproducibility")
    minibatches = peer_last_minibatches(is_peer_group, groups_per_minibatch)
    order = torch.randperm(len(minibatches), generator=generator, device=generator.device).tolist()
    return [minibatches[i] for i in order]

