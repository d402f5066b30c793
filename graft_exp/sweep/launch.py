"""Launching a planned sweep: job config files, one multirun per pair or group, jobs started once what they need
(``after``) is trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from graft_exp import schema, tracking
from graft_exp.launching import status, summary
from graft_exp.launching.callbacks import SWEEP_ENV, Concurrency
from graft_exp.launching.jobs import CONF_DIR, Job
from graft_exp.sweep.planning import Sweep, SweepJob
from graft_exp.sweep.state import STYLE, Snapshot, console, counts, report, snapshot


def models_override(job: Job) -> str:
    """The override that chooses the job's models, ``group=...`` or ``pair=...``: the launch
    command sets it, so that the launcher's resources follow the models."""
    groups = [text for text in job.overrides if text.split("=", 1)[0] == "group"]
    return groups[-1] if groups else f"pair={job.cfg.pair.name}"


def job_file(job: Job, group_keys: set[str]) -> str:
    """A Hydra config (the "experiment" pattern) that sets the job's own overrides, except the
    pair or group, which the launch command sets (:func:`models_override`)."""
    defaults, values = [], {}
    for text in job.overrides:
        key, value = text.split("=", 1)
        if key in ("pair", "group"):
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


def launch_commands(sweep: Sweep, ready: list[SweepJob], overrides: list[str], out: Path,
                    workers: int | None = None) -> list[tuple[list[str], Path, list[str]]]:
    """One ``python -m graft_exp -m`` command per pair or group (it fixes the launcher's resources):
    (command, its Hydra sweep dir, the run keys in the order given). ``workers``: the local
    launcher's worker processes (default: one per core)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    commands = []
    group_keys = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    for models in dict.fromkeys(models_override(sj.job) for sj in ready):
        batch = [sj for sj in ready if models_override(sj.job) == models]
        sweep_dir = (out / sweep.study / f"{stamp}-{batch[0].job.cfg.pair.name}").resolve()
        jobs_dir = sweep_dir / "jobs" / "sweep_job"
        jobs_dir.mkdir(parents=True, exist_ok=True)
        names = []
        for sj in batch:
            name = f"j{sj.index:03d}"
            (jobs_dir / f"{name}.yaml").write_text(job_file(sj.job, group_keys))
            names.append(name)
        command = [sys.executable, "-m", "graft_exp", "-m", models, f"+sweep_job={','.join(names)}",
                   f"study={sweep.study}", f"hydra.searchpath=[file://{sweep_dir / 'jobs'}]",
                   f"hydra.sweep.dir={sweep_dir}", *overrides]
        if workers is not None:
            command.append(f"hydra.launcher.n_jobs={workers}")
        commands.append((command, sweep_dir, [sj.key for sj in batch]))
    return commands


@dataclass(eq=False)
class Launch:
    """One ``python -m graft_exp -m`` process and the run keys of its jobs."""

    proc: subprocess.Popen
    keys: list[str]
    workers: int | None = None   # cores it runs jobs on (exclusive clusters)

    def alive(self) -> bool:
        return self.proc.poll() is None


def launch(sweep: Sweep, ready: list[SweepJob], overrides: list[str], out: Path,
           manifest: Path, workers: int | None = None) -> list[Launch]:
    """Start the multiruns of ``ready`` (one per pair or group) without waiting for them."""
    launches = []
    for command, sweep_dir, keys in launch_commands(sweep, ready, overrides, out, workers):
        with manifest.open("a") as f:
            f.write(json.dumps({"time": time.time(), "sweep_dir": str(sweep_dir), "keys": keys}) + "\n")
        console.print(f"launching {len(keys)} job(s): {' '.join(command[2:])}", soft_wrap=True)
        proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1", SWEEP_ENV: "1"})
        launches.append(Launch(proc, keys, workers))
    return launches


def by_priority(sweep: Sweep, jobs: list[SweepJob]) -> list[SweepJob]:
    """Jobs that others need first (a dependent starts as soon as a core frees after them), then in
    the sweep file's order (written most expensive first, so the last jobs are short)."""
    needed = {id(n) for sj in sweep.jobs for n in sj.needs}
    return sorted(jobs, key=lambda sj: (id(sj) not in needed, sj.index))


def busy_cores(launches: list[Launch], states: dict[str, tuple[str, str | None]]) -> int:
    """Cores the live multiruns of an exclusive cluster occupy: each its workers, fewer once it has
    fewer unfinished jobs than workers (its tail)."""
    ended = (status.DONE, status.FAILED, status.CRASHED)
    return sum(min(la.workers, sum(states[k][0] not in ended for k in la.keys)) for la in launches)


def exclusive_batch(ready: list[SweepJob], idle: int, tail: bool) -> list[SweepJob]:
    """The ready jobs an exclusive cluster starts now on its ``idle`` cores: those of the first pair or
    group only (one multirun, whose workers are the idle cores: several at once would each take them
    all), and in a tail exactly as many as there are idle cores, so that later ones can be filled too."""
    first = models_override(ready[0].job)
    batch = [sj for sj in ready if models_override(sj.job) == first]
    return batch[:idle] if tail else batch


