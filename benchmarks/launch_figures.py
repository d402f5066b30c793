"""Launching figures: time of ``--dry-run`` on the main-table sweep, wall time of a 2-job tiny sweep
through ``cluster=slurm``.

    python benchmarks/launch_figures.py [--repeat 3] [--no-slurm]

The dry-run is timed cold (empty composition cache: every config is composed by Hydra) and warm
(the cache a previous listing left), against an existing, empty SQLite store. The Slurm sweep needs a running
cluster (a private one: ``python tests/support/private_slurm.py start DIR``, then the ``export SLURM_CONF=...`` it
prints) and runs ``graft`` and ``grpo_n8`` on the tiny pair for 4 short steps into a fresh SQLite store. The other two launching figures are printed by the service tests:
metrics lost under 8 concurrent writers (``tests/test_mlflow_server.py``) and duplicated or lost steps
after a preemption and a requeue (``tests/test_slurm.py``):

    python -m pytest -s -m service tests/test_slurm.py tests/test_mlflow_server.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_SHORT = ["train.max_steps=4", "train.batch_prompts=4", "train.minibatch_prompts=2", "eval.val_every=4",
              "eval.runs=1", "eval.samples=1", "eval.max_problems=4", "backend.progress=false",
              "train.save_every=1"]


def timed(command: list[str], cwd: Path, env: dict | None = None) -> float:
    started = time.monotonic()
    subprocess.run(command, cwd=cwd, env={**os.environ, **(env or {})}, check=True, capture_output=True)
    return time.monotonic() - started


def dry_run_times(work: Path, repeat: int) -> tuple[float, list[float]]:
    from graft_exp.tracking import ensure_store

    uri = f"sqlite:///{work / 'mlflow.db'}"
    ensure_store(uri, "graft/main")   # an existing store: the dry-run opens it as it would a real one
    command = [sys.executable, "-m", "graft_exp.sweep", str(ROOT / "sweeps" / "main.yaml"), "--dry-run",
               f"tracking.uri={uri}"]
    cache = {"XDG_CACHE_HOME": str(work / "cache")}
    cold = timed(command, work, cache)
    return cold, [timed(command, work, cache) for _ in range(repeat)]


def slurm_sweep_time(work: Path) -> float:
    sweep = work / "slurm2.yaml"
    sweep.write_text("study: slurm2\nruns:\n  - {pair: tiny, method: [graft, grpo_n8], seed: 0}\n")
    return timed([sys.executable, "-m", "graft_exp.sweep", str(sweep), "--out", str(work / "multirun"),
                  "--poll", "2", "cluster=slurm", "cluster.poll_s=2",
                  f"tracking.uri=sqlite:///{work / 'slurm.db'}", f"checkpoint_root={work / 'checkpoints'}",
                  *TINY_SHORT], work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="warm dry-runs to time")
    parser.add_argument("--no-slurm", action="store_true", help="skip the Slurm sweep")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cold, warm = dry_run_times(work, args.repeat)
        print(f"dry-run sweeps/main.yaml: cold {cold:.2f} s, warm {min(warm):.2f}-{max(warm):.2f} s "
              f"(load average {load:.1f} on {os.cpu_count()} CPUs)")
        if not args.no_slurm and shutil.which("sbatch"):
            print(f"2-job tiny sweep through cluster=slurm: {slurm_sweep_time(work):.1f} s wall")


if __name__ == "__main__":
    main()
