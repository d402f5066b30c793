"""The paper's reporting rules as pure pandas functions (no MLflow), each citing where the paper states it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from graft_exp.intervals import mean_sd, paired_interval, t_halfwidth

AVG = "avg"


def eval_scores(history: pd.DataFrame, benches: list[str], scale: float = 1.0) -> pd.DataFrame:
    """Scores of one checkpoint: one row per evaluation run (``test/<bench>`` at step = run index).

    ``history`` has columns ``key, step, value``. Adds ``avg``, the unweighted mean of the benchmarks *per
    evaluation run* (App. B: "the aggregate score is the unweighted mean of the five benchmarks"); it is NaN
    for a run that lacks one of ``benches``.
    """
    tests = history[history["key"].isin([f"test/{b}" for b in benches])]
    table = tests.pivot_table(index="step", columns="key", values="value", aggfunc="last")
    table = table.rename(columns=lambda k: k[len("test/"):]).reindex(columns=benches) * scale
    table[AVG] = table[benches].mean(axis=1, skipna=False)
    table.index.name = "eval_run"
    return table


def mean_std(scores: pd.DataFrame) -> dict[str, float]:
    """``<col>_mean`` and ``<col>_std`` for every column (``intervals.mean_sd`` of its values, missing ones left
    out), plus ``n`` (the number of rows averaged)."""
    out = {"n": len(scores)}
    for column in scores.columns:
        out[f"{column}_mean"], out[f"{column}_std"] = mean_sd(scores[column].dropna())
    return out


def checkpoint_summary(scores: pd.DataFrame) -> dict[str, float]:
    """Main-table cell values: mean and std over the evaluation runs of the selected checkpoint (Table 1). The
    paper says "mean and standard deviation" (Sec. 5.1, App. B) without naming the estimator; the sample one, as
    App. C states for the spread over training runs, so that every "±" reads the same way."""
    return mean_std(scores)


def seed_summary(per_seed_scores: list[pd.DataFrame]) -> dict[str, float]:
    """App. C: average the evaluation runs within each training run, then "mean and sample standard deviation
    over three independent runs"."""
    per_seed_means = pd.DataFrame([scores.mean() for scores in per_seed_scores])
    return mean_std(per_seed_means)


def bold_cells(block_means: pd.DataFrame, reference: str) -> dict[str, set[str]]:
    """Table 1's bold rule: per column, the best method of the block; nothing when ``reference`` is best.

    ``block_means`` has one row per method (index) and one column per score; methods with a NaN in a column
    do not compete in it, and without the reference row nothing is bolded (the rule needs it).
    """
    bold: dict[str, set[str]] = {method: set() for method in block_means.index}
    if reference not in block_means.index:
        return bold
    for column in block_means.columns:
        values = block_means[column].dropna()
        if reference not in values.index:
            continue
        winner = values.idxmax()
        if winner != reference and values[winner] > values[reference]:
            bold[winner].add(column)
    return bold


def better_of_two(block_means: pd.DataFrame) -> dict[str, set[str]]:
    """App. C's bold rule: per column, the better mean of the two methods of the block."""
    bold: dict[str, set[str]] = {method: set() for method in block_means.index}
    for column in block_means.columns:
        values = block_means[column]
        if values.notna().all() and len(values) == 2 and values.iloc[0] != values.iloc[1]:
            bold[values.idxmax()].add(column)
    return bold


def dagger_marks(ours: pd.Series, tiers: list[tuple[str, pd.DataFrame]]) -> dict[str, str]:
    """Table 1's marks: per column, the last tier whose baselines ``ours`` all exceeds (e.g. † then ‡).

    ``tiers`` lists (mark, baselines) with growing sets of baselines (rows = methods); a tier counts only
    when all its baselines are present in that column, so a missing run never earns a mark.
    """
    marks = {}
    for column in ours.index:
        if pd.isna(ours[column]):
            continue
        for mark, baselines in tiers:
            values = baselines[column]
            if values.isna().any() or not (ours[column] > values).all():
                break
            marks[column] = mark
    return marks


def value_at_step(series: pd.Series, step: float) -> float:
    """A cumulative metric at ``step``: the last value logged at or before it (NaN if none)."""
    if series.empty or pd.isna(step):
        return math.nan
    logged = series[series.index <= step]
    return float(logged.iloc[-1]) if len(logged) else math.nan


def final_value(series: pd.Series) -> float:
    return float(series.iloc[-1]) if len(series) else math.nan


