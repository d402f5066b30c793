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
- ``graft_nll`` / ``graft_nll_denominator`` (SGT): rows of the drawn correct peer responses, which enter
                        only the NLL term (their PG weight is 0), and that term's minibatch token count;
- ``graft_minibatch_index`` the minibatch's position in the step (HACPO's m);
- ``graft_<name>``      each of the loss's per-row columns computed from the exchange's rows
                        (``objective.ROW_COLUMNS``: HACPO's ``source_mean_log_prob``, ``capability_ratio``).

Advantages stay verl's ``advantages`` column ([B, T], the row's advantage on its response tokens).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.padding import no_padding_2_padding

from graft_exp.methods.objective import COUNT_METRICS, LossSpec, NllRows, receiver_loss

WEIGHT, IS_PEER, DENOMINATOR = "graft_weight", "graft_is_peer", "graft_denominator"
NLL, NLL_DENOMINATOR, MINIBATCH_INDEX = "graft_nll", "graft_nll_denominator", "graft_minibatch_index"


def row_column(name: str) -> str:
    """The batch column carrying the loss's per-row input ``name`` (an ``objective.ROW_COLUMNS`` key)."""
    return f"graft_{name}"


def _columns(data: TensorDict, names: list[str]) -> TensorDict:
    present = [n for n in names if n in data.keys()]  # noqa: SIM118 (TensorDict has no __contains__ for keys)
    return data.select(*present).to_padded_tensor()


def _first(values: torch.Tensor) -> float:
    """A per-minibatch constant carried on every row."""
    return float(values.reshape(-1)[0])


def _metrics(loss: torch.Tensor, raw: dict[str, torch.Tensor], dp_size: int) -> dict:
    """Every micro-batch on every rank emits the same keys: verl's ``Metric.aggregate_dp`` needs one value
    per micro-batch from each data-parallel rank (a key only some micro-batches emit, e.g. ``nll_tokens``
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

    The objective is ``graft_exp.methods.objective.receiver_loss``, the one the local backend optimises, with
    the minibatch-wide denominators the rows carry. ``config`` is the actor's verl ``ActorConfig``
    (unused, kept for verl's signature). The returned loss is the micro-batch's share of the minibatch
    objective times the data-parallel size, because FSDP averages gradients over data-parallel ranks.
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    dp_size = int(data["dp_size"])
    cols = _columns(data, ["response_mask", "old_log_probs", "advantages", "ref_log_prob", WEIGHT, IS_PEER,
                           DENOMINATOR, NLL, NLL_DENOMINATOR, MINIBATCH_INDEX, *map(row_column, spec.row_columns)])
    mask = cols["response_mask"].bool()
    needs, extra = spec.columns, {}
    if "nll_rows" in needs and NLL in cols.keys():  # noqa: SIM118 (TensorDict keys)
        rows = cols[NLL].bool()
        if bool(rows.any()):
            extra["nll_rows"] = NllRows(log_prob[rows], mask[rows], _first(cols[NLL_DENOMINATOR][rows]))
    if "old_log_prob" in needs:
        extra["old_log_prob"] = cols["old_log_probs"]
    extra.update({name: cols[row_column(name)] for name in spec.row_columns})
    if "minibatch_index" in needs:
        extra["minibatch_index"] = int(_first(cols[MINIBATCH_INDEX]))
    if spec.needs_reference_model:
        extra["ref_log_prob"] = cols["ref_log_prob"]
    loss, raw = receiver_loss(spec, log_prob, mask, cols["advantages"], cols[WEIGHT].float(), cols[IS_PEER].bool(),
                              denominator=_first(cols[DENOMINATOR]), **extra)
    loss = loss * dp_size
    return loss, _metrics(loss, raw, dp_size)
