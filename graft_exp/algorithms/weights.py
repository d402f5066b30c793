"""How much each peer response counts: compatibility score and weight (eqs. 7-9) and the weight rules
of the ablations (no gate, random admission, success-only). A weight of 0 removes the response from
the loss (numerator and token-mean denominator)."""

from __future__ import annotations

import torch

from ._checks import (
    check_binary,
    check_finite,
    check_mask_like,
    check_ndim,
    check_same_shape,
    check_unit_interval,
)


def sequence_log_prob_sums(log_prob: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence summed log-prob and token count over the response mask: [B, T] -> ([B], [B]).
    These are what the trajectory log stores and what ``compatibility_score`` takes."""
    check_ndim("log_prob", log_prob, 2)
    check_mask_like("response_mask", response_mask, "log_prob", log_prob)
    mask = response_mask.bool()
    check_finite("log_prob", log_prob, where=mask)
    return torch.where(mask, log_prob, torch.zeros_like(log_prob)).sum(dim=1), mask.sum(dim=1)


def compatibility_score(
    receiver_log_prob_sum: torch.Tensor,
    receiver_num_tokens: torch.Tensor,
    source_log_prob_sum: torch.Tensor,
    source_num_tokens: torch.Tensor,
) -> torch.Tensor:
    """s(o|q) of eq. (8): exp(mean token log-prob of o^R under the receiver's old policy minus mean
    token log-prob of o^S under the source's old (generating) policy).

    The receiver's and the source's tokenizations may have different lengths; each mean uses its own
    count. All inputs have the same shape (one entry per peer response); counts must be >= 1.
    """
    inputs = {
        "receiver_log_prob_sum": receiver_log_prob_sum,
        "receiver_num_tokens": receiver_num_tokens,
        "source_log_prob_sum": source_log_prob_sum,
        "source_num_tokens": source_num_tokens,
    }
    for name, value in inputs.items():
        check_same_shape(name, value, "receiver_log_prob_sum", receiver_log_prob_sum)
        check_finite(name, value)
    if bool((receiver_num_tokens < 1).any()) or bool((source_num_tokens < 1).any()):
        raise ValueError("token counts must be >= 1: an empty response has no mean token log-prob")
    mean_receiver = receiver_log_prob_sum.double() / receiver_num_tokens.double()
    mean_source = source_log_prob_sum.double() / source_num_tokens.double()
    dtype = receiver_log_prob_sum.dtype if receiver_log_prob_sum.dtype.is_floating_point else torch.float32
    return torch.exp(mean_receiver - mean_source).to(dtype)


def _check_scores(score: torch.Tensor) -> None:
    if not isinstance(score, torch.Tensor):
        raise TypeError(f"score must be a torch.Tensor, got {type(score).__name__}")
    check_finite("score", score)
    if bool((score < 0).any()):
        raise ValueError("score must be >= 0 (it is an exponential of a log-prob difference)")


def compatibility_weight(score: torch.Tensor, delta: float) -> torch.Tensor:
    """w = 1[s > delta] * min(s, 1) (eq. 9). s exactly at delta is dropped (weight 0); s > 1 is capped
    at 1. ``delta = 0`` is the no-floor variant (every response admitted with weight min(s, 1))."""
    _check_scores(score)
    check_unit_interval("delta", delta)
    return torch.where(score > delta, score.clamp(max=1.0), torch.zeros_like(score))


def ungated_weight(score: torch.Tensor) -> torch.Tensor:
    """``graft_no_gate``: every transferred response gets weight 1 (no floor, no compatibility weighting)."""
    _check_scores(score)
    return torch.ones_like(score)


def random_admission_weights(score: torch.Tensor, delta: float, generator: torch.Generator) -> torch.Tensor:
    """``graft_random_admission`` (App. G): count the transferred peer responses with s > delta, admit
    exactly that many drawn uniformly (without replacement) from all of them, and weight the admitted
    ones min(s, 1) with no floor: w = 1[admitted] * min(s, 1).

    ``score`` holds the scores of all peer responses transferred to one receiver at this step (any
    shape, e.g. [G, n] for G transferred groups); the result has the same shape.
    """
    _check_scores(score)
    check_unit_interval("delta", delta)
    flat = score.reshape(-1)
    num_admitted = int((flat > delta).sum())
    order = torch.randperm(flat.numel(), generator=generator, device=generator.device).to(flat.device)
    admitted = torch.zeros_like(flat, dtype=torch.bool)
    admitted[order[:num_admitted]] = True
    return torch.where(admitted, flat.clamp(max=1.0), torch.zeros_like(flat)).reshape(score.shape)


def success_only_weights(weights: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """``graft_success_only``: failed peer responses get weight 0, so they leave both the numerator and
    the token-mean denominator; successes keep their weight. The advantages must still be computed on the
    full source group (before this filter), as GRAFT does. ``rewards`` is binary, same shape."""
    check_same_shape("rewards", rewards, "weights", weights)
    check_finite("rewards", rewards)
    check_binary("rewards", rewards)
    return torch.where(rewards == 1, weights, torch.zeros_like(weights))
