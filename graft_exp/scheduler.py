"""Where a job runs and whether it still does: Slurm ids, local processes, log files.

A job run records its location as tags (``graft.slurm_job_id``, ``graft.host``, ``graft.pid``,
``graft.log``). A RUNNING run whose location is gone (its Slurm job left the queue, its process
died) crashed without a chance to mark itself; ``liveness`` tells the two apart.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

from graft_exp import schema

#: A pending job Slurm will not start by itself: held after a failed launch ("launch failed requeued
#: held"), or by a user or an administrator. ``slurm_queue`` reports it in place of PENDING.
SLURM_HELD = "HELD"
SLURM_ACTIVE = {SLURM_HELD, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
                "REQUEUE_FED", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"}


#: Set by a launcher that runs several jobs at once on this machine's cores: how many each job may use.
JOB_CORES_ENV = "GRAFT_JOB_CORES"


def job_cores() -> int:
    """Cores this job may use: ``GRAFT_JOB_CORES`` where a launcher shares this machine's cores between
    jobs, else the cores this process may run on: its affinity (Slurm's cpuset, taskset) and its cgroup's CPU quota
    (a container's), as joblib counts them for the launcher's workers."""
    given = os.environ.get(JOB_CORES_ENV)
    if not given:
        import joblib

        return joblib.cpu_count()
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"{JOB_CORES_ENV}={given!r} is not a number of cores: set a positive integer, or unset it")
    return int(given)


def slurm_job_id() -> str | None:
    """This process's Slurm job as ``squeue -r`` names it: ``<array>_<task>`` for array tasks."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def log_path() -> str | None:
    """The file this job's output goes to: submitit's stdout log, else Hydra's job log."""
    if os.environ.get("SUBMITIT_FOLDER"):
        import submitit

        return str(submitit.JobEnvironment().paths.stdout)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        hc = HydraConfig.get()
        return str(Path(hc.runtime.output_dir) / f"{hc.job.name}.log")
    return None


def location_tags() -> dict[str, str]:
    """Tags saying where this job runs now (a requeued job updates them)."""
    tags = {schema.HOST: socket.gethostname(), schema.PID: str(os.getpid())}
    job = slurm_job_id()
    if job:
        tags[schema.SLURM_JOB_ID] = job
    log = log_path()
    if log:
        tags[schema.LOG] = log
    return tags


def slurm_queue() -> dict[str, str] | None:
    """State of every job in the Slurm queue by id (array tasks one by one, e.g. ``12_3``), or None
    where Slurm is not installed. Pending array tasks that Slurm still groups (``12_[4-7]``) are
    expanded by ``-r``."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T|%r"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return None
    queue = {}
    for line in out.splitlines():
        job, state, reason = (line.strip().split("|", 2) + ["", ""])[:3]
        if job:
            queue[job] = queue_state(state, reason)
    return queue


def queue_state(state: str, reason: str) -> str:
    """A job's state as ``slurm_queue`` reports it: SLURM_HELD for a pending job whose reason is a hold
    (``launch failed requeued held``, ``JobHeldUser``, ``JobHeldAdmin``), else Slurm's own state."""
    held = state == "PENDING" and "held" in reason.lower().replace("_", " ")
    return SLURM_HELD if held else state


def held_hint(job: str) -> str:
    """The way out for a job Slurm holds."""
    return (f"Slurm holds job {job} (e.g. launch failed requeued held; `squeue -j {job} -o %r` says why): "
            f"`scontrol release {job}` lets it start again once the cause is fixed, `scancel {job}` gives it up")


def requeue_under_way(error: BaseException) -> bool:
    """Whether ``error`` is submitit's own ``scontrol requeue`` (its preemption handler's) killed by the requeue it
    asked for: Slurm stops the job's processes as it requeues the job, and a ``scontrol`` that has not returned yet
    dies with them, so submitit raises CalledProcessError (a negative return code: the signal) although the job is
    requeued and will resume. Such a job was preempted; it did not fail."""
    return (isinstance(error, subprocess.CalledProcessError) and error.returncode < 0
            and [str(word) for word in error.cmd[:2]] == ["scontrol", "requeue"])


def process_alive(pid: int) -> bool:
    """Whether a process of this machine with ``pid`` exists (pid reuse aside)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def liveness(tags: dict[str, str], queue: dict[str, str] | None) -> bool | None:
    """Whether the job that last wrote a run (by its location tags) is still alive: True, False, or
    None when this machine cannot tell (another host, or Slurm unreachable from here)."""
    job = tags.get(schema.SLURM_JOB_ID)
    if job:
        if queue is None:
            return None
        return queue.get(job) in SLURM_ACTIVE
    host, pid = tags.get(schema.HOST), tags.get(schema.PID)
    if host and pid and host == socket.gethostname():
        return process_alive(int(pid))
    return None
