"""The same budgeted job run twice, once on its own and once beside a CPU hog: where each charge stops it.

    python benchmarks/budget_under_load.py [--reference-steps 6] [--hogs N] [overrides ...]

A reference GRAFT job of the tiny pair trains ``--reference-steps`` steps; its final ``cost/flops`` and
``cost/gpu_hours`` are the budgets (``train.flops_of`` / ``train.gpu_hours_of`` name it). Then the same job
with ``train.max_steps`` twice as long runs under each budget (``rerun=true``: the same run key, a fresh run),
once as it is and once beside ``--hogs`` busy processes (default: one per core). Prints, per charge and load, the step each job stopped at and the cost it
had then. The counted charge stops both at the reference's step; the measured one stops the loaded job
earlier, since every step takes longer.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.table import Table

from graft_exp import schema

SMALL = ["eval.max_problems=2", "eval.runs=1", "eval.samples=1", "eval.val_every=100", "backend.progress=false"]


def spin() -> None:
    while True:
        pass


def train(store: Path, *overrides: str) -> None:
    done = subprocess.run([sys.executable, "-m", "graft_exp", f"tracking.uri=sqlite:///{store}/mlflow.db",
                           f"checkpoint_root={store}/ckpt", *SMALL, *overrides], check=False, cwd=store,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(overrides)} failed:\n{done.stderr[-3000:]}")


def job_run(client: MlflowClient, study: str):
    runs = client.search_runs([client.get_experiment_by_name(schema.experiment_name(study)).experiment_id],
                              f"tags.`{schema.STUDY}` = '{study}'")
    return next(r for r in runs if schema.MODEL not in r.data.tags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-steps", type=int, default=6)
    parser.add_argument("--hogs", type=int, default=os.cpu_count())
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every job (default: GRAFT, tiny pair)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        client = MlflowClient(f"sqlite:///{store}/mlflow.db")
        print(f"reference: {args.reference_steps} steps", flush=True)
        train(store, "study=reference", f"train.max_steps={args.reference_steps}", *args.overrides)
        reference = job_run(client, "reference")
        key = reference.data.tags[schema.RUN_KEY]
        rows = []
        for unit in ("flops", "gpu_hours"):
            for load in ("on its own", f"beside {args.hogs} busy processes"):
                study = f"{unit}_{'hog' if 'busy' in load else 'quiet'}"
                print(f"{unit} budget, {load}", flush=True)
                hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.hogs if "busy" in load else 0)]
                for hog in hogs:
                    hog.start()
                try:
                    train(store, f"study={study}", f"train.max_steps={2 * args.reference_steps}",
                          f"train.{unit}_of={key}", "rerun=true", *args.overrides)
                finally:
                    for hog in hogs:
                        hog.kill()
                run = job_run(client, study)
                rows.append((unit, load, run.data.tags[schema.LAST_STEP], run.data.metrics[schema.CHARGES[unit]],
                             run.data.metrics[schema.GPU_HOURS] * 3600))
    table = Table(title=f"budget = the reference job's cost after {args.reference_steps} steps "
                        f"(cost/flops {reference.data.metrics[schema.FLOPS]:.4g}, cost/gpu_hours "
                        f"{reference.data.metrics[schema.GPU_HOURS]:.4g})", title_justify="left")
    for column in ("budget in", "load", "stopped at step", "its cost then", "charged seconds"):
        table.add_column(column)
    for unit, load, step, cost, seconds in rows:
        table.add_row(unit, load, step, f"{cost:.4g}", f"{seconds:.1f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
