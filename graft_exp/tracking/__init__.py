"""MLflow records of docs/design.md's schema: job runs, model runs, run identity and resumption.

Modules by job: ``identity`` (run keys, params, code version), ``store`` (checks before launch, store
creation, UI links), ``runs`` (opening, resuming, tags, exactly-once logging, stored logs), ``datasets``
(dataset inputs), ``spool`` (what a job's runs log while the store does not answer, kept in the job's
directory and sent when it answers again). The names callers use are re-exported here (``tracking.open_job``, ...).

A job's identity is ``graft.run_key``, a hash of its resolved config without launcher, tracking
and path settings. Opening a job finds the run with that key: FINISHED -> skipped, unfinished ->
the same run is resumed (a requeued or re-launched job never creates a second run), none -> a new
run. Model runs carry their own key, so a GRPO baseline of one (model, n, seed) is found and
shared by every pair that contains that model.

Besides docs/design.md's ``graft.*`` tags, runs carry what the MLflow UI reads: experiments are tagged
as model-training experiments, runs have MLflow's source tags (git commit, entry point), short
top-level params (method, pair, seed, delta, n, backend) next to the flattened config, a one-line
description, and each model run its training and benchmark data as dataset inputs.
"""

from graft_exp.tracking.datasets import dataset_inputs, log_dataset_inputs
from graft_exp.tracking.identity import (
    flatten,
    git_sha,
    identity,
    model_run_key,
    resolved_config,
    run_key,
    source_tags,
)
from graft_exp.tracking.runs import (
    DESCRIPTION_TAG,
    PARENT_TAG,
    AlreadyRunning,
    Budget,
    BudgetMissing,
    KeyedByAnotherVersion,
    StoredLogMissing,
    TrackedRun,
    check_stored_logs,
    common_tags,
    data_order,
    find_run,
    job_budget,
    job_description,
    key_params,
    logged_config,
    model_description,
    open_job,
    open_model_run,
    refuse_other_version_keys,
    replayed_method,
    run_params,
    stored_log_peers,
    stored_log_run,
)
from graft_exp.tracking.spool import SPOOL_DIR, OtherStore, Spool, SpoolError, StoreDown, send_left
from graft_exp.tracking.store import (
    EXPERIMENT_TAGS,
    TrackingError,
    check_credentials,
    check_store,
    compare_hint,
    create_sqlite_store,
    empty_store_template,
    ensure_store,
    experiment_name,
    sqlite_file,
    ui_link,
)

__all__ = [
    "DESCRIPTION_TAG",
    "EXPERIMENT_TAGS",
    "PARENT_TAG",
    "SPOOL_DIR",
    "AlreadyRunning",
    "Budget",
    "BudgetMissing",
    "KeyedByAnotherVersion",
    "OtherStore",
    "Spool",
    "SpoolError",
    "StoreDown",
    "StoredLogMissing",
    "TrackedRun",
    "TrackingError",
    "check_credentials",
    "check_store",
    "check_stored_logs",
    "common_tags",
    "compare_hint",
    "create_sqlite_store",
    "data_order",
    "dataset_inputs",
    "empty_store_template",
    "ensure_store",
    "experiment_name",
    "find_run",
    "flatten",
    "git_sha",
    "identity",
    "job_budget",
    "job_description",
    "key_params",
    "log_dataset_inputs",
    "logged_config",
    "model_description",
    "model_run_key",
    "open_job",
    "open_model_run",
    "refuse_other_version_keys",
    "replayed_method",
    "resolved_config",
    "run_key",
    "run_params",
    "send_left",
    "source_tags",
    "sqlite_file",
    "stored_log_peers",
    "stored_log_run",
    "ui_link",
]
