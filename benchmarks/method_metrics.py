"""Per-step metrics of every method on the local backend, and the verl config each method generates, dumped to
JSON: the behaviour baseline a refactor of the method plumbing is checked against (the same file before and after
must match).

    OMP_NUM_THREADS=1 python benchmarks/method_metrics.py OUT.json [--steps 3] [--methods graft hacpo]

Each method trains the tiny pair for ``--steps`` steps (seed 0) through ``python -m graft_exp`` into a
private SQLite store, and each method that serves a group of three trains ``group=tiny3`` too; every metric of
the job run and its model runs is written out except the wall-clock cost (``cost/gpu_hours``). ``graft_stored``
runs after ``grpo_n8``, whose log it replays. Beside them, each method's verl config for every model of pair1
(and of ``group=trio`` where the method serves three), as verl would receive it: what the method's settings
reach in the verl backend (clip ranges, minibatches, the reference model's KL term, scheduler steps).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from graft_exp import methods as registry
from graft_exp import schema
from graft_exp.config import register_schemas
from graft_exp.config import roles as members

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SMALL = ["seed=0", "train.batch_prompts=8", "train.minibatch_prompts=4", "eval.max_problems=2",
         "eval.runs=2", "eval.samples=1", "eval.val_every=1", "backend.progress=false", "backend.threads=1"]


def histories(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in sorted(run.data.metrics) if key not in schema.WALL_CLOCK}


def composed(*overrides: str):
    """The job's config as ``python -m graft_exp`` composes it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def serves_three(method: str) -> bool:
    cfg = composed(f"method={method}")
    resolved = registry.resolve(cfg.method)
    return resolved.co_train and not resolved.two_models_only


def verl_configs(method: str, group: str | None) -> dict:
    """Each model's verl config for ``method`` on pair1 (or ``group``), resolved; the paths of this machine
    left out."""
    from graft_exp.backends.verl.config import verl_config
    cfg = composed(f"method={method}", "backend=verl", "pair=pair1", "backend.model_dir=/models", "backend.data_dir=/data",
                   *([f"group={group}"] if group else []))
    configs = {role: OmegaConf.to_container(verl_config(cfg, role, "CKPT", training_steps=10), resolve=True)
               for role in members(cfg.pair)}
    # the checkout's own path (the agent loop's config file) is not behaviour: two checkouts compare equal
    return json.loads(json.dumps(configs).replace(str(ROOT), "<repo>"))


def run_job(method: str, steps: int, tmp: str, group: str | None, also: tuple[str, ...] = ()) -> dict:
    uri = f"sqlite:///{tmp}/mlflow.db"
    study = f"baseline_{group}" if group else "baseline"
    cmd = [sys.executable, "-m", "graft_exp", f"method={method}", f"train.max_steps={steps}",
           f"tracking.uri={uri}", f"checkpoint_root={tmp}/ckpt", f"study={study}", *SMALL,
           *([f"group={group}"] if group else []), *also]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{method} {group or ''} failed")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(schema.experiment_name(study))
    job = [r for r in client.search_runs([exp.experiment_id], f"tags.`graft.method` = '{method}'")
           if "mlflow.parentRunId" not in r.data.tags]
    assert len(job) == 1, (method, len(job))
    job_id = job[0].info.run_id
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{job_id}'")
    return {"job": histories(client, job_id),
            **{r.data.tags["graft.role"]: histories(client, r.info.run_id) for r in children}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", nargs="*", default=None)
    parser.add_argument("--also", nargs="*", default=[], help="overrides for every job (e.g. a setting that must "
                                                             "change no metric)")
    args = parser.parse_args()
    register_schemas()
    methods = args.methods or sorted(p.stem for p in (CONF / "method").glob("*.yaml") if p.stem != "graft_stored")
    if args.methods is None or "graft_stored" in args.methods:
        methods = [m for m in methods if m != "graft_stored"]
        if "grpo_n8" not in methods:
            methods.append("grpo_n8")
        methods.append("graft_stored")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            three = serves_three(method)
            results[method] = {"pair": run_job(method, args.steps, tmp, None, tuple(args.also)),
                               "verl_pair1": verl_configs(method, None)}
            if three:
                results[method]["tiny3"] = run_job(method, args.steps, tmp, "tiny3", tuple(args.also))
                results[method]["verl_trio"] = verl_configs(method, "trio")
            print(method, "done", "(and tiny3)" if three else "", flush=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