def run(sweep: Sweep, overrides: list[str], out: Path, parallel: bool, poll_s: float,
        cores: int | None = None) -> int:
    """Launch every job that is neither finished nor queued as soon as what it needs is trained;
    print each launched job's state changes as they happen; end with the status table. Exit
    status 1 when a job did not finish.

    A parallel cluster's multirun process only waits for its jobs' results (Hydra's submitit
    launcher polls them with growing intervals, and reports failures at the end); once MLflow and
    Slurm show every job of it ended, it is stopped. On an exclusive cluster (``cluster=local``,
    ``cores`` given) the jobs run inside multirun processes that together use ``cores`` workers:
    the first takes every ready job; when its tail leaves cores idle, jobs that became ready since
    (a ``graft_stored`` job after its GRPO n=8 log, which ``by_priority`` trains early) start on
    them, so no core waits for a whole wave to end.
    """
    manifest = out / sweep.study / "launches.jsonl"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    # The store exists before anything (this loop included) reads it: concurrent first-time
    # schema creation by two processes crashes one of them.
    tracking.ensure_store(sweep.uri, schema.experiment_name(sweep.study))
    attempted = launch_until_ended(sweep, overrides, out, manifest, parallel, poll_s, cores)
    return final_report(sweep, snapshot(sweep, manifest, scheduler_too=True), attempted)


def launch_until_ended(sweep: Sweep, overrides: list[str], out: Path, manifest: Path, parallel: bool,
                       poll_s: float, cores: int | None) -> set[str]:
    """``run``'s loop: every ``poll_s`` seconds the sweep's state, the launched jobs' changes printed, the
    multiruns whose jobs all ended stopped, the ready jobs launched where there is room; until nothing is
    running that the sweep launched and nothing left can start. Returns the run keys it launched."""
    attempted: set[str] = set()
    seen: dict[str, str] = {}
    launches: list[Launch] = []
    # A held job waits for a person (scontrol release / scancel), not for the sweep: it ends the wait.
    ended = (status.DONE, status.FAILED, status.CRASHED, status.HELD)
    while True:
        snap = snapshot(sweep, manifest, scheduler_too=True)
        print_changes(sweep, snap, attempted, seen)
        for la in launches:
            if parallel and la.alive() and all(snap.states[k][0] in ended for k in la.keys):
                la.proc.terminate()   # every job ended: only the launcher's own waiting is left
                la.proc.wait(timeout=60)
        launches = [la for la in launches if la.alive()]
        todo = [sj for sj in sweep.jobs if snap.state(sj) in status.TO_SUBMIT and sj.key not in attempted]
        ready = by_priority(sweep, [sj for sj in todo if snap.ready(sj)])
        idle = cores - busy_cores(launches, snap.states) if cores else int(parallel or not launches)
        if ready and idle > 0:
            if cores:
                ready = exclusive_batch(ready, idle, tail=bool(launches))
            launches += launch(sweep, ready, overrides, out, manifest, workers=min(idle, len(ready)) if cores else None)
            attempted |= {sj.key for sj in ready}
            continue
        in_flight = [sj for sj in sweep.jobs if snap.state(sj) in (status.RUNNING, status.PENDING)]
        if not launches and not (todo and in_flight) and not any(sj.key in attempted for sj in in_flight):
            return attempted
        time.sleep(poll_s)


def print_changes(sweep: Sweep, snap: Snapshot, attempted: set[str], seen: dict[str, str]) -> None:
    """Each launched job's state where it changed since ``seen`` (updated), with its log once it failed."""
    for sj in sweep.jobs:
        state, log = snap.states[sj.key]
        if sj.key in attempted and seen.get(sj.key) != state:
            console.print(f"[{STYLE[state]}]{state}[/] #{sj.index} {sj.job.label}" +
                          (f": log {log}" if state in (status.FAILED, status.CRASHED) else "") +
                          (f": {log}" if state == status.HELD else ""),
                          soft_wrap=True)
        seen[sj.key] = state


def final_report(sweep: Sweep, snap: Snapshot, attempted: set[str]) -> int:
    """The status table with the failed jobs' logs, the results with their comparison (``summary``: each job's
    run as this last snapshot found it), the jobs never launched. 0 when every job finished and was compared."""
    report(sweep, snap, with_logs=True)
    compared = summary.print_jobs(sweep.uri, [(f"#{sj.index} {sj.job.label}", sj.key) for sj in sweep.jobs],
                                  f"{sweep.path} - study {sweep.study}: results",
                                  reference=sweep.jobs[0].job.cfg.compare_to if sweep.jobs else None,
                                  run_ids=snap.run_ids)
    never = [sj for sj in sweep.jobs if snap.state(sj) in status.TO_SUBMIT and sj.key not in attempted]
    for sj in never:
        console.print(f"  [yellow]not launched[/] #{sj.index} {sj.job.label}: what it needs did not finish")
    return 0 if compared and counts(sweep, snap)[status.DONE] == len(sweep.jobs) else 1


def launcher(cluster: DictConfig | None, overrides: list[str], out: Path, poll_s: float | None):
    """``run`` as the jobs' ``cluster`` launches them (``Concurrency``), for a planned sweep or each round of
    ``until_decided``; ``poll_s`` None: the cluster's ``poll_s``."""
    concurrency = Concurrency.of(cluster)
    poll = poll_s if poll_s is not None else float(cluster.poll_s if cluster else 30)
    cores = concurrency.sweep_cores()
    return lambda sweep: run(sweep, overrides, out, parallel=concurrency.multiruns_overlap, poll_s=poll, cores=cores)
