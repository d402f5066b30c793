"""Job runs and model runs: open (new, resumed or skipped by run key, a live duplicate refused), tags,
exactly-once metric logging (``TrackedRun``), and the stored-log lookup of stored-trajectory replay."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from graft_exp import environment, methods, prompts, scheduler, schema
from graft_exp.config import BUDGET_SETTINGS, budget_setting, peers, roles
from graft_exp.tracking.datasets import log_dataset_inputs
from graft_exp.tracking.identity import flatten, git_sha, model_run_key, run_key, source_tags, stable_hash
from graft_exp.tracking.spool import Spool, now_ms, send
from graft_exp.tracking.store import TrackingError, ensure_store, experiment_name

PARENT_TAG = "mlflow.parentRunId"


DESCRIPTION_TAG = "mlflow.note.content"


@dataclass
class TrackedRun:
    """One MLflow run (job or model) with batched, exactly-once metric logging. Every write is a record of
    ``tracking.spool`` (``spool.send``); once the job's spool is attached (``keep_in``), what the store does not take
    while it does not answer is kept there and sent when it answers again."""

    client: MlflowClient
    run_id: str
    resumed: bool = False
    budget: Budget | None = None   # a job's equal-compute budget, resolved once by ``open_job`` (None: steps alone)
    spool: Spool | None = None     # the job's spool (None: every write goes straight to the store)
    ended: str | None = None       # the status this process closed the run with (None: still open)
    _logged: dict[str, set[int]] = field(default_factory=dict)

    def keep_in(self, spool: Spool) -> None:
        self.spool = spool
        spool.attach(self.run_id)

    def _write(self, record: dict) -> None:
        if self.spool is None:
            send(self.client, self.run_id, record)
        else:
            self.spool.write(self.run_id, record)

    def _read(self, read):
        """``read()``, or None while the job's store does not answer."""
        return read() if self.spool is None else self.spool.read(read)

    def logged_steps(self, key: str) -> set[int] | None:
        """Steps at which ``key`` is already recorded (read once per key on resumed runs); None while the store
        does not answer and this run's steps of ``key`` are not known yet (the replay then leaves out the steps
        the run holds)."""
        if key not in self._logged:
            history = self._read(lambda: self.client.get_metric_history(self.run_id, key)) if self.resumed else []
            if history is None:
                return None
            self._logged[key] = {m.step for m in history}
        return self._logged[key]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics at ``step``, skipping any (key, step) already recorded: a resumed job that
        replays its last step neither duplicates nor drops it."""

        now = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            steps = self.logged_steps(key)
            if steps is not None:
                if step in steps:
                    continue
                steps.add(step)
            batch.append([key, float(value), now, step])
        if batch:
            self._write({"op": "metrics", "metrics": batch})

    def set_tags(self, tags: dict[str, str]) -> None:
        self._write({"op": "tags", "tags": {k: str(v) for k, v in tags.items()}})

    def log_params(self, params: dict[str, str]) -> None:
        existing = (self._read(lambda: self.client.get_run(self.run_id).data.params) if self.resumed else {}) or {}
        todo = {k: v[:6000] for k, v in params.items() if k not in existing}
        if todo:
            self._write({"op": "params", "params": todo})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._write({"op": "artifact", "local": str(path), "path": artifact_path})

    def log_artifacts(self, directory: str | Path, artifact_path: str | None = None) -> None:
        self._write({"op": "artifacts", "local": str(directory), "path": artifact_path})

    def finish(self, status: str = "FINISHED") -> None:
        self.ended = status
        self._write({"op": "status", "status": status, "end_time": now_ms()})

    @property
    def status(self) -> str:
        return self.client.get_run(self.run_id).info.status


def find_run(client: MlflowClient, key: str):
    """The newest run, in any graft/ experiment, whose graft.run_key is ``key`` (or None)."""
    exps = [e.experiment_id for e in client.search_experiments(filter_string=schema.GRAFT_EXPERIMENTS)]
    if not exps:
        return None
    runs = client.search_runs(exps, f"tags.`graft.run_key` = '{key}'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def logged_config(client: MlflowClient, run_id: str, into: Path) -> dict | None:
    """The resolved config a job run logged (``config.yaml``), or None when it logged none."""
    if not any(f.path == "config.yaml" for f in client.list_artifacts(run_id)):
        return None
    return yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", str(into))).read_text())


def _key_of(logged: dict | None) -> str | None:
    """The key this version computes from a logged config, or None (none logged, or a shape it does not read)."""
    try:
        return run_key(logged) if logged else None
    except (KeyError, TypeError, AttributeError, ValueError):
        return None


class KeyedByAnotherVersion(TrackingError):
    """The store holds this job's run under the key an earlier version computed (``python -m graft_exp.rekey``)."""


