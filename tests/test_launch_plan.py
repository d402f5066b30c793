"""``launching.callbacks.plan`` and ``refusal_before_stores``: what launching a multirun does, decided from its
jobs (composed as the launcher composes them) and what the stores hold, without Hydra's multirun or any side
effect; ``LaunchCallback`` only applies it (tests/test_resources.py, test_local_multirun.py run it through Hydra),
and its ``on_job_end`` tells a preempted submitit job from a failed one."""

from __future__ import annotations

import shutil
import signal
import subprocess

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from graft_exp import scheduler, tracking
from graft_exp.launching.callbacks import LaunchCallback, LaunchPlan, PlannedJob, plan, refusal_before_stores


@pytest.fixture
def jobs_of(compose_cfg, tmp_path, store_template):
    """The multirun's jobs for each list of overrides, on ``cluster`` (its group config: parallel, ordering), and
    their store as the callback leaves it before planning: created, empty."""
    shutil.copy(store_template, tmp_path / "store.db")

    def make(cluster: str, *points: list[str]):
        cfgs = [compose_cfg(f"cluster={cluster}", f"tracking.uri=sqlite:///{tmp_path}/store.db",
                            f"checkpoint_root={tmp_path}/ckpt", *point) for point in points]
        jobs = [PlannedJob(i, list(point), cfg) for i, (point, cfg) in enumerate(zip(points, cfgs))]
        return jobs, cfgs[0].cluster
    return make


def test_independent_jobs_run_side_by_side_each_on_a_share_of_the_cores(jobs_of, monkeypatch):
    monkeypatch.setenv(scheduler.JOB_CORES_ENV, "8")
    jobs, cluster = jobs_of("submitit_local", ["seed=0"], ["seed=1"], ["seed=2"])
    assert refusal_before_stores(jobs, cluster, OmegaConf.create({}), set()) is None
    assert plan(jobs, cluster, OmegaConf.create({}), set(), set()) == LaunchPlan(job_cores="2", monitor=True)
    jobs, cluster = jobs_of("local", ["seed=0"], ["seed=1"])
    assert plan(jobs, cluster, OmegaConf.create({}), set(), set(), reported_elsewhere=True) == \
        LaunchPlan(job_cores="1", monitor=False)


def test_jobs_that_must_not_overlap_run_in_order_on_this_machine_and_are_refused_on_slurm(jobs_of):
    points = (["method=grpo_n8", "seed=0"], ["method=graft_stored", "seed=0"])
    jobs, cluster = jobs_of("local", *points)
    launch = plan(jobs, cluster, OmegaConf.create({}), set(), set())
    assert launch.one_at_a_time == "1 graft_stored job(s) replay the log of an earlier GRPO n=8 job"
    assert launch.refusal is None and launch.job_cores is None and not launch.monitor
    jobs, cluster = jobs_of("slurm", *points)
    refused = plan(jobs, cluster, OmegaConf.create({}), set(), set()).refusal
    assert refused.startswith("nothing launched: stored-trajectory jobs have no log to replay")
    # two pairs sharing one unfinished GRPO baseline: trained twice at once on Slurm; not once it finished
    jobs, cluster = jobs_of("slurm", ["pair=tiny", "method=grpo_n8"], ["pair=tiny_ac", "method=grpo_n8"])
    assert "both train tiny-char-llama" in plan(jobs, cluster, OmegaConf.create({}), set(), set()).refusal
    finished = {tracking.model_run_key(jobs[0].cfg, "A")}
    assert plan(jobs, cluster, OmegaConf.create({}), set(), finished).refusal is None


def test_the_slurm_request_follows_the_plans_and_keeps_what_the_user_set(jobs_of):
    jobs, cluster = jobs_of("slurm", ["seed=0"], ["seed=1"])
    assert plan(jobs, cluster, OmegaConf.create({}), set(), set()) == LaunchPlan(
        slurm_request={"gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": 2}, monitor=True)
    launcher = OmegaConf.create({"mem_gb": 4})
    assert plan(jobs, cluster, launcher, {"mem_gb"}, set()).slurm_request == {"gpus_per_node": 0, "cpus_per_task": 1}
    # a request below a job's plan is refused before any store exists
    launcher = OmegaConf.create({"mem_gb": 1})
    assert "hydra.launcher.mem_gb=1 is below its plan's 2" in refusal_before_stores(jobs, cluster, launcher, {"mem_gb"})


def test_an_invalid_job_is_refused_before_any_store_is_touched(jobs_of, tmp_path):
    jobs, cluster = jobs_of("local", ["seed=0"], ["seed=1", "method.delta=1.5"])
    before = (tmp_path / "store.db").read_bytes()
    refused = refusal_before_stores(jobs, cluster, OmegaConf.create({}), set())
    assert refused.startswith("invalid configuration, nothing launched:") and "job #1" in refused
    assert (tmp_path / "store.db").read_bytes() == before


def test_a_submitit_job_whose_requeue_stopped_its_scontrol_leaves_as_preempted(monkeypatch):
    """The same preemption as ``test_a_requeue_that_stops_its_own_scontrol_is_a_preemption``, landing outside the
    training (Hydra hands the error to ``on_job_end``): the job exits as submitit does after its requeue, without
    recording a failure."""
    monkeypatch.setenv("SUBMITIT_FOLDER", "unused")
    stopped = subprocess.CalledProcessError(-signal.SIGTERM, ["scontrol", "requeue", "3"])
    with pytest.raises(SystemExit) as left:
        LaunchCallback().on_job_end(OmegaConf.create(), JobReturn(status=JobStatus.FAILED, _return_value=stopped))
    assert left.value.code == -1 and left.value.__cause__ is stopped
