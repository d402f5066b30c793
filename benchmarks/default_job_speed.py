"""The default job (README's first command) against an earlier commit, side by side, and where its seconds go.

    python benchmarks/default_job_speed.py [--against 0947777] [--repeats 2]

Each repeat runs ``python -m graft_exp`` (pair=tiny, method=graft, 30 steps, validation, the final evaluation) once
from this checkout and once from a worktree of ``--against`` (made for the run, removed after), alternating which
goes first, each in a fresh process with a private MLflow store, one OpenMP thread per model. Prints each run's wall
time, the mean ratio, and the timeline of this checkout's last run read back from its store: start-up (the process
to the first step), the training steps (``time/step_s``; per model its phases and wait), validation
(``time/validate_s``), checkpoints (``time/checkpoint_s``), the final evaluation (``time/test_s``) and the end (the
record's artifacts, the runs closed, the process's exit).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_job(checkout: Path, store: Path) -> tuple[float, float]:
    """One default job from ``checkout`` into ``store``: (wall seconds, the wall-clock start as epoch seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(checkout)}
    command = [sys.executable, "-m", "graft_exp", "backend.progress=false", f"tracking.uri=sqlite:///{store}/mlflow.db",
               f"checkpoint_root={store}/ckpt", f"hydra.run.dir={store}/hydra"]
    began, start = time.time(), time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, check=False, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the default job of {checkout} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start, began


def timeline(store: Path, began: float, wall: float) -> None:
    """Where the job's seconds went, from its own record."""
    from mlflow import MlflowClient

    from graft_exp import schema

    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    job = next(r for r in runs if schema.ROLE not in r.data.tags)
    models = {r.data.tags[schema.ROLE]: r for r in runs if schema.ROLE in r.data.tags}

    def history(run, key):
        return client.get_metric_history(run.info.run_id, key)

    steps = history(job, schema.STEP_SECONDS)
    first_step_started = min(m.timestamp for m in steps) / 1000 - steps[0].value
    summed = {key: sum(m.value for m in history(job, key)) for key in (schema.STEP_SECONDS, schema.CHECKPOINT_SECONDS)}
    # the models validate and evaluate at the same time (each on a core): the longer of the two is the job's
    validation = max(sum(m.value for m in history(r, schema.VALIDATE_SECONDS)) for r in models.values())
    test = max(sum(m.value for m in history(r, schema.TEST_SECONDS)) for r in models.values())
    start_up = first_step_started - began
    end = wall - start_up - summed[schema.STEP_SECONDS] - validation - summed[schema.CHECKPOINT_SECONDS] - test
    print(f"\nwhere this checkout's default job spent its {wall:.1f} s:")
    for label, seconds in (("start-up (imports, checks, store, models, validation at step 0)", start_up),
                           ("training steps (30)", summed[schema.STEP_SECONDS]),
                           ("validation after steps", validation), ("checkpoints", summed[schema.CHECKPOINT_SECONDS]),
                           ("final evaluation", test), ("the end (artifacts, runs closed, exit)", end)):
        print(f"  {label:62} {seconds:6.1f} s  {seconds / wall:5.1%}")
    print("  per model, over the training steps (seconds; wait = the pool idle while the other worked):")
    for role, run in sorted(models.items()):
        parts = {p: sum(m.value for m in history(run, schema.phase_metric(p))) for p in schema.PHASES}
        parts["wait"] = sum(m.value for m in history(run, schema.WAIT_SECONDS))
        print(f"    {role} {run.data.tags[schema.MODEL]:16} " + ", ".join(f"{p} {v:.1f}" for p, v in parts.items()))
    validated = [m for m in history(models["A"], schema.VALIDATE_SECONDS) if m.step == 0]
    if validated:
        print(f"  (of the start-up, validation at step 0: {validated[0].value:.1f} s for model A)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="0947777", help="the commit to run side by side (default: 0947777)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each checkout")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch) / "against"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), args.against], cwd=ROOT, check=True)
        try:
            walls: dict[str, list[float]] = {"this checkout": [], args.against: []}
            for r in range(args.repeats):
                order = [("this checkout", ROOT), (args.against, other)]
                for name, checkout in order if r % 2 == 0 else order[::-1]:
                    store = Path(scratch) / f"{name.replace(' ', '_')}-{r}"
                    store.mkdir()
                    seconds, began = run_job(checkout, store)
                    walls[name].append(seconds)
                    print(f"default job, {name:14} wall {seconds:6.1f} s (load average {os.getloadavg()[0]:.2f})",
                          flush=True)
                    if name == "this checkout":
                        last = (store, began, seconds)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False)
        mean = {name: sum(v) / len(v) for name, v in walls.items()}
        print(f"mean of {args.repeats}: this checkout {mean['this checkout']:.1f} s, {args.against} "
              f"{mean[args.against]:.1f} s: this checkout is {mean[args.against] / mean['this checkout']:.2f}x faster")
        timeline(*last)


if __name__ == "__main__":
    main()
