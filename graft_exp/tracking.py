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


def ensure_store(uri: str, experiment: str) -> str:
    """Create (or migrate) the store and the experiment, from the launching process.

    Concurrent first-time SQLite schema creation crashes jobs, so this runs once before any job
    starts. An unreachable server or unwritable store fails here, before anything is launched.
    """
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        if not db.parent.exists() or not os.access(db.parent, os.W_OK):
            raise TrackingError(f"cannot write the MLflow store {uri}: directory {db.parent} is "
                                "missing or not writable; set tracking.uri to a writable location")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    try:
        client = MlflowClient(uri)
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


def _open(client: MlflowClient, experiment_id: str, key: str, tags: dict, run_name: str,
          rerun: bool) -> TrackedRun | None:
    """Find-or-create by key: None if FINISHED (and not rerun), the same run if unfinished."""
    found = find_run(client, key)
    if found is not None and not rerun:
        if found.info.status == "FINISHED":
            return None
        client.update_run(found.info.run_id, status="RUNNING")
        return TrackedRun(client, found.info.run_id, resumed=True)
    run = client.create_run(experiment_id, tags={"graft.run_key": key, **tags}, run_name=run_name)
    return TrackedRun(client, run.info.run_id)


def common_tags(cfg: DictConfig) -> dict[str, str]:
    tags = {
        "graft.study": cfg.study, "graft.method": cfg.method.name, "graft.pair": cfg.pair.name,
        "graft.seed": str(cfg.seed), "graft.backend": cfg.backend.name,
    }
    slurm_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if slurm_id:
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        tags["graft.slurm_job_id"] = f"{slurm_id}_{task}" if task else slurm_id
    return tags


def open_job(cfg: DictConfig) -> TrackedRun | None:
    """The job run of ``cfg`` (new or resumed), or None when a FINISHED run exists and not rerun."""
    uri = cfg.tracking.uri
    experiment_id = ensure_store(uri, experiment_name(cfg))
    client = MlflowClient(uri)
    tags = {**common_tags(cfg), "graft.git_sha": git_sha()}
    name = f"{cfg.pair.name}-{cfg.method.name}-s{cfg.seed}"
    job = _open(client, experiment_id, run_key(cfg), tags, name, cfg.rerun)
    if job is not None:
        job.set_tags(tags)   # a resumed run records where it runs now (e.g. its new Slurm id)
        job.log_params(flatten(OmegaConf.to_container(cfg, resolve=True)))
    return job


def open_model_run(cfg: DictConfig, job: TrackedRun, role: str) -> TrackedRun | None:
    """The model run of ``role`` under ``job`` (new or resumed), or None if that model's run is
    FINISHED already (e.g. a GRPO baseline trained for another pair)."""
    other = "B" if role == "A" else "A"
    tags = {
        **common_tags(cfg), PARENT_TAG: job.run_id, "graft.model": cfg.pair[role],
        "graft.peer": cfg.pair[other] if cfg.method.co_train else "none",
        "graft.role": role, "graft.n": str(cfg.method.n),
    }
    experiment_id = job.client.get_run(job.run_id).info.experiment_id
    name = f"{cfg.pair[role]}-{cfg.method.name}-s{cfg.seed}"
    return _open(job.client, experiment_id, model_run_key(cfg, role), tags, name, cfg.rerun)


