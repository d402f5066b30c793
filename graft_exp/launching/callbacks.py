"""Hydra callback that closes the holes Hydra's launchers leave (every ``cluster`` option installs it).

In the launching process, before any job starts (``on_multirun_start``):
  * every job of the multirun is composed and validated, so a bad point stops the sweep at once;
  * the MLflow store and each job's experiment are created (or migrated) and the tracking server
    is checked: concurrent first-time SQLite schema creation crashes jobs, and a dead server
    must fail before submission, not in hundreds of jobs;
  * on a parallel cluster, two jobs that would train one shared GRPO baseline at the same time
    are refused (``python -m graft_exp.sweep`` orders such jobs); on ``cluster=local``
    (``cluster.in_order_when_needed``) the multirun runs its jobs one after another instead;
  * a ``graft_stored`` job whose peer GRPO n=8 log is neither in the store nor trained by an
    earlier job of this (sequential) multirun is refused;
  * every job's resource plan (``graft_exp.resources``) is checked, and on Slurm the array's request is
    set from the plans (``slurm_request``): GPUs, CPUs and memory follow from the members each job trains;
  * the jobs of a multirun on this machine learn their share of its cores (``scheduler.JOB_CORES_ENV``);
  * ``backend=verl`` jobs of one multirun on this machine (``cluster=local``) run one after another: side
    by side they would share the same GPUs; ``cluster=submitit_local`` refuses more than one;
  * submitit's "Bypassing sacct error" warning, printed at every poll where Slurm accounting is
    disabled, is reported once.
While the jobs run, a monitor thread reports each failed or crashed job with its log as soon as
MLflow or Slurm shows it (Hydra's submitit launcher would report failures only at the end).

In a job process (``on_job_end``): a failed job under submitit exits non-zero, so Slurm marks it
FAILED instead of COMPLETED (Hydra catches the exception and submitit would exit 0).
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from dataclasses import dataclass, field
from functools import cached_property

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf, read_write

from graft_exp import methods, resources, scheduler, tracking
from graft_exp.config import ConfigError, roles, trained, validate_job
from graft_exp.launching import status, summary

log = logging.getLogger("graft_exp.launch")
SWEEP_ENV = "GRAFT_SWEEP_LAUNCH"   # set by python -m graft_exp.sweep in the multiruns it starts


@dataclass
class PlannedJob:
    index: int
    overrides: list[str]
    cfg: DictConfig

    @cached_property
    def key(self) -> str:
        return tracking.run_key(self.cfg)

    @property
    def label(self) -> str:
        return f"#{self.index} ({' '.join(self.overrides) or 'defaults'})"


def multirun_jobs(config: DictConfig) -> list[PlannedJob] | None:
    """The jobs Hydra's basic sweeper will launch for ``config``, composed as the launcher will
    compose them; None for other sweepers."""
    if not config.hydra.sweeper._target_.endswith("BasicSweeper"):
        return None
    params = config.hydra.sweeper.get("params") or {}
    arguments = [*(f"{k}={v}" for k, v in params.items()), *config.hydra.overrides.task]
    parsed = OverridesParser.create().parse_overrides(arguments)
    batches = BasicSweeper.split_arguments(parsed, None)
    loader = GlobalHydra.instance().hydra.config_loader
    jobs = []
    for overrides in (ov for batch in batches for ov in batch):
        cfg = loader.load_sweep_config(config, list(overrides))
        with_hydra_removed = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        jobs.append(PlannedJob(len(jobs), list(overrides), with_hydra_removed))
    return jobs


def varying_overrides(jobs: list[PlannedJob]) -> dict[int, list[str]]:
    """Each job's overrides that not every job of the multirun shares (what the sweep varies)."""
    shared = set.intersection(*(set(job.overrides) for job in jobs)) if jobs else set()
    return {job.index: [o for o in job.overrides if o not in shared] for job in jobs}


