"""The receiver's objective, once for every backend: which loss a method optimises (``LossSpec``) and
the loss of one minibatch (or micro-batch) of receiver rows (``receiver_loss``).

The local backend calls ``receiver_loss`` per minibatch; the verl backend calls it per micro-batch
inside its FSDP workers (``backends/verl/loss.py``), passing the minibatch-wide denominators so that
micro-batching and data parallelism leave eq. (10) intact. The numbers come from
``graft_exp.algorithms``; this module only maps a method to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from graft_exp.algorithms import (
    HACPO_CROSS_CLIP_DELTA,
    HACPO_CROSS_CLIP_STEP,
    HACPO_SELF_CLIP_HIGH,
    HACPO_SELF_CLIP_LOW,
    graft_policy_loss,
    hacpo_kl_loss,
    hacpo_policy_loss,
    luffy_policy_loss,
    sequence_ratio_policy_loss,
    sgt_nll_loss,
)
from graft_exp.hyperparameters import CLIP_HIGH, CLIP_LOW, LUFFY_GAMMA, SGT_LAMBDA
from graft_exp.methods.registry import Registry

#: The loss's count metrics, summed over a step's micro-batches, ranks and minibatches: tokens (HACPO:
#: sequences) of own and peer rows, of those the clipped ones, and SGT's NLL tokens.
COUNT_METRICS = ("tokens_self", "tokens_peer", "clipped_tokens_self", "clipped_tokens_peer",
                 "seqs_self", "seqs_peer", "clipped_seqs_self", "clipped_seqs_peer", "nll_tokens")


@dataclass(frozen=True)
class Objective:
    """A receiver loss: ``loss(spec, log_prob, mask, advantages, weights, is_peer, **columns)`` and the
    per-row ``columns`` it reads beyond those (the backends build exactly these)."""

    loss: Callable
    columns: frozenset[str]
    sequence_level: bool = False    # averages and clip counts over sequences (the count metrics' seqs_*)


#: The receiver losses by name (``methods.PeerLoss.objective`` / ``methods.RATIOS`` name them).
OBJECTIVES = Registry("receiver loss")


@dataclass(frozen=True)
class LossSpec:
    """Which objective a receiver optimises and its settings, from the resolved method (``Method.loss``, built by
    its peer loss: ``peer_losses.PeerLoss.loss_spec``; picklable: it travels to verl's Ray workers inside the
    loss function). Single-model GRPO is ``graft`` with no peer rows, which is the token-mean GRPO loss (eq. 2)."""

    kind: str                       # an ``OBJECTIVES`` key: graft | sequence_ratio | luffy | sgt | hacpo
    clip_low: float = CLIP_LOW
    clip_high: float = CLIP_HIGH
    clip_ratio_c: float | None = None   # verl's dual clip for negative advantages (every method sets 3.0)
    luffy_gamma: float = LUFFY_GAMMA
    sgt_lambda: float = SGT_LAMBDA
    hacpo_self_clip_low: float = HACPO_SELF_CLIP_LOW
    hacpo_self_clip_high: float = HACPO_SELF_CLIP_HIGH
    hacpo_cross_clip_delta: float = HACPO_CROSS_CLIP_DELTA
    hacpo_cross_clip_step: float = HACPO_CROSS_CLIP_STEP
    hacpo_kl_coef: float = 0.0      # HACPO's KL to the initial policy (method.hacpo.kl_coef where the peer loss has one)

    @property
    def objective(self) -> Objective:
        return OBJECTIVES.get(self.kind)

    @property
    def columns(self) -> frozenset[str]:
        """The per-row inputs of this loss beyond log-probs, mask, advantages, weights and ``is_peer``."""
        return self.objective.columns

    @property
    def sequence_level(self) -> bool:
        """HACPO averages over sequences (its denominators and clip counts are sequences, not tokens)."""
        return self.objective.sequence_level

    @property
    def needs_reference_model(self) -> bool:
        """The loss reads the frozen initial policy's log-probs (``ref_log_prob``; verl's ref worker)."""
        return self.hacpo_kl_coef > 0


@dataclass
class NllRows:
    """SGT's NLL rows: log-probs and mask of the drawn correct peer responses, and the term's
    token denominator (None: the rows' own token count)."""

    log_prob: torch.Tensor
    mask: torch.Tensor
    num_tokens: float | None = None


def receiver_loss(spec: LossSpec, log_prob: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                  weights: torch.Tensor, is_peer: torch.Tensor, **columns) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to minimise on receiver rows ``[B, T]`` and its raw metrics (``graft_exp.algorithms``).

    ``columns`` are the spec's ``columns`` (``denominator`` too: the minibatch's present-token count, or
    sequence count for HACPO, when this is a micro-batch). GRAFT and its token-level variants: eq. (10)
    with ``old_log_prob`` the receiver-old policy of own and peer rows. SGT adds ``sgt_lambda`` x NLL of
    ``nll_rows``. HACPO: its sequence-level objective with ``source_mean_log_prob`` (the generating policy's
    mean token log-prob), the per-row ``capability_ratio``, the minibatch's position and, when
    ``hacpo_kl_coef > 0``, the KL to ``ref_log_prob`` on own rows.
    """
    return spec.objective.loss(spec, log_prob, mask, advantages, weights, is_peer, **columns)


def _clipped(policy_loss: Callable, extra: Callable[[LossSpec], dict]):
    """eq. (10)-style clipped objective of ``policy_loss`` (``graft_exp.algorithms.losses``)."""
    def loss(spec, log_prob, mask, advantages, weights, is_peer, *, old_log_prob, denominator=None):
        return policy_loss(log_prob, old_log_prob, advantages, weights, mask, spec.clip_low, spec.clip_high,
                           is_peer=is_peer, num_tokens=denominator, clip_ratio_c=spec.clip_ratio_c, **extra(spec))
    return loss


_graft = _clipped(graft_policy_loss, lambda spec: {})
OBJECTIVES.register("graft", Objective(_graft, frozenset({"old_log_prob", "denominator"})))
OBJECTIVES.register("sequence_ratio", Objective(_clipped(sequence_ratio_policy_loss, lambda spec: {}),
                                                frozenset({"old_log_prob", "denominator"})))
OBJECTIVES.register("luffy", Objective(_clipped(luffy_policy_loss, lambda spec: {"gamma": spec.luffy_gamma}),
                                       frozenset({"old_log_prob", "denominator"})))


def _sgt(spec, log_prob, mask, advantages, weights, is_peer, *, old_log_prob, denominator=None, nll_rows=None):
    """GRAFT's clipped loss on own rows plus ``sgt_lambda`` x the NLL of the drawn correct peer responses."""
    loss, raw = _graft(spec, log_prob, mask, advantages, weights, is_peer, old_log_prob=old_log_prob,
                       denominator=denominator)
    if nll_rows is not None:
        nll, nll_metrics = sgt_nll_loss(nll_rows.log_prob, nll_rows.mask, spec.sgt_lambda, num_tokens=nll_rows.num_tokens)
        loss, raw = loss + nll, {**raw, **nll_metrics}
    return loss, raw


