"""Policy losses to *minimise* (the negated objectives): GRAFT's eq. (10), its sequence-ratio ablation,
the LUFFY-style peer objective, and SGT's auxiliary NLL.

The clipped policy losses share one signature (``graft`` with unit weights and no peers is GRPO), so
``objective.OBJECTIVES`` wraps each the same way::

    loss, metrics = fn(log_prob, old_log_prob, advantages, weights, response_mask,
                       clip_low, clip_high, *, is_peer=None, num_tokens=None, clip_ratio_c=None)

``clip_ratio_c`` (> 1) is verl's dual clip for negative advantages (the objective of an A < 0 token is
at least clip_ratio_c * A); None leaves it off.

Shapes: ``log_prob``, ``old_log_prob``, ``response_mask`` are [B, T] (B sequences, T padded response
tokens; ``log_prob`` carries the gradient, ``old_log_prob`` is the receiver's behaviour policy for own
*and* peer rows); ``advantages`` is [B] (broadcast over tokens) or [B, T]; ``weights`` is [B] (1 for
own rows, w(o) for peer rows; 0 removes the row from numerator and denominator); ``is_peer`` is a bool
[B] (default: all own) used for the per-kind metrics and, in LUFFY, for the objective itself.

``num_tokens`` (optional) overrides the token-mean denominator: pass the number of response tokens of
the present (weight > 0) rows of the whole minibatch when the minibatch is split into micro-batches
for gradient accumulation, so that the summed micro-batch losses equal the minibatch loss.

Metrics (detached 0-dim float tensors; call ``float()`` to log):
  ``pg_loss``                     the loss value
  ``tokens_self``/``tokens_peer`` response tokens of present own / peer rows
  ``clipped_tokens_self``/``_peer`` of those, tokens clipped in the sense of Appendix H:
                                  A > 0 and ratio > 1 + clip_high, or A < 0 and ratio < 1 - clip_low
  ``clipfrac_self``/``clipfrac_peer`` clipped / tokens of that kind (0 when there are none; aggregate
                                  across minibatches with the counts, not by averaging fractions)
  ``clipfrac``                    over all present tokens
  ``ratio_mean``                  mean importance ratio over present tokens
  ``ppo_kl``                      mean of (old_log_prob - log_prob) over present tokens (as verl)
  ``removed_sequences``           rows with weight 0
"""

from __future__ import annotations

import torch

from graft_exp.hyperparameters import CLIP_HIGH, CLIP_LOW, LUFFY_GAMMA

from ._checks import check_clip, check_finite, check_mask_like, check_ndim, check_row_vector

#: Bound on |log ratio| before exponentiating, as verl does, so that a far-off token cannot overflow.
_MAX_LOG_RATIO = 20.0