def refuse_other_version_keys(client: MlflowClient, cfg: DictConfig) -> None:
    """Raise ``KeyedByAnotherVersion`` when no run holds this job's key but a job run of the same study, pair,
    method and seed does under another key that its own logged config gives this version's key: the run of this
    very job, keyed by an earlier rule. Without this, the job would silently train it again beside the old run."""
    key = run_key(cfg)
    if cfg.rerun or find_run(client, key) is not None:
        return
    experiment = client.get_experiment_by_name(experiment_name(cfg))
    if experiment is None:
        return
    same = " and ".join(f"tags.`{tag}` = '{value}'" for tag, value in (
        (schema.METHOD, cfg.method.name), (schema.PAIR, cfg.pair.name), (schema.SEED, str(cfg.seed))))
    with tempfile.TemporaryDirectory() as tmp:
        for run in client.search_runs([experiment.experiment_id], same, max_results=50):
            if PARENT_TAG in run.data.tags or run.data.tags.get(schema.RUN_KEY) == key:
                continue
            if _key_of(logged_config(client, run.info.run_id, Path(tmp) / run.info.run_id)) == key:
                raise KeyedByAnotherVersion(
                    f"the store {cfg.tracking.uri} holds this job's run {run.info.run_id} under key "
                    f"{run.data.tags.get(schema.RUN_KEY)}, which this version computes as {key}: run `python -m "
                    f"graft_exp.rekey --tracking-uri {cfg.tracking.uri}` once (README, Upgrading), then launch again; "
                    "nothing was trained")


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
    run = client.create_run(experiment_id, tags={schema.RUN_KEY: key, **tags}, run_name=run_name)
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
    if tags.get(schema.SLURM_JOB_ID):
        if tags[schema.SLURM_JOB_ID] == me:
            return
        alive = scheduler.liveness(tags, scheduler.slurm_queue())
    elif tags.get(schema.PID) == str(os.getpid()) and not me:
        return
    else:
        alive = scheduler.liveness(tags, None)
    if alive:
        where = tags.get(schema.SLURM_JOB_ID) or f"pid {tags.get(schema.PID)} on {tags.get(schema.HOST)}"
        raise AlreadyRunning(f"run {found.info.run_id} (graft.run_key={key}) is being trained by {where}; "
                             "not starting a second copy")


def common_tags(cfg: DictConfig) -> dict[str, str]:
    """Tags of job and model runs: what the run is, and where it runs now."""
    return {
        schema.STUDY: cfg.study, schema.METHOD: cfg.method.name, schema.PAIR: cfg.pair.name,
        schema.SEED: str(cfg.seed), schema.BACKEND: cfg.backend.name,
        **scheduler.location_tags(),
    }


def key_params(cfg: DictConfig) -> dict[str, str]:
    """Short top-level params to group and filter by in the UI, beside the flattened config.
    ``delta`` is the compatibility floor of methods that gate peer responses (``methods.Method.gated``), else
    ``none``."""
    gated = methods.resolve(cfg.method).gated
    return {"method": cfg.method.name, "pair": cfg.pair.name, "seed": str(cfg.seed),
            "delta": str(cfg.method.delta) if gated else "none", "n": str(cfg.method.n),
            "backend": cfg.backend.name}


def run_params(cfg: DictConfig) -> dict[str, str]:
    """Params of job and model runs: the flattened resolved config and the short key params."""
    return {**flatten(OmegaConf.to_container(cfg, resolve=True)), **key_params(cfg)}


