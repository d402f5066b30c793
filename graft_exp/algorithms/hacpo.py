"""HACPO baseline (Zhang et al., "Heterogeneous Agent Collaborative RL"), written from a reading of its
official code, ``recipe/hacpo`` of the HACRL-code repository (``hacpo_core_algos.py``:
``compute_hacpo_advantages``, ``compute_hacpo_loss``, ``CapabilityTracker``; ``hacpo_workers.py``:
``hacpo_ppo_loss``; ``hacpo_ray_trainer.py``: ``_update_target``; ``run_hacpo_math_8gpu.sh``).

What the official code does, per training step and per target (receiver) model:

1. Capability of each model = mean over the last 5 steps (current included) of its per-step
   positive rate (fraction of its rollouts with reward > 0), floored at 1e-8.
   capability_ratio(source -> target) = clamp(cap_source / cap_target, 0.1, 10).
2. Advantages over the pooled 2n group of each prompt (own n + peer n): baseline = mean of r_i * u_i
   with u = 1 for own and u = 1 / capability_ratio(peer -> target) for peer responses; the plain
   mean when all 2n rewards are equal; the own-group mean when the weighted baseline exceeds 1.
   Denominator: the pooled group's unbiased std + 1e-6. Own and peer responses both get these.
3. Sequence ratio r = exp(mean token log-prob of the response under the target's current policy minus
   the source's mean token log-prob at rollout time) (|log r| clamped at 10). For own rows the source is
   the target's old policy (GSPO-style); for peer rows it is the peer's generating policy.
4. Own rows: min(r*A, clip(r, 1-3e-4, 1+4e-4)*A). Peer rows:
   clamp(r, L_m, 1) * sg[clamp(r, L_m, 1)]^alpha * capability_ratio * A, alpha = 1, with the stepwise
   lower bound L_m = min(1, 0.8 + 0.025 m). ``m`` counts the optimizer minibatches of the target's
   update *within the current training step*, from 0, own and peer minibatches alike (the counter is
   keyed by step and target and resets each step).
5. Loss = -(sum of per-sequence objectives) / (sequences in the minibatch) (a sequence mean, not a
   token mean), plus 1e-3 * KL, where KL is verl's ``low_var_kl`` (k3) against the reference policy,
   token-mean per sequence over *own* rows only, summed and divided by the minibatch's sequence count.
6. Minibatches: own trajectories first, then peer ones, 64 prompts (64*n rows) per minibatch, no
   shuffle. With ``ordering.peer_last_minibatches(torch.cat([own, peer]), 64)`` over 2P "groups" (own
   group of prompt i at index i, peer group at P + i), the list position is ``m``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graft_exp.hyperparameters import (
    HACPO_KL_COEF,
    HACPO_PEER_CLIP_INIT,
    HACPO_PEER_CLIP_STEP,
    HACPO_SELF_CLIP_HIGH,
    HACPO_SELF_CLIP_LOW,
)

from ._checks import check_finite, check_group_size, check_mask_like, check_ndim, check_row_vector

#: The peer clamp's lower bound, L_m = min(1, 1 - delta + m * step): the config's init = 1 - delta.
HACPO_CROSS_CLIP_DELTA = 1.0 - HACPO_PEER_CLIP_INIT
HACPO_CROSS_CLIP_STEP = HACPO_PEER_CLIP_STEP


def hacpo_positive_rate(rewards: torch.Tensor) -> torch.Tensor:
    """One model's per-step capability sample: the fraction of its rollouts (any shape) with reward > 0."""
    check_finite("rewards", rewards)
    if rewards.numel() == 0:
        raise ValueError("rewards is empty; a positive rate needs at least one rollout")
    return (rewards > 0).float().mean()


def hacpo_capability(positive_rate_history: Sequence[float] | torch.Tensor, window: int = 5,
                     minimum: float = 1e-8) -> float:
    """A model's capability: mean of its last ``window`` per-step positive rates (each floored at
    ``minimum``), the current step's included; 1.0 before any step."""
    history = torch.as_tensor(positive_rate_history, dtype=torch.float64).reshape(-1)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window!r}")
    check_finite("positive_rate_history", history)
    if history.numel() == 0:
        return 1.0
    return max(float(history[-window:].clamp(min=minimum).mean()), minimum)


