"""``python -m analysis transfers``: did the receivers learn from the transfers? Absorption rates from the
transfer logs (``graft_exp.transfers``) of every finished model run, with intervals.

The prompts compared are a receiver's **candidates**: those it failed entirely (k = 0) that a source solved
(k > 0). A candidate is absorbed when the receiver solves it at least once after the step (k > 0), measured by
the probe (``train.probe_transfers``: the receiver samples the prompt again right after its update) or, at no
cost, at the receiver's next visit of the prompt in a later epoch (its ``prompt_success.parquet``). Candidates
it received a group on are compared with its **controls**, the candidates where nothing was transferred. Controls are fair only where the rule cut such candidates for
reasons unrelated to the prompt: balancing, ties and random draws (``graft_random_prompts``); a gate that
rejected every response of a group leaves it "selected" with nothing admitted. A method that transfers on every
prompt (HACPO) has no controls: its rows say so. Breakdowns: by method, by direction (source -> receiver), by
the transferred responses' mean token log-prob under the receiver's old policy (quartiles: how far off the
receiver's policy they were), by subject. Rates carry Wilson 95 % intervals, differences Newcombe's.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from graft_exp import schema
from graft_exp.transfers import prompt_outcomes, read_log

Z = 1.959963984540054   # the 97.5 % normal quantile


def wilson(successes: int, n: int) -> tuple[float, float, float]:
    """The rate and its Wilson score 95 % interval (NaNs when n = 0)."""
    if n == 0:
        return math.nan, math.nan, math.nan
    p = successes / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return p, centre - half, centre + half


def newcombe(a: tuple[int, int], b: tuple[int, int]) -> tuple[float, float, float]:
    """Difference of two rates a - b ((successes, n) each) with Newcombe's hybrid score interval (method 10)."""
    (pa, la, ua), (pb, lb, ub) = wilson(*a), wilson(*b)
    if math.isnan(pa) or math.isnan(pb):
        return math.nan, math.nan, math.nan
    d = pa - pb
    return d, d - math.sqrt((pa - la) ** 2 + (ub - pb) ** 2), d + math.sqrt((ua - pa) ** 2 + (pb - lb) ** 2)


PROMPT_COLUMNS = ["prompt_id", "subject", "receiver", "k_receiver", "k_source", "received", "k_after", "source",
                  "admitted", "logp_mean", "candidate", "control"]


def prompt_rows(log: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, prompt) of one receiver's log: whether any source's group was received, whether it is
    a candidate (the receiver failed it entirely, its source, or for a prompt not received any source, solved
    it) and a control (a candidate not received), the probe's k after the step, the mean receiver log-prob of
    the admitted responses and how many were admitted."""
    if log.empty:
        return pd.DataFrame()
    admitted = log[log["admitted"]]
    logp = admitted.groupby(["step", "prompt_index"])["receiver_logp_mean"].mean()
    count = admitted.groupby(["step", "prompt_index"]).size()
    selected = log[log["selected"]].groupby(["step", "prompt_index"])
    by = ["step", "prompt_index"]
    prompts = log.groupby(by).agg(prompt_id=("prompt_id", "first"), subject=("subject", "first"),
                                  receiver=("receiver", "first")).join(prompt_outcomes(log, by))
    prompts["source"] = selected["source"].first().reindex(prompts.index)
    prompts["admitted"] = count.reindex(prompts.index).fillna(0).astype(int)
    prompts["logp_mean"] = logp.reindex(prompts.index)
    prompts["control"] = ~prompts["received"] & prompts["candidate"]
    return prompts[PROMPT_COLUMNS].reset_index()


def next_visits(prompts: pd.DataFrame, success: pd.DataFrame) -> pd.Series:
    """The receiver's k at its next visit of each prompt (its own ``prompt_success`` rows of a later step)."""
    if success.empty:
        return pd.Series(math.nan, index=prompts.index)
    later = success.sort_values("step")
    out = []
    for step, prompt_id in zip(prompts["step"], prompts["prompt_id"]):
        seen = later[(later["prompt_id"] == prompt_id) & (later["step"] > step)]
        out.append(float(seen["k"].iloc[0]) if len(seen) else math.nan)
    return pd.Series(out, index=prompts.index)