def stored_logs_in_store(jobs: list[PlannedJob]) -> set[tuple[int, str]]:
    """(job index, peer model) of each ``graft_stored`` job's peer log its store already holds: the store asked
    once per plan, one client per store."""
    clients: dict[str, MlflowClient] = {}
    found = set()
    for job in jobs:
        for peer in tracking.stored_log_peers(job.cfg):
            uri = str(job.cfg.tracking.uri)
            client = clients.setdefault(uri, MlflowClient(uri))
            if tracking.stored_log_run(client, job.cfg, peer) is not None:
                found.add((job.index, peer))
    return found


def missing_stored_logs(jobs: list[PlannedJob], parallel: bool, in_store: set[tuple[int, str]] | None = None
                        ) -> list[str]:
    """``graft_stored`` jobs whose peer log (a FINISHED GRPO n=8 run of the model, same seed) is
    neither in the store (``in_store``: ``stored_logs_in_store``, asked here when not given) nor written first
    by an earlier job of this multirun: a sequential launcher runs jobs in order; on a parallel one the log cannot
    exist in time."""
    in_store = stored_logs_in_store(jobs) if in_store is None else in_store
    problems = []
    for job in jobs:
        peers = tracking.stored_log_peers(job.cfg)
        if not peers:
            continue
        earlier = [] if parallel else jobs[:job.index]
        replayed = tracking.replayed_method(job.cfg)
        missing = [peer for peer in peers
                   if not any(e.cfg.method.name == replayed and e.cfg.seed == job.cfg.seed
                              and peer in [e.cfg.pair[r] for r in roles(e.cfg.pair)] for e in earlier)
                   and (job.index, peer) not in in_store]
        if missing:
            problems.append(f"job {job.label} replays the GRPO n=8 log of {' and '.join(missing)} with seed "
                            f"{job.cfg.seed}: none in {job.cfg.tracking.uri}; launch `python -m graft_exp "
                            f"pair={job.cfg.pair.name} method={replayed} seed={job.cfg.seed}` first")
    return problems


class SacctWarningOnce(logging.Filter):
    """Where Slurm accounting is disabled (``sacct`` fails: common on small clusters), submitit warns
    "Bypassing sacct error" at every poll of every job. Say it once, in one line, and drop the rest:
    job states still come from submitit's own files and, in the failure monitor, from squeue."""

    reported = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Bypassing sacct error" not in record.getMessage():
            return True
        if not SacctWarningOnce.reported:
            SacctWarningOnce.reported = True
            log.warning("Slurm accounting is not available (sacct fails); job states come from submitit's "
                        "result files and squeue. Reported once: %s", record.getMessage())
        return False


def report_sacct_errors_once() -> None:
    submitit_log = logging.getLogger("submitit")
    if not any(isinstance(f, SacctWarningOnce) for f in submitit_log.filters):
        submitit_log.addFilter(SacctWarningOnce())


def fail_before_launch(message: str) -> None:
    """Stop the launching process (callback exceptions are only warnings to Hydra)."""
    log.error(message)
    raise SystemExit(2)


def shared_baseline_clashes(jobs: list[PlannedJob], finished_keys: set[str]) -> list[str]:
    """Pairs of jobs that would train one unfinished single-model run (a GRPO baseline shared by
    two pairs) concurrently."""
    owner: dict[str, PlannedJob] = {}
    clashes = []
    for job in jobs:
        if methods.co_trains(job.cfg.method):
            continue
        for role in roles(job.cfg.pair):
            key = tracking.model_run_key(job.cfg, role)
            if key in finished_keys:
                continue
            if key in owner:
                clashes.append(f"{owner[key].label} and {job.label} both train {job.cfg.pair[role]} "
                               f"({job.cfg.method.name}, seed {job.cfg.seed})")
            else:
                owner[key] = job
    return clashes


