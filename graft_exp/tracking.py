"""MLflow records of DESIGN.md's schema: job runs, model runs, run identity and resumption.

A job's identity is ``graft.run_key``, a hash of its resolved config without launcher, tracking
and path settings. Opening a job finds the run with that key: FINISHED -> skipped, unfinished ->
the same run is resumed (a requeued or re-launched job never creates a second run), none -> a new
run. Model runs carry their own key, so a GRPO baseline of one (model, n, seed) is found and
shared by every pair that contains that model.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from graft_exp import scheduler

# Config sections that say where or how a job runs, not what it computes.
NON_IDENTITY_KEYS = ("cluster", "tracking", "checkpoint_root", "rerun", "study", "hydra")
PARENT_TAG = "mlflow.parentRunId"
MAX_BATCH = 1000   # MLflow's log_batch limit on metrics per call
MAX_PARAMS = 100   # ... and on params per call


class TrackingError(RuntimeError):
    """The tracking store cannot be used; the message says what to check."""


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity(cfg: DictConfig) -> dict:
    """The resolved config minus the keys that do not change what a job computes."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return {k: v for k, v in resolved.items() if k not in NON_IDENTITY_KEYS}


def run_key(cfg: DictConfig) -> str:
    """``graft.run_key`` of a job: stable hash of its identity config."""
    return _hash(identity(cfg))


def model_run_key(cfg: DictConfig, role: str) -> str:
    """Identity of one trained model. Single-model methods leave out the pair and the peer, so a
    GRPO baseline of (model, method, seed) is one run whichever pair launches it."""
    ident = identity(cfg)
    if cfg.method.co_train:
        return _hash({"job": ident, "role": role})
    ident.pop("pair")
    ident["model"] = cfg.pair[role]
    return _hash(ident)


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list) else str(v)
    return out


def git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def experiment_name(cfg: DictConfig) -> str:
    return f"graft/{cfg.study}"


def check_store(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast, with the fix in the message, when ``uri`` cannot take runs: a SQLite file in a
    missing or read-only place, or a tracking server that does not answer its health check."""
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        place = db if db.exists() else db.parent
        if not place.exists() or not os.access(place, os.W_OK):
            raise TrackingError(f"cannot write the MLflow store {uri}: {place} is missing or not "
                                "writable; set tracking.uri to a writable location")
    elif uri.startswith(("http://", "https://")):
        import requests

        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
        except requests.RequestException as err:
            raise TrackingError(
                f"the MLflow tracking server {uri} does not answer ({type(err).__name__}: {err}). "
                "Start it (mlflow server --backend-store-uri postgresql://... "
                "--artifacts-destination ...) or fix MLFLOW_TRACKING_URI, then launch again."
            ) from err


def ensure_store(uri: str, experiment: str) -> str:
    """Create (or migrate) the store and the experiment, from the launching process; return the
    experiment id.

    Concurrent first-time SQLite schema creation crashes jobs, so this runs once before any job
    starts. An unreachable server or unwritable store fails here, before anything is launched.
    """
    check_store(uri)
    try:
        client = MlflowClient(uri)   # a database store is created, or its missing tables migrated, here
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return client.create_experiment(experiment)
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    except Exception as err:  # MLflow raises many kinds; all mean the same thing to the user
        raise TrackingError(
            f"MLflow tracking store {uri} is not usable ({type(err).__name__}: {err}). "
            "Start the server / fix tracking.uri (or MLFLOW_TRACKING_URI) and launch again."
        ) from err


def accounted_gpus(cfg: DictConfig) -> int:
    """N_GPU of ``cost/gpu_hours`` (paper App. D: N_GPU x summed per-step training wall time).

    The GPUs Slurm allocated to this job (``SLURM_GPUS_ON_NODE`` x nodes) when it runs under Slurm
    with GPUs, else what the pair asks for (``pair.gpus``: 4 for pair1..3, as in the paper). A
    CPU-only job (the tiny pair) is charged as one device so that its compute curves keep a scale.
    """
    on_node = os.environ.get("SLURM_GPUS_ON_NODE")
    if on_node and on_node.isdigit() and int(on_node) > 0:
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1
        return int(on_node) * int(nodes)
    return max(int(cfg.pair.gpus), 1)


@dataclass
class TrackedRun:
    """One MLflow run (job or model) with batched, exactly-once metric logging."""

    client: MlflowClient
    run_id: str
    resumed: bool = False
    _logged: dict[str, set[int]] = field(default_factory=dict)

    def logged_steps(self, key: str) -> set[int]:
        """Steps at which ``key`` is already recorded (read once per key on resumed runs)."""
        if key not in self._logged:
            history = self.client.get_metric_history(self.run_id, key) if self.resumed else []
            self._logged[key] = {m.step for m in history}
        return self._logged[key]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics at ``step``, skipping any (key, step) already recorded: a resumed job that
        replays its last step neither duplicates nor drops it."""
        import time

        now = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            steps = self.logged_steps(key)
            if step in steps:
                continue
            steps.add(step)
            batch.append(Metric(key, float(value), now, step))
        for i in range(0, len(batch), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + MAX_BATCH])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_params(self, params: dict[str, str]) -> None:
        existing = self.client.get_run(self.run_id).data.params if self.resumed else {}
        todo = [Param(k, v[:6000]) for k, v in params.items() if k not in existing]
        for i in range(0, len(todo), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=todo[i:i + MAX_PARAMS])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

    @property
    def status(self) -> str:
        return self.client.get_run(self.run_id).info.status


