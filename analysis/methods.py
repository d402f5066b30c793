"""``python -m analysis methods``: the comparison a multirun or a sweep ends with (``graft_exp.launching.comparison``),
for any finished jobs in MLflow: an experiment's, several, or those whose settings match ``--where key=value``
filters (a flattened config key, or ``method``, ``pair``, ``seed``). Written as CSV, Markdown and LaTeX (one file
each, a block per pair), and printed."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from analysis.store import ANALYSIS_TAG, StoreUnavailable, graft_experiments
from graft_exp import schema
from graft_exp.launching import comparison, summary

#: ``--where`` keys read from a job run's tags where its params lack them.
TAG_FILTERS = {"method": schema.METHOD, "pair": schema.PAIR, "seed": schema.SEED}


def job_results(client: MlflowClient, experiments: list[str] | None, where: list[str]) -> list:
    """The FINISHED job runs of ``experiments`` (every ``graft/*`` one when None) that match every ``key=value``
    of ``where``, as ``summary.JobResult``s."""
    filters = []
    for item in where:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise StoreUnavailable(f"--where {item!r} is not key=value, e.g. --where train.max_steps=20")
        filters.append((key, value))
    ids = list(graft_experiments(client, experiments))
    runs = client.search_runs(ids, "attributes.status = 'FINISHED'", max_results=50000) if ids else []
    results = []
    for run in runs:
        tags, params = run.data.tags, run.data.params
        if "mlflow.parentRunId" in tags or schema.RUN_KEY not in tags or ANALYSIS_TAG in tags:
            continue
        if all(params.get(k, tags.get(TAG_FILTERS.get(k, ""))) == v for k, v in filters):
            label = f"{tags.get(schema.METHOD)} seed {tags.get(schema.SEED)}"
            results.append(summary.job_result(client, run, label))
    return sorted(results, key=lambda r: (r.pair, r.method, len(r.seed), r.seed))


def frame(comparisons: list[comparison.Comparison]) -> pd.DataFrame:
    """Every comparison's rows, one table (scores and differences in percentage points)."""
    rows = []
    for c in comparisons:
        for row in c.rows:
            rows.append({"pair": c.pair, "reference": c.reference,
                         **{k: (100 * v if isinstance(v, float) and ("mean" in k or " se" in k or "delta" in k)
                                else v) for k, v in row.items() if k != "pair"},
                         "differs in": "; ".join(c.differ)})
    return pd.DataFrame(rows)


def _cell(value) -> str:
    return "-" if isinstance(value, float) and math.isnan(value) else f"{value:.2f}" if isinstance(value, float) \
        else str(value)


def write(comparisons: list[comparison.Comparison], out: Path) -> list[Path]:
    """``methods.csv``, ``methods.md`` and ``methods.tex`` under ``out``."""
    table = frame(comparisons)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "methods.csv", out / "methods.md", out / "methods.tex"]
    table.to_csv(paths[0], index=False, float_format="%.4f")
    md, tex = [], []
    for c in comparisons:
        columns = ["method", "seeds", *(f"{m} mean" for m in [*c.models, "pair"]), "delta", "delta lo", "delta hi",
                   "paired seeds", "gpu_hours per job"]
        rows = table[table["pair"] == c.pair]
        title = (f"**{c.pair}** (vs {c.reference}; test avg %, mean over seeds; delta: paired, 95 % t-interval; "
                 f"{c.note})")
        md += [title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        md += ["| " + " | ".join(_cell(r[col]) for col in columns) + " |" for _, r in rows.iterrows()] + [""]
        tex += [f"% {c.pair} vs {c.reference}; {c.note}", "\\begin{tabular}{l" + "r" * (len(columns) - 1) + "}",
                " & ".join(col.replace("_", "\\_") for col in columns) + " \\\\ \\hline"]
        tex += [" & ".join(_cell(r[col]).replace("_", "\\_") for col in columns) + " \\\\" for _, r in rows.iterrows()]
        tex += ["\\end{tabular}", ""]
    paths[1].write_text("\n".join(md), encoding="utf-8")
    paths[2].write_text("\n".join(tex), encoding="utf-8")
    return paths
