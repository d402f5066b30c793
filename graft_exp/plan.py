"""``python -m graft_exp.plan <overrides> [--json]``: a job's resource plan before anything is submitted.

The overrides are those of ``python -m graft_exp`` (one job, no ``-m`` lists). The plan is
``graft_exp.resources.job_plan`` of the composed config, for the members the job would train now: a
single-model job whose shared GRPO baseline of one member is FINISHED in the tracking store trains (and asks
Slurm for) the other only. A plan that cannot fit is printed, then refused in one line (exit 2), as launching
refuses it. Nothing is created: the store is read only if it exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig

from graft_exp import resources
from graft_exp.config import ConfigError, register_schemas, validate
from graft_exp.launching.jobs import CONF_DIR, PAPER_STEPS, Projection, TimeLimit, estimate_cost, time_limit
from graft_exp.preflight import measured_cost


def compose_job(overrides: list[str]) -> DictConfig:
    """The job config ``python -m graft_exp <overrides>`` composes."""
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def format_plan(plan: resources.Plan, cfg: DictConfig, cost: Projection) -> str:
    """The plan as a few aligned lines (sizes in GB)."""
    job = f"pair={cfg.pair.name} method={cfg.method.name} seed={cfg.seed} backend={plan.backend}"
    lines = [f"job: {job}; trains {', '.join(f'{r} {cfg.pair[r]}' for r in plan.trained)}"]
    if plan.backend == "verl":
        lines.append(f"pools ({plan.nnodes} node{'s' * (plan.nnodes > 1)}):")
        for p in plan.pools:
            lines.append(f"  {p.role} {p.model:<28} {p.gpus_per_node} GPUs/node x {p.nnodes}, rollout_tp {p.rollout_tp}, "
                         f"{p.replicas} vLLM replica{'s' * (p.replicas > 1)}")
        lines.append("GPU memory per GPU (GB): params + grads + AdamW (fp32, FSDP-sharded), activations, vLLM's share; "
                     "rollout = FSDP + vLLM + reserve, train = FSDP + activations + allocator headroom + reserve")
        for p in plan.pools:
            m = p.gpu_mem_gb
            vllm = f"{m.vllm_fraction:g} of GPU" + (f" = {m.vllm}" if m.vllm is not None else "")
            size = f"{m.gpu:g} GB GPU" if m.gpu is not None else "GPU size not given (cluster.gpu_mem_gb)"
            rollout = "?" if m.rollout is None else f"{m.rollout}"
            lines.append(f"  {p.role} {m.params} + {m.grads} + {m.optimizer}, activations {m.activations} + "
                         f"{m.headroom}, vLLM {vllm}; "
                         f"rollout {rollout}, train {m.train} of {size}")
        lines.append(f"host per node: {plan.cpus} CPUs ({plan.ray_cpus} in verl's placement groups, 3 per GPU), "
                     f"{plan.host_mem_gb} GB memory")
        for name, c in plan.checkpoint.items():
            lines.append(f"checkpoint {name}: {', '.join(c.contents)}: {c.gb} GB")
        lines.append(f"peak disk per job: {plan.peak_disk_gb} GB")
    s, limit = plan.slurm, time_limit(cfg)
    lines.append(cost_line(cost, cfg))
    lines.append(f"slurm request: --nodes={s['nodes']} --gpus-per-node={s['gpus_per_node']} "
                 f"--cpus-per-task={s['cpus_per_task']} --mem={s['mem_gb']}G --time={limit.slurm}")
    lines.extend(f"note: {n}" for n in plan.notes + limit_notes(cost, limit))
    return "\n".join(lines)


def cost_line(cost: Projection, cfg: DictConfig) -> str:
    steps = cfg.train.max_steps or PAPER_STEPS
    wall = "wall time unknown" if cost.wall_hours is None else f"~{cost.wall_hours:.1f} h wall"
    return f"cost: ~{cost.gpu_hours:.1f} GPU-h, {wall} ({steps} steps; {cost.source})"


def limit_notes(cost: Projection, limit: TimeLimit) -> list[str]:
    """What the time limit does to a job of this length: nothing, requeues, or more requeues than allowed."""
    if cost.wall_hours is None:
        return []
    requeues = limit.requeues(cost.wall_hours)
    if not requeues:
        return []
    said = (f"the job's ~{cost.wall_hours:.1f} h exceed the {limit.minutes / 60:g} h limit (--time): at the limit it "
            f"checkpoints (USR2) and is requeued, {requeues} time{'s' * (requeues > 1)}, resuming its MLflow run")
    if requeues > limit.requeues_allowed:
        said += (f"; more than hydra.launcher.max_num_timeout={limit.requeues_allowed} allows: raise it, or the "
                 f"pair's cluster.resources.<pair>.timeout_min where the site's limit is longer")
    return [said]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graft_exp.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of one job, as for python -m graft_exp")
    args = parser.parse_args(argv)
    from graft_exp.launching.callbacks import trained_roles

    try:
        cfg = compose_job(args.overrides)
        validate(cfg)
        trained = trained_roles(cfg)
        plan = resources.job_plan(cfg, trained)
        cost = measured_cost(cfg) or estimate_cost(cfg, trained)
    except HydraException as err:   # a misspelt key, an unknown option, a sweep list: Hydra's first line names it
        print(f"plan: {str(err).splitlines()[0]} (the overrides of one job, as for python -m graft_exp)",
              file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"plan refused: {err}", file=sys.stderr)
        return 2
    limit = time_limit(cfg)
    shown = {**plan.to_dict(), "cost": {**asdict(cost), "time_limit_min": limit.minutes,
                                        "requeues": limit.requeues(cost.wall_hours or 0.0)}}
    print(json.dumps(shown, indent=1) if args.json else format_plan(plan, cfg, cost))
    try:
        resources.check(plan, cfg)
    except ConfigError as err:
        print(f"plan refused: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
