"""Real Slurm: the test session's own two-node cluster (``slurm`` fixture, tests/support/private_slurm.py), or an
opted-in real partition for the tests that are safe there. A tiny 2-job sweep through ``cluster=slurm``
into MLflow, one job per node; a job requeued mid-run that ends as one FINISHED run with every step
exactly once; a failed job; run state following the queue; and the rule itself: with a decoy "site"
Slurm answering on this machine, the suite's jobs land only on its own cluster. The jobs are real
``python -m graft_exp`` jobs on the tiny pair, kept short."""

import os
import re
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from support import ports, private_slurm
from support.private_slurm import PrivateSlurm

from graft_exp import scheduler
from graft_exp.launching import status
from graft_exp.sweep import plan

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.service, pytest.mark.slow]
# Metrics of docs/design.md's schema logged at every training step (others only when they apply).
EVERY_STEP = {"cost/gpu_hours", "train/reward_mean", "train/all_fail_frac", "exchange/A_to_B",
              "exchange/B_to_A"}
# A few steps of the tiny pair, one validation, one final evaluation: each job takes seconds.
SHORT = ["train.max_steps=4", "train.batch_prompts=4", "train.minibatch_prompts=2", "eval.val_every=4",
         "eval.runs=1", "eval.samples=1", "eval.max_problems=4", "backend.progress=false",
         "train.save_every=1"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Jobs see the submitting directory on the (here: only) node, as on a shared filesystem."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def sweep_file(path: Path, methods: list[str], seed: int = 0) -> Path:
    grid = f"{{pair: tiny, method: [{', '.join(methods)}], seed: {seed}}}"
    path.write_text(f"study: {path.stem}\nruns:\n  - {grid}\n")
    return path


def sweep_command(path: Path, workdir: Path, slurm, *extra: str, checkpoints: Path | None = None) -> list[str]:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    return [sys.executable, "-m", "graft_exp.sweep", str(path), "--out", str(workdir / "multirun"),
            "--poll", "2", "cluster=slurm", "cluster.poll_s=2", f"tracking.uri={uri}",
            f"checkpoint_root={checkpoints or workdir / 'checkpoints'}", *slurm.launcher_overrides, *SHORT, *extra]


def run_sweep(path: Path, workdir: Path, slurm, timeout: float,
              checkpoints: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(sweep_command(path, workdir, slurm, checkpoints=checkpoints), capture_output=True,
                          text=True, timeout=timeout, check=False)


def completed_jobs(cluster: PrivateSlurm) -> dict[str, dict[str, str]]:
    """The cluster's record of finished jobs (jobcomp/filetxt), by id (``12_0`` for array tasks)."""
    record = cluster.root / "log" / "jobcomp.txt"
    jobs = {}
    for line in record.read_text().splitlines() if record.exists() else []:
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        key = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}" if "ArrayJobId" in fields else fields["JobId"]
        jobs[key] = fields
    return jobs


def wait_for_completion_record(cluster: PrivateSlurm, ids: list[str], timeout: float = 120.0) -> dict[str, dict]:
    """The finished-job record once it lists every job of ``ids``: a sweep sees a job's run FINISHED in
    MLflow while the Slurm job is still exiting, and Slurm writes the record only when the job has ended."""
    deadline = time.monotonic() + timeout
    while True:
        record = completed_jobs(cluster)
        if all(i in record for i in ids) or time.monotonic() > deadline:
            return record
        time.sleep(1)


def runs_by_key(uri: str) -> dict[str, list]:
    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments(filter_string="name LIKE 'graft/%'")]
    out: dict[str, list] = {}
    for run in client.search_runs(exps, ""):
        out.setdefault(run.data.tags.get("graft.run_key"), []).append(run)
    return out


def step_counts(client: MlflowClient, run) -> dict[str, Counter]:
    return {key: Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics}