def best_validation_step(val_avg: pd.Series) -> float:
    """App. B: the highest-scoring validation checkpoint (the first one on ties) among trained ones.

    Step 0 (the initial model) is validated for the curves but is not a candidate: a selected checkpoint
    must have been trained, and it must have a training cost.
    """
    trained = val_avg[val_avg.index > 0].dropna()
    return float(trained.idxmax()) if len(trained) else math.nan


def joint_checkpoint_cost(job_cost: pd.Series, best_steps: list[float]) -> float:
    """App. D: a joint run's cost through the later of its models' selected checkpoints."""
    if not best_steps or any(pd.isna(s) for s in best_steps):
        return math.nan
    return value_at_step(job_cost, max(best_steps))


def shares_mismatch(job_cost: pd.Series, shares: list[pd.Series]) -> float:
    """The largest relative gap between a joint run's cost and the sum of its models' shares (App. D).

    Every model run logs its cumulative share and the job run the joint cost; the shares add up to the
    joint cost at every step. Compared at the steps all of them logged; NaN when there is none.
    """
    steps = job_cost.index
    for share in shares:
        steps = steps.intersection(share.index)
    if not len(steps):
        return math.nan
    total = sum(share.loc[steps].to_numpy() for share in shares)
    joint = job_cost.loc[steps].to_numpy()
    return float(np.max(np.abs(total - joint) / np.maximum(np.abs(joint), 1e-12)))


def cost_cut(online: float, stored: float) -> float:
    """Fig. 3b: the fraction of the online checkpoint's cost that stored trajectories save."""
    return 1.0 - stored / online if online and not (pd.isna(online) or pd.isna(stored)) else math.nan


def clip_fractions(self_frac: pd.Series, peer_frac: pd.Series, peer_admitted: pd.Series,
                   first: int = 1, last: int = 48) -> dict[str, float]:
    """App. H: clipped-token fractions (percent) over steps ``first..last`` for own and peer tokens.

    Peer fractions are averaged over the steps that trained on peer tokens (``train/peer_admitted`` > 0
    when logged, else every step that logged a peer fraction); ``zero_peer_steps`` and ``peer_steps`` count
    those steps with no clipped peer token, for the table's pooled "steps with zero clipping" row.
    """
    def window(series):
        return series[(series.index >= first) & (series.index <= last)].dropna()

    own, peer = window(self_frac), window(peer_frac)
    admitted = window(peer_admitted)
    if len(admitted):
        peer = peer[peer.index.isin(admitted.index[admitted > 0])]
    return {
        "clipfrac_self": 100 * own.mean() if len(own) else math.nan,
        "clipfrac_peer": 100 * peer.mean() if len(peer) else math.nan,
        "zero_peer_steps": int((peer == 0).sum()),
        "peer_steps": len(peer),
    }


def rescue_fraction(receiver: pd.DataFrame, *peers: pd.DataFrame) -> pd.Series:
    """Fig. 1 (right): per step, the fraction of the receiver's all-fail prompts that the peer solved (with
    several peers, that at least one of them solved: a group's rescue).

    The frames hold ``step, prompt_id, k`` (successes out of n) from independent runs that saw the same
    prompt batches; prompts are matched on (step, prompt_id). Steps without an all-fail prompt are NaN.
    """
    peer = pd.concat(peers).groupby(["step", "prompt_id"], as_index=False)["k"].max()
    joined = receiver.merge(peer, on=["step", "prompt_id"], suffixes=("_receiver", "_peer"))
    all_fail = joined[joined["k_receiver"] == 0]
    rescued = (all_fail["k_peer"] >= 1).groupby(all_fail["step"]).mean()
    steps = np.sort(joined["step"].unique())
    return rescued.reindex(steps).rename("rescue_fraction")


def confidence_halfwidth(values: pd.Series, level: float = 0.95) -> float:
    """Half-width of the Student-t confidence interval of the mean (Fig. 3a's 95% CIs over evaluation runs)."""
    return t_halfwidth(values.dropna().to_numpy(), level)


def paired_difference(values: pd.Series, reference: pd.Series, level: float = 0.95) -> dict[str, float]:
    """A method against a reference trained with the same seeds: the mean over seeds of (value - reference)
    and the Student-t ``level`` interval of that mean (``n - 1`` degrees of freedom).

    Both series are indexed by seed; only seeds present in both count (pairing removes the seed-to-seed
    spread that both share, e.g. the prompt order). ``n`` is the number of pairs; the interval is NaN below 2.
    """
    diff = (values - reference).dropna()
    mean, lo, hi = paired_interval(diff.to_numpy(), level)
    return {"mean": mean, "lo": lo, "hi": hi, "n": len(diff)}
