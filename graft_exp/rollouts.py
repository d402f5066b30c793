"""One model's rollouts of a training step: n responses per prompt with their rewards, GRPO advantages
and generation log-probs. What the exchange reads, the trajectory log stores and the driver records."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollouts:
    """One model's n responses to each prompt of the batch, as generated (and as logged)."""

    model: str
    prompt_ids: list[str]
    responses: list[list[str]]            # [P][n] decoded strings
    rewards: torch.Tensor                 # [P, n] binary
    advantages: torch.Tensor              # [P, n] GRPO advantages of this group (eq. 1)
    logp_sum: torch.Tensor                # [P, n] generation log-prob sum (the source policy)
    num_tokens: torch.Tensor              # [P, n] generated tokens
    finished: torch.Tensor                # [P, n] bool: ended with the end-of-sequence token

    @property
    def n(self) -> int:
        return self.rewards.shape[1]

    @property
    def k(self) -> torch.Tensor:
        """k_M(q): successes per prompt (long [P])."""
        return self.rewards.sum(dim=1).round().long()

    @classmethod
    def concat_groups(cls, parts: list[tuple[Rollouts, list[int]]]) -> Rollouts:
        """The chosen prompt groups of several rollouts of one model, in order (DAPO's refilled batch)."""
        stack = lambda name: torch.cat([getattr(r, name)[groups] for r, groups in parts])
        return cls(model=parts[0][0].model, prompt_ids=[r.prompt_ids[q] for r, g in parts for q in g],
                   responses=[r.responses[q] for r, g in parts for q in g], rewards=stack("rewards"),
                   advantages=stack("advantages"), logp_sum=stack("logp_sum"), num_tokens=stack("num_tokens"),
                   finished=stack("finished"))
