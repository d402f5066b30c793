"""The receiver's objective, once for every backend: which loss a method optimises (``LossSpec``) and
the loss of one minibatch (or micro-batch) of receiver rows (``receiver_loss``).

The local backend calls ``receiver_loss`` per minibatch; the verl backend calls it per micro-batch
inside its FSDP workers (``backends/verl/loss.py``), passing the minibatch-wide denominators so that
micro-batching and data parallelism leave eq. (10) intact. The numbers come from
``graft_exp.algorithms``; this module only maps a method to them. The per-row inputs computed from the
exchange's rows (``ROW_COLUMNS``) are built here too, once for both backends (``row_column_values``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graft_exp.algorithms import (
    graft_policy_loss,
    hacpo_kl_loss,
    hacpo_policy_loss,
    luffy_policy_loss,
    sequence_ratio_policy_loss,
    sgt_nll_loss,
)
from graft_exp.hyperparameters import CLIP_HIGH, CLIP_LOW
from graft_exp.methods.receiver import PEER, Row
from graft_exp.methods.registry import Registry

if TYPE_CHECKING:
    from graft_exp.rollouts import Rollouts

#: The loss's count metrics, summed over a step's micro-batches, ranks and minibatches: tokens (HACPO:
#: sequences) of own and peer rows, of those the clipped ones, and SGT's NLL tokens.
COUNT_METRICS = ("tokens_self", "tokens_peer", "clipped_tokens_self", "clipped_tokens_peer",
                 "seqs_self", "seqs_peer", "clipped_seqs_self", "clipped_seqs_peer", "nll_tokens")


@dataclass(frozen=True)
class Objective:
    """A receiver loss: ``loss(spec, log_prob, mask, advantages, weights, is_peer, **columns)`` and the
    per-row ``columns`` it reads beyond those. A backend supplies what only it has (``old_log_prob``,
    ``ref_log_prob``, ``nll_rows``, its minibatch's ``denominator`` and ``minibatch_index``); the columns
    computed from the exchange's rows (``ROW_COLUMNS``) both backends take from ``row_column_values``."""

    loss: Callable
    columns: frozenset[str]
    sequence_level: bool = False    # averages and clip counts over sequences (the count metrics' seqs_*)


#: The receiver losses by name (``methods.PeerLoss.objective`` / ``methods.RATIOS`` name them).
OBJECTIVES = Registry("receiver loss")


@dataclass(frozen=True)
class LossSpec:
    """Which objective a receiver optimises and its settings, from the resolved method (``Method.loss``, built by
    its peer loss: ``peer_losses.PeerLoss.loss_spec``; picklable: it travels to verl's Ray workers inside the
    loss function). Single-model GRPO is ``graft`` with no peer rows, which is the token-mean GRPO loss (eq. 2).
    The clip range is every clipped objective's; ``settings`` holds the objective's own numbers by name (LUFFY's
    ``luffy_gamma``, SGT's ``sgt_lambda``, HACPO's clips, a ``method.params`` value), which its peer loss
    entry reads from the method's config, so a new loss adds no field here."""

    kind: str                       # an ``OBJECTIVES`` key: graft | sequence_ratio | luffy | sgt | hacpo | ...
    clip_low: float = CLIP_LOW
    clip_high: float = CLIP_HIGH
    clip_ratio_c: float | None = None   # verl's dual clip for negative advantages (every method sets 3.0)
    kl_coef: float = 0.0            # a KL term to the initial policy (HACPO's method.hacpo.kl_coef); 0: none
    settings: dict[str, float] = field(default_factory=dict)

    @property
    def objective(self) -> Objective:
        return OBJECTIVES.get(self.kind)

    @property
    def columns(self) -> frozenset[str]:
        """The per-row inputs of this loss beyond log-probs, mask, advantages, weights and ``is_peer``."""
        return self.objective.columns

    @property
    def row_columns(self) -> frozenset[str]:
        """Those of ``columns`` computed from the exchange's rows (``ROW_COLUMNS``), the same for every backend."""
        return self.columns & ROW_COLUMNS.keys()

    @property
    def sequence_level(self) -> bool:
        """HACPO averages over sequences (its denominators and clip counts are sequences, not tokens)."""
        return self.objective.sequence_level

    @property
    def needs_reference_model(self) -> bool:
        """The loss reads the frozen initial policy's log-probs (``ref_log_prob``; verl's ref worker)."""
        return self.kl_coef > 0


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
    ``kl_coef > 0``, the KL to ``ref_log_prob`` on own rows.
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
OBJECTIVES.register("luffy", Objective(_clipped(luffy_policy_loss,
                                                lambda spec: {"gamma": spec.settings["luffy_gamma"]}),
                                       frozenset({"old_log_prob", "denominator"})))


def _sgt(spec, log_prob, mask, advantages, weights, is_peer, *, old_log_prob, denominator=None, nll_rows=None):
    """GRAFT's clipped loss on own rows plus ``sgt_lambda`` x the NLL of the drawn correct peer responses."""
    loss, raw = _graft(spec, log_prob, mask, advantages, weights, is_peer, old_log_prob=old_log_prob,
                       denominator=denominator)
    if nll_rows is not None:
        nll, nll_metrics = sgt_nll_loss(nll_rows.log_prob, nll_rows.mask, spec.settings["sgt_lambda"],
                                        num_tokens=nll_rows.num_tokens)
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
    settings = spec.settings
    loss, raw = hacpo_policy_loss(
        log_prob, mask, source_mean_log_prob, advantages, is_peer, capability_ratio, minibatch_index,
        self_clip_low=settings["self_clip_low"], self_clip_high=settings["self_clip_high"],
        cross_clip_delta=settings["cross_clip_delta"], cross_clip_step=settings["cross_clip_step"],
        num_sequences=denominator)
    if spec.kl_coef > 0:
        kl, kl_raw = hacpo_kl_loss(log_prob, ref_log_prob, mask, is_peer, spec.kl_coef, num_sequences=denominator)
        loss, raw = loss + kl, {**raw, **kl_raw}
    return loss, raw


OBJECTIVES.register("hacpo", Objective(_hacpo, frozenset({"source_mean_log_prob", "capability_ratio", "minibatch_index",
                                                          "ref_log_prob", "denominator"}),
                                       sequence_level=True))


def _peer_scaled(spec, log_prob, mask, advantages, weights, is_peer, *, old_log_prob, denominator=None):
    """eq. (10) with each peer row's weight w(o) scaled by lambda = ``peer_scale`` in [0, 1] (1: GRAFT's loss). The
    token mean keeps eq. (10)'s denominator, the tokens of rows with w(o) > 0, so lambda only weighs the peer term
    against the own rows' (at lambda = 0 the peer tokens still count, as in verl's minibatch denominator)."""
    if denominator is None:   # a whole minibatch (the local backend): eq. (10)'s present tokens, before scaling
        denominator = max(int((mask.bool() & (weights > 0).unsqueeze(1)).sum()), 1)
    scaled = torch.where(is_peer, weights * spec.settings["peer_scale"], weights)
    return _graft(spec, log_prob, mask, advantages, scaled, is_peer, old_log_prob=old_log_prob, denominator=denominator)


OBJECTIVES.register("peer_scaled", Objective(_peer_scaled, frozenset({"old_log_prob", "denominator"})))


# ------------------------------------------------------------------------- per-row columns of the exchange
def generation_mean_log_prob(rows: list[Row], own: Rollouts, source: Rollouts | None,
                             capability_ratio: float) -> torch.Tensor:
    """HACPO's per-row mean token log-prob under the policy that generated the row (own rows: the
    receiver's rollout, peer rows: the source's), from the rollouts' ``logp_sum`` / ``num_tokens`` (a
    response of no tokens counts one, so that its mean is defined)."""
    def mean(rollouts, q, i):
        return float(rollouts.logp_sum[q, i] / rollouts.num_tokens[q, i].clamp(min=1))
    return torch.tensor([mean(source if row.origin == PEER else own, row.prompt, row.sample) for row in rows],
                        dtype=torch.float32)


def step_capability_ratio(rows: list[Row], own: Rollouts, source: Rollouts | None,
                          capability_ratio: float) -> torch.Tensor:
    """HACPO's capability ratio of the receiver's peer to itself this step (``PeerLoss.capability_ratios``), on
    every row (own rows ignore it)."""
    return torch.full((len(rows),), float(capability_ratio))


#: The per-row columns computed from the exchange's rows: ``build(rows, own, source, capability_ratio) ->
#: tensor [len(rows)]``, the rows being the receiver's (``receiver.Row``), ``own`` / ``source`` the step's rollouts
#: of the receiver and of its source (None: no peer rows). Both backends call ``row_column_values``: a loss that
#: needs a new per-row number registers its builder here, and no backend changes.
ROW_COLUMNS: dict[str, Callable[..., torch.Tensor]] = {
    "source_mean_log_prob": generation_mean_log_prob,
    "capability_ratio": step_capability_ratio,
}


def row_column_values(spec: LossSpec, rows: list[Row], own: Rollouts, source: Rollouts | None,
                      capability_ratio: float) -> dict[str, torch.Tensor]:
    """The spec's ``row_columns`` of ``rows``, in their order (float32 [len(rows)] each, on the CPU)."""
    return {name: ROW_COLUMNS[name](rows, own, source, capability_ratio) for name in sorted(spec.row_columns)}
