"""Per-step metrics of every method on the local backend, dumped to JSON: the behaviour baseline a
refactor of the method plumbing is checked against (the same file before and after must match).

    OMP_NUM_THREADS=1 python benchmarks/method_metrics.py OUT.json [--steps 3] [--methods graft hacpo]

Each method trains the tiny pair for ``--steps`` steps (seed 0) through ``python -m graft_exp`` into a
private SQLite store; every metric of the job run and its model runs is written out except the wall-clock
cost (``cost/gpu_hours``). ``graft_stored`` runs after ``grpo_n8``, whose log it replays.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient

CONF = Path(__file__).resolve().parents[1] / "conf" / "method"
SMALL = ["pair=tiny", "seed=0", "train.batch_prompts=8", "train.minibatch_prompts=4", "eval.max_problems=2",
         "eval.runs=2", "eval.samples=1", "eval.val_every=1", "backend.progress=false", "backend.threads=1"]
WALL_CLOCK = {"cost/gpu_hours"}


def histories(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in sorted(run.data.metrics) if key not in WALL_CLOCK}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", nargs="*", default=None)
    args = parser.parse_args()
    methods = args.methods or sorted(p.stem for p in CONF.glob("*.yaml") if p.stem != "graft_stored")
    if args.methods is None or "graft_stored" in args.methods:
        methods = [m for m in methods if m != "graft_stored"]
        if "grpo_n8" not in methods:
            methods.append("grpo_n8")
        methods.append("graft_stored")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        for method in methods:
            cmd = [sys.executable, "-m", "graft_exp", f"method={method}", f"train.max_steps={args.steps}",
                   f"tracking.uri={uri}", f"checkpoint_root={tmp}/ckpt", "study=baseline", *SMALL]
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{method} failed")
            client = MlflowClient(uri)
            exp = client.get_experiment_by_name("graft/baseline")
            job = [r for r in client.search_runs([exp.experiment_id], f"tags.`graft.method` = '{method}'")
                   if "mlflow.parentRunId" not in r.data.tags]
            assert len(job) == 1, (method, len(job))
            job_id = job[0].info.run_id
            children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{job_id}'")
            results[method] = {"job": histories(client, job_id),
                               **{r.data.tags["graft.role"]: histories(client, r.info.run_id) for r in children}}
            print(method, "done", flush=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