def _prepare(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    is_peer: torch.Tensor | None,
    num_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the shared inputs; return (present token mask [B,T], advantages [B,T], is_peer [B])."""
    check_ndim("log_prob", log_prob, 2)
    if old_log_prob.shape != log_prob.shape:
        raise ValueError(
            f"old_log_prob has shape {tuple(old_log_prob.shape)} but log_prob has {tuple(log_prob.shape)}"
        )
    check_mask_like("response_mask", response_mask, "log_prob", log_prob)
    batch = log_prob.shape[0]
    check_row_vector("weights", weights, batch)
    if advantages.shape == (batch,):
        advantages = advantages.unsqueeze(1).expand_as(log_prob)
    elif advantages.shape != log_prob.shape:
        raise ValueError(
            f"advantages must have shape ({batch},) or {tuple(log_prob.shape)}, got {tuple(advantages.shape)}"
        )
    if is_peer is None:
        is_peer = torch.zeros(batch, dtype=torch.bool, device=log_prob.device)
    else:
        check_row_vector("is_peer", is_peer, batch)
        is_peer = is_peer.bool()
    check_clip(clip_low, clip_high)
    if num_tokens is not None and not num_tokens > 0:
        raise ValueError(f"num_tokens must be > 0 when given, got {num_tokens!r}")
    mask = response_mask.bool()
    check_finite("log_prob", log_prob, where=mask)
    check_finite("old_log_prob", old_log_prob, where=mask)
    check_finite("advantages", advantages, where=mask)
    check_finite("weights", weights)
    if bool((weights < 0).any()):
        raise ValueError("weights must be >= 0 (0 removes a sequence)")
    present = mask & (weights > 0).unsqueeze(1)
    return present, advantages, is_peer


def _masked(values: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    # torch.where rather than multiplication: padding may hold anything, and its gradient must be 0.
    return torch.where(present, values, torch.zeros_like(values))


def _wide(values: torch.Tensor) -> torch.Tensor:
    """At least float32 for metric sums: bf16 sums over thousands of tokens lose the mean."""
    return values.to(torch.promote_types(values.dtype, torch.float32))


def _check_clip_ratio_c(clip_ratio_c: float | None) -> None:
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1 when given, got {clip_ratio_c!r}")


def _clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """min(ratio*A, clip(ratio, 1-clip_low, 1+clip_high)*A) and the Appendix-H clipped-token mask.

    With ``clip_ratio_c`` (dual-clip PPO, Ye et al. 2020, as verl's ``compute_policy_loss_vanilla``):
    for A < 0 the objective is bounded below by clip_ratio_c * A, so a token whose ratio grew past
    clip_ratio_c under a negative advantage stops pushing (its gradient is 0). The clipped-token mask
    keeps the Appendix-H definition (the dual bound acts only where that mask is already false).
    """
    objective = torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages)
    if clip_ratio_c is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, advantages * clip_ratio_c), objective)
    clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
    return objective, clipped


def _token_mean_loss(
    objective: torch.Tensor,
    weights: torch.Tensor,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor,
    present: torch.Tensor,
    is_peer: torch.Tensor,
    num_tokens: int | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-(sum over present tokens of w * objective) / (number of present tokens), plus metrics."""
    tokens = present.sum()
    denominator = tokens.clamp(min=1) if num_tokens is None else num_tokens
    loss = -_masked(weights.unsqueeze(1) * objective, present).sum() / denominator

    peer_tokens_mask = present & is_peer.unsqueeze(1)
    self_tokens_mask = present & ~is_peer.unsqueeze(1)
    with torch.no_grad():
        tokens_self, tokens_peer = self_tokens_mask.sum().float(), peer_tokens_mask.sum().float()
        clipped_self = (clipped & self_tokens_mask).sum().float()
        clipped_peer = (clipped & peer_tokens_mask).sum().float()
        all_tokens = tokens.float().clamp(min=1)
        metrics = {
            "pg_loss": loss.detach(),
            "tokens_self": tokens_self,
            "tokens_peer": tokens_peer,
            "clipped_tokens_self": clipped_self,
            "clipped_tokens_peer": clipped_peer,
            "clipfrac_self": clipped_self / tokens_self.clamp(min=1),
            "clipfrac_peer": clipped_peer / tokens_peer.clamp(min=1),
            "clipfrac": (clipped_self + clipped_peer) / all_tokens,
            "ratio_mean": _wide(_masked(ratio.detach(), present)).sum() / all_tokens,
            "ppo_kl": -_wide(_masked(log_ratio.detach(), present)).sum() / all_tokens,
            "removed_sequences": (weights == 0).sum().float(),
        }
    return loss, metrics


def graft_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    *,
    is_peer: torch.Tensor | None = None,
    num_tokens: int | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRAFT's objective, eq. (10), as a loss: token-level clipped surrogate with the ratio against the
    receiver's old policy for own and peer tokens alike, each sequence's terms times its weight, divided
    by the number of response tokens of the rows present (weight > 0).

    ``clip_ratio_c`` adds verl's dual clip for negative advantages (every method's config sets it, 3.0;
    None keeps the plain clipped surrogate). With unit weights, no peers and ``clip_ratio_c`` = verl's,
    this is verl's ``compute_policy_loss_vanilla`` with ``token-mean`` (the DAPO/verl GRPO loss, eq. 2),
    value for value. See the module docstring for shapes, ``is_peer``, ``num_tokens`` and the metrics.
    """
    present, advantages, is_peer = _prepare(
        log_prob, old_log_prob, advantages, weights, response_mask, clip_low, clip_high, is_peer, num_tokens
    )
    _check_clip_ratio_c(clip_ratio_c)
    log_ratio = _masked(log_prob - old_log_prob, present).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    objective, clipped = _clipped_objective(ratio, advantages, clip_low, clip_high, clip_ratio_c)
    return _token_mean_loss(objective, weights, ratio, log_ratio, clipped, present, is_peer, num_tokens)


def sequence_ratio_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    *,
    is_peer: torch.Tensor | None = None,
    num_tokens: int | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``graft_seq_ratio`` ("w/o token-level ratio", App. G): eq. (10) with every token's ratio replaced
    by its sequence's length-normalised ratio exp(mean_t(log pi_theta - log pi_old)) (the geometric mean
    of the token ratios, as GSPO), clipped per sequence with the same (clip_low, clip_high).

    Only the ratio changes: weights, advantages and the token-mean aggregation are those of eq. (10),
    so a sequence contributes |o| * w * min(s*A, clip(s)*A) / (total tokens). Advantages must be per
    sequence ([B], or [B, T] constant along each row). Clipped-token counts count every token of a
    clipped sequence.
    """
    present, advantages, is_peer = _prepare(
        log_prob, old_log_prob, advantages, weights, response_mask, clip_low, clip_high, is_peer, num_tokens
    )
    token_log_ratio = _masked(log_prob - old_log_prob, response_mask.bool())
    lengths = response_mask.bool().sum(dim=1).clamp(min=1)
    sequence_log_ratio = (token_log_ratio.sum(dim=1) / lengths).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    log_ratio = _masked(sequence_log_ratio.unsqueeze(1).expand_as(log_prob), present)
    ratio = torch.exp(log_ratio)
    _check_clip_ratio_c(clip_ratio_c)
    objective, clipped = _clipped_objective(ratio, advantages, clip_low, clip_high, clip_ratio_c)
    return _token_mean_loss(objective, weights, ratio, log_ratio, clipped, present, is_peer, num_tokens)


def luffy_shaping(prob: torch.Tensor, gamma: float = LUFFY_GAMMA) -> torch.Tensor:
    """LUFFY's regularised importance-sampling shaping f(p) = p / (p + gamma)."""
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma!r}")
    return prob / (prob + gamma)


