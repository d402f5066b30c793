"""The receiver's objective, once for every backend: which loss a method optimises (``LossSpec``) and
the loss of one minibatch (or micro-batch) of receiver rows (``receiver_loss``).

The local backend calls ``receiver_loss`` per minibatch; the verl backend calls it per micro-batch
inside its FSDP workers (``backends/verl/loss.py``), passing the minibatch-wide denominators so that
micro-batching and data parallelism leave eq. (10) intact. The numbers come from
``graft_exp.algorithms``; this module only maps a method to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graft_exp.algorithms import POLICY_LOSSES, hacpo_kl_loss, hacpo_policy_loss, sgt_nll_loss

#: The loss's count metrics, summed over a step's micro-batches, ranks and minibatches: tokens (HACPO:
#: sequences) of own and peer rows, of those the clipped ones, and SGT's NLL tokens.
COUNT_METRICS = ("tokens_self", "tokens_peer", "clipped_tokens_self", "clipped_tokens_peer",
                 "seqs_self", "seqs_peer", "clipped_seqs_self", "clipped_seqs_peer", "sft_tokens")


@dataclass(frozen=True)
class LossSpec:
    """Which objective a receiver optimises, from the method config (picklable: it travels to verl's
    Ray workers inside the loss function)."""

    kind: str                       # graft | sequence_ratio | luffy | sgt | hacpo
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float | None = None   # verl's dual clip for negative advantages (every method sets 3.0)
    luffy_gamma: float = 0.1
    sgt_lambda: float = 0.1
    hacpo_self_clip_low: float = 3e-4
    hacpo_self_clip_high: float = 4e-4
    hacpo_cross_clip_delta: float = 0.2
    hacpo_cross_clip_step: float = 0.025
    hacpo_kl_coef: float = 1e-3

    @classmethod
    def from_method(cls, method) -> LossSpec:
        """The objective of a method config (``cfg.method``). Single-model GRPO is ``graft`` with no
        peer rows, which is the token-mean GRPO loss (eq. 2)."""
        kinds = {"hacpo": "hacpo", "nll": "sgt", "luffy": "luffy"}
        kind = kinds.get(method.peer_loss, "sequence_ratio" if method.ratio == "sequence" else "graft")
        hacpo = method.hacpo
        return cls(kind=kind, clip_low=float(method.clip_low), clip_high=float(method.clip_high),
                   clip_ratio_c=float(method.clip_ratio_c), luffy_gamma=float(method.luffy_gamma), sgt_lambda=float(method.sgt_lambda),
                   hacpo_self_clip_low=float(hacpo.self_clip_low), hacpo_self_clip_high=float(hacpo.self_clip_high),
                   hacpo_cross_clip_delta=1.0 - float(hacpo.peer_clip_init),
                   hacpo_cross_clip_step=float(hacpo.peer_clip_step), hacpo_kl_coef=float(hacpo.kl_coef))

    @property
    def sequence_level(self) -> bool:
        """HACPO averages over sequences (its denominators and clip counts are sequences, not tokens)."""
        return self.kind == "hacpo"


@dataclass
class SftRows:
    """SGT's NLL rows: log-probs and mask of the drawn correct peer responses, and the term's
    token denominator (None: the rows' own token count)."""

    log_prob: torch.Tensor
    mask: torch.Tensor
    num_tokens: float | None = None


def receiver_loss(spec: LossSpec, log_prob: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                  weights: torch.Tensor, is_peer: torch.Tensor, *, old_log_prob: torch.Tensor | None = None,
                  denominator: float | None = None, sft: SftRows | None = None,
                  source_mean_log_prob: torch.Tensor | None = None,
                  capability_ratio: torch.Tensor | float = 1.0, minibatch_index: int = 0,
                  ref_log_prob: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to minimise on receiver rows ``[B, T]`` and its raw metrics (``graft_exp.algorithms``).

    GRAFT and its token-level variants: eq. (10) with ``old_log_prob`` the receiver-old policy of own
    and peer rows (``denominator``: the minibatch's present-token count when this is a micro-batch).
    SGT adds ``sgt_lambda`` x NLL of ``sft``. HACPO: its sequence-level objective with
    ``source_mean_log_prob`` (the generating policy's mean token log-prob), the per-row
    ``capability_ratio``, the minibatch's position and, when ``hacpo_kl_coef > 0``, the KL to
    ``ref_log_prob`` on own rows (``denominator``: the minibatch's sequence count).
    """
    if spec.kind == "hacpo":
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
    extra = {"gamma": spec.luffy_gamma} if spec.kind == "luffy" else {}
    loss_fn = POLICY_LOSSES["graft" if spec.kind == "sgt" else spec.kind]
    loss, raw = loss_fn(log_prob, old_log_prob, advantages, weights, mask, spec.clip_low, spec.clip_high,
                        is_peer=is_peer, num_tokens=denominator, clip_ratio_c=spec.clip_ratio_c, **extra)
    if spec.kind == "sgt" and sft is not None:
        nll, sft_raw = sgt_nll_loss(sft.log_prob, sft.mask, spec.sgt_lambda, num_tokens=sft.num_tokens)
        loss, raw = loss + nll, {**raw, **sft_raw}
    return loss, raw


def generation_mean_log_prob(rows, own, source) -> torch.Tensor:
    """HACPO's per-row mean token log-prob under the policy that generated the row (own rows: the
    receiver's rollout, peer rows: the source's), from the rollouts' ``logp_sum`` / ``num_tokens``."""
    def mean(rollouts, q, i):
        return float(rollouts.logp_sum[q, i] / rollouts.num_tokens[q, i])
    return torch.tensor([mean(source if row.origin == "peer" else own, row.prompt, row.sample) for row in rows])