def test_two_job_sweep_through_slurm(slurm, workdir, record_property):
    path = sweep_file(workdir / "slurm2.yaml", ["graft", "grpo_n8"])
    started = time.monotonic()
    done = run_sweep(path, workdir, slurm, timeout=900)
    wall = time.monotonic() - started
    record_property("slurm_2_job_sweep_wall_s", round(wall, 1))
    print(f"\n2-job tiny sweep through cluster=slurm: {wall:.1f} s wall")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "2 jobs: 2 finished" in done.stdout

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    sweep = plan(path, [f"tracking.uri={uri}", *SHORT])
    runs = runs_by_key(uri)
    client = MlflowClient(uri)
    for sj in sweep.jobs:
        (job_run,) = runs[sj.key]
        assert job_run.info.status == "FINISHED"
        assert re.fullmatch(r"\d+_[01]", job_run.data.tags["graft.slurm_job_id"])
        assert job_run.data.tags["graft.study"] == "slurm2"
        assert Path(job_run.data.tags["graft.log"]).is_file()
        assert set(step_counts(client, job_run)["cost/gpu_hours"]) == {1, 2, 3, 4}
        for role in sj.roles:
            (model_run,) = runs[sj.job.model_keys[role]]
            assert model_run.info.status == "FINISHED"
            assert model_run.data.tags["mlflow.parentRunId"] == job_run.info.run_id

    if slurm.private is not None:
        # The jobs ran on this session's cluster, one per node (CR_LLN; two "hosts" when namespaces exist).
        ids = [runs[sj.key][0].data.tags["graft.slurm_job_id"] for sj in sweep.jobs]
        record = wait_for_completion_record(slurm.private, ids)
        assert all(record.get(i, {}).get("JobState") == "COMPLETED" for i in ids), record
        nodes = {record[i]["NodeList"] for i in ids}
        assert nodes == {n.name for n in slurm.private.members}, record
        print(f"jobs {ids} ran on nodes {sorted(nodes)} of cluster {slurm.private.cluster}")

    # Everything is finished now: a second launch submits nothing.
    again = run_sweep(path, workdir, slurm, timeout=300)
    assert again.returncode == 0 and "launching" not in again.stdout
    assert "2 jobs: 2 finished" in again.stdout


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the sweep ended while waiting for {what}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def store_has_a_run(db: Path) -> bool:
    """Read-only, so that looking never creates or migrates the store."""
    if not db.exists():
        return False
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            return conn.execute("SELECT count(*) FROM runs").fetchone()[0] > 0
    except sqlite3.Error:   # not created yet, or being created
        return False


def last_step(client: MlflowClient, run_id: str) -> int:
    history = client.get_metric_history(run_id, "cost/gpu_hours")
    return max((m.step for m in history), default=0)


def release_when_held(slurm_id: str, proc: subprocess.Popen) -> None:
    """Slurm holds a requeued job (BeginTime ~2 min ahead); release it now to keep the test short."""
    wait_for(lambda: "BeginTime" in subprocess.run(["squeue", "-h", "-r", "-j", slurm_id, "-o", "%r"],
                                                   capture_output=True, text=True, check=False).stdout,
             120, "Slurm to hold the requeued job", proc)
    subprocess.run(["scontrol", "update", f"JobId={slurm_id}", "StartTime=now"], check=True)