def hacpo_capability_ratio(source_capability: float, target_capability: float, ratio_min: float = 0.1,
                           ratio_max: float = 10.0) -> float:
    """capability_ratio(source -> target) = clamp(cap_source / cap_target, ratio_min, ratio_max)."""
    if not (source_capability > 0 and target_capability > 0):
        raise ValueError(f"capabilities must be > 0, got {source_capability!r} and {target_capability!r}")
    if not 0 < ratio_min <= ratio_max:
        raise ValueError(f"need 0 < ratio_min <= ratio_max, got {ratio_min!r}, {ratio_max!r}")
    return min(max(source_capability / target_capability, ratio_min), ratio_max)


def hacpo_advantages(
    self_rewards: torch.Tensor, peer_rewards: torch.Tensor, capability_ratio: float, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Capability-aware advantages over the pooled 2n group of each prompt (see module docstring, 2).

    ``self_rewards`` and ``peer_rewards`` are [P, n] (the official code requires equal counts);
    ``capability_ratio`` is capability_ratio(peer -> self). Returns (own advantages, peer advantages).
    """
    check_ndim("self_rewards", self_rewards, 2)
    check_group_size(self_rewards.shape[1])
    if peer_rewards.shape != self_rewards.shape:
        raise ValueError(
            f"peer_rewards has shape {tuple(peer_rewards.shape)} but self_rewards has {tuple(self_rewards.shape)}; "
            "HACPO pools equal-size groups"
        )
    check_finite("self_rewards", self_rewards)
    check_finite("peer_rewards", peer_rewards)
    if not capability_ratio > 0:
        raise ValueError(f"capability_ratio must be > 0, got {capability_ratio!r}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    self_rewards, peer_rewards = self_rewards.float(), peer_rewards.float()
    pooled = torch.cat([self_rewards, peer_rewards], dim=1)
    weighted = torch.cat([self_rewards, peer_rewards / capability_ratio], dim=1)
    baseline = weighted.mean(dim=1, keepdim=True)
    # Guard: a weighted baseline above the maximal binary reward falls back to the own group's mean.
    baseline = torch.where(baseline > 1.0, self_rewards.mean(dim=1, keepdim=True), baseline)
    uniform = (pooled == pooled[:, :1]).all(dim=1, keepdim=True)
    advantages = (pooled - baseline) / (pooled.std(dim=1, keepdim=True) + eps)
    # A uniform group gets the plain mean as baseline, hence exactly 0 (no capability-made signal).
    advantages = torch.where(uniform, torch.zeros_like(advantages), advantages)
    n = self_rewards.shape[1]
    return advantages[:, :n], advantages[:, n:]


def hacpo_which_advantages(peer_advantages: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``hacpo_which`` (App. G): peer responses keep their HACPO advantages only on prompts selected by
    GRAFT's balanced exchange; elsewhere they get 0 and contribute no gradient. Own advantages are
    unchanged (still pooled over 2n). ``peer_advantages`` [P, n], ``selected`` bool [P]."""
    check_ndim("peer_advantages", peer_advantages, 2)
    check_row_vector("selected", selected, peer_advantages.shape[0])
    return torch.where(selected.bool().unsqueeze(1), peer_advantages, torch.zeros_like(peer_advantages))


def hacpo_cross_clip_lower(minibatch_index: int, delta: float = HACPO_CROSS_CLIP_DELTA,
                           step: float = HACPO_CROSS_CLIP_STEP) -> float:
    """Stepwise lower bound of the peer clamp, L_m = min(1, 1 - delta + m * step); m is the optimizer
    minibatch index within the current training step's update (from 0)."""
    if not isinstance(minibatch_index, int) or minibatch_index < 0:
        raise ValueError(f"minibatch_index must be an int >= 0, got {minibatch_index!r}")
    if not 0 <= delta <= 1 or step < 0:
        raise ValueError(f"need delta in [0, 1] and step >= 0, got {delta!r}, {step!r}")
    return min(1.0, 1.0 - delta + minibatch_index * step)


def hacpo_policy_loss(
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    source_mean_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    is_peer: torch.Tensor,
    capability_ratio: torch.Tensor | float,
    minibatch_index: int,
    *,
    self_clip_low: float = HACPO_SELF_CLIP_LOW,
    self_clip_high: float = HACPO_SELF_CLIP_HIGH,
    cross_clip_delta: float = HACPO_CROSS_CLIP_DELTA,
    cross_clip_step: float = HACPO_CROSS_CLIP_STEP,
    alpha: float = 1.0,
    max_abs_log_ratio: float = 10.0,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HACPO's policy loss (module docstring, 3-5) for one minibatch of B sequences.

    ``log_prob``/``response_mask`` [B, T]: the target's current log-probs of each row in its own
    tokenization; ``source_mean_log_prob`` [B]: the generating policy's mean token log-prob at rollout
    (for own rows: the target's old policy); ``advantages`` [B]; ``is_peer`` bool [B];
    ``capability_ratio``: capability_ratio(source -> target) per row or one float (unused for own rows);
    ``num_sequences`` overrides the sequence-mean denominator (the minibatch size when micro-batching).

    Metrics (detached 0-dim tensors): ``pg_loss``, ``seqs_self``/``seqs_peer``, ``clipped_seqs_self``
    (Appendix H's sign-aware rule at sequence level: A>0 and r>1+high, or A<0 and r<1-low),
    ``clipped_seqs_peer`` (peer clamp active: r < L_m or r > 1, which zeroes the gradient whatever the
    sign of A), ``clipfrac_self``/``clipfrac_peer``, ``ratio_mean_self``/``ratio_mean_peer``,
    ``cross_clip_lower`` (L_m).
    """
    mask, lengths, capability_ratio = _prepare(log_prob, response_mask, source_mean_log_prob, advantages, is_peer,
                                               capability_ratio, num_sequences)
    if self_clip_low < 0 or self_clip_high < 0 or not 0 <= cross_clip_delta <= 1 or alpha < 0:
        raise ValueError("need self clips >= 0, cross_clip_delta in [0, 1] and alpha >= 0")
    batch = log_prob.shape[0]
    peer = is_peer.bool()
    mean_log_prob = torch.where(mask, log_prob, torch.zeros_like(log_prob)).sum(dim=1) / lengths
    log_ratio = (mean_log_prob - source_mean_log_prob).clamp(-max_abs_log_ratio, max_abs_log_ratio)
    ratio = torch.exp(log_ratio)

    self_objective = torch.minimum(ratio * advantages, ratio.clamp(1 - self_clip_low, 1 + self_clip_high) * advantages)
    lower = hacpo_cross_clip_lower(minibatch_index, cross_clip_delta, cross_clip_step)
    cross_ratio = ratio.clamp(lower, 1.0)
    # The alpha factor is a detached modulation, as in the official code.
    cross_objective = cross_ratio * cross_ratio.detach().pow(alpha) * capability_ratio * advantages
    objective = torch.where(peer, cross_objective, self_objective)
    loss = -objective.sum() / (batch if num_sequences is None else num_sequences)

    return loss, _metrics(loss, ratio, advantages, peer, lower, self_clip_low, self_clip_high)


def _prepare(log_prob: torch.Tensor, response_mask: torch.Tensor, source_mean_log_prob: torch.Tensor,
             advantages: torch.Tensor, is_peer: torch.Tensor, capability_ratio: torch.Tensor | float,
             num_sequences: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate ``hacpo_policy_loss``'s inputs; return (the response mask, each row's length, the capability
    ratio per row)."""
    check_ndim("log_prob", log_prob, 2)
    check_mask_like("response_mask", response_mask, "log_prob", log_prob)
    batch = log_prob.shape[0]
    for name, value in (("source_mean_log_prob", source_mean_log_prob), ("advantages", advantages),
                        ("is_peer", is_peer)):
        check_row_vector(name, value, batch)
    capability_ratio = torch.as_tensor(capability_ratio, dtype=log_prob.dtype, device=log_prob.device)
    capability_ratio = capability_ratio.expand(batch) if capability_ratio.ndim == 0 else capability_ratio
    check_row_vector("capability_ratio", capability_ratio, batch)
    mask = response_mask.bool()
    lengths = mask.sum(dim=1)
    if bool((lengths < 1).any()):
        raise ValueError("every sequence needs at least one response token (its mean log-prob is undefined)")
    check_finite("log_prob", log_prob, where=mask)
    for name, value in (("source_mean_log_prob", source_mean_log_prob), ("advantages", advantages),
                        ("capability_ratio", capability_ratio)):
        check_finite(name, value)
    if bool((capability_ratio <= 0).any()):
        raise ValueError("capability_ratio must be > 0")
    if num_sequences is not None and not num_sequences > 0:
        raise ValueError(f"num_sequences must be > 0 when given, got {num_sequences!r}")
    return mask, lengths, capability_ratio


@torch.no_grad()
def _metrics(loss: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, peer: torch.Tensor, lower: float,
             self_clip_low: float, self_clip_high: float) -> dict[str, torch.Tensor]:
    """``hacpo_policy_loss``'s metrics (its docstring), detached."""
    ratio = ratio.detach()
    clipped_self = ((advantages > 0) & (ratio > 1 + self_clip_high)) | ((advantages < 0) & (ratio < 1 - self_clip_low))
    clipped_peer = (ratio < lower) | (ratio > 1.0)
    seqs_self, seqs_peer = (~peer).sum().float(), peer.sum().float()
    clipped_seqs_self = (clipped_self & ~peer).sum().float()
    clipped_seqs_peer = (clipped_peer & peer).sum().float()
    return {
        "pg_loss": loss.detach(),
        "seqs_self": seqs_self,
        "seqs_peer": seqs_peer,
        "clipped_seqs_self": clipped_seqs_self,
        "clipped_seqs_peer": clipped_seqs_peer,
        "clipfrac_self": clipped_seqs_self / seqs_self.clamp(min=1),
        "clipfrac_peer": clipped_seqs_peer / seqs_peer.clamp(min=1),
        "ratio_mean_self": torch.where(~peer, ratio, 0.0).float().sum() / seqs_self.clamp(min=1),
        "ratio_mean_peer": torch.where(peer, ratio, 0.0).float().sum() / seqs_peer.clamp(min=1),
        "cross_clip_lower": loss.detach().new_tensor(lower),
    }


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimators of Schulman's note, as verl names them: ``k1``
    (log-ratio), ``k2`` (half squared log-ratio), ``k3`` = ``low_var_kl`` (exp(ref - lp) - (ref - lp) - 1,
    the log-ratio clamped at +-20 and the result at +-10, as verl). HACPO uses ``k3``."""
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(f"ref_log_prob has shape {tuple(ref_log_prob.shape)}, log_prob {tuple(log_prob.shape)}")
    if estimator == "k1":
        return log_prob - ref_log_prob
    if estimator == "k2":
        return 0.5 * (log_prob - ref_log_prob).square()
    if estimator in ("k3", "low_var_kl"):
        log_ref_ratio = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
        return (torch.exp(log_ref_ratio) - log_ref_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2', 'k3' or 'low_var_kl'")


def hacpo_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    is_peer: torch.Tensor,
    coef: float = HACPO_KL_COEF,
    *,
    estimator: str = "k3",
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HACPO's KL term: ``coef`` * (sum over own rows of the token-mean KL estimate) / (sequences in the
    minibatch, peer rows included, or ``num_sequences``). Peer rows carry no KL. Metric ``kl``: the
    unscaled value."""
    check_ndim("log_prob", log_prob, 2)
    check_mask_like("response_mask", response_mask, "log_prob", log_prob)
    check_row_vector("is_peer", is_peer, log_prob.shape[0])
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got {coef!r}")
    mask = response_mask.bool() & ~is_peer.bool().unsqueeze(1)
    check_finite("log_prob", log_prob, where=mask)
    check_finite("ref_log_prob", ref_log_prob, where=mask)
    zeros = torch.zeros_like(log_prob)
    per_token = kl_estimate(torch.where(mask, log_prob, zeros), torch.where(mask, ref_log_prob, zeros), estimator)
    per_sequence = torch.where(mask, per_token, zeros).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    kl = per_sequence.sum() / (log_prob.shape[0] if num_sequences is None else num_sequences)
    return coef * kl, {"kl": kl.detach()}
