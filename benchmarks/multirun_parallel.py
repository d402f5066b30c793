"""README's 6-job sweep on the default cluster (timed in docs/tiny.md): its wall time over the sum of its jobs' times.

    python benchmarks/multirun_parallel.py [--steps 3] [overrides ...]

Runs ``python -m graft_exp -m method=graft,sgt seed=0,1,2`` (``cluster=local``: Hydra's joblib
launcher, one job per core) with ``train.max_steps=--steps`` and a small evaluation into a fresh
SQLite store, then reads each job run's start and end time from MLflow. The ratio wall time / sum of
the job times is 1 when the jobs run one after another and 1/cores at best (target <= 0.6 on 2 cores);
the wall time includes the launching process's start-up and pre-launch checks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import joblib

from graft_exp.launching import status

SWEEP = ["method=graft,sgt", "seed=0,1,2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="train.max_steps of every job")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        command = [sys.executable, "-m", "graft_exp", "-m", *SWEEP, f"train.max_steps={args.steps}",
                   "train.save_every=100", "eval.val_every=100", "eval.max_problems=8", "eval.runs=1",
                   "eval.samples=1", "backend.progress=false", f"tracking.uri={uri}",
                   f"checkpoint_root={Path(tmp) / 'ckpt'}", f"hydra.sweep.dir={Path(tmp) / 'multirun'}",
                   *args.overrides]
        print(" ".join(command[1:]), flush=True)
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        subprocess.run(command, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
        wall = time.monotonic() - started
        load_after = os.getloadavg()[0]
        runs = status.fetch_runs(uri)
        jobs = runs[runs["parent"].isna()]
    if len(jobs) != 6 or set(jobs["status"]) != {"FINISHED"}:
        raise SystemExit(f"expected 6 FINISHED job runs, got {list(jobs['status'])}")
    seconds = (jobs["end_time"] - jobs["start_time"]) / 1000
    print(f"cores (joblib.cpu_count): {joblib.cpu_count()}; load average before/after: "
          f"{load_before:.1f}/{load_after:.1f}")
    print(f"job times (s): {', '.join(f'{s:.0f}' for s in sorted(seconds))}")
    print(f"wall time {wall:.0f} s / sum of job times {seconds.sum():.0f} s = {wall / seconds.sum():.2f} "
          f"(target <= 0.6 on 2 cores)")


if __name__ == "__main__":
    main()