def load(client: MlflowClient, experiment_ids: list[str]) -> pd.DataFrame:
    """Every finished model run's transfer log as prompt rows, with method, seed and run id; ``absorbed`` is the
    probe's answer where it ran, else the next visit's."""
    runs = client.search_runs(experiment_ids, "attributes.status = 'FINISHED'", max_results=50_000)
    frames = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            if schema.MODEL not in run.data.tags:
                continue
            names = {f.path for f in client.list_artifacts(run.info.run_id)}
            if "transfers" not in names:
                continue
            folder = Path(tmp) / run.info.run_id
            log = read_log(Path(client.download_artifacts(run.info.run_id, "transfers", str(folder))))
            prompts = prompt_rows(log)
            if prompts.empty:
                continue
            success = (pd.read_parquet(client.download_artifacts(run.info.run_id, "prompt_success.parquet",
                                                                  str(folder)))
                       if "prompt_success.parquet" in names else pd.DataFrame())
            prompts["k_next"] = next_visits(prompts, success)
            prompts["method"] = run.data.tags.get(schema.METHOD)
            prompts["seed"] = run.data.tags.get(schema.SEED)
            prompts["pair"] = run.data.tags.get(schema.PAIR)
            prompts["run_id"] = run.info.run_id
            frames.append(prompts)
    if not frames:
        return pd.DataFrame()
    rows = pd.concat(frames, ignore_index=True)
    if rows["pair"].nunique() > 1:   # a method on a pair and on a group are two rows
        rows["method"] = rows["method"] + " (" + rows["pair"] + ")"
    rows["measured"] = np.where(rows["k_after"] >= 0, "probe", np.where(rows["k_next"].notna(), "next visit", ""))
    rows["absorbed"] = np.where(rows["k_after"] >= 0, rows["k_after"] > 0, rows["k_next"] > 0)
    return rows


