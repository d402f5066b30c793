"""``python -m graft_exp``: compose pair x method x seed, validate, open the job's MLflow run, and hand it
to the driver (``driver.fit``) with the configured backend."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from graft_exp import resources, schema, tracking
from graft_exp.config import ConfigError, register_schemas
from graft_exp.launching import summary

log = logging.getLogger("graft_exp")
register_schemas()


def check_launch_mode(cfg: DictConfig) -> None:
    """Hydra applies a launcher to multiruns only: ``cluster=slurm`` without ``-m`` would train in
    the foreground, here, on the login machine. Stop and give the command that submits it."""
    hydra_cfg = HydraConfig.get()
    if cfg.cluster.name != "local" and hydra_cfg.mode == RunMode.RUN:
        command = " ".join(["python -m graft_exp -m", *hydra_cfg.overrides.task])
        raise ConfigError(f"cluster={cfg.cluster.name} launches multiruns only (Hydra runs a single job here, "
                          f"in this process); nothing launched. Submit it as a one-job sweep: {command}")


@contextmanager
def job_temporary_folder() -> Iterator[str]:
    """The job's temporary files (vLLM's sockets, verl's checkpoint locks, torch's and multiprocessing's scratch,
    in every process the job starts: they inherit ``TMPDIR``) in a folder of its own, removed when the job ends
    however it ends; the next job of a multirun's process gets its own."""
    folder = tempfile.mkdtemp(prefix="graft-job-")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    try:
        yield folder
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        shutil.rmtree(folder, ignore_errors=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        check_launch_mode(cfg)
        resources.check_job(cfg)
    except ConfigError as err:
        # A bad override stops the whole sweep before any training, with one clear line.
        log.error("invalid configuration: %s", err)
        raise SystemExit(2) from err
    # The loop and the backends import torch (a second): a bad config has failed before it.
    from graft_exp import driver
    from graft_exp.backends import backend_factory
    try:
        driver.check_newest_checkpoint(cfg)
    except driver.CheckpointError as err:
        log.error("invalid configuration: %s", err)
        raise SystemExit(2) from err
    try:
        # What an earlier start of this job kept while its store did not answer goes first (a fresh run would
        # empty the directory that holds it); then the run is opened as the store now holds it.
        tracking.send_left(driver.run_directory(cfg), cfg.tracking.uri)
        job = tracking.open_job(cfg)
    except tracking.AlreadyRunning as err:
        log.warning("skip: %s", err)
        return
    except tracking.TrackingError as err:
        log.error("%s", err)
        raise SystemExit(2) from err
    if job is None:
        log.info("skip %s/%s seed %s: a FINISHED run with graft.run_key=%s exists (rerun=true forces)",
                 cfg.pair.name, cfg.method.name, cfg.seed, tracking.run_key(cfg))
        return
    if job.resumed:
        log.info("resuming MLflow run %s (graft.run_key=%s)", job.run_id, tracking.run_key(cfg))
    lead = HydraConfig.get().launcher.get("signal_delay_s")
    if lead is not None:   # the checkpoint a warned job writes must fit in it (python -m graft_exp.preflight)
        job.set_tags({schema.SIGNAL_LEAD: int(lead)})
    # The driver closes the job's runs (FINISHED, FAILED, KILLED). A preempted or timed-out Slurm job leaves
    # through SystemExit (submitit checkpoints, requeues and exits): the runs stay RUNNING, and the requeued
    # job resumes them by their run_key.
    with job_temporary_folder():
        try:
            driver.fit(cfg, job, backend_factory(cfg.backend.name))
        except tracking.SpoolError as err:
            log.error("%s", err)
            raise SystemExit(1) from None
    if job.spool.pending:   # the store has not answered: nothing to read a summary from (the spool's line said so)
        return
    if HydraConfig.get().mode == RunMode.RUN:   # a multirun prints one table of its jobs, and the link, at its end
        summary.print_job(cfg.tracking.uri, job.run_id, f"{cfg.pair.name} / {cfg.method.name} / seed {cfg.seed}")
        log.info(tracking.compare_hint(cfg.tracking.uri, job.client.get_run(job.run_id).info.experiment_id))


if __name__ == "__main__":
    main()
