"""The state of a planned sweep's jobs from MLflow and the scheduler, and its status table."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

from graft_exp import scheduler, tracking
from graft_exp.launching import status
from graft_exp.sweep.planning import Sweep, SweepJob

console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def read_runs(uri: str) -> pd.DataFrame:
    """Runs of the store, without creating a SQLite file that does not exist yet."""
    db = tracking.sqlite_file(uri)
    if db is not None and not db.exists():
        return pd.DataFrame(columns=status.RUN_COLUMNS)
    return status.fetch_runs(uri)


@dataclass
class Snapshot:
    """The state of every job of a sweep at one moment."""

    states: dict[str, tuple[str, str | None]]     # run key -> (state, log)
    model_done: dict[str, bool]                   # model run key -> trained
    run_ids: dict[str, str]                       # run key -> the id of its newest run (the keys that have one)

    def state(self, sj: SweepJob) -> str:
        return self.states[sj.key][0]

    def models_done(self, sj: SweepJob) -> bool:
        return all(self.model_done.get(key, False) for key in sj.job.model_keys.values())

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
    run_ids = {sj.key: newest[sj.key]["run_id"] for sj in sweep.jobs if sj.key in newest}
    return Snapshot(states, model_done, run_ids)


def counts(sweep: Sweep, snap: Snapshot) -> dict[str, int]:
    out = dict.fromkeys((status.DONE, status.RUNNING, status.PENDING, status.HELD, status.FAILED,
                         status.CRASHED, status.MISSING), 0)
    for sj in sweep.jobs:
        out[snap.state(sj)] += 1
    return out


STYLE = {status.DONE: "green", status.RUNNING: "cyan", status.PENDING: "cyan", status.FAILED: "red",
         status.CRASHED: "red", status.MISSING: "yellow", status.HELD: "red"}


def report(sweep: Sweep, snap: Snapshot, with_logs: bool) -> None:
    """The job table and the summary line (and failed jobs with their logs)."""
    table = Table(title=f"{sweep.path} - study {sweep.study} - {sweep.uri}", title_justify="left")
    for col in ("#", "job", "run_key", "state", "est. GPU-h", "est. wall h", "after"):
        table.add_column(col, justify="right" if col in ("#", "est. GPU-h", "est. wall h") else "left")
    for sj in sweep.jobs:
        state = snap.state(sj)
        waits = sj.needs + sj.follows
        blocked = state in status.TO_SUBMIT and not snap.ready(sj)
        shown = f"[{STYLE[state]}]{state}[/]" + (" (waits)" if blocked else "")
        table.add_row(str(sj.index), sj.job.label, sj.key, shown, f"{sj.gpu_hours:.1f}", f"{sj.wall_hours:.1f}",
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
        f"{c[status.PENDING]} pending, {c[status.HELD]} held, {c[status.FAILED] + c[status.CRASHED]} failed, "
        f"{c[status.MISSING]} missing; estimated GPU-hours: {sum(sj.gpu_hours for sj in todo):.1f} "
        f"to run, {sum(sj.gpu_hours for sj in sweep.jobs):.1f} for the whole sweep; wall time (App. D, each job "
        f"on its own GPUs): {sum(sj.wall_hours for sj in todo):.1f} h summed over the jobs to run, the longest "
        f"{max((sj.wall_hours for sj in todo), default=0.0):.1f} h")
    if with_logs:
        for sj in sweep.jobs:
            state, log = snap.states[sj.key]
            if state in (status.FAILED, status.CRASHED):
                console.print(f"  [red]{state}[/] #{sj.index} {sj.job.label}: log {log or 'unknown'}",
                              soft_wrap=True)
            elif state == status.HELD:
                console.print(f"  [red]{state}[/] #{sj.index} {sj.job.label}: {log}", soft_wrap=True)