def find_run(client: MlflowClient, key: str):
    """The newest run, in any graft/ experiment, whose graft.run_key is ``key`` (or None)."""
    exps = [e.experiment_id for e in client.search_experiments(filter_string="name LIKE 'graft/%'")]
    if not exps:
        return None
    runs = client.search_runs(exps, f"tags.`graft.run_key` = '{key}'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


class AlreadyRunning(TrackingError):
    """Another live process (Slurm job or local process) is writing the run of this key."""


def _open(client: MlflowClient, experiment_id: str, key: str, tags: dict, run_name: str,
          rerun: bool) -> TrackedRun | None:
    """Find-or-create by key: None if FINISHED (and not rerun), the same run if unfinished.

    ``rerun`` only lets a FINISHED run be trained again; an unfinished one is always resumed, so
    that a requeued ``rerun=true`` job continues its new run instead of starting a third.
    """
    found = find_run(client, key)
    if found is not None and found.info.status == "FINISHED" and not rerun:
        return None
    if found is not None and found.info.status != "FINISHED":
        client.update_run(found.info.run_id, status="RUNNING")
        return TrackedRun(client, found.info.run_id, resumed=True)
    run = client.create_run(experiment_id, tags={"graft.run_key": key, **tags}, run_name=run_name)
    return TrackedRun(client, run.info.run_id)


def _refuse_live_duplicate(client: MlflowClient, key: str) -> None:
    """Raise AlreadyRunning when the unfinished run of ``key`` is being written by another live
    job: launching a sweep twice must not make two processes train into one run. The same Slurm
    job coming back after a requeue is not another job."""
    found = find_run(client, key)
    if found is None or found.info.status != "RUNNING":
        return
    tags = found.data.tags
    me = scheduler.slurm_job_id()
    if tags.get("graft.slurm_job_id"):
        if tags["graft.slurm_job_id"] == me:
            return
        alive = scheduler.liveness(tags, scheduler.slurm_queue())
    elif tags.get("graft.pid") == str(os.getpid()) and not me:
        return
    else:
        alive = scheduler.liveness(tags, None)
    if alive:
        where = tags.get("graft.slurm_job_id") or f"pid {tags.get('graft.pid')} on {tags.get('graft.host')}"
        raise AlreadyRunning(f"run {found.info.run_id} (graft.run_key={key}) is being trained by {where}; "
                             "not starting a second copy")


def common_tags(cfg: DictConfig) -> dict[str, str]:
    """Tags of job and model runs: what the run is, and where it runs now."""
    return {
        "graft.study": cfg.study, "graft.method": cfg.method.name, "graft.pair": cfg.pair.name,
        "graft.seed": str(cfg.seed), "graft.backend": cfg.backend.name,
        **scheduler.location_tags(),
    }


def open_job(cfg: DictConfig) -> TrackedRun | None:
    """The job run of ``cfg`` (new or resumed), or None when a FINISHED run exists and not rerun.

    Raises AlreadyRunning when another live job is training this key right now."""
    uri = cfg.tracking.uri
    experiment_id = ensure_store(uri, experiment_name(cfg))
    client = MlflowClient(uri)
    key = run_key(cfg)
    _refuse_live_duplicate(client, key)
    tags = {**common_tags(cfg), "graft.git_sha": git_sha()}
    name = f"{cfg.pair.name}-{cfg.method.name}-s{cfg.seed}"
    job = _open(client, experiment_id, key, tags, name, cfg.rerun)
    if job is not None:
        job.set_tags(tags)   # a resumed run records where it runs now (e.g. its new Slurm id)
        job.log_params(flatten(OmegaConf.to_container(cfg, resolve=True)))
    return job


def open_model_run(cfg: DictConfig, job: TrackedRun, role: str) -> TrackedRun | None:
    """The model run of ``role`` under ``job`` (new or resumed), or None when this job must not
    train that model: its run is FINISHED already (e.g. a GRPO baseline trained for another pair),
    or it belongs to another job run (a shared baseline that job is training, or will resume)."""
    other = "B" if role == "A" else "A"
    tags = {
        **common_tags(cfg), PARENT_TAG: job.run_id, "graft.model": cfg.pair[role],
        "graft.peer": cfg.pair[other] if cfg.method.co_train else "none",
        "graft.role": role, "graft.n": str(cfg.method.n),
    }
    key = model_run_key(cfg, role)
    found = find_run(job.client, key)
    unfinished = found is not None and found.info.status != "FINISHED"
    if unfinished and found.data.tags.get(PARENT_TAG) != job.run_id:
        return None
    experiment_id = job.client.get_run(job.run_id).info.experiment_id
    name = f"{cfg.pair[role]}-{cfg.method.name}-s{cfg.seed}"
    run = _open(job.client, experiment_id, key, tags, name, cfg.rerun)
    if run is not None and run.resumed:
        run.set_tags(common_tags(cfg))
    return run