def rates(rows: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Absorption after a transfer vs on the controls, per group of ``by``: counts, rates with Wilson
    intervals, the difference with Newcombe's; a group without controls says so."""
    measured = rows[rows["measured"] != ""]
    out = []
    for key, group in measured.groupby(by, dropna=False) if by else [((), measured)]:
        key = key if isinstance(key, tuple) else (key,)
        received, control = group[group["received"] & group["candidate"]], group[group["control"]]
        a = (int(received["absorbed"].sum()), len(received))
        b = (int(control["absorbed"].sum()), len(control))
        ra, rb, diff = wilson(*a), wilson(*b), newcombe(a, b)
        out.append({**dict(zip(by, key)), "received": a[1], "absorbed after transfer": ra[0],
                    "transfer lo": ra[1], "transfer hi": ra[2], "controls": b[1], "absorbed on controls": rb[0],
                    "control lo": rb[1], "control hi": rb[2], "difference": diff[0], "difference lo": diff[1],
                    "difference hi": diff[2],
                    "note": "" if b[1] else "no controls: every candidate prompt was transferred"})
    return pd.DataFrame(out)


QUARTILES = ["Q1 (most off-policy)", "Q2", "Q3", "Q4 (closest)"]


def logp_buckets(rows: pd.DataFrame) -> pd.Series:
    """Quartile, within its method, of each received candidate's admitted responses' mean receiver log-prob
    (Q1: the most off-policy)."""
    scored = rows["logp_mean"].where(rows["received"] & rows["candidate"])

    def quartiles(values: pd.Series) -> pd.Series:
        if values.notna().sum() < 4:
            return pd.Series("", index=values.index)
        ranked = values.rank(method="first")   # ties (a response scored alike) split evenly between quartiles
        return pd.qcut(ranked, 4, labels=QUARTILES).astype(str).where(values.notna(), "")
    return scored.groupby(rows["method"]).transform(quartiles)


def breakdowns(rows: pd.DataFrame) -> pd.DataFrame:
    """The table: overall per method, then per method by direction, by subject and (received prompts only) by
    the receiver log-prob quartile."""
    rows = rows.assign(direction=rows["source"].fillna("(none)") + " -> " + rows["receiver"],
                       logp_quartile=logp_buckets(rows))
    parts = [rates(rows, ["method"]).assign(breakdown="overall")]
    parts.append(rates(rows, ["method", "subject"]).assign(breakdown="subject"))
    received = rows[rows["received"] & rows["candidate"]]
    only = "received prompts only (a control has neither a source nor a score)"
    parts.append(rates(received.assign(control=False), ["method", "direction"]).assign(breakdown="direction", note=only))
    quartiles = rates(received[received["logp_quartile"] != ""].assign(control=False), ["method", "logp_quartile"])
    parts.append(quartiles.assign(breakdown="receiver log-prob quartile", note=only))
    return pd.concat(parts, ignore_index=True)


def markdown(table: pd.DataFrame) -> str:
    def pct(value, lo, hi) -> str:
        return "—" if pd.isna(value) else f"{100 * value:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"

    header = ("| breakdown | method | group | received | absorbed after transfer % [95% CI] | controls | "
              "absorbed on controls % [95% CI] | difference (points) [95% CI] | note |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for _, r in table.iterrows():
        group = next((str(r[c]) for c in ("subject", "direction", "logp_quartile") if c in r and pd.notna(r[c])), "all")
        lines.append(f"| {r['breakdown']} | {r['method']} | {group} | {r['received']} | "
                     f"{pct(r['absorbed after transfer'], r['transfer lo'], r['transfer hi'])} | {r['controls']} | "
                     f"{pct(r['absorbed on controls'], r['control lo'], r['control hi'])} | "
                     f"{pct(r['difference'], r['difference lo'], r['difference hi'])} | {r['note']} |")
    return "\n".join(lines) + "\n"


def figure(table: pd.DataFrame, out: Path) -> list[Path]:
    """Absorption after a transfer vs on the controls, per method, with Wilson intervals (PNG and PDF)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall = table[table["breakdown"] == "overall"].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(max(4.8, 1.6 + 1.3 * len(overall)), 3.6))
    x = np.arange(len(overall))
    for offset, (label, rate, lo, hi, colour) in enumerate([
            ("after a transfer", "absorbed after transfer", "transfer lo", "transfer hi", "tab:blue"),
            ("controls (no transfer)", "absorbed on controls", "control lo", "control hi", "tab:gray")]):
        values = 100 * overall[rate].to_numpy(dtype=float)
        errors = 100 * np.abs(np.vstack([overall[rate] - overall[lo], overall[hi] - overall[rate]]).astype(float))
        ax.bar(x + (offset - 0.5) * 0.38, np.nan_to_num(values), 0.38, yerr=np.nan_to_num(errors), capsize=3,
               color=colour, label=label)
    ax.set_xticks(x, overall["method"], rotation=20)
    ax.set_ylabel("receiver solves it after the step (%)")
    ax.set_title("Prompts solved after the step (Wilson 95% CI)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "transfers.png", out / "transfers.pdf"]
    for path in paths:
        fig.savefig(path, dpi=150)
    plt.close(fig)
    return paths


def write(client: MlflowClient, experiment_ids: list[str], out: Path) -> tuple[pd.DataFrame, list[Path]]:
    """transfers.csv/.md and the figure under ``out``; (the table, the paths). Empty when no run has a
    measured transfer log."""
    rows = load(client, experiment_ids)
    if rows.empty or not (rows["measured"] != "").any():
        return pd.DataFrame(), []
    table = breakdowns(rows)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "transfers.csv", index=False)
    (out / "transfers.md").write_text(markdown(table))
    return table, [out / "transfers.csv", out / "transfers.md", *figure(table, out)]