def test_requeued_job_resumes_its_run_with_each_step_once(slurm, own_slurm, workdir, record_property):
    """Interrupted twice: preempted (submitit's USR2 handler checkpoints and requeues the job itself),
    then requeued from outside (`scontrol requeue` kills it). The run stays RUNNING in between and
    ends as one FINISHED run in which every step is recorded once. Enough steps that the job is still
    training when the second interruption comes: submitit lets a SIGTERM pass, so a job that finishes
    within Slurm's kill grace period (KillWait) completes instead of being requeued."""
    steps = 20
    overrides = [f"train.max_steps={steps}", "eval.val_every=10"]
    path = sweep_file(workdir / "requeue.yaml", ["graft"], seed=5)
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    proc = subprocess.Popen(sweep_command(path, workdir, slurm, *overrides), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        # Opening a store with MlflowClient creates or migrates it; doing that while the launcher creates the
        # same store races MLflow's migrations ("table _alembic_tmp_experiments already exists"). So the test
        # opens it only once the store holds a run, i.e. after the launcher has finished making it.
        wait_for(lambda: store_has_a_run(workdir / "mlflow.db"), 600, "the job's run", proc)
        client = MlflowClient(uri)

        def job_run_past(step: int):
            for run in [r for rs in runs_by_key(uri).values() for r in rs]:
                if "mlflow.parentRunId" not in run.data.tags and last_step(client, run.info.run_id) >= step:
                    return run
            return None

        run = wait_for(lambda: job_run_past(3), 600, "the job to log step 3", proc)
        slurm_id = run.data.tags["graft.slurm_job_id"]
        subprocess.run(["scancel", "--signal=USR2", slurm_id], check=True)      # preemption notice
        release_when_held(slurm_id, proc)
        assert client.get_run(run.info.run_id).info.status == "RUNNING"         # resumable, not FAILED
        preempted_at = last_step(client, run.info.run_id)
        wait_for(lambda: job_run_past(preempted_at + 3), 600, "the resumed job to log 3 more steps", proc)
        subprocess.run(["scontrol", "requeue", slurm_id], check=True)
        release_when_held(slurm_id, proc)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]

    sweep = plan(path, [f"tracking.uri={uri}", *SHORT, *overrides])
    (sj,) = sweep.jobs
    runs = runs_by_key(uri)
    (job_run,) = runs[sj.key]                       # one MLflow run, not a second one after a requeue
    assert job_run.info.run_id == run.info.run_id and job_run.info.status == "FINISHED"
    assert job_run.data.tags["graft.slurm_job_id"] == slurm_id
    duplicated, lost = 0, 0
    for r in [job_run] + [runs[sj.job.model_keys[role]][0] for role in sj.roles]:
        assert r.info.status == "FINISHED"
        for key, counts in step_counts(client, r).items():
            duplicated += sum(c - 1 for c in counts.values())
            if key in EVERY_STEP:
                lost += len(set(range(1, steps + 1)) - set(counts))
    record_property("requeue_duplicated_steps", duplicated)
    print(f"\npreemption + requeue: {duplicated} duplicated steps, {lost} lost steps")
    assert (duplicated, lost) == (0, 0)
    log = Path(job_run.data.tags["graft.log"]).read_text()
    assert "this job is preempted" in log and log.count("resuming MLflow run") == 2


def test_failed_job_is_reported_as_it_fails_and_slurm_says_failed(slurm, workdir):
    """A job that cannot write its run directory fails after its run started (the checkpoint root is
    writable, so the launch-time checks pass, but ``<checkpoint_root>/<run_key>`` is a regular file): the
    sweep names it with its log while running, Slurm records FAILED (not COMPLETED) and the run is FAILED."""
    checkpoints = workdir / "checkpoints"
    checkpoints.mkdir()
    path = sweep_file(workdir / "failing.yaml", ["graft"])
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    (sj,) = plan(path, [f"tracking.uri={uri}", f"checkpoint_root={checkpoints}", *SHORT]).jobs
    (checkpoints / sj.key).write_text("")
    done = run_sweep(path, workdir, slurm, timeout=900, checkpoints=checkpoints)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    (run,) = runs_by_key(uri)[sj.key]
    assert run.info.status == "FAILED"
    log = run.data.tags["graft.log"]
    assert f"failed #0 pair=tiny method=graft seed=0: log {log}" in done.stdout
    assert "FileExistsError" in Path(log).read_text()

    def final_state():
        # The sweep reports the failure from MLflow; the job may still be exiting in Slurm.
        shown = subprocess.run(["scontrol", "show", "job", run.data.tags["graft.slurm_job_id"]],
                               capture_output=True, text=True, check=True).stdout
        state = re.search(r"JobState=(\S+)", shown).group(1)
        return None if state in ("PENDING", "RUNNING", "COMPLETING") else state
    assert wait_for(final_state, 120, "the failed job to end in Slurm") == "FAILED"


