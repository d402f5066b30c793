"""MLflow records of DESIGN.md's schema: job runs, model runs, run identity and resumption.

A job's identity is ``graft.run_key``, a hash of its resolved config without launcher, tracking
and path settings. Opening a job finds the run with that key: FINISHED -> skipped, unfinished ->
the same run is resumed (a requeued or re-launched job never creates a second run), none -> a new
run. Model runs carry their own key, so a GRPO baseline of one (model, n, seed) is found and
shared by every pair that contains that model.

Besides DESIGN.md's ``graft.*`` tags, runs carry what the MLflow UI reads: experiments are tagged
as model-training experiments, runs have MLflow's source tags (git commit, entry point), short
top-level params (method, pair, seed, delta, n, backend) next to the flattened config, a one-line
description, and each model run its training and benchmark data as dataset inputs.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import mlflow.data
import mlflow.exceptions
import pandas as pd
from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from graft_exp import environment, scheduler

# Config sections that say where or how a job runs, not what it computes.
NON_IDENTITY_KEYS = ("cluster", "tracking", "checkpoint_root", "rerun", "study", "hydra")
PARENT_TAG = "mlflow.parentRunId"
MAX_BATCH = 1000   # MLflow's log_batch limit on metrics per call
MAX_PARAMS = 100   # ... and on params per call
# MLflow 3.x records an experiment's kind in this tag; the UI's experiment-kind selector writes it.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
DESCRIPTION_TAG = "mlflow.note.content"
DATA_ORDER_TAG = "graft.data_order"   # model runs: what a graft_stored replay must match
DATASET_CONTEXT_TAG = "mlflow.data.context"   # what mlflow.log_input(context=...) writes


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


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def git_sha() -> str:
    return _git("rev-parse", "HEAD") or "unknown"


def source_tags(entry_point: str) -> dict[str, str]:
    """MLflow's own source tags, which fill the UI's Source and User columns: the entry point, the
    git commit (and remote, which the UI links to) of this checkout, local process or scheduler job."""
    tags = {"mlflow.source.name": entry_point,
            "mlflow.source.type": "JOB" if scheduler.slurm_job_id() else "LOCAL",
            "mlflow.user": getpass.getuser()}
    for key, args in (("commit", ("rev-parse", "HEAD")), ("repoURL", ("config", "--get", "remote.origin.url"))):
        value = _git(*args)
        if value:
            tags[f"mlflow.source.git.{key}"] = value
    return tags


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
                "Start it (python -m graft_exp.server start --dir ... --host ...) or fix "
                "MLFLOW_TRACKING_URI, then launch again."
            ) from err


def check_credentials(uri: str, experiment: str, timeout_s: float = 10.0) -> None:
    """Fail before submission when a tracking server with authentication (MLflow's basic-auth
    app) would refuse the jobs: their credentials, as MLflow reads them (MLFLOW_TRACKING_USERNAME /
    MLFLOW_TRACKING_PASSWORD, else ~/.mlflow/credentials), are refused (401), the server refuses
    the request itself (403, e.g. a host name outside its --allowed-hosts), or the user may not
    write the existing experiment (403). A server without authentication passes."""
    import requests
    from mlflow.utils.credentials import read_mlflow_creds

    creds = read_mlflow_creds()
    auth = (creds.username, creds.password) if creds.username and creds.password else None
    who = f"user {creds.username!r}" if auth else "no credentials"
    base = uri.rstrip("/")
    fix = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or ~/.mlflow/credentials "
           "(mode 0600), to a user of the server (python -m graft_exp.server add-user NAME)")
    try:
        me = requests.get(f"{base}/api/2.0/mlflow/users/current", auth=auth, timeout=timeout_s)
        if me.status_code == 404:   # no authentication app: nothing to check
            return
        if me.status_code == 401:
            raise TrackingError(f"the MLflow tracking server {uri} refused {who} (401 Unauthorized): "
                                f"{fix}, then launch again")
        if me.status_code == 403:
            raise TrackingError(f"the MLflow tracking server {uri} refused the request (403 Forbidden: "
                                f"{me.text.strip()[:200]}); if it names the Host header, start the "
                                "server with this host name (graft_exp.server start --name)")
        me.raise_for_status()
        if me.json()["user"]["is_admin"]:
            return
        exp = requests.get(f"{base}/api/2.0/mlflow/experiments/get-by-name", auth=auth,
                           params={"experiment_name": experiment}, timeout=timeout_s)
        if exp.status_code == 404:   # a new experiment: creating it (ensure_store) is the check
            return
        exp.raise_for_status()
        perm = requests.get(f"{base}/api/3.0/mlflow/users/permissions/get", auth=auth, timeout=timeout_s,
                            params={"username": creds.username, "resource_type": "experiment",
                                    "resource_id": exp.json()["experiment"]["experiment_id"]})
        perm.raise_for_status()
    except requests.RequestException as err:
        raise TrackingError(f"cannot check the credentials on the MLflow tracking server {uri} "
                            f"({type(err).__name__}: {err})") from err
    if perm.json()["permission"] not in ("EDIT", "MANAGE"):
        raise TrackingError(f"{who} may not write experiment {experiment!r} on the MLflow tracking "
                            f"server {uri} (403 Forbidden: its permission is {perm.json()['permission']}); use the "
                            "credentials of a user that writes (graft_exp.server add-user without "
                            "--read-only) or have EDIT granted on the experiment")


def ensure_store(uri: str, experiment: str) -> str:
    """Create (or migrate) the store and the experiment, from the launching process; return the
    experiment id.

    Concurrent first-time SQLite schema creation crashes jobs, so this runs once before any job
    starts. An unreachable server or unwritable store fails here, before anything is launched.
    """
    check_store(uri)
    if uri.startswith(("http://", "https://")):
        check_credentials(uri, experiment)
    try:
        client = MlflowClient(uri)   # a database store is created, or its missing tables migrated, here
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return client.create_experiment(experiment, tags=EXPERIMENT_TAGS)
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        for key, value in EXPERIMENT_TAGS.items():   # experiments made before the kind was recorded
            if key not in exp.tags:
                client.set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id
    except Exception as err:  # MLflow raises many kinds; all mean the same thing to the user
        if getattr(err, "error_code", None) == "PERMISSION_DENIED":
            raise TrackingError(f"MLflow tracking server {uri} refused to create experiment "
                                f"{experiment!r} (403 Forbidden): the user has read-only access; use "
                                "credentials of a user that writes") from err
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


def key_params(cfg: DictConfig) -> dict[str, str]:
    """Short top-level params to group and filter by in the UI, beside the flattened config.
    ``delta`` is the compatibility floor of methods that gate peer responses, else ``none``."""
    gated = cfg.method.co_train and cfg.method.gate
    return {"method": cfg.method.name, "pair": cfg.pair.name, "seed": str(cfg.seed),
            "delta": str(cfg.method.delta) if gated else "none", "n": str(cfg.method.n),
            "backend": cfg.backend.name}


def run_params(cfg: DictConfig) -> dict[str, str]:
    """Params of job and model runs: the flattened resolved config and the short key params."""
    return {**flatten(OmegaConf.to_container(cfg, resolve=True)), **key_params(cfg)}


def job_description(cfg: DictConfig) -> str:
    pair = cfg.pair
    how = "co-trained" if cfg.method.co_train else "each trained alone"
    return (f"{cfg.method.name} on pair {pair.name} ({pair.A} and {pair.B}, {how}), seed {cfg.seed}, "
            f"n={cfg.method.n}, {cfg.backend.name} backend")


def model_description(cfg: DictConfig, role: str) -> str:
    peer = cfg.pair["B" if role == "A" else "A"]
    source = "its stored GRPO n=8 log" if cfg.method.source == "stored" else "online"
    partner = f", peer {peer} ({source})" if cfg.method.co_train else ""
    return f"{cfg.pair[role]} (role {role}) trained with {cfg.method.name}{partner}, seed {cfg.seed}"


class StoredLogMissing(TrackingError):
    """graft_stored's source, the peer's finished GRPO n=8 run with the same seed, is not in the store."""


def stored_log_run(client: MlflowClient, cfg: DictConfig, peer: str):
    """The run whose trajectory log ``graft_stored`` replays when ``peer`` is the source: the newest
    FINISHED GRPO n=8 model run of ``peer`` with this seed, in any graft/ experiment (or None). Any
    backend's run of that model qualifies: the model key names the weights."""
    experiments = [e.experiment_id for e in client.search_experiments(filter_string="name LIKE 'graft/%'")]
    if not experiments:
        return None
    query = (f"tags.`graft.method` = 'grpo_n8' and tags.`graft.model` = '{peer}' and "
             f"tags.`graft.seed` = '{cfg.seed}' and attributes.status = 'FINISHED'")
    runs = client.search_runs(experiments, query, max_results=1, order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def stored_log_peers(cfg: DictConfig) -> list[str]:
    """The models whose GRPO n=8 logs a job replays: both of the pair (each role replays its peer)."""
    return [cfg.pair.A, cfg.pair.B] if cfg.method.source == "stored" else []


def data_order(cfg: DictConfig) -> str:
    """What fixes the prompts of every training step: the data, its size, the batch size and the seed,
    with batches inside epochs (a replayed log must have been written in the same order)."""
    return _hash({"data": cfg.pair.data, "train_size": cfg.pair.train_size, "seed": cfg.seed,
                  "batch_prompts": cfg.train.batch_prompts, "batches": "within epochs, partial dropped"})


def check_stored_logs(cfg: DictConfig, client: MlflowClient) -> None:
    """Raise StoredLogMissing, naming the job to launch first, when a peer log ``cfg`` replays is absent
    or was written in another data order."""
    runs = {peer: stored_log_run(client, cfg, peer) for peer in stored_log_peers(cfg)}
    missing = [peer for peer, run in runs.items() if run is None]
    if missing:
        raise StoredLogMissing(
            f"method={cfg.method.name} replays the trajectory log of the finished GRPO n=8 run with seed "
            f"{cfg.seed} of {' and '.join(missing)}, and {cfg.tracking.uri} has none: launch "
            f"`python -m graft_exp pair={cfg.pair.name} method=grpo_n8 seed={cfg.seed}` first")
    other = [peer for peer, run in runs.items() if run.data.tags.get(DATA_ORDER_TAG) != data_order(cfg)]
    if other:
        raise StoredLogMissing(
            f"method={cfg.method.name} replays the GRPO n=8 log of {' and '.join(other)} (seed {cfg.seed}), "
            "but it was written in another data order (pair data or train_size, train.batch_prompts, or an "
            f"older batching): relaunch `python -m graft_exp pair={cfg.pair.name} method=grpo_n8 "
            f"seed={cfg.seed} rerun=true` with this job's train settings first")


def open_job(cfg: DictConfig) -> TrackedRun | None:
    """The job run of ``cfg`` (new or resumed), or None when a FINISHED run exists and not rerun.

    Raises AlreadyRunning when another live job is training this key right now, and
    StoredLogMissing (before any run is created) when a ``graft_stored`` job has no log to replay."""
    uri = cfg.tracking.uri
    experiment_id = ensure_store(uri, experiment_name(cfg))
    client = MlflowClient(uri)
    key = run_key(cfg)
    _refuse_live_duplicate(client, key)
    check_stored_logs(cfg, client)
    tags = {**common_tags(cfg), "graft.git_sha": git_sha(), **source_tags("python -m graft_exp"),
            **environment.tags(), DESCRIPTION_TAG: job_description(cfg)}
    name = f"{cfg.pair.name}-{cfg.method.name}-s{cfg.seed}"
    job = _open(client, experiment_id, key, tags, name, cfg.rerun)
    if job is not None:
        job.set_tags(tags)   # a resumed run records where it runs now (e.g. its new Slurm id)
        job.log_params(run_params(cfg))
        log_dataset_inputs(client, job.run_id, cfg)
    return job


def ui_link(experiment_id: str, server: str = "http://127.0.0.1:5000") -> str:
    """The experiment's runs table in the MLflow UI. MLflow 3.17's UI opens every experiment on its
    GenAI overview unless the workflow type is ``machine_learning`` (its sidebar toggle "Model
    training", remembered per browser, or this URL parameter); the experiment-kind tag does not
    change that."""
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def compare_hint(uri: str, experiment_id: str) -> str:
    """One line telling where to compare the runs of ``experiment_id``."""
    if uri.startswith(("http://", "https://")):
        return f"compare the runs in the MLflow UI: {ui_link(experiment_id, uri)}"
    return f"compare the runs in the MLflow UI: mlflow ui --backend-store-uri {uri}, then open {ui_link(experiment_id)}"


def _frame_input(frame: pd.DataFrame, name: str, source, context: str, digest: str | None = None) -> DatasetInput:
    with warnings.catch_warnings():
        # MLflow registers its local-file source class twice and warns that a path is ambiguous.
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
        dataset = mlflow.data.from_pandas(frame, source=source, name=name, digest=digest)
    return DatasetInput(dataset._to_mlflow_entity(), [InputTag(DATASET_CONTEXT_TAG, context)])


def _tiny_inputs(cfg: DictConfig) -> list[DatasetInput]:
    """The tiny pair's generated splits, as the local backend draws them (graft_exp/tiny/task.py)."""
    from graft_exp.tiny import models as tiny
    from graft_exp.tiny.task import DATA_SEED, SKILLS, benchmark, train_split

    def frame(problems):
        return pd.DataFrame([(p.uid, p.skill, p.question, p.answer) for p in problems],
                            columns=["uid", "skill", "question", "answer"])

    size = int(cfg.pair.train_size)
    source = {"generator": "graft_exp.tiny.task.train_split", "skills": ",".join(SKILLS),
              "size": size, "eval_size": tiny.EVAL_SIZE, "data_seed": DATA_SEED}
    inputs = [_frame_input(frame(train_split(SKILLS, tiny.EVAL_SIZE, size)), f"{cfg.pair.data}/train",
                           CodeDatasetSource(source), "training")]
    limit = cfg.eval.get("max_problems") or tiny.EVAL_SIZE
    for bench in cfg.pair.benchmarks:
        source = {"generator": "graft_exp.tiny.task.benchmark", "skill": bench, "problems": limit,
                  "data_seed": DATA_SEED}
        inputs.append(_frame_input(frame(benchmark(bench, tiny.EVAL_SIZE)[:limit]), f"{cfg.pair.data}/{bench}",
                                   CodeDatasetSource(source), "evaluation"))
    return inputs


def _parquet_inputs(cfg: DictConfig) -> list[DatasetInput]:
    """The Parquet files ``python -m graft_exp.prepare`` writes under ``backend.data_dir``; a digest of
    the file's bytes (MLflow's own digest skips the nested prompt and answer columns)."""
    from graft_exp.prepare import SOURCES

    root = Path(cfg.backend.get("data_dir") or "data")
    inputs = []
    for key, context in [(cfg.pair.data, "training"), *((b, "evaluation") for b in cfg.pair.benchmarks)]:
        if key not in SOURCES:
            continue
        path = (root / key / f"{SOURCES[key].output}.parquet").resolve()
        if not path.is_file():
            continue   # the backend reports the missing file when it reads it
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        inputs.append(_frame_input(pd.read_parquet(path), key, str(path), context, digest))
    return inputs


def dataset_inputs(cfg: DictConfig) -> list[DatasetInput]:
    """The training data and benchmarks of ``cfg``'s pair as MLflow dataset inputs (name, digest,
    source, schema, row count), so that the UI's Dataset column says what a model was trained on."""
    return _tiny_inputs(cfg) if cfg.pair.data == "tiny_arith" else _parquet_inputs(cfg)


def log_dataset_inputs(client: MlflowClient, run_id: str, cfg: DictConfig, attempts: int = 5) -> None:
    """Log :func:`dataset_inputs` on ``run_id``. MLflow's store finds or creates each dataset of the
    experiment in two statements, so jobs that start together (a multirun, a Slurm array) can both try
    to create the same one and the second fails on the unique key. Logging is idempotent (inputs
    already logged are skipped), so the loser retries and finds the winner's rows."""
    datasets = dataset_inputs(cfg)
    for attempt in range(attempts):
        try:
            client.log_inputs(run_id, datasets=datasets)
            return
        except mlflow.exceptions.MlflowException:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


def open_model_run(cfg: DictConfig, job: TrackedRun, role: str) -> TrackedRun | None:
    """The model run of ``role`` under ``job`` (new or resumed), or None when this job must not
    train that model: its run is FINISHED already (e.g. a GRPO baseline trained for another pair),
    or it belongs to another job run (a shared baseline that job is training, or will resume)."""
    other = "B" if role == "A" else "A"
    tags = {
        **common_tags(cfg), PARENT_TAG: job.run_id, "graft.model": cfg.pair[role],
        "graft.peer": cfg.pair[other] if cfg.method.co_train else "none",
        "graft.role": role, "graft.n": str(cfg.method.n), DATA_ORDER_TAG: data_order(cfg),
        **source_tags("python -m graft_exp"),
        DESCRIPTION_TAG: model_description(cfg, role),
    }
    key = model_run_key(cfg, role)
    found = find_run(job.client, key)
    unfinished = found is not None and found.info.status != "FINISHED"
    if unfinished and found.data.tags.get(PARENT_TAG) != job.run_id:
        return None
    experiment_id = job.client.get_run(job.run_id).info.experiment_id
    name = f"{cfg.pair[role]}-{cfg.method.name}-s{cfg.seed}"
    run = _open(job.client, experiment_id, key, tags, name, cfg.rerun)
    if run is not None:
        if run.resumed:
            run.set_tags(common_tags(cfg))
        run.log_params(run_params(cfg))
        log_dataset_inputs(job.client, run.run_id, cfg)
    return run
