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
  (default)   launch what is not finished and not queued, through ``cluster=...``, in waves that
              respect ``after``; report failures as they happen; finish with the status table.

Other arguments are Hydra overrides for every job, e.g. ``cluster=slurm tracking=server
hydra.launcher.partition=gpu``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from graft_exp import scheduler, tracking
from graft_exp.launching import status
from graft_exp.launching.callbacks import SWEEP_ENV
from graft_exp.launching.jobs import CONF_DIR, ROLES, Composer, Job, estimate_gpu_hours

console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)


class SweepError(ValueError):
    """A sweep file or command line that cannot be planned; the message says what to fix."""


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _override(key: str, value) -> str:
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={value}"


def expand(grid: dict) -> list[tuple[str, ...]]:
    """The jobs of one grid (without ``after``), in the order its keys and values are written."""
    keys = [k for k in grid if k != "after"]
    values = [_as_list(grid[k]) for k in keys]
    return [tuple(_override(k, v) for k, v in zip(keys, combo)) for combo in itertools.product(*values)]


def replace(overrides: tuple[str, ...], changes: dict) -> tuple[str, ...]:
    """``overrides`` with the keys of ``changes`` set to its values (added when absent)."""
    keys = [o.split("=", 1)[0] for o in overrides]
    out = [o for o, k in zip(overrides, keys) if k not in changes]
    return tuple(out + [_override(k, v) for k, v in changes.items()])


@dataclass(eq=False)
class SweepJob:
    """A job of a sweep with its place in the plan."""

    job: Job
    index: int
    roles: tuple[str, ...]                 # models this job trains (a shared GRPO baseline: its first job)
    needs: list[SweepJob] = field(default_factory=list)       # `after`: their models must be finished
    follows: list[SweepJob] = field(default_factory=list)     # shared baseline: run after these started it
    gpu_hours: float = 0.0

    @property
    def key(self) -> str:
        return self.job.key


@dataclass
class Sweep:
    path: Path
    study: str
    jobs: list[SweepJob]
    shared: list[tuple[Job, list[SweepJob]]]   # dropped single-model jobs and the jobs training their models
    uri: str


def load(path: Path) -> dict:
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or "study" not in spec or "runs" not in spec:
        raise SweepError(f"{path}: a sweep file needs `study:` and `runs:` (a list of override grids)")
    return spec


def plan(path: Path, overrides: list[str], composer: Composer | None = None) -> Sweep:
    """Compose every job of the sweep file ``path`` with the command-line ``overrides``."""
    spec = load(path)
    study = str(spec["study"])
    swept = {"study", *(k for grid in spec["runs"] for k in grid if k != "after")}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in swept:
            raise SweepError(f"{path} sets {key}; override other keys only (or copy the sweep file)")
    owned = composer is None
    composer = composer or Composer([*overrides, f"study={study}"])
    try:
        by_key: dict[str, Job] = {}
        order: list[str] = []
        after: dict[str, list[str]] = {}

        def add(ovs: tuple[str, ...]) -> str:
            job = Job(ovs, composer.compose(list(ovs)))
            if job.key not in by_key:
                by_key[job.key] = job
                order.append(job.key)
            return job.key

        for grid in spec["runs"]:
            for ovs in expand(grid):
                deps = [add(replace(ovs, change)) for change in _as_list(grid.get("after") or [])]
                key = add(ovs)
                after.setdefault(key, []).extend(d for d in deps if d != key)
        uri = composer.base.tracking.uri
    finally:
        if owned:
            composer.close()
    return _order(path, study, [by_key[k] for k in order], after, uri)


