"""A real ``mlflow server`` with basic auth on a real PostgreSQL (``python -m graft_exp.server``):
8 tiny jobs of one user write into it at the same time (``cluster=submitit_local tracking=server``)
and every metric of every job is there afterwards; a dead server stops a sweep before anything is
launched."""

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from graft_exp.server import read_credentials
from graft_exp.sweep import plan

pytestmark = [pytest.mark.service, pytest.mark.slow]
# Metrics of docs/design.md's schema logged at every training step (others only when they apply).
EVERY_STEP = {"cost/gpu_hours", "train/reward_mean", "train/all_fail_frac", "exchange/A_to_B",
              "exchange/B_to_A"}
STEPS = 3
# Short tiny jobs (2 rollouts per prompt): the test is about 8 writers at once, not about learning.
SHORT = [f"train.max_steps={STEPS}", "method.n=2", "train.batch_prompts=4", "train.minibatch_prompts=2",
         "eval.val_every=3", "eval.runs=1", "eval.samples=1", "eval.max_problems=4", "backend.progress=false",
         "train.save_every=3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_installed() -> bool:
    return any(Path("/usr/lib/postgresql").glob("*/bin/initdb"))


@pytest.fixture(scope="session")
def mlflow_server():
    """``python -m graft_exp.server`` on loopback for this test session, with a user that writes;
    stopped at its end. Yields (URI, username, password)."""
    if not postgres_installed():
        pytest.skip("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb); CI installs "
                    "the `postgresql` Debian package in .ci/run")
    # As root PostgreSQL runs as `postgres`, which cannot enter pytest's private temporary directory.
    where = Path(tempfile.mkdtemp(prefix="graft-mlflow-server-"))
    where.chmod(0o711)
    port = free_port()

    def server(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "graft_exp.server", *args, "--dir", str(where)],
                              capture_output=True, text=True, timeout=400, check=False)
    try:
        started = server("start", "--host", "127.0.0.1", "--port", str(port), "--pg-port", str(free_port()),
                         "--workers", "2")
        assert started.returncode == 0, started.stderr
        added = server("add-user", "jobs")
        assert added.returncode == 0, added.stderr
        yield (f"http://127.0.0.1:{port}", *read_credentials(where / "users" / "jobs.credentials"))
    finally:
        server("stop")
        shutil.rmtree(where, ignore_errors=True)


def test_eight_concurrent_jobs_lose_no_metric(mlflow_server, tmp_path, monkeypatch, record_property):
    uri, user, password = mlflow_server
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    path = tmp_path / "concurrent8.yaml"
    path.write_text("study: concurrent8\nruns:\n"
                    "  - {pair: tiny, method: [graft, grpo_n8], seed: [0, 1, 2, 3]}\n")
    common = ["cluster=submitit_local", "cluster.poll_s=2", "tracking=server",
              f"checkpoint_root={tmp_path / 'checkpoints'}", *SHORT]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "graft_exp.sweep", str(path), "--out",
                           str(tmp_path / "multirun"), "--poll", "2", *common],
                          capture_output=True, text=True, timeout=1200, check=False)
    print(f"\n8 concurrent tiny jobs into mlflow server + PostgreSQL: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    sweep = plan(path, common)
    assert len(sweep.jobs) == 8
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("graft/concurrent8")
    runs = client.search_runs([exp.experiment_id], "")
    by_key = {r.data.tags["graft.run_key"]: r for r in runs}
    expected, lost, duplicated = 0, 0, 0
    for sj in sweep.jobs:
        job_run = by_key[sj.key]
        assert job_run.info.status == "FINISHED"
        children = [by_key[sj.job.model_keys[role]] for role in ("A", "B")]
        for run in [job_run, *children]:
            assert run.info.status == "FINISHED"
            per_step = [k for k in run.data.metrics if k in EVERY_STEP]
            assert per_step, f"run {run.info.run_id} logged no per-step metric"
            for key in per_step:
                counts = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
                expected += STEPS
                lost += len(set(range(1, STEPS + 1)) - set(counts))
                duplicated += sum(c - 1 for c in counts.values())
    record_property("metrics_lost_8_writers", lost)
    print(f"8 concurrent writers: {lost} of {expected} per-step metric values lost, {duplicated} duplicated")
    assert (lost, duplicated) == (0, 0)


def test_dead_server_stops_the_sweep_before_submission(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    done = subprocess.run([sys.executable, "-m", "graft_exp", "-m", "method=graft,sgt", "tracking=server",
                           "cluster=submitit_local", f"hydra.sweep.dir={tmp_path / 'multirun'}"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0
    assert f"the MLflow tracking server {dead} does not answer" in done.stdout + done.stderr
    assert not (tmp_path / "multirun" / ".submitit").exists()      # nothing was submitted
