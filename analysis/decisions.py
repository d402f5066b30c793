"""``python -m analysis decisions``: each comparison's verdict from a seeds-until-decided sweep, and the
score at equal compute beside the score at equal steps.

Verdicts come from the sweep's own MLflow run (``graft.analysis=until-decided``, written by
``graft_exp.sweep.until``): its last round's decision, adjusted interval and the seeds (and scores) it
used, so the table is rebuilt from what the rule saw. Beside them, the measures RL papers now report,
from ``rliable`` (Agarwal et al., "Deep RL at the edge of the statistical precipice", 2021): the
probability that the method beats the reference on a seed, and each method's interquartile mean, with
95% stratified-bootstrap intervals (not adjusted for the family: descriptive).

Equal compute: job runs with a budget (``graft.budget_gpu_hours``: ``train.max_gpu_hours`` or ``gpu_hours_of``,
App. D's measured charge; ``graft.budget_flops``: ``train.max_flops`` or ``flops_of``, the counted one) against
runs of the same method, pair and seed with every other setting equal but no budget (the same number of steps
as the reference job); scores are the job's models' mean ``test/avg`` in points. A budgeted job's reference is
the run its ``train.gpu_hours_of`` / ``flops_of`` names; jobs are shared between studies by
run key, so the reference and the equal-steps twins are looked up in every ``graft/*`` experiment (a
sweep that reuses another study's GRPO n=8 jobs finds them there).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from graft_exp import schema
from graft_exp.config import BUDGET_KEYS, BUDGET_SETTINGS
from graft_exp.intervals import mean_sd, paired_interval, rliable_measures
from graft_exp.scores import checkpoint_score, job_score

UNTIL_DECIDED = "until-decided"
#: Params that set the budget (or only the study's name): equal-steps twins differ from a budgeted job only there.
BUDGET_PARAMS = (*BUDGET_KEYS, "study")


def _experiments(client: MlflowClient, names: list[str] | None) -> list[str]:
    exps = client.search_experiments(filter_string=schema.GRAFT_EXPERIMENTS)
    return [e.experiment_id for e in exps if names is None or e.name in names]


def decision_records(client: MlflowClient, experiment_ids: list[str]) -> list:
    """The newest until-decided run of each sweep file (a rerun of the same sweep replaces the older)."""
    runs = client.search_runs(experiment_ids, f"tags.`{schema.ANALYSIS}` = '{UNTIL_DECIDED}'",
                              order_by=["attributes.start_time DESC"])
    newest = {}
    for run in runs:
        newest.setdefault(run.data.tags.get(schema.SWEEP), run)
    return list(newest.values())


def rounds(client: MlflowClient, run_id: str, folder: Path) -> list[dict]:
    """Every round record of an until-decided run, in order."""
    local = Path(client.download_artifacts(run_id, "rounds", str(folder)))
    files = sorted(local.glob("round_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(p.read_text()) for p in files]


def verdicts(client: MlflowClient, run, folder: Path) -> pd.DataFrame:
    """One row per comparison of one until-decided run: its verdict after the last round."""
    records = rounds(client, run.info.run_id, folder / run.info.run_id)
    if not records:
        return pd.DataFrame()
    params = run.data.params
    last = records[-1]
    rows = []
    for label, verdict in last["decisions"].items():
        method, reference = label.split(" vs ")
        # A comparison's numbers are those of the round that decided it (later rounds copy them).
        decided = next((r for r in records if r["decisions"][label] == verdict), last)
        seeds = [x for x in decided["seeds"][method] if x in decided["seeds"][reference]]
        by_seed = {m: dict(zip(decided["seeds"][m], decided["scores"][m])) for m in (method, reference)}
        x = np.array([by_seed[method][s] for s in seeds])
        y = np.array([by_seed[reference][s] for s in seeds])
        lo, hi = decided["intervals"][label]
        rows.append({"sweep": run.data.tags.get(schema.SWEEP), "rule": params.get("decide_rule", "adastop"),
                     "comparison": label,
                     "verdict": verdict if verdict != "continue" else "undecided (stopped before the cap)",
                     "seeds": len(seeds), "seed list": " ".join(map(str, seeds)),
                     "round": decided["index"], "mean diff": float(np.mean(x - y)),
                     "adjusted lo": lo, "adjusted hi": hi, "alpha": float(params["alpha"]),
                     "margin": float(params["margin_points"]), **rliable_measures(x, y)})
    return pd.DataFrame(rows)


def job_scores(client: MlflowClient, experiment_ids: list[str]) -> pd.DataFrame:
    """One row per FINISHED job run: method, pair, seed, budget, last step, cost, score (points), params."""
    runs = client.search_runs(experiment_ids, "attributes.status = 'FINISHED'", max_results=50_000)
    models: dict[str, list[float]] = {}
    for run in runs:
        if schema.MODEL in run.data.tags:
            history = client.get_metric_history(run.info.run_id, schema.TEST + "avg")
            if history:
                parent = run.data.tags.get("mlflow.parentRunId")
                models.setdefault(parent, []).append(100 * checkpoint_score([m.value for m in history]))
    rows = []
    for run in runs:
        tags = run.data.tags
        if schema.MODEL in tags or schema.RUN_KEY not in tags or run.info.run_id not in models:
            continue
        unit = schema.budget_unit(tags)
        reference = next((run.data.params[f"train.{name}"] for _, name in BUDGET_SETTINGS.values()
                          if run.data.params.get(f"train.{name}", "None") != "None"), "None")
        rows.append({"run_id": run.info.run_id, "run_key": tags[schema.RUN_KEY], "reference_key": reference,
                     "experiment_id": run.info.experiment_id,
                     "method": tags.get(schema.METHOD), "pair": tags.get(schema.PAIR),
                     "seed": int(tags.get(schema.SEED)),
                     "budget": float(tags[schema.budget_tag(unit)]) if unit else math.nan, "budget unit": unit,
                     "steps": int(tags[schema.LAST_STEP]) if schema.LAST_STEP in tags else math.nan,
                     "gpu_hours": run.data.metrics.get(schema.GPU_HOURS, math.nan),
                     "flops": run.data.metrics.get(schema.FLOPS, math.nan),
                     "score": job_score(models[run.info.run_id]),
                     "setting": json.dumps({k: v for k, v in sorted(run.data.params.items())
                                            if k not in BUDGET_PARAMS}, sort_keys=True)})
    return pd.DataFrame(rows)


def _paired(diffs: np.ndarray) -> str:
    if len(diffs) < 2:
        return "—"
    mean, lo, hi = paired_interval(diffs)
    return f"{mean:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def equal_compute(jobs: pd.DataFrame, reference: str, study: list[str] | None = None) -> pd.DataFrame:
    """Per budgeted method of the ``study`` experiments (all when None): the score at equal compute and at
    equal steps, each with its paired (same seed) difference to its reference job: the run its
    ``train.gpu_hours_of`` names, else the ``reference`` method's unbudgeted run of the same pair, seed and
    settings. The reference's own row is both: the budget is its cost."""
    if jobs.empty:
        return pd.DataFrame()
    in_study = jobs["experiment_id"].isin(study) if study is not None else pd.Series(True, index=jobs.index)
    budgeted = jobs[in_study & jobs["budget"].notna()]
    plain = jobs[jobs["budget"].isna()]
    if budgeted.empty:
        return pd.DataFrame()
    by_key = plain.drop_duplicates("run_key").set_index("run_key")
    fallback = plain[plain["method"] == reference].drop_duplicates(["pair", "seed", "setting"])

    def reference_of(job) -> pd.Series | None:
        if job["reference_key"] in by_key.index:
            return by_key.loc[job["reference_key"]]
        same = fallback[(fallback["pair"] == job["pair"]) & (fallback["seed"] == job["seed"])
                        & (fallback["setting"] == job["setting"])]
        return None if same.empty else same.iloc[0]

    refs = {i: reference_of(job) for i, job in budgeted.iterrows()}
    ref_rows = pd.DataFrame([r for r in refs.values() if r is not None]).drop_duplicates(["pair", "seed", "setting"])
    rows = []
    if not ref_rows.empty:
        scores = ref_rows["score"].to_numpy()
        rows.append(_equal_compute_row(reference, ref_rows, scores, None, scores, None, reference))
    for method, group in budgeted.groupby("method"):
        base = np.array([refs[i]["score"] if refs[i] is not None else math.nan for i in group.index])
        twins = group.assign(base=base).merge(plain, on=["method", "pair", "seed", "setting"], suffixes=("", "_steps"))
        rows.append(_equal_compute_row(method, group, group["score"].to_numpy(), base,
                                       twins["score_steps"].to_numpy(), twins["base"].to_numpy(), reference))
    return pd.DataFrame(rows)


