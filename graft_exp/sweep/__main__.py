"""``python -m graft_exp.sweep SWEEP.yaml``: list, check and launch the runs of one paper table.

A sweep file (``sweeps/*.yaml``) names its MLflow study and lists override grids::

    study: stored
    runs:
      - {pair: [pair1, pair2, pair3], method: [grpo_n8, graft], seed: 0}
      - pair: [pair1, pair2, pair3]
        method: graft_stored
        seed: 0
        after: {method: grpo_n8}     # needs the GRPO n=8 runs of the same pair and seed first

Each grid is a Cartesian product of its keys (Hydra override keys; a scalar is a one-value list).
``after`` names the jobs a job needs: the same overrides with these replaced.

Every job is identified by its ``graft.run_key``, whatever study trained it. A single-model job
(GRPO) whose models another job of the sweep already trains is dropped, and one that shares a
model with an earlier job runs after it, so a shared GRPO baseline is trained once.

  --dry-run   the job list and how many are finished / running / failed / missing (MLflow only),
              with estimated GPU-hours;
  --status    the same from MLflow and the scheduler, failed jobs with their log;
  (default)   launch what is not finished and not queued, through ``cluster=...``, each job once
              what it needs (``after``) is trained, jobs that others need first; on
              ``cluster=local`` the next ready job takes a core as soon as one is idle; report
              failures as they happen; finish with the status table.

  --until-decided [--max-seeds N]
              run the file's seeds, then rounds of further seeds for the ``decide:`` comparisons still
              undecided, until each is decided or N seeds (``graft_exp.sweep.decide``: the rule,
              AdaStop; ``graft_exp.sweep.until``: the rounds and what MLflow records of them).

Other arguments are Hydra overrides for every job, e.g. ``cluster=slurm tracking=server
hydra.launcher.partition=gpu``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from rich.markup import escape

from graft_exp import resources, tracking
from graft_exp.config import ConfigError, folder_problem
from graft_exp.sweep.decide import DecideError, Settings, settings
from graft_exp.sweep.launch import launcher
from graft_exp.sweep.planning import Sweep, SweepError, load, plan
from graft_exp.sweep.state import console, report, snapshot
from graft_exp.sweep.until import check_resumed_rule, file_seeds, until_decided


def invalid_jobs(sweep) -> list[str]:
    """Every job's ``validate`` or resource-plan failure, before anything reads or creates the store."""
    problems = []
    for sj in sweep.jobs:
        try:
            resources.check_job(sj.job.cfg)
        except ConfigError as err:
            problems.append(f"  job #{sj.index} {sj.job.label}: {err}")
    return problems


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m graft_exp.sweep", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="a sweep file, e.g. sweeps/main.yaml")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="list jobs and their state; launch nothing")
    mode.add_argument("--status", action="store_true", help="state from MLflow and the scheduler, with logs")
    parser.add_argument("--out", type=Path, default=Path("multirun/sweeps"),
                        help="where launches write their Hydra sweep dirs and launches.jsonl")
    parser.add_argument("--poll", type=float, default=None,
                        help="seconds between state checks while waiting (default: cluster.poll_s)")
    mode.add_argument("--until-decided", action="store_true",
                      help="add rounds of seeds until the file's `decide:` comparisons are decided")
    parser.add_argument("--max-seeds", type=int, default=None,
                        help="--until-decided: the cap on seeds per method (default: decide.max_seeds, 12)")
    parser.add_argument("--only", action="append", default=[], metavar="KEY=V1[,V2]",
                        help="run the jobs whose swept KEY is one of these values (and the jobs they need), e.g. "
                             "--only pair=pair1 --only method=graft,grpo_n8; repeatable")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every job (cluster=slurm ...)")
    return parser


def arguments_problem(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot go together (printed after "error:"), or None."""
    problem = folder_problem(args.out)
    if problem:
        return f"--out {escape(str(args.out))}: {escape(problem)}; give a folder for the launches' Hydra folders"
    if args.only and args.until_decided:
        return "--until-decided runs the file's `decide:` comparisons as a whole; drop --only"
    if args.max_seeds is not None and not args.until_decided:
        return "--max-seeds caps --until-decided; add --until-decided or drop --max-seeds"
    return None


def planned(args: argparse.Namespace) -> tuple[Sweep, dict | None, Settings | None]:
    """The sweep file's jobs, and with ``--until-decided`` its spec and ``decide:`` settings (else None, None)."""
    spec = decide = None
    if args.until_decided:
        spec = load(args.sweep)
        decide = settings(spec, file_seeds(spec), args.max_seeds, args.sweep)
    sweep = plan(args.sweep, args.overrides, only=args.only)
    if decide is not None:
        listed = {str(sj.job.cfg.method.name) for sj in sweep.jobs}
        absent = [m for m in decide.methods if m not in listed]
        if absent:
            raise DecideError(f"{args.sweep}: decide.comparisons names {', '.join(absent)}, which no grid of "
                              f"`runs:` trains; add it to a grid or remove the comparison")
        check_resumed_rule(sweep, decide)
    return sweep, spec, decide


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_intermixed_args(argv)
    problem = arguments_problem(args)
    if problem:
        console.print(f"[red]error:[/] {problem}", soft_wrap=True)
        return 2
    try:
        sweep, spec, decide = planned(args)
    except (SweepError, DecideError) as err:
        console.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True)
        return 2
    except (HydraException, OmegaConfBaseException) as err:   # a wrong type or unknown key or option
        console.print(f"[red]invalid configuration, nothing launched:[/] {' '.join(str(err).split())}",
                      soft_wrap=True)
        return 2
    problems = invalid_jobs(sweep)
    if problems:
        console.print("[red]invalid configuration, nothing launched:[/]\n" + "\n".join(problems), soft_wrap=True)
        return 2
    if args.dry_run or args.status:
        manifest = args.out / sweep.study / "launches.jsonl"
        report(sweep, snapshot(sweep, manifest, scheduler_too=args.status), with_logs=args.status)
        return 0
    run = launcher(sweep.jobs[0].job.cfg.cluster if sweep.jobs else None, args.overrides, args.out, args.poll)
    try:
        return until_decided(args.sweep, spec, decide, args.overrides, run) if decide is not None else run(sweep)
    except tracking.TrackingError as err:
        console.print(f"[red]nothing launched:[/] {err}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