def job_description(cfg: DictConfig) -> str:
    pair = cfg.pair
    how = "co-trained" if methods.co_trains(cfg.method) else "each trained alone"
    members = [pair[role] for role in roles(pair)]
    kind = "pair" if len(members) == 2 else "group"
    return (f"{cfg.method.name} on {kind} {pair.name} ({' and '.join(members)}, {how}), seed {cfg.seed}, "
            f"n={cfg.method.n}, {cfg.backend.name} backend")


def model_description(cfg: DictConfig, role: str) -> str:
    peer = peer_key(cfg, role)
    replayed = methods.resolve(cfg.method).source.replays_log_of
    source = f"its stored {replayed} log" if replayed else "online"
    partner = f", peer {peer} ({source})" if methods.co_trains(cfg.method) else ""
    return f"{cfg.pair[role]} (role {role}) trained with {cfg.method.name}{partner}, seed {cfg.seed}"


class StoredLogMissing(TrackingError):
    """graft_stored's source, the peer's finished GRPO n=8 run with the same seed, is not in the store."""


def stored_log_run(client: MlflowClient, cfg: DictConfig, peer: str):
    """The run whose trajectory log ``graft_stored`` replays when ``peer`` is the source: the newest
    FINISHED GRPO n=8 model run of ``peer`` with this seed, in any graft/ experiment (or None). Any
    backend's run of that model qualifies: the model key names the weights."""
    experiments = [e.experiment_id for e in client.search_experiments(filter_string=schema.GRAFT_EXPERIMENTS)]
    if not experiments:
        return None
    query = (f"tags.`graft.method` = '{replayed_method(cfg)}' and tags.`graft.model` = '{peer}' and "
             f"tags.`graft.seed` = '{cfg.seed}' and attributes.status = 'FINISHED'")
    runs = client.search_runs(experiments, query, max_results=1, order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def replayed_method(cfg: DictConfig) -> str | None:
    """The single-model method whose trajectory logs a job replays (``methods.Source``), or None."""
    return methods.resolve(cfg.method).source.replays_log_of


def stored_log_peers(cfg: DictConfig) -> list[str]:
    """The models whose GRPO n=8 logs a job replays: both of the pair (each role replays its peer)."""
    return [cfg.pair[role] for role in roles(cfg.pair)] if replayed_method(cfg) else []


def peer_key(cfg: DictConfig, role: str) -> str:
    """``graft.peer`` of a co-trained model: its peer's model key; in a group, the other members' keys joined by ','."""
    return ",".join(cfg.pair[peer] for peer in peers(cfg.pair, role))


def data_order(cfg: DictConfig) -> str:
    """What fixes the prompts of every training step: the data, its size, the batch size and the seed,
    with batches inside epochs (a replayed log must have been written in the same order)."""
    return stable_hash({"data": cfg.pair.data, "train_size": cfg.pair.train_size, "seed": cfg.seed,
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
            f"`python -m graft_exp pair={cfg.pair.name} method={replayed_method(cfg)} seed={cfg.seed}` first")
    other = [peer for peer, run in runs.items() if run.data.tags.get(schema.DATA_ORDER) != data_order(cfg)]
    if other:
        raise StoredLogMissing(
            f"method={cfg.method.name} replays the GRPO n=8 log of {' and '.join(other)} (seed {cfg.seed}), "
            "but it was written in another data order (pair data or train_size, train.batch_prompts, or an "
            f"older batching): relaunch `python -m graft_exp pair={cfg.pair.name} method={replayed_method(cfg)} "
            f"seed={cfg.seed} rerun=true` with this job's train settings first")


class BudgetMissing(TrackingError):
    """``train.gpu_hours_of`` / ``flops_of`` names a job that has not finished (or does not exist) in the
    store, or one that never recorded the charge the budget is in."""


@dataclass(frozen=True)
class Budget:
    """A job's equal-compute budget: ``amount`` of the cost metric ``metric`` (``schema.CHARGES``)."""

    unit: str       # gpu_hours | flops
    amount: float

    @property
    def metric(self) -> str:
        return schema.CHARGES[self.unit]


def job_budget(cfg: DictConfig, client: MlflowClient) -> Budget | None:
    """The job's equal-compute budget: ``train.max_gpu_hours`` / ``max_flops``, or the final cost in that unit
    of the FINISHED job whose run key ``train.gpu_hours_of`` / ``flops_of`` names (the whole reference run, both
    models of a GRPO job: App. D's "both models"); None without a budget."""
    found = budget_setting(cfg.train)
    if found is None:
        return None
    unit, name, value = found
    if name.startswith("max_"):
        return Budget(unit, float(value))
    ref = find_run(client, str(value))
    if ref is None or ref.info.status != "FINISHED":
        state = "is not in the store" if ref is None else f"is {ref.info.status}"
        raise BudgetMissing(f"train.{name}={value}: that job {state} in {cfg.tracking.uri}; train it first "
                            f"(a sweep's `compute_of` does) or set train.max_{unit} instead")
    cost = ref.data.metrics.get(schema.CHARGES[unit])
    if cost is None:
        recorded = [metric for metric in schema.CHARGES.values() if metric in ref.data.metrics]
        instead = [f"train.{BUDGET_SETTINGS[u][1]}" for u, metric in schema.CHARGES.items() if metric in recorded]
        raise BudgetMissing(f"train.{name}={value}: that job recorded no {schema.CHARGES[unit]} (it ran before "
                            f"that charge existed; it records {', '.join(recorded) or 'no cost'}): budget with "
                            f"{' or '.join(instead) or 'an amount'} instead, or retrain it with rerun=true")
    return Budget(unit, float(cost))


def open_job(cfg: DictConfig) -> TrackedRun | None:
    """The job run of ``cfg`` (new or resumed), or None when a FINISHED run exists and not rerun.

    Raises AlreadyRunning when another live job is training this key right now, and
    StoredLogMissing (before any run is created) when a ``graft_stored`` job has no log to replay."""
    uri = cfg.tracking.uri
    experiment_id = ensure_store(uri, experiment_name(cfg))
    client = MlflowClient(uri)
    key = run_key(cfg)
    _refuse_live_duplicate(client, key)
    refuse_other_version_keys(client, cfg)
    check_stored_logs(cfg, client)
    budget = job_budget(cfg, client)
    tags = {**common_tags(cfg), schema.GIT_SHA: git_sha(), **source_tags("python -m graft_exp"),
            **environment.tags(), DESCRIPTION_TAG: job_description(cfg)}
    if budget is not None:
        tags[schema.budget_tag(budget.unit)] = repr(budget.amount)
    name = f"{cfg.pair.name}-{cfg.method.name}-s{cfg.seed}"
    job = _open(client, experiment_id, key, tags, name, cfg.rerun)
    if job is not None:
        job.budget = budget
        job.set_tags(tags)   # a resumed run records where it runs now (e.g. its new Slurm id)
        job.log_params(run_params(cfg))
        log_dataset_inputs(client, job.run_id, cfg)
    return job


def snapshot_tags(entry) -> dict[str, str]:
    """What a model run records of its catalog entry's snapshot and prompting: the prompt format as
    ``<name>@<digest>`` (the digest is what its run key holds) and the pinned revision, each where set."""
    tags = {}
    if entry.get("prompt_format"):
        fmt = prompts.prompt_format(entry.prompt_format)
        tags[schema.PROMPT_FORMAT] = f"{fmt.name}@{fmt.digest}"
    if entry.get("revision"):
        tags[schema.REVISION] = str(entry.revision)
    return tags


def open_model_run(cfg: DictConfig, job: TrackedRun, role: str) -> TrackedRun | None:
    """The model run of ``role`` under ``job`` (new or resumed), or None when this job must not
    train that model: its run is FINISHED already (e.g. a GRPO baseline trained for another pair),
    or it belongs to another job run (a shared baseline that job is training, or will resume)."""
    tags = {
        **common_tags(cfg), PARENT_TAG: job.run_id, schema.MODEL: cfg.pair[role],
        schema.PEER: peer_key(cfg, role) if methods.co_trains(cfg.method) else schema.NO_PEER,
        schema.ROLE: role, schema.N: str(cfg.method.n), schema.DATA_ORDER: data_order(cfg),
        **snapshot_tags(cfg.models[cfg.pair[role]]), **source_tags("python -m graft_exp"),
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