def _mean_sd(scores: np.ndarray) -> str:
    """``mean ± s.d.`` over seeds (``intervals.mean_sd``); the mean alone for one seed, as the tables show it."""
    mean, sd = mean_sd(scores)
    return f"{mean:.2f}" + ("" if math.isnan(sd) else f" ± {sd:.2f}")


def _equal_compute_row(method: str, group: pd.DataFrame, at_compute: np.ndarray, base: np.ndarray | None,
                       at_steps: np.ndarray, steps_base: np.ndarray | None, reference: str) -> dict:
    """One method's row: ``base``/``steps_base`` are its jobs' reference scores (None: the reference itself)."""
    def delta(scores, bases):
        if bases is None or not len(scores):
            return "—"
        ok = ~np.isnan(bases)
        return _paired(scores[ok] - bases[ok])

    return {
        "method": method, "seeds": len(group),
        "steps (min-max)": f"{int(np.nanmin(group['steps']))}-{int(np.nanmax(group['steps']))}",
        "budget in": ", ".join(sorted({u for u in group.get("budget unit", ()) if isinstance(u, str)})) or "—",
        "GPU-h per job": float(group["gpu_hours"].mean()),
        "TFLOPs per job": float(group["flops"].mean()) / 1e12 if "flops" in group else math.nan,
        "score at equal compute": _mean_sd(at_compute),
        f"Δ vs {reference}, equal compute [95% CI]": delta(at_compute, base),
        "seeds at equal steps": len(at_steps),
        "score at equal steps": f"{at_steps.mean():.2f}" if len(at_steps) else "—",
        f"Δ vs {reference}, equal steps [95% CI]": delta(at_steps, steps_base),
    }