def test_state_of_a_run_follows_its_slurm_job(slurm, workdir):
    """RUNNING in MLflow is trusted only while the job is in Slurm's queue: held -> held (with the way
    out), gone -> crashed."""
    held = subprocess.run(["sbatch", "--hold", "--parsable", *slurm.sbatch_args, "--wrap", "true",
                           "-o", str(workdir / "out")],
                          capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    try:
        run = {"status": "RUNNING", "slurm_job_id": held, "log": "held.log"}
        state, hint = status.run_state(run, scheduler.slurm_queue())
        assert state == status.HELD
        assert f"scontrol release {held}" in hint and f"scancel {held}" in hint
        subprocess.run(["scancel", held], check=True)
        wait_for(lambda: held not in scheduler.slurm_queue(), 60, "the job to leave the queue")
        assert status.run_state(run, scheduler.slurm_queue()) == (status.CRASHED, "held.log")
    finally:
        subprocess.run(["scancel", held], check=False)


def test_suite_never_submits_to_a_slurm_it_did_not_start(own_slurm, tmp_path):
    """A decoy "site" cluster answers here, and SLURM_CONF points to it (as on a login node); a pytest
    session of a test that submits a job (sbatch, as submitit does) and follows it in the queue still
    passes, on a cluster of its own: the decoy's queue and its record of finished jobs stay empty, and its
    controller never received a submission. (The 2-job sweep test checks on whose nodes sweeps run.)"""
    decoy = PrivateSlurm(tmp_path / "site", nodes=1, gpus=0, netns=False).start()
    try:
        assert decoy.run("sinfo", "-h", "-o", "%T").stdout.split() == ["idle"]     # the site answers
        inner = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", f"--basetemp={tmp_path / 'inner'}",
             f"{Path(__file__)}::test_state_of_a_run_follows_its_slurm_job"],
            env={**os.environ, "SLURM_CONF": str(decoy.conf)}, cwd=ROOT, capture_output=True, text=True,
            timeout=300, check=False)
        assert inner.returncode == 0 and "1 passed" in inner.stdout, inner.stdout[-4000:] + inner.stderr[-2000:]
        assert decoy.run("squeue", "-h").stdout == ""
        assert completed_jobs(decoy) == {}
        assert "_slurm_rpc_submit_batch_job" not in (decoy.root / "log" / "slurmctld.log").read_text()
        # ... and the inner session's own controller did (tmp_path_factory.mktemp("slurm") in its basetemp).
        own = tmp_path / "inner" / "slurm0" / "log" / "slurmctld.log"
        assert "_slurm_rpc_submit_batch_job" in own.read_text()
    finally:
        decoy.stop()


def test_a_cluster_whose_ports_are_taken_before_its_daemons_bind_them_comes_up_on_others(own_slurm, tmp_path,
                                                                                          monkeypatch):
    """Between the choice of a port and a daemon's bind, another process can take it (seen in CI: a controller
    died on "Address already in use", its port held by its own node's slurmd, and the suite waited 90 s in vain).
    Here every port of the first attempt is held: the controller dies on it, the bring-up says so and starts
    again on other ports, and the cluster answers."""
    held = socket.socket()
    held.bind(("", ports.free_port()))
    draws = iter([lambda count: [held.getsockname()[1]] * count])   # the first attempt's ports: all the held one
    monkeypatch.setattr(private_slurm, "free_ports", lambda count: next(draws, ports.free_ports)(count))
    cluster = PrivateSlurm(tmp_path / "busy", nodes=1, gpus=0, netns=False)
    try:
        cluster.start()
        assert cluster.run("sinfo", "-h", "-o", "%T").stdout.split() == ["idle"]
        died = (tmp_path / "busy" / "log" / "slurmctld.log.attempt1").read_text()
        assert "fatal: slurm_init_msg_engine_port error Address already in use" in died
        assert f"SlurmctldPort={held.getsockname()[1]}\n" not in cluster.conf.read_text()
    finally:
        cluster.stop()
        held.close()
