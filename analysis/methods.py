"""``python -m analysis methods``: the comparison a multirun or a sweep ends with (``graft_exp.launching.comparison``),
for any finished jobs in MLflow: an experiment's, several, or those whose settings match ``--where key=value``
filters (a flattened config key, or ``method``, ``pair``, ``seed``). Written as CSV, Markdown and LaTeX (one file
each, a block per pair), and printed."""

from __future__ import annotations

import difflib
import math
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from analysis.store import ANALYSIS_TAG, StoreUnavailable, graft_experiments
from graft_exp import schema
from graft_exp.launching import comparison, summary

#: ``--where`` keys read from a job run's tags where its params lack them.
TAG_FILTERS = {"method": schema.METHOD, "pair": schema.PAIR, "seed": schema.SEED}


def job_results(client: MlflowClient, experiments: list[str] | None, where: list[str], keys: set[str] | None = None,
                by: str = "method") -> list:
    """The FINISHED job runs of ``experiments`` (every ``graft/*`` one when None) that match every ``key=value``
    of ``where`` (and whose run key is one of ``keys``, a sweep file's jobs, when given), as ``summary.JobResult``s
    compared by ``by``: the method, or another setting (``method.delta``, ``train.max_steps``...), whose value then
    names each compared group."""
    filters = []
    for item in where:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise StoreUnavailable(f"--where {item!r} is not key=value, e.g. --where train.max_steps=20")
        filters.append((key, value))
    ids = list(graft_experiments(client, experiments))
    runs = client.search_runs(ids, "attributes.status = 'FINISHED'", max_results=50000) if ids else []
    jobs = [run for run in runs if "mlflow.parentRunId" not in run.data.tags and schema.RUN_KEY in run.data.tags
            and ANALYSIS_TAG not in run.data.tags]
    if keys is not None:
        jobs = [run for run in jobs if run.data.tags[schema.RUN_KEY] in keys]
    known = {k for run in jobs for k in run.data.params} | set(TAG_FILTERS)
    for key, _ in [*filters, (by, "")]:
        if jobs and key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=3) or sorted(known)[:4]
            option = "--by" if (key, "") == (by, "") and key not in dict(filters) else "--where"
            raise StoreUnavailable(f"{option} {key}: no job has that setting (e.g. {', '.join(near)})")
    results = []
    for run in jobs:
        tags, params = run.data.tags, run.data.params
        if all(params.get(k, tags.get(TAG_FILTERS.get(k, ""))) == v for k, v in filters):
            label = f"{tags.get(schema.METHOD)} seed {tags.get(schema.SEED)}"
            result = summary.job_result(client, run, label)
            if by != "method":
                result.method = f"{by}={params.get(by, tags.get(TAG_FILTERS.get(by, '')))}"
            results.append(result)
    if not results:
        raise StoreUnavailable(f"no finished job matches: {len(jobs)} finished jobs in "
                               f"{', '.join(experiments or ['graft/*'])}" + (f", none with {' '.join(where)}" if where else ""))
    return sorted(results, key=lambda r: (r.pair, r.method, len(r.seed), r.seed))


def why_no_comparison(results: list) -> str:
    """Why the jobs ``results`` give no comparison: one method only, or methods that share no seed."""
    methods: dict[str, set[str]] = {}
    for job in results:
        if job.status == "FINISHED" and job.pair_score is not None:
            methods.setdefault(job.method, set()).add(job.seed)
    if not methods:
        return (f"none of the {len(results)} finished jobs selected has a final test score of each model "
                "(test/avg): they stopped before their final evaluation")
    if len(methods) < 2:
        name = next(iter(methods))
        return (f"the {len(results)} finished jobs selected are all {name if '=' in name else f'method={name}'}: a "
                f"comparison needs two {'values' if '=' in name else 'methods'} (add --experiment, or loosen --where)")
    listed = "; ".join(f"{m} (seeds {', '.join(comparison.seed_order(s))})" for m, s in methods.items())
    return f"the methods share no seed: {listed}; run them with the same seeds (seed=0,1,2)"


def frame(comparisons: list[comparison.Comparison]) -> pd.DataFrame:
    """Every comparison's rows, one table (scores and differences in percentage points)."""
    rows = []
    for c in comparisons:
        for row in c.rows:
            rows.append({"pair": c.pair, "reference": c.reference,
                         **{k: (100 * v if isinstance(v, float) and ("mean" in k or " sd" in k or "delta" in k)
                                else v) for k, v in row.items() if k != "pair"},
                         "differs in": "; ".join(c.differ)})
    return pd.DataFrame(rows)


def figure(comparisons: list[comparison.Comparison], out: Path) -> list[Path]:
    """``methods_figure.png``/``.pdf`` (and ``methods_figure.csv``, the points): per pair, each job's pair score by method, a point per
    seed and a line joining one seed's jobs (the pairing the differences use); beside it each method's mean paired
    difference from the reference with its 95 % Student-t interval."""
    from analysis.figures import COLORS, _save, plt

    fig, axes = plt.subplots(len(comparisons), 2, figsize=(10, 3.6 * len(comparisons)), squeeze=False)
    points = []
    for (scores_ax, delta_ax), c in zip(axes, comparisons):
        methods = [c.reference] + [row["method"] for row in c.rows if row["method"] != c.reference]
        seeds = comparison.seed_order({seed for by_seed in c.pair_scores.values() for seed in by_seed})
        for j, seed in enumerate(seeds):
            shift = 0.06 * (j - (len(seeds) - 1) / 2)   # seeds side by side: equal scores stay visible
            xs = [i for i, m in enumerate(methods) if seed in c.pair_scores[m]]
            ys = [100 * c.pair_scores[methods[i]][seed] for i in xs]
            scores_ax.plot([x + shift for x in xs], ys, color="#b0b7bf", lw=0.8, zorder=1)
            scores_ax.scatter([x + shift for x in xs], ys, color=[COLORS.get(methods[i], "#c0392b") for i in xs],
                              s=22, zorder=2)
            points += [{"pair": c.pair, "method": methods[i], "seed": seed, "pair score %": y} for i, y in zip(xs, ys)]
        scores_ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
        scores_ax.set_ylabel("pair avg test score (%)")
        scores_ax.set_title(f"{c.pair}: each seed's jobs, joined", fontsize=10)
        others = [row for row in c.rows if row["method"] != c.reference]
        for i, row in enumerate(others):
            mean, lo, hi = (100 * row[k] for k in ("delta", "delta lo", "delta hi"))
            err = [[mean - lo], [hi - mean]] if not math.isnan(lo) else None
            delta_ax.errorbar([mean], [i], xerr=err, fmt="o", color=COLORS.get(row["method"], "#c0392b"), capsize=4)
        delta_ax.axvline(0, color="#555", lw=0.8, ls="--")
        delta_ax.set_yticks(range(len(others)), [row["method"] for row in others])
        delta_ax.set_xlabel(f"paired difference vs {c.reference} (points), 95% t-interval")
        delta_ax.set_title(f"{c.pair}: against {c.reference}", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "methods_figure", pd.DataFrame(points) if points else None)


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
                   "paired seeds", "gpu_hours per job",
                   *(("budget", "budget unit", "steps min", "steps max") if c.equal_compute else ())]
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
