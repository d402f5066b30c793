"""The receiver's loss inside verl's training engine, through the ``set_loss_fn`` path.

verl's registered policy losses (``core_algos.register_policy_loss``) only receive log-probs, old
log-probs, advantages and the response mask: ``workers.utils.losses.ppo_loss`` selects those columns
before calling them. GRAFT needs per-sequence weights, the peer flag and minibatch-wide denominators,
so the actor gets ``actor_loss`` instead (``worker_group.set_loss_fn(partial(actor_loss, config, spec))``):
it is called per micro-batch with the whole micro-batch TensorDict and calls ``graft_exp.algorithms``.

Columns the driver adds to the receiver batch (one value per row; see ``batch.py``):

- ``graft_weight``      w(o): 1 for own rows, the compatibility weight for peer rows, 0 for a removed
                        (or padding) row;
- ``graft_is_peer``     1 for peer rows;
- ``graft_denominator`` the token-mean denominator of the row's optimizer minibatch: response tokens of
                        its rows with weight > 0 (HACPO: its number of sequences), identical on every row
                        of a minibatch, so that micro-batching and data parallelism leave eq. (10) intact;
- ``graft_sft`` / ``graft_sft_denominator`` (SGT): rows of the drawn correct peer responses, which enter
                        only the NLL term (their PG weight is 0), and that term's minibatch token count;
- ``graft_source_mean_log_prob``, ``graft_capability_ratio``, ``graft_minibatch_index`` (HACPO).

Advantages stay verl's ``advantages`` column ([B, T], the row's advantage on its response tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.padding import no_padding_2_padding

from graft_exp.algorithms import POLICY_LOSSES, hacpo_kl_loss, hacpo_policy_loss, sgt_nll_loss

WEIGHT, IS_PEER, DENOMINATOR = "graft_weight", "graft_is_peer", "graft_denominator"
SFT, SFT_DENOMINATOR = "graft_sft", "graft_sft_denominator"
SOURCE_MEAN_LOG_PROB, CAPABILITY_RATIO, MINIBATCH_INDEX = (
    "graft_source_mean_log_prob", "graft_capability_ratio", "graft_minibatch_index")

#: Token (HACPO: sequence) counts summed over micro-batches, data-parallel ranks and minibatches.
COUNT_METRICS = ("tokens_self", "tokens_peer", "clipped_tokens_self", "clipped_tokens_peer",
                 "seqs_self", "seqs_peer", "clipped_seqs_self", "clipped_seqs_peer", "sft_tokens")


@dataclass(frozen=True)
class LossSpec:
    """Which objective a receiver optimises, from the method config (picklable: it travels to the
    Ray workers inside the loss function)."""

    kind: str                       # graft | sequence_ratio | luffy | sgt | hacpo
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float | None = 3.0   # verl's dual clip for A < 0 (graft_policy_loss's clip_ratio_c)
    luffy_gamma: float = 0.1
    sgt_lambda: float = 0.1
    hacpo_self_clip_low: float = 3e-4
    hacpo_self_clip_high: float = 4e-4
    hacpo_cross_clip_delta: float = 0.2
    hacpo_cross_clip_step: float = 0.025
    hacpo_kl_coef: float = 1e-3

    @classmethod
    def from_method(cls, method) -> LossSpec:
        """The policy loss of a method config (``cfg.method``)."""
        if method.peer_loss == "hacpo":
            kind = "hacpo"
        elif method.peer_loss == "nll":
            kind = "sgt"
        elif method.peer_loss == "luffy":
            kind = "luffy"
        elif method.ratio == "sequence":
            kind = "sequence_ratio"
        else:
            kind = "graft"
        hacpo = method.hacpo
        return cls(kind=kind, clip_low=float(method.clip_low), clip_high=float(method.clip_high),
                   clip_ratio_c=float(method.clip_ratio_c), luffy_gamma=float(method.luffy_gamma), sgt_lambda=float(method.sgt_lambda),
                   hacpo_self_clip_low=float(hacpo.self_clip_low), hacpo_self_clip_high=float(hacpo.self_clip_high),
                   hacpo_cross_clip_delta=1.0 - float(hacpo.peer_clip_init),
                   hacpo_cross_clip_step=float(hacpo.peer_clip_step), hacpo_kl_coef=float(hacpo.kl_coef))


def _columns(data: TensorDict, names: list[str]) -> TensorDict:
    present = [n for n in names if n in data.keys()]  # noqa: SIM118 (TensorDict has no __contains__ for keys)
    return data.select(*present).to_padded_tensor()


def _first(values: torch.Tensor) -> float:
    """A per-minibatch constant carried on every row."""
    return float(values.reshape(-1)[0])


def _metrics(loss: torch.Tensor, raw: dict[str, torch.Tensor], dp_size: int) -> dict:
    """Every micro-batch on every rank emits the same keys: verl's ``Metric.aggregate_dp`` needs one value
    per micro-batch from each data-parallel rank (a key only some micro-batches emit, e.g. ``sft_tokens``
    of SGT's NLL rows, fails there or is averaged over the wrong number of ranks), so a count a
    micro-batch has no rows for is 0."""
    # verl averages SUM metrics over data-parallel ranks, then sums over micro-batches: counts are scaled
    # by dp_size so that the result is their global sum; the loss is already scaled (it is what verl logs).
    metrics = {"actor/pg_loss": Metric(AggregationType.SUM, loss.detach())}
    for key in COUNT_METRICS:
        metrics[f"graft/{key}"] = Metric(AggregationType.SUM, float(raw.get(key, 0.0)) * dp_size)
    return metrics


def actor_loss(config, spec: LossSpec, model_output: dict, data: TensorDict, dp_group=None):
    """verl loss function (``set_loss_fn``) for one micro-batch: returns ``(loss, metrics)``.

    ``config`` is the actor's verl ``ActorConfig`` (unused by the GRAFT objectives, kept for the verl
    signature). The returned loss is the micro-batch's share of the minibatch objective times the
    data-parallel size, because FSDP averages gradients over data-parallel ranks.
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    dp_size = int(data["dp_size"])
    cols = _columns(data, ["response_mask", "old_log_probs", "advantages", "ref_log_prob", WEIGHT, IS_PEER,
                           DENOMINATOR, SFT, SFT_DENOMINATOR, SOURCE_MEAN_LOG_PROB, CAPABILITY_RATIO,
                           MINIBATCH_INDEX])
    mask = cols["response_mask"].bool()
    weights, is_peer = cols[WEIGHT].float(), cols[IS_PEER].bool()
    if spec.kind == "hacpo":
        return _hacpo_loss(spec, log_prob, mask, cols, is_peer, dp_size)
    row_advantage = cols["advantages"]
    loss_fn = POLICY_LOSSES["graft" if spec.kind == "sgt" else spec.kind]
    extra = {"gamma": spec.luffy_gamma} if spec.kind == "luffy" else {}
    loss, raw = loss_fn(log_prob, cols["old_log_probs"], row_advantage, weights, mask, spec.clip_low,
                        spec.clip_high, is_peer=is_peer, num_tokens=_first(cols[DENOMINATOR]),
                        clip_ratio_c=spec.clip_ratio_c, **extra)
    if spec.kind == "sgt":
        sft_rows = cols[SFT].bool()
        if bool(sft_rows.any()):
            nll, sft_raw = sgt_nll_loss(log_prob[sft_rows], mask[sft_rows], spec.sgt_lambda,
                                        num_tokens=_first(cols[SFT_DENOMINATOR][sft_rows]))
            loss = loss + nll
            raw = {**raw, **sft_raw}
    loss = loss * dp_size
    return loss, _metrics(loss, raw, dp_size)