def _order(path: Path, study: str, jobs: list[Job], after: dict[str, list[str]], uri: str) -> Sweep:
    """Drop single-model jobs whose models earlier jobs train; order shared baselines; cost."""
    owner: dict[str, SweepJob] = {}
    planned: dict[str, SweepJob] = {}
    shared = []
    for job in jobs:
        roles, follows = [], []
        for role, model_key in job.model_keys.items():
            if job.single_model and model_key in owner:
                follows.append(owner[model_key])
            else:
                roles.append(role)
        if not roles:
            shared.append((job, list(dict.fromkeys(follows))))
            continue
        sj = SweepJob(job, len(planned), tuple(roles), follows=list(dict.fromkeys(follows)))
        sj.gpu_hours = estimate_gpu_hours(job.cfg, sj.roles)
        for role in roles:
            owner.setdefault(job.model_keys[role], sj)
        planned[job.key] = sj
    dropped = {job.key: keepers for job, keepers in shared}
    for sj in planned.values():
        # A needed job's models may be trained by the jobs it follows (shared baselines).
        needs = [[planned[k], *planned[k].follows] if k in planned else dropped[k]
                 for k in after.get(sj.key, [])]
        sj.needs = list(dict.fromkeys(n for group in needs for n in group))
    return Sweep(path, study, list(planned.values()), shared, uri)


# ---------------------------------------------------------------------------------------------
# State


def read_runs(uri: str) -> pd.DataFrame:
    """Runs of the store, without creating a SQLite file that does not exist yet."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return pd.DataFrame(columns=status.RUN_COLUMNS)
    return status.fetch_runs(uri)


@dataclass
class Snapshot:
    """The state of every job of a sweep at one moment."""

    states: dict[str, tuple[str, str | None]]     # run key -> (state, log)
    model_done: dict[str, bool]                   # model run key -> trained

    def state(self, sj: SweepJob) -> str:
        return self.states[sj.key][0]

    def models_done(self, sj: SweepJob) -> bool:
        return all(self.model_done.get(sj.job.model_keys[r], False) for r in ROLES)

    def ready(self, sj: SweepJob) -> bool:
        """Whether ``sj`` may start now: what it needs is trained, and the jobs that train its
        shared baselines have ended (their model runs exist: it neither trains them too nor at the
        same time)."""
        return (all(self.models_done(n) for n in sj.needs)
                and all(self.state(f) in (status.DONE, status.FAILED, status.CRASHED) for f in sj.follows))


def snapshot(sweep: Sweep, manifest: Path, scheduler_too: bool) -> Snapshot:
    """Job states from MLflow (newest run per key, any study) and, with ``scheduler_too``, Slurm."""
    runs = read_runs(sweep.uri)
    newest = status.newest_by_key(runs)
    queue = scheduler.slurm_queue() if scheduler_too else None
    subs = status.read_submissions(manifest) if scheduler_too else {}
    states = {sj.key: status.run_state(newest.get(sj.key), queue, subs.get(sj.key), scheduler_too)
              for sj in sweep.jobs}
    run_status = dict(zip(runs["run_id"], runs["status"]))
    model_done = {}
    for sj in sweep.jobs:
        for key in sj.job.model_keys.values():
            run = newest.get(key)
            # A model run is trained when FINISHED, or when the job run that owns it finished.
            model_done[key] = run is not None and "FINISHED" in (run["status"], run_status.get(run["parent"]))
    return Snapshot(states, model_done)


def counts(sweep: Sweep, snap: Snapshot) -> dict[str, int]:
    out = dict.fromkeys((status.DONE, status.RUNNING, status.PENDING, status.FAILED, status.CRASHED,
                         status.MISSING), 0)
    for sj in sweep.jobs:
        out[snap.state(sj)] += 1
    return out


STYLE = {status.DONE: "green", status.RUNNING: "cyan", status.PENDING: "cyan", status.FAILED: "red",
         status.CRASHED: "red", status.MISSING: "yellow"}


def report(sweep: Sweep, snap: Snapshot, with_logs: bool) -> None:
    """The job table and the summary line (and failed jobs with their logs)."""
    table = Table(title=f"{sweep.path} - study {sweep.study} - {sweep.uri}", title_justify="left")
    for col in ("#", "job", "run_key", "state", "est. GPU-h", "after"):
        table.add_column(col, justify="right" if col in ("#", "est. GPU-h") else "left")
    for sj in sweep.jobs:
        state = snap.state(sj)
        waits = sj.needs + sj.follows
        blocked = state in status.TO_SUBMIT and not snap.ready(sj)
        shown = f"[{STYLE[state]}]{state}[/]" + (" (waits)" if blocked else "")
        table.add_row(str(sj.index), sj.job.label, sj.key, shown, f"{sj.gpu_hours:.1f}",
                      " ".join(f"#{w.index}" for w in dict.fromkeys(waits)))
    console.print(table)
    for job, keepers in sweep.shared:
        trained_by = ", ".join(f"#{k.index}" for k in keepers)
        console.print(f"  {job.label}: not a job of its own, its models are trained by {trained_by} "
                      "(shared GRPO baselines)")
    c = counts(sweep, snap)
    todo = [sj for sj in sweep.jobs if snap.state(sj) in status.TO_SUBMIT]
    console.print(
        f"{len(sweep.jobs)} jobs: {c[status.DONE]} finished, {c[status.RUNNING]} running, "
        f"{c[status.PENDING]} pending, {c[status.FAILED] + c[status.CRASHED]} failed, "
        f"{c[status.MISSING]} missing; estimated GPU-hours: {sum(sj.gpu_hours for sj in todo):.1f} "
        f"to run, {sum(sj.gpu_hours for sj in sweep.jobs):.1f} for the whole sweep")
    if with_logs:
        for sj in sweep.jobs:
            state, log = snap.states[sj.key]
            if state in (status.FAILED, status.CRASHED):
                console.print(f"  [red]{state}[/] #{sj.index} {sj.job.label}: log {log or 'unknown'}",
                              soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# Launching


def job_file(job: Job, group_keys: set[str]) -> str:
    """A Hydra config (the "experiment" pattern) that sets the job's own overrides, except the
    pair, which the launch command sets so that the launcher's resources follow the pair."""
    defaults, values = [], {}
    for text in job.overrides:
        key, value = text.split("=", 1)
        if key == "pair":
            continue
        if key in group_keys:
            defaults.append(f"  - override /{key}: {value}")
        else:
            values[key] = yaml.safe_load(value)
    body = OmegaConf.to_yaml(OmegaConf.from_dotlist([f"{k}={json.dumps(v)}" for k, v in values.items()]))
    lines = ["# @package _global_", f"# graft_exp sweep job: {job.label}"]
    if defaults:
        lines += ["defaults:", *defaults]
    if values:
        lines.append(body.rstrip())
    return "\n".join(lines) + "\n"


