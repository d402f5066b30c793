"""Group-relative advantages (paper §2, eq. 1) and the pooled-group variant (Appendix G)."""

from __future__ import annotations

import torch

from ._checks import check_finite, check_group_size, check_ndim


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages per group: ``(r - mean) / (std + eps)`` along the last dimension (eq. 1).

    ``rewards`` has shape [P, n] (one row per prompt). The std is the unbiased one (``torch.std``'s
    default, as verl's ``compute_grpo_outcome_advantage``). Zero-variance groups (all pass or all
    fail) get advantages of exactly 0, whatever rounding the mean would leave.
    """
    check_ndim("rewards", rewards, 2)
    check_group_size(rewards.shape[1])
    check_finite("rewards", rewards)
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    rewards = rewards.float() if not rewards.dtype.is_floating_point else rewards
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(rewards), (rewards - mean) / (std + eps))


def pooled_group_advantages(
    receiver_rewards: torch.Tensor, peer_rewards: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages over the concatenated group G_B(q) || G_A(q) (Appendix G, "Pooled groups").

    Both inputs are [P, n_*] reward tensors for the same prompts. Returns the advantages of the
    receiver's and of the peer's responses, each in its input's shape. With a failed receiver group
    (k_B = 0) the pooled mean is k_A / (2n) and the receiver's failures get negative advantages.
    """
    check_ndim("receiver_rewards", receiver_rewards, 2)
    check_ndim("peer_rewards", peer_rewards, 2)
    if receiver_rewards.shape[0] != peer_rewards.shape[0]:
        raise ValueError(
            f"receiver_rewards has {receiver_rewards.shape[0]} prompts but peer_rewards has "
            f"{peer_rewards.shape[0]}; pooling needs the same prompts"
        )
    pooled = grpo_advantages(torch.cat([receiver_rewards, peer_rewards], dim=1), eps=eps)
    return pooled[:, : receiver_rewards.shape[1]], pooled[:, receiver_rewards.shape[1] :]