def write(client: MlflowClient, names: list[str] | None, out: Path, reference: str) -> list[Path]:
    """Write decisions.csv/.md and equal_compute.csv/.md into ``out``; the paths written."""
    ids = _experiments(client, names)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    frames = [verdicts(client, run, out / "rounds") for run in decision_records(client, ids)]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if not table.empty:
        paths += _write_frame(table, out / "decisions", _decision_markdown(table))
    ec = equal_compute(job_scores(client, _experiments(client, None)), reference, ids)
    if not ec.empty:
        paths += _write_frame(ec, out / "equal_compute", markdown(ec) + "\nScores: mean ± sample standard deviation "
                             "over seeds; Δ: mean paired difference [95% Student-t interval].\n")
    return paths


def _decision_markdown(table: pd.DataFrame) -> str:
    shown = pd.DataFrame({
        "comparison": table["comparison"], "rule": table.get("rule", "adastop"),
        "verdict": table["verdict"], "seeds": table["seeds"],
        "Δ (points) [adjusted interval]": [f"{r['mean diff']:+.2f} [{r['adjusted lo']:+.2f}, {r['adjusted hi']:+.2f}]"
                                           for _, r in table.iterrows()],
        "P(improve) [95% CI]": [f"{r['P(improve)']:.2f} [{r['P(improve) lo']:.2f}, {r['P(improve) hi']:.2f}]"
                                for _, r in table.iterrows()],
        "IQM method [95% CI]": [f"{r['IQM method']:.2f} [{r['IQM method lo']:.2f}, {r['IQM method hi']:.2f}]"
                                for _, r in table.iterrows()],
        "IQM reference [95% CI]": [f"{r['IQM ref']:.2f} [{r['IQM ref lo']:.2f}, {r['IQM ref hi']:.2f}]"
                                   for _, r in table.iterrows()],
    })
    alpha, margin = table["alpha"].iloc[0], table["margin"].iloc[0]
    rule = ", ".join(sorted(set(table["rule"]))) if "rule" in table else "adastop"
    note = (f"Family-wise alpha {alpha} over the comparisons and rounds (rule: {rule}); the adjusted interval is the "
            f"paired t interval at 1 - alpha/(comparisons x rounds); equivalent: no difference found at the cap "
            f"and the adjusted interval within ±{margin} points. P(improve) and IQM: rliable, 95% stratified "
            "bootstrap, not adjusted.")
    return markdown(shown) + "\n" + note + "\n"


def markdown(frame: pd.DataFrame) -> str:
    """A GitHub table of ``frame`` (floats to 4 decimals)."""
    cells = [[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row] for row in frame.itertuples(index=False)]
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells]) + "\n"


def _write_frame(frame: pd.DataFrame, stem: Path, markdown: str) -> list[Path]:
    csv, md = stem.with_suffix(".csv"), stem.with_suffix(".md")
    frame.to_csv(csv, index=False)
    md.write_text(markdown)
    return [csv, md]
