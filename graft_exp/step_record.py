"""What a training step writes after its update (Alg. 1's record phase): each model's step metrics
(``schema.MODEL_METRICS``) with its trajectory-log entry, and each receiver's transfer log
(``graft_exp.transfers``). Pure bookkeeping over what the step computed: nothing here samples, scores or trains
(the probe of the transfer log is the driver's, handed in)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from graft_exp import schema
from graft_exp.contract import Sampled
from graft_exp.costs import mfu
from graft_exp.methods.exchange import REPLAYED, peer_solved_frac, rollout_metrics
from graft_exp.methods.objective import LossSpec
from graft_exp.methods.receiver import PEER, ReceiverBatch
from graft_exp.rollouts import Rollouts
from graft_exp.trajectories import write_step
from graft_exp.transfers import Scored, group_rows
from graft_exp.transfers import write_step as write_transfers

#: A backend's update result that is a measurement, not a count: the trainer's peak reserved GPU memory (GiB).
GPU_PEAK = "gpu_peak_reserved_gb"
#: Another: the update's model FLOPs utilisation as the trainer measured it (verl's own ``mfu``, on a GPU only).
UPDATE_MFU = "mfu"
#: The driver's probe: (receiver, step, its own sample, its (source, selected) pairs, the sources) -> {prompt: k}.
Probe = Callable[[str, int, Sampled, list, dict[str, Rollouts]], dict[int, int]]


def update_metrics(counts: dict[str, float], spec: LossSpec) -> dict[str, float]:
    """``train/loss`` (mean over the step's minibatches), ``train/clipfrac_self`` and ``train/clipfrac_peer``
    from the step's summed counts (tokens; sequences for HACPO), as a backend's ``update`` returns them.
    The peer fraction is NaN (not logged) at a step without peer tokens."""
    kind = "seqs" if spec.sequence_level else "tokens"
    own, peer = counts.get(f"{kind}_self", 0.0), counts.get(f"{kind}_peer", 0.0)
    return {schema.TRAIN + "loss": counts["loss"],
            schema.TRAIN + "clipfrac_self": counts.get(f"clipped_{kind}_self", 0.0) / max(own, 1.0),
            schema.TRAIN + "clipfrac_peer": counts.get(f"clipped_{kind}_peer", 0.0) / peer if peer > 0 else float("nan")}


def model_step(root: Path, role: str, step: int, own: Sampled, batch: ReceiverBatch, counts: dict[str, float],
               peer_rollouts: dict[str, Rollouts], loss: LossSpec, co_train: bool) -> dict[str, float]:
    """Model ``role``'s step metrics (``schema.MODEL_METRICS``), and its trajectory-log entry under ``root``."""
    rollouts = own.rollouts
    m = {schema.TRAIN + k: v for k, v in rollout_metrics(rollouts).items()}
    m.update(update_metrics(counts, loss))
    if GPU_PEAK in counts:   # the verl trainer's (backends/verl/backend.py)
        m[schema.TRAIN + GPU_PEAK] = counts[GPU_PEAK]
    if co_train:
        m.update({schema.TRAIN + k: v for k, v in batch.metrics.items()})
    if own.logprob_gap is not None:
        m[schema.TRAIN + "rollout_logprob_gap"] = own.logprob_gap
    if peer_rollouts:
        m[schema.TRAIN + "peer_solved_frac"] = peer_solved_frac(rollouts, list(peer_rollouts.values()))
    if len(peer_rollouts) > 1:   # a group: what each peer solved of this model's all-fail prompts
        m.update({schema.peer_solved_metric(peer): peer_solved_frac(rollouts, [r])
                  for peer, r in peer_rollouts.items()})
    write_step(root / "trajectories" / role, step, rollouts, own.token_ids)
    return m


def transfer_log(root: Path, step: int, own: dict[str, Sampled], batches: dict[str, ReceiverBatch],
                 orders: dict[str, list[list[int]]], transfers: dict, plan_sources: dict[str, Rollouts | None],
                 scored: dict[str, Scored], probe: Probe | None) -> dict[str, dict]:
    """Each receiver's transfer log of this step (``graft_exp.transfers``), written under ``root`` beside its
    trajectory log; with a ``probe`` (``train.probe_transfers``), the receiver's successes after its update on
    the prompts it received a group on and on the ones it could have (the controls). Returns each receiver's
    rows."""
    out = {}
    for receiver, batch in batches.items():
        pairs = [(s, mask) for (s, r), mask in transfers.items() if r == receiver]
        if not pairs:
            continue
        sources = {s: (plan_sources[receiver] if s == REPLAYED else own[s].rollouts) for s, _ in pairs}
        minibatch = {g: index for index, groups in enumerate(orders[receiver]) for g in groups}
        mine = own[receiver].rollouts
        after = probe(receiver, step, own[receiver], pairs, sources) if probe else {}
        own_prompts = {row.prompt for row in batch.rows if row.origin != PEER}
        parts = []
        for s, selected in pairs:
            taken = selected.tolist()
            admitted = {(r.prompt, r.sample): (r.weight, minibatch.get(r.group, -1)) for r in batch.rows
                        if r.origin == PEER and taken[r.prompt]}
            admitted.update({(q, i): (1.0, minibatch.get(q, -1)) for q, i in batch.nll if taken[q]})
            replaced = set(range(len(taken))) - own_prompts
            parts.append(group_rows(step, mine.model, sources[s].model, own[receiver].problems, sources[s],
                                    mine.k.tolist(), taken, admitted, replaced, scored[receiver], after))
        write_transfers(root / "transfers" / receiver, step, parts)
        out[receiver] = {name: [v for part in parts for v in part[name]] for name in parts[0]}
    return out


def timeline_metrics(seconds: dict[str, float], wall: float, counts: dict[str, float], update_flops: float,
                     devices: int, peak: float | None) -> dict[str, float]:
    """Model ``role``'s part of the step's timeline: its busy seconds per phase (``costs.Timeline.seconds[role]``),
    ``time/wait_s`` (``wall``, the step up to its record, less its busy time) and ``perf/mfu``: the trainer's own
    (``counts[UPDATE_MFU]``, verl's), else the update's counted FLOPs over its seconds on ``devices`` GPUs of dense
    peak ``peak`` (None: a CPU or an unknown GPU, no MFU)."""
    m = {schema.phase_metric(name): value for name, value in seconds.items()}
    m[schema.WAIT_SECONDS] = max(wall - sum(seconds.values()), 0.0)
    utilisation = counts.get(UPDATE_MFU, mfu(update_flops, seconds["update"], devices, peak))
    if utilisation is not None:
        m[schema.MFU] = utilisation
    return m
