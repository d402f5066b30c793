"""What one receiver trains on at a step: its rows (own and peer responses with their advantages and weights),
grouped for minibatching. Built by the method's peer loss (``graft_exp.methods.peer_losses``), read by the backends.

Torch-free at import, like ``graft_exp.methods``: tensors arrive already built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from graft_exp.rollouts import Rollouts

SELF, PEER = "self", "peer"

#: ``scorer(prompts [S], source) -> (logp_sum [S, n], num_tokens [S, n])``: receiver-old log-prob sums
#: and token counts of the re-tokenized responses ``source.responses[q]`` for q in ``prompts``.
Scorer = Callable[[list[int], "Rollouts"], tuple["torch.Tensor", "torch.Tensor"]]


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
    group_is_peer: torch.Tensor                    # bool [groups]: the group contains peer rows
    nll: list[tuple[int, int]] = field(default_factory=list)   # SGT: (prompt, peer sample) pairs
    metrics: dict[str, float] = field(default_factory=dict)

    def peer_copies(self) -> list[tuple[int, int]]:
        """The (prompt, source sample) of every peer response this batch trains on: peer rows and SGT's NLL rows."""
        return [(row.prompt, row.sample) for row in self.rows if row.origin == PEER] + list(self.nll)

    def without_copies(self, dropped: set[tuple[int, int]]) -> ReceiverBatch:
        """This batch without the peer responses ``dropped`` (prompt, source sample), as a gate of weight 0
        would leave it: own rows, groups and their order unchanged; ``peer_admitted`` counts what is left."""
        rows = [row for row in self.rows if row.origin != PEER or (row.prompt, row.sample) not in dropped]
        nll = [pair for pair in self.nll if pair not in dropped]
        removed = len(self.rows) - len(rows) + len(self.nll) - len(nll)
        metrics = dict(self.metrics, peer_admitted=self.metrics["peer_admitted"] - removed)
        return ReceiverBatch(rows, self.group_is_peer, nll, metrics)

    def minibatches(self, method, groups_per_minibatch: int, generator: torch.Generator) -> list[list[int]]:
        """Group indices of each minibatch, in processing order (``method.order``: peer-last / first / uniform)."""
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
