"""State of jobs from MLflow and the scheduler: finished, running, pending, failed, missing.

MLflow run states mean: RUNNING (in progress, or crashed without a chance to mark it), FAILED
(an exception), KILLED (interrupted), FINISHED. A RUNNING run whose job is gone (its Slurm job
left the queue, its process died) is reported as ``crashed``; a job submitted to Slurm that has
no run yet is ``pending`` while Slurm holds it and ``crashed`` once it left the queue.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from graft_exp import scheduler, schema

RUN_COLUMNS = ["run_id", "key", "status", "start_time", "end_time", "parent", "slurm_job_id", "host",
               "pid", "log", "experiment"]
DONE, RUNNING, PENDING = "finished", "running", "pending"
FAILED, CRASHED, MISSING = "failed", "crashed", "missing"
HELD = "held"   # in the Slurm queue, but Slurm will not start it (scheduler.SLURM_HELD): the log slot holds the way out
TO_SUBMIT = (FAILED, CRASHED, MISSING)


def fetch_runs(uri: str) -> pd.DataFrame:
    """Every run of every ``graft/`` experiment that carries a ``graft.run_key``, newest first: job
    runs and model runs alike (one query per page, whatever the study)."""
    client = MlflowClient(uri)
    exps = {e.experiment_id: e.name for e in client.search_experiments(filter_string=schema.GRAFT_EXPERIMENTS)}
    rows, token = [], None
    while exps:
        page = client.search_runs(list(exps), "", max_results=5000, page_token=token,
                                  order_by=["attributes.start_time DESC"])
        for run in page:
            tags = run.data.tags
            if schema.RUN_KEY not in tags:
                continue
            rows.append((run.info.run_id, tags[schema.RUN_KEY], run.info.status, run.info.start_time,
                         run.info.end_time, tags.get("mlflow.parentRunId"), tags.get(schema.SLURM_JOB_ID),
                         tags.get(schema.HOST), tags.get(schema.PID), tags.get(schema.LOG),
                         exps[run.info.experiment_id]))
        token = page.token
        if not token:
            break
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def newest_by_key(runs: pd.DataFrame) -> dict[str, dict]:
    """The newest run of each key (a ``rerun=true`` job adds a newer run to a key)."""
    return {row["key"]: row for row in runs.drop_duplicates("key").to_dict("records")}


@dataclass
class Submission:
    """Where a job was submitted by the sweep tool: its Hydra sweep dir and index in that multirun."""

    sweep_dir: str
    index: int

    def slurm_job_id(self) -> str | None:
        """The Slurm id from submitit's per-job folder once submitted: ``<array>_<index>``, or a
        plain id when the multirun had one job (submitit then submits no array)."""
        folder = Path(self.sweep_dir, ".submitit")
        names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
        found = sorted(n for n in names if re.fullmatch(rf"\d+_{self.index}", n))
        if not found and self.index == 0:
            found = sorted(n for n in names if n.isdigit() and Path(folder, n, f"{n}_submitted.pkl").exists())
        return found[-1] if found else None

    def log(self) -> str:
        job = self.slurm_job_id()
        if job is None:
            return str(Path(self.sweep_dir))
        return str(Path(self.sweep_dir, ".submitit", job, f"{job}_0_log.out"))


def read_submissions(manifest: Path) -> dict[str, Submission]:
    """Latest submission of each run key from a sweep's ``launches.jsonl``."""
    subs: dict[str, Submission] = {}
    if manifest.exists():
        for line in manifest.read_text().splitlines():
            entry = json.loads(line)
            for index, key in enumerate(entry["keys"]):
                subs[key] = Submission(entry["sweep_dir"], index)
    return subs


def run_state(run: dict | None, queue: dict[str, str] | None, submission: Submission | None = None,
              check_liveness: bool = True) -> tuple[str, str | None]:
    """(state, log path) of one job from its newest run, the Slurm queue and its last submission."""
    if run is None:
        if submission is not None and check_liveness:
            job = submission.slurm_job_id()
            if job and queue is not None and queue.get(job) == scheduler.SLURM_HELD:
                return HELD, scheduler.held_hint(job)
            if job and queue is not None and queue.get(job) in scheduler.SLURM_ACTIVE:
                return (RUNNING if queue[job] == "RUNNING" else PENDING), submission.log()
            if job:
                return CRASHED, submission.log()
        return MISSING, None
    status, log = run["status"], run.get("log")
    if status == "FINISHED":
        return DONE, log
    if status in ("FAILED", "KILLED"):
        return FAILED, log
    if not check_liveness:
        return RUNNING, log
    tags = {schema.SLURM_JOB_ID: run.get("slurm_job_id"), schema.HOST: run.get("host"),
            schema.PID: run.get("pid")}
    alive = scheduler.liveness({k: v for k, v in tags.items() if v}, queue)
    if alive is False:
        return CRASHED, log
    if run.get("slurm_job_id") and queue is not None and queue.get(run["slurm_job_id"]) == scheduler.SLURM_HELD:
        return HELD, scheduler.held_hint(run["slurm_job_id"])
    if run.get("slurm_job_id") and queue is not None and queue.get(run["slurm_job_id"]) != "RUNNING":
        return PENDING, log   # requeued: Slurm holds it before it resumes the run
    return RUNNING, log