def launch_commands(sweep: Sweep, ready: list[SweepJob], overrides: list[str],
                    out: Path) -> list[tuple[list[str], Path, list[str]]]:
    """One ``python -m graft_exp -m`` command per pair (the pair fixes the launcher's resources):
    (command, its Hydra sweep dir, the run keys in job-index order)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    commands = []
    pairs = list(dict.fromkeys(sj.job.cfg.pair.name for sj in ready))
    group_keys = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    for pair in pairs:
        batch = [sj for sj in ready if sj.job.cfg.pair.name == pair]
        sweep_dir = (out / sweep.study / f"{stamp}-{pair}").resolve()
        jobs_dir = sweep_dir / "jobs" / "sweep_job"
        jobs_dir.mkdir(parents=True, exist_ok=True)
        names = []
        for sj in batch:
            name = f"j{sj.index:03d}"
            (jobs_dir / f"{name}.yaml").write_text(job_file(sj.job, group_keys))
            names.append(name)
        command = [sys.executable, "-m", "graft_exp", "-m", f"pair={pair}", f"+sweep_job={','.join(names)}",
                   f"study={sweep.study}", f"hydra.searchpath=[file://{sweep_dir / 'jobs'}]",
                   f"hydra.sweep.dir={sweep_dir}", *overrides]
        commands.append((command, sweep_dir, [sj.key for sj in batch]))
    return commands


@dataclass(eq=False)
class Launch:
    """One ``python -m graft_exp -m`` process and the run keys of its jobs."""

    proc: subprocess.Popen
    keys: list[str]

    def alive(self) -> bool:
        return self.proc.poll() is None


def launch(sweep: Sweep, ready: list[SweepJob], overrides: list[str], out: Path,
           manifest: Path) -> list[Launch]:
    """Start the multiruns of ``ready`` (one per pair) without waiting for them."""
    launches = []
    for command, sweep_dir, keys in launch_commands(sweep, ready, overrides, out):
        with manifest.open("a") as f:
            f.write(json.dumps({"time": time.time(), "sweep_dir": str(sweep_dir), "keys": keys}) + "\n")
        console.print(f"launching {len(keys)} job(s): {' '.join(command[2:])}", soft_wrap=True)
        proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1", SWEEP_ENV: "1"})
        launches.append(Launch(proc, keys))
    return launches


def run(sweep: Sweep, overrides: list[str], out: Path, parallel: bool, poll_s: float) -> int:
    """Launch every job that is neither finished nor queued as soon as what it needs is trained;
    print each launched job's state changes as they happen; end with the status table. Exit
    status 1 when a job did not finish.

    A parallel cluster's multirun process only waits for its jobs' results (Hydra's submitit
    launcher polls them with growing intervals, and reports failures at the end); once MLflow and
    Slurm show every job of it ended, it is stopped. On ``cluster=local`` the jobs run inside
    the multirun process, one multirun at a time.
    """
    manifest = out / sweep.study / "launches.jsonl"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    # The store exists before anything (this loop included) reads it: concurrent first-time
    # schema creation by two processes crashes one of them.
    tracking.ensure_store(sweep.uri, f"graft/{sweep.study}")
    attempted: set[str] = set()
    seen: dict[str, str] = {}
    launches: list[Launch] = []
    ended = (status.DONE, status.FAILED, status.CRASHED)
    while True:
        snap = snapshot(sweep, manifest, scheduler_too=True)
        for sj in sweep.jobs:
            state, log = snap.states[sj.key]
            if sj.key in attempted and seen.get(sj.key) != state:
                console.print(f"[{STYLE[state]}]{state}[/] #{sj.index} {sj.job.label}" +
                              (f": log {log}" if state in (status.FAILED, status.CRASHED) else ""),
                              soft_wrap=True)
            seen[sj.key] = state
        for la in launches:
            if parallel and la.alive() and all(snap.states[k][0] in ended for k in la.keys):
                la.proc.terminate()   # every job ended: only the launcher's own waiting is left
                la.proc.wait(timeout=60)
        launches = [la for la in launches if la.alive()]
        todo = [sj for sj in sweep.jobs if snap.state(sj) in status.TO_SUBMIT and sj.key not in attempted]
        ready = [sj for sj in todo if snap.ready(sj)]
        if ready and (parallel or not launches):
            launches += launch(sweep, ready, overrides, out, manifest)
            attempted |= {sj.key for sj in ready}
            continue
        in_flight = [sj for sj in sweep.jobs if snap.state(sj) in (status.RUNNING, status.PENDING)]
        if not launches and not (todo and in_flight) and not any(sj.key in attempted for sj in in_flight):
            break
        time.sleep(poll_s)
    snap = snapshot(sweep, manifest, scheduler_too=True)
    report(sweep, snap, with_logs=True)
    never = [sj for sj in sweep.jobs if snap.state(sj) in status.TO_SUBMIT and sj.key not in attempted]
    for sj in never:
        console.print(f"  [yellow]not launched[/] #{sj.index} {sj.job.label}: what it needs did not finish")
    return 0 if counts(sweep, snap)[status.DONE] == len(sweep.jobs) else 1


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every job (cluster=slurm ...)")
    args = parser.parse_intermixed_args(argv)
    try:
        sweep = plan(args.sweep, args.overrides)
    except (SweepError, FileNotFoundError) as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    manifest = args.out / sweep.study / "launches.jsonl"
    if args.dry_run or args.status:
        report(sweep, snapshot(sweep, manifest, scheduler_too=args.status), with_logs=args.status)
        return 0
    cluster = sweep.jobs[0].job.cfg.cluster if sweep.jobs else None
    poll = args.poll if args.poll is not None else float(cluster.poll_s if cluster else 30)
    try:
        return run(sweep, args.overrides, args.out, parallel=bool(cluster and cluster.parallel), poll_s=poll)
    except tracking.TrackingError as err:
        console.print(f"[red]nothing launched:[/] {err}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
