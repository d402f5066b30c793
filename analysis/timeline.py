"""``python -m analysis timeline``: where each pool's step time goes, per pair and method, from the step's timeline
every model run records (``time/<phase>_s`` and ``time/wait_s``, docs/design.md "The step's timeline").

The table gives each model's mean seconds per step and the share of each phase, the wait included (the shares add
up to the step's wall time before its record); the figure stacks each pool's phases per step, one panel per model
of the first seed of each (pair, method).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from mlflow.tracking import MlflowClient

from analysis.store import load_histories
from graft_exp import schema

#: The timeline's parts in the order they are stacked: each phase, then the pool's wait.
PARTS = [*schema.PHASES, "wait"]
METRICS = {schema.phase_metric(phase): phase for phase in schema.PHASES} | {schema.WAIT_SECONDS: "wait"}
COLORS = {"generate": "#4a90c2", "reward": "#8c6bb1", "logprob": "#e6a141", "score": "#c0392b",
          "update": "#2e8b57", "sync": "#6b7785", "wait": "#d9d9d9"}
KEYS = ["pair", "method", "role", "model"]


def model_runs(client: MlflowClient, experiment_ids: list[str]) -> pd.DataFrame:
    """Every model run of the experiments (a ``graft.role`` tag), with its pair, method, seed, role and model."""
    rows = []
    for run in client.search_runs(experiment_ids, max_results=50_000):
        tags = run.data.tags
        if schema.ROLE in tags and schema.ANALYSIS not in tags:
            rows.append({"run_id": run.info.run_id, "pair": tags.get(schema.PAIR), "method": tags.get(schema.METHOD),
                         "seed": int(tags.get(schema.SEED, 0)), "role": tags[schema.ROLE],
                         "model": tags.get(schema.MODEL)})
    return pd.DataFrame(rows, columns=["run_id", "pair", "method", "seed", "role", "model"])


def steps(client: MlflowClient, experiment_ids: list[str]) -> pd.DataFrame:
    """One row per model run and training step: its seconds in each part of the timeline (``PARTS``)."""
    runs = model_runs(client, experiment_ids)
    if runs.empty:
        return pd.DataFrame(columns=[*runs.columns, "step", *PARTS])
    history = load_histories(client, {key: runs["run_id"].tolist() for key in METRICS})
    if history.empty:
        return pd.DataFrame(columns=[*runs.columns, "step", *PARTS])
    wide = (history.assign(part=history["key"].map(METRICS))
            .pivot_table(index=["run_id", "step"], columns="part", values="value", aggfunc="last")
            .reindex(columns=PARTS).fillna(0.0).reset_index())
    return runs.merge(wide, on="run_id").sort_values(["pair", "method", "seed", "role", "step"], ignore_index=True)


def shares(frame: pd.DataFrame) -> pd.DataFrame:
    """Per pair, method and model: the steps read, the mean step (its busy parts and its wait, seconds) and each
    part's share of it (the mean over steps of each part over the mean step)."""
    grouped = frame.groupby(KEYS, sort=True)
    mean = grouped[PARTS].mean()
    step = mean.sum(axis=1)
    table = (mean.div(step, axis=0) * 100).round(1).add_suffix(" %")
    table.insert(0, "step s", step.round(3))
    table.insert(0, "steps", grouped.size())
    return table.reset_index()


def markdown(table: pd.DataFrame) -> str:
    head = "| " + " | ".join(table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(str(v) for v in row) + " |" for row in table.itertuples(index=False))]) + "\n"


def figure(frame: pd.DataFrame):
    """Each pool's parts stacked per step: one row per (pair, method) (its lowest seed), one panel per model."""
    first = frame[frame["seed"] == frame.groupby(["pair", "method"])["seed"].transform("min")]
    jobs = list(first.groupby(["pair", "method"]).groups)
    roles = sorted(first["role"].unique())
    fig, axes = plt.subplots(len(jobs), len(roles), figsize=(5.5 * len(roles), 2.8 * len(jobs)), squeeze=False,
                             sharey="row")
    for i, (pair, method) in enumerate(jobs):
        for j, role in enumerate(roles):
            ax = axes[i][j]
            pool = first[(first["pair"] == pair) & (first["method"] == method) & (first["role"] == role)]
            if pool.empty:
                ax.set_axis_off()
                continue
            bottom = pd.Series(0.0, index=pool.index)
            for part in PARTS:
                ax.bar(pool["step"], pool[part], bottom=bottom, width=0.85, color=COLORS[part], label=part)
                bottom = bottom + pool[part]
            ax.set_title(f"{pair} {method}: {role} {pool['model'].iloc[0]} (seed {pool['seed'].iloc[0]})", fontsize=9)
            ax.set_xlabel("training step")
            if j == 0:
                ax.set_ylabel("seconds")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0.06 / len(jobs), 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=len(PARTS), frameon=False)
    return fig


def write(client: MlflowClient, experiment_ids: list[str], out: Path) -> tuple[pd.DataFrame, list[Path]]:
    """The shares table (CSV, Markdown), the per-step frame (CSV) and the figure (PNG, PDF) into ``out``; nothing
    is written where no model run recorded a timeline (the table comes back empty)."""
    frame = steps(client, experiment_ids)
    if frame.empty:
        return pd.DataFrame(), []
    table = shares(frame)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "timeline.csv", out / "timeline.md", out / "timeline-steps.csv"]
    table.to_csv(paths[0], index=False)
    paths[1].write_text(markdown(table))
    frame.to_csv(paths[2], index=False)
    fig = figure(frame)
    for suffix in ("png", "pdf"):
        paths.append(out / f"timeline.{suffix}")
        fig.savefig(paths[-1], dpi=150, bbox_inches="tight")
    plt.close(fig)
    return table, paths
