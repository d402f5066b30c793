"""Time every table and figure on a paper-scale MLflow store, against per-call history fetching.

    python benchmarks/analysis_scale.py --store /tmp/graft-scale   # builds the store once, then reuses it

The store holds every study of the paper (3 pairs, all methods, ``--seeds`` seeds, 174 steps, ~20 metrics per
model run). Printed: the time of ``tables`` + ``figures`` end to end (load, build, render); the time of the
analysis' own history loading; and the time of fetching histories with one ``MlflowClient.get_metric_history``
call per run and metric (every metric of every run, and only the ones the analysis reads), with the ratios.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from analysis import figures, render, synthetic, tables
from analysis.results import Analysis
from analysis.store import _history_plan, _tidy_runs, graft_experiments, load_histories, load_store


def build_store(root: Path, seeds: int) -> str:
    uri = f"sqlite:///{root / 'mlflow.db'}"
    if (root / "mlflow.db").exists():
        return uri
    root.mkdir(parents=True, exist_ok=True)
    jobs = synthetic.paper_like_jobs(steps=174, seeds=seeds)
    start = time.perf_counter()
    synthetic.write_jobs(uri, jobs, root / "artifacts")
    print(f"built store: {len(jobs)} job runs, {sum(len(j.models) for j in jobs)} model runs "
          f"in {time.perf_counter() - start:.0f} s")
    return uri


def tables_and_figures(uri: str, out: Path) -> float:
    start = time.perf_counter()
    analysis = Analysis(load_store(uri))
    for table in tables.build_all(analysis).values():
        render.write_table(table, out)
    figures.build_all(analysis, out)
    return time.perf_counter() - start


def history_plans(uri: str) -> tuple[dict, dict]:
    """(the histories the analysis reads, every metric history of every run): key -> run ids."""
    client = MlflowClient(uri)
    experiments = graft_experiments(client, None)
    mlflow.set_tracking_uri(uri)
    runs = _tidy_runs(mlflow.search_runs(experiment_ids=list(experiments), max_results=100000), experiments)
    everything = {c[len("metric:"):]: runs.index[runs[c].notna()].tolist() for c in runs if c.startswith("metric:")}
    return _history_plan(runs), everything


def bulk_histories(uri: str, plan: dict) -> float:
    start = time.perf_counter()
    load_histories(MlflowClient(uri), plan)
    return time.perf_counter() - start


def per_call_histories(uri: str, plan: dict) -> tuple[float, int]:
    """Fetch histories one ``MlflowClient.get_metric_history`` call per (run, metric)."""
    client = MlflowClient(uri)
    start = time.perf_counter()
    calls = 0
    for key, run_ids in plan.items():
        for run_id in run_ids:
            client.get_metric_history(run_id, key)
            calls += 1
    return time.perf_counter() - start, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, required=True, help="directory of the benchmark store (reused)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per study (3 gives > 200 model runs)")
    args = parser.parse_args()
    uri = build_store(args.store, args.seeds)
    model_runs = load_store(uri).model_runs
    print(f"store: {len(model_runs)} model runs")
    with tempfile.TemporaryDirectory() as out:
        ours = tables_and_figures(uri, Path(out))
    needed_plan, every_plan = history_plans(uri)
    bulk = bulk_histories(uri, needed_plan)
    needed, needed_calls = per_call_histories(uri, needed_plan)
    everything, all_calls = per_call_histories(uri, every_plan)
    print(f"all tables + figures (load, build, render): {ours:.1f} s")
    print(f"history loading as the analysis does it (bulk, only what it reads): {bulk:.2f} s")
    print(f"  one get_metric_history call per run and metric, every metric ({all_calls} calls): {everything:.1f} s"
          f" -> {everything / bulk:.0f}x the bulk load, {everything / ours:.1f}x all tables + figures")
    print(f"  one call per run and metric, only what the analysis reads ({needed_calls} calls): {needed:.1f} s"
          f" -> {needed / bulk:.1f}x the bulk load")


if __name__ == "__main__":
    main()