def _hacpo_loss(spec: LossSpec, log_prob, mask, cols, is_peer, dp_size):
    """HACPO's sequence-level objective plus its KL term (own rows only), per ``graft_exp.algorithms``."""
    advantages = (cols["advantages"] * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    present = cols[WEIGHT] > 0
    num_sequences = _first(cols[DENOMINATOR])
    loss, raw = hacpo_policy_loss(
        log_prob[present], mask[present], cols[SOURCE_MEAN_LOG_PROB][present].float(), advantages[present],
        is_peer[present], cols[CAPABILITY_RATIO][present].float(), int(_first(cols[MINIBATCH_INDEX])),
        self_clip_low=spec.hacpo_self_clip_low, self_clip_high=spec.hacpo_self_clip_high,
        cross_clip_delta=spec.hacpo_cross_clip_delta, cross_clip_step=spec.hacpo_cross_clip_step,
        num_sequences=num_sequences)
    if spec.hacpo_kl_coef > 0:
        kl, kl_raw = hacpo_kl_loss(log_prob[present], cols["ref_log_prob"][present], mask[present],
                                   is_peer[present], spec.hacpo_kl_coef, num_sequences=num_sequences)
        loss = loss + kl
        raw = {**raw, **kl_raw}
    loss = loss * dp_size
    return loss, _metrics(loss, raw, dp_size)