OBJECTIVES.register("sgt", Objective(_sgt, frozenset({"old_log_prob", "denominator", "nll_rows"})))


def _hacpo(spec, log_prob, mask, advantages, weights, is_peer, *, source_mean_log_prob, capability_ratio=1.0,
           minibatch_index=0, ref_log_prob=None, denominator=None):
    if advantages.dim() == 2:   # verl's [B, T] advantages column: one value per row
        advantages = (advantages * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    # Rows of weight 0 (verl's padding to the data-parallel size) take no part in HACPO's objective.
    present = weights > 0
    log_prob, mask, advantages, is_peer = log_prob[present], mask[present], advantages[present], is_peer[present]
    source_mean_log_prob = source_mean_log_prob[present]
    if isinstance(capability_ratio, torch.Tensor):
        capability_ratio = capability_ratio[present]
    if ref_log_prob is not None:
        ref_log_prob = ref_log_prob[present]
    loss, raw = hacpo_policy_loss(
        log_prob, mask, source_mean_log_prob, advantages, is_peer, capability_ratio, minibatch_index,
        self_clip_low=spec.hacpo_self_clip_low, self_clip_high=spec.hacpo_self_clip_high,
        cross_clip_delta=spec.hacpo_cross_clip_delta, cross_clip_step=spec.hacpo_cross_clip_step,
        num_sequences=denominator)
    if spec.hacpo_kl_coef > 0:
        kl, kl_raw = hacpo_kl_loss(log_prob, ref_log_prob, mask, is_peer, spec.hacpo_kl_coef,
                                   num_sequences=denominator)
        loss, raw = loss + kl, {**raw, **kl_raw}
    return loss, raw


OBJECTIVES.register("hacpo", Objective(_hacpo, frozenset({"source_mean_log_prob", "capability_ratio", "minibatch_index",
                                                          "ref_log_prob", "denominator"}),
                                       sequence_level=True))


def generation_mean_log_prob(rows, own, source) -> torch.Tensor:
    """HACPO's per-row mean token log-prob under the policy that generated the row (own rows: the
    receiver's rollout, peer rows: the source's), from the rollouts' ``logp_sum`` / ``num_tokens``."""
    def mean(rollouts, q, i):
        return float(rollouts.logp_sum[q, i] / rollouts.num_tokens[q, i])
    return torch.tensor([mean(source if row.origin == "peer" else own, row.prompt, row.sample) for row in rows])