def luffy_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    *,
    is_peer: torch.Tensor | None = None,
    num_tokens: int | None = None,
    gamma: float = LUFFY_GAMMA,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``graft_luffy`` (App. G): peer tokens contribute -f(pi_theta(token)) * A with f(p) = p/(p+gamma)
    (behaviour probability taken as 1, no clipping, ``old_log_prob`` unused for them); own tokens use
    the clipped surrogate of eq. (10) (dual-clipped with ``clip_ratio_c``); same weights and token-mean
    denominator.

    LUFFY replaces the compatibility gate, so a trainer passes weight 1 for peer rows. Peer tokens are
    never counted as clipped; ``ratio_mean`` and ``ppo_kl`` still use the receiver-old ratio.
    """
    present, advantages, is_peer = _prepare(
        log_prob, old_log_prob, advantages, weights, response_mask, clip_low, clip_high, is_peer, num_tokens
    )
    log_ratio = _masked(log_prob - old_log_prob, present).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    _check_clip_ratio_c(clip_ratio_c)
    own_objective, clipped = _clipped_objective(ratio, advantages, clip_low, clip_high, clip_ratio_c)
    peer_objective = luffy_shaping(torch.exp(_masked(log_prob, present)), gamma) * advantages
    peer_rows = is_peer.unsqueeze(1).expand_as(log_prob)
    objective = torch.where(peer_rows, peer_objective, own_objective)
    return _token_mean_loss(objective, weights, ratio, log_ratio, clipped & ~peer_rows, present, is_peer, num_tokens)


def sgt_nll_loss(
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float = 0.1,
    *,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SGT's auxiliary term: ``coef`` (lambda = 0.1) times the token-mean negative log-likelihood, under
    the receiver, of the drawn correct peer responses (``log_prob`` [B, T] of those rows only). Added to
    the GRPO loss by the trainer. With no rows (B = 0 or no tokens) the term is 0 and keeps the graph.
    Metrics: ``nll_mean`` (unscaled token-mean NLL), ``nll_tokens``."""
    check_ndim("log_prob", log_prob, 2)
    check_mask_like("response_mask", response_mask, "log_prob", log_prob)
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got {coef!r}")
    if num_tokens is not None and not num_tokens > 0:
        raise ValueError(f"num_tokens must be > 0 when given, got {num_tokens!r}")
    mask = response_mask.bool()
    check_finite("log_prob", log_prob, where=mask)
    tokens = mask.sum()
    denominator = tokens.clamp(min=1) if num_tokens is None else num_tokens
    nll = -_masked(log_prob, mask).sum() / denominator
    return coef * nll, {"nll_mean": nll.detach(), "nll_tokens": tokens.detach().float()}