def finished_keys(uris: set[str]) -> set[str]:
    keys: set[str] = set()
    for uri in uris:
        runs = status.fetch_runs(uri)
        keys |= set(runs.loc[runs["status"] == "FINISHED", "key"])
    return keys


def order_needs(jobs: list[PlannedJob], finished: set[str], in_store: set[tuple[int, str]] | None = None
                ) -> list[str]:
    """Why the jobs of a multirun must run one after another (empty: they may overlap): shared
    GRPO baselines two of them would train (``finished``: the run keys already FINISHED), stored-trajectory
    jobs replaying an earlier job's log (``in_store``: the logs the store holds, ``stored_logs_in_store``)."""
    in_store = stored_logs_in_store(jobs) if in_store is None else in_store
    clashes = shared_baseline_clashes(jobs, finished)
    stored = set(missing_stored_logs(jobs, True, in_store)) - set(missing_stored_logs(jobs, False, in_store))
    return [f"{c} (a shared GRPO baseline)" for c in clashes] + [
        f"{len(stored)} graft_stored job(s) replay the log of an earlier GRPO n=8 job"] * bool(stored)


def trained_roles(cfg: DictConfig, finished: set[str] | None = None) -> list[str]:
    """The members the job ``cfg`` trains (``config.trained``, the driver's rule) from the model runs FINISHED in
    its store (``finished``: run keys; default: read from the job's store when it exists, creating nothing). A job
    whose runs have all finished is skipped when it starts; it is planned as a whole."""
    members = roles(cfg.pair)
    if finished is None:
        uri = cfg.tracking.uri
        db = tracking.sqlite_file(uri)
        finished = finished_keys({uri}) if db is None or db.exists() else set()
    unfinished = {role for role in members if tracking.model_run_key(cfg, role) not in finished}
    return trained(cfg.pair, methods.co_trains(cfg.method), unfinished) or members


def shared_gpus(cluster: str, jobs: list[PlannedJob]) -> str | None:
    """Why the jobs of a multirun on this machine (``cluster=local`` or ``submitit_local``) must not run side by
    side (None: they may): several ``backend=verl`` jobs would each start a Ray over the same GPUs."""
    on_gpus = [job for job in jobs if job.cfg.backend.name == "verl"]
    if cluster in ("local", "submitit_local") and len(on_gpus) > 1:
        return f"{len(on_gpus)} backend=verl jobs would share this machine's GPUs"
    return None


#: The launcher keys of a job's Slurm request, each the plan's (``resources.Plan.slurm``) unless overridden.
SLURM_KEYS = ("gpus_per_node", "cpus_per_task", "mem_gb")


def slurm_request(plans: list[resources.Plan], overridden: set[str]) -> dict[str, int]:
    """The request of one submitit array (all its jobs share one): per key, the largest any job's plan asks
    for; a key the user set (``hydra.launcher.<key>=...``, checked against the plans by ``check_plans``) stays."""
    return {key: max(plan.slurm[key] for plan in plans) for key in SLURM_KEYS if key not in overridden}


def check_plans(jobs: list[PlannedJob], finished: set[str], launcher: DictConfig,
                overridden: set[str]) -> tuple[list[resources.Plan], list[str]]:
    """Every job's plan, and a line per job whose plan cannot fit (``resources.check``) or whose overridden
    Slurm request is below its plan."""
    plans, problems = [], []
    for job in jobs:
        try:
            plan = resources.job_plan(job.cfg, trained_roles(job.cfg, finished))
            resources.check(plan, job.cfg)
        except ConfigError as err:
            problems.append(f"  job {job.label}: {err}")
            continue
        plans.append(plan)
        for key in sorted(overridden & set(SLURM_KEYS)):
            given = launcher.get(key)
            if given is not None and int(given) < plan.slurm[key]:
                problems.append(f"  job {job.label}: hydra.launcher.{key}={given} is below its plan's "
                                f"{plan.slurm[key]}: raise it, or drop the override (python -m graft_exp.plan shows "
                                "the plan)")
    return plans, problems


