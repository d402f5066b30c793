"""Time every table and figure on a paper-scale MLflow store, against per-call history fetching.

    python benchmarks/analysis_scale.py --store /tmp/graft-scale   # builds the store once, then reuses it

The store holds every study of the paper (3 pairs, all methods, ``--seeds`` seeds, 174 steps, ~20 metrics per
model run). Printed: the time of ``tables`` + ``figures`` end to end (load, build, render), the time of fetching
the same runs' histories one ``MlflowClient.get_metric_history`` call per run and metric, and their ratio.
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
from analysis.store import _history_plan, _tidy_runs, graft_experiments, load_store


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


def per_call_histories(uri: str, only_needed: bool) -> tuple[float, int]:
    """Fetch histories one call per (run, metric): every metric, or only the ones the analysis reads."""
    client = MlflowClient(uri)
    start = time.perf_counter()
    experiments = graft_experiments(client, None)
    mlflow.set_tracking_uri(uri)
    raw = mlflow.search_runs(experiment_ids=list(experiments), max_results=100000)
    runs = _tidy_runs(raw, experiments)
    if only_needed:
        plan = _history_plan(runs)
    else:
        plan = {c[len("metric:"):]: runs.index[runs[c].notna()].tolist() for c in runs if c.startswith("metric:")}
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
    needed, needed_calls = per_call_histories(uri, only_needed=True)
    everything, all_calls = per_call_histories(uri, only_needed=False)
    print(f"all tables + figures (load, build, render): {ours:.1f} s")
    print(f"per-call get_metric_history, the metrics the analysis reads ({needed_calls} calls): {needed:.1f} s "
          f"-> ratio {needed / ours:.1f}x")
    print(f"per-call get_metric_history, every metric of every run ({all_calls} calls): {everything:.1f} s "
          f"-> ratio {everything / ours:.1f}x")


if __name__ == "__main__":
    main()