class FailureMonitor(threading.Thread):
    """Polls MLflow (and Slurm) for the jobs of a multirun; logs every start, finish and failure
    as it happens, with the log file of failed jobs."""

    def __init__(self, jobs: list[PlannedJob], poll_s: float):
        super().__init__(name="graft-failure-monitor", daemon=True)
        self.jobs, self.poll_s = jobs, poll_s
        self.stop = threading.Event()
        self.seen: dict[int, str] = {}

    def poll(self) -> None:
        uris = {job.cfg.tracking.uri for job in self.jobs}
        runs = {}
        for uri in uris:
            runs.update(status.newest_by_key(status.fetch_runs(uri)))
        queue = scheduler.slurm_queue()
        for job in self.jobs:
            state, log_file = status.run_state(runs.get(job.key), queue)
            if state == self.seen.get(job.index) or state in (status.MISSING, status.PENDING):
                continue
            self.seen[job.index] = state
            if state in (status.FAILED, status.CRASHED):
                log.error("job %s %s; log: %s", job.label, state.upper(), log_file or "unknown")
            elif state == status.HELD:
                log.error("job %s HELD: %s", job.label, log_file)
            else:
                log.info("job %s %s", job.label, state)

    def run(self) -> None:
        while not self.stop.wait(self.poll_s):
            try:
                self.poll()
            except (MlflowException, OSError, ValueError) as err:  # a flaky poll: the next one retries
                log.warning("failure monitor: %s", err)


@dataclass(frozen=True)
class Concurrency:
    """How a cluster runs jobs side by side (``cluster.parallel``, ``cluster.exclusive``), one reading for the launch
    plan of a multirun and for ``python -m graft_exp.sweep``, which starts multiruns."""

    parallel: bool    # a multirun's jobs run at the same time
    exclusive: bool   # a multirun's workers take this machine's cores, one job each (cluster=local)

    @classmethod
    def of(cls, cluster: DictConfig | None) -> Concurrency:
        return cls(bool(cluster and cluster.parallel), bool(cluster and cluster.get("exclusive")))

    @property
    def multiruns_overlap(self) -> bool:
        """Whether multiruns may run at the same time, each as if alone (an exclusive one's cores are counted)."""
        return self.parallel and not self.exclusive

    def sweep_cores(self) -> int | None:
        """The cores an exclusive cluster's multiruns share, together one worker per core (None: not counted)."""
        return scheduler.job_cores() if self.exclusive else None


@dataclass(frozen=True)
class LaunchPlan:
    """What launching a multirun does, decided from its jobs and what the stores already hold (``plan``) before
    anything is launched; ``LaunchCallback`` applies it."""

    refusal: str | None = None            # why nothing is launched (the launch exits 2 with it)
    one_at_a_time: str | None = None      # why the jobs run one after another, in order (the launcher's n_jobs=1)
    slurm_request: dict[str, int] = field(default_factory=dict)   # hydra.launcher keys from the jobs' plans
    job_cores: str | None = None          # scheduler.JOB_CORES_ENV for the job processes (None: their own count)
    monitor: bool = False                 # report each job's start, finish and failure as they happen


def refusal_before_stores(jobs: list[PlannedJob], cluster: DictConfig, launcher: DictConfig,
                          overridden: set[str]) -> str | None:
    """Why nothing may be created or launched, from the jobs alone: an invalid job, ``backend=verl`` jobs that
    ``cluster=submitit_local`` would start on the same GPUs, a resource plan that cannot fit."""
    problems = []
    for job in jobs:
        try:
            validate_job(job.cfg)
        except ConfigError as err:
            problems.append(f"  job {job.label}: {err}")
    if problems:
        return "invalid configuration, nothing launched:\n" + "\n".join(problems)
    sharing = shared_gpus(cluster.name, jobs)
    if sharing and cluster.name == "submitit_local":
        return (f"nothing launched: cluster=submitit_local starts all {len(jobs)} jobs at once, and {sharing}: "
                "launch them with cluster=local (one after another) or cluster=slurm")
    _, problems = check_plans(jobs, set(), launcher, overridden)
    if problems:
        return "resource plan refused, nothing launched:\n" + "\n".join(problems)
    return None


def plan(jobs: list[PlannedJob], cluster: DictConfig, launcher: DictConfig, overridden: set[str],
         finished: set[str], *, reported_elsewhere: bool = False) -> LaunchPlan:
    """How the multirun's jobs launch, once their stores exist (``finished``: the run keys FINISHED there): the
    Slurm request from the plans (a job whose other member's shared baseline finished asks for its own pool
    only); one after another where they would share GPUs or where order matters (``cluster.in_order_when_needed``:
    shared GRPO baselines, stored replay of an earlier job's log), else refused when order matters; each job's
    share of this machine's cores; refused when a stored-trajectory job has no log to replay.
    ``reported_elsewhere``: ``python -m graft_exp.sweep`` reports the jobs' states itself (no monitor)."""
    request = {}
    if cluster.name == "slurm":
        plans, _ = check_plans(jobs, finished, launcher, overridden)
        request = slurm_request(plans, overridden)
    concurrency = Concurrency.of(cluster)
    parallel, one_at_a_time = concurrency.parallel, None
    in_store = stored_logs_in_store(jobs)
    if parallel:
        one_at_a_time = shared_gpus(cluster.name, jobs)
        if one_at_a_time is None and cluster.get("in_order_when_needed"):
            one_at_a_time = "; ".join(order_needs(jobs, finished, in_store)) or None
        parallel = one_at_a_time is None
    cores = None
    if parallel and concurrency.exclusive:
        cores = "1"   # the joblib workers share this machine's cores, one each
    elif parallel and cluster.name == "submitit_local":
        cores = str(max(1, scheduler.job_cores() // len(jobs)))   # all start at once: a share each
    missing_logs = missing_stored_logs(jobs, parallel, in_store)
    if missing_logs:
        return LaunchPlan(refusal="nothing launched: stored-trajectory jobs have no log to replay:\n  "
                                  + "\n  ".join(missing_logs) + "\n(`python -m graft_exp.sweep` launches them after "
                                  "their GRPO n=8 jobs)")
    clashes = shared_baseline_clashes(jobs, finished) if parallel else []
    if clashes:
        return LaunchPlan(refusal="nothing launched: jobs running at the same time would train the same shared GRPO "
                                  "baseline twice:\n  " + "\n  ".join(clashes) + "\nLaunch the sweep with "
                                  "`python -m graft_exp.sweep` (it orders them), or these jobs one after another.")
    return LaunchPlan(one_at_a_time=one_at_a_time, slurm_request=request, job_cores=cores,
                      monitor=parallel and not reported_elsewhere)


class LaunchCallback(Callback):
    """Installed by every ``conf/cluster/*.yaml``: see the module docstring. It applies ``plan``'s decisions in
    the launching process; what it holds there (the failure monitor's thread, the multirun's jobs and stores)
    is not pickled into the jobs Hydra's submitit launcher starts."""

    def __init__(self) -> None:
        self.monitors: list[FailureMonitor] = []
        self.planned: list[PlannedJob] = []
        self.experiments: dict[tuple[str, str], str] = {}   # (store, experiment name) -> id, for the hint at the end

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        jobs = multirun_jobs(config)
        if jobs is None:
            log.warning("sweeper %s: jobs are validated one by one as they start", config.hydra.sweeper._target_)
            return
        launcher = config.hydra.launcher
        overridden = {o.split("=", 1)[0].removeprefix("hydra.launcher.")
                      for o in config.hydra.overrides.hydra if o.startswith("hydra.launcher.")}
        refusal = refusal_before_stores(jobs, config.cluster, launcher, overridden)
        if refusal:   # before any store exists: a job that cannot run creates nothing
            fail_before_launch(refusal)
        stores = {(job.cfg.tracking.uri, tracking.experiment_name(job.cfg)) for job in jobs}
        try:
            experiments = {store: tracking.ensure_store(*store) for store in sorted(stores)}
            for job in jobs:   # a store of an earlier version: re-key it before any job trains again beside it
                tracking.refuse_other_version_keys(MlflowClient(job.cfg.tracking.uri), job.cfg)
        except tracking.TrackingError as err:
            fail_before_launch(f"nothing launched: {err}")
        uris = {uri for uri, _ in stores}
        launch = plan(jobs, config.cluster, launcher, overridden, finished_keys(uris),
                      reported_elsewhere=bool(os.environ.get(SWEEP_ENV)))
        if launch.refusal:
            fail_before_launch(launch.refusal)
        with read_write(launcher):
            launcher.update(launch.slurm_request)
            if launch.one_at_a_time:
                launcher.n_jobs = 1   # the joblib launcher runs them in this order
        if launch.slurm_request:
            log.info("Slurm request per job: %s", ", ".join(f"{k}={v}" for k, v in launch.slurm_request.items()))
        if launch.one_at_a_time:
            log.info("the %d jobs run one after another, in order: %s", len(jobs), launch.one_at_a_time)
        if launch.job_cores:   # the job processes started after this inherit it
            os.environ[scheduler.JOB_CORES_ENV] = launch.job_cores
        report_sacct_errors_once()
        if launch.monitor:
            monitor = FailureMonitor(jobs, float(config.cluster.poll_s))
            monitor.start()
            self.monitors.append(monitor)
        self.planned, self.experiments = jobs, experiments
        log.info("pre-launch checks passed: %d jobs, store(s) %s", len(jobs), ", ".join(sorted(uris)))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        while self.monitors:
            monitor = self.monitors.pop()
            monitor.stop.set()
            monitor.poll()   # the last word on every job, before Hydra's own summary
        compared = True
        if not os.environ.get(SWEEP_ENV):   # python -m graft_exp.sweep prints one table for all its multiruns
            swept = varying_overrides(self.planned)
            for uri in sorted({job.cfg.tracking.uri for job in self.planned}):
                labels = [(f"#{job.index} {' '.join(swept[job.index]) or 'defaults'}", job.key)
                          for job in self.planned if job.cfg.tracking.uri == uri]
                compared &= summary.print_jobs(uri, labels, f"multirun of {len(self.planned)} jobs: results",
                                               reference=self.planned[0].cfg.compare_to if self.planned else None)
        self.planned = []
        for (uri, _), experiment_id in sorted(self.experiments.items()):
            log.info(tracking.compare_hint(uri, experiment_id))
        self.experiments = {}
        if not compared:
            raise SystemExit(1)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        if job_return.status == JobStatus.FAILED and os.environ.get("SUBMITIT_FOLDER"):
            if scheduler.requeue_under_way(job_return._return_value):   # preempted, not failed (driver.fit)
                raise SystemExit(-1) from job_return._return_value
            exit_failed_submitit_job(job_return._return_value)


def exit_failed_submitit_job(error: BaseException) -> None:
    """Record ``error`` as the submitit job's result, as submitit itself records an exception, and
    exit 1: the launching process gets the traceback without asking sacct (which clusters without
    accounting lack), and Slurm marks the job FAILED. SystemExit passes through Hydra and submitit."""
    import submitit
    from submitit.core.utils import cloudpickle_dump

    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    cloudpickle_dump(("error", text), submitit.JobEnvironment().paths.result_pickle)
    log.error("job failed (%s: %s); exiting non-zero so that the scheduler records the failure",
              type(error).__name__, error)
    raise SystemExit(1)
