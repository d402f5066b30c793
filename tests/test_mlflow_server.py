"""A real ``mlflow server`` with basic auth on a real PostgreSQL (``python -m graft_exp.server``):
4 tiny jobs of one user, 12 runs, write into it at the same time (``cluster=submitit_local tracking=server``,
twice as many jobs as the CI machine has cores) and every metric of every job is there afterwards; a dead
server stops a sweep before anything is launched."""

import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from support.ports import free_port

from graft_exp.server import read_credentials
from graft_exp.sweep import plan

pytestmark = [pytest.mark.service, pytest.mark.slow]
# Metrics of docs/design.md's schema logged at every training step (others only when they apply).
EVERY_STEP = {"cost/gpu_hours", "train/reward_mean", "train/all_fail_frac", "exchange/A_to_B",
              "exchange/B_to_A"}
STEPS = 3
# Short tiny jobs (2 rollouts per prompt): the test is about many writers at once, not about learning.
SHORT = [f"train.max_steps={STEPS}", "method.n=2", "train.batch_prompts=4", "train.minibatch_prompts=2",
         "eval.val_every=3", "eval.runs=1", "eval.samples=1", "eval.max_problems=4", "backend.progress=false",
         "train.save_every=3"]


def postgres_installed() -> bool:
    return any(Path("/usr/lib/postgresql").glob("*/bin/initdb"))


#: Where the module's server keeps its data and its PostgreSQL's port (set by ``mlflow_server``).
SERVER = {}


@pytest.fixture(scope="module")
def mlflow_server():
    """``python -m graft_exp.server`` on loopback for this module's tests, with a user that writes;
    stopped after them. Yields (URI, username, password)."""
    if not postgres_installed():
        pytest.skip("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb); CI installs "
                    "the `postgresql` Debian package in .ci/run")
    # As root PostgreSQL runs as `postgres`, which cannot enter pytest's private temporary directory.
    where = Path(tempfile.mkdtemp(prefix="graft-mlflow-server-"))
    where.chmod(0o711)
    port, pg_port = free_port(), free_port()
    SERVER.update(dir=where, pg_port=pg_port)

    def server(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "graft_exp.server", *args, "--dir", str(where)],
                              capture_output=True, text=True, timeout=400, check=False)
    try:
        started = server("start", "--host", "127.0.0.1", "--port", str(port), "--pg-port", str(pg_port),
                         "--workers", "2")
        assert started.returncode == 0, started.stderr
        added = server("add-user", "jobs")
        assert added.returncode == 0, added.stderr
        yield (f"http://127.0.0.1:{port}", *read_credentials(where / "users" / "jobs.credentials"))
    finally:
        server("stop")
        shutil.rmtree(where, ignore_errors=True)


def test_concurrent_jobs_lose_no_metric(mlflow_server, tmp_path, monkeypatch, record_property,
                                              exclusive_memory):
    uri, user, password = mlflow_server
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    path = tmp_path / "concurrent.yaml"
    path.write_text("study: concurrent\nruns:\n"
                    "  - {pair: tiny, method: [graft, grpo_n8], seed: [0, 1]}\n")
    common = ["cluster=submitit_local", "cluster.poll_s=2", "tracking=server",
              f"checkpoint_root={tmp_path / 'checkpoints'}", *SHORT]
    with exclusive_memory():   # four jobs, each with torch and two models: ~4 GB
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "graft_exp.sweep", str(path), "--out",
                               str(tmp_path / "multirun"), "--poll", "2", *common],
                              capture_output=True, text=True, timeout=1200, check=False)
    print(f"\n4 concurrent tiny jobs into mlflow server + PostgreSQL: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    sweep = plan(path, common)
    assert len(sweep.jobs) == 4
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("graft/concurrent")
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
    record_property("metrics_lost_concurrent_writers", lost)
    print(f"{len(runs)} concurrent runs: {lost} of {expected} per-step metric values lost, {duplicated} duplicated")
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


def test_a_postgresql_uri_as_postgresql_writes_it_works_with_the_server_extra(mlflow_server):
    """``postgresql://user:pw@host:port/db`` as a tracking URI: SQLAlchemy 2.1 reads it as psycopg 3, which
    the server extra does not install; graft_exp lets it use the psycopg2 the extra installs, so a store is
    created and a run written through the URI exactly as PostgreSQL's documentation writes it."""
    import importlib.util

    import psycopg2

    from graft_exp import tracking

    assert importlib.util.find_spec("psycopg") is None, "psycopg 3 is installed: this test shows nothing"
    password = (SERVER["dir"] / "secrets" / "postgres.password").read_text().strip()
    admin = psycopg2.connect(host="127.0.0.1", port=SERVER["pg_port"], user="mlflow", password=password,
                             dbname="mlflow")
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute("DROP DATABASE IF EXISTS direct_uri")
        cur.execute("CREATE DATABASE direct_uri")
    admin.close()
    uri = f"postgresql://mlflow:{password}@127.0.0.1:{SERVER['pg_port']}/direct_uri"
    experiment_id = tracking.ensure_store(uri, "graft/direct-uri")
    client = MlflowClient(uri)
    run = client.create_run(experiment_id)
    client.log_metric(run.info.run_id, "cost/gpu_hours", 0.5, step=1)
    assert client.get_metric_history(run.info.run_id, "cost/gpu_hours")[0].value == 0.5
    # The same database with a wrong password: one line naming the database (password hidden) and the fix.
    with pytest.raises(tracking.TrackingError, match=r"postgresql://mlflow:\*\*\*@127.0.0.1.* start it, or fix"):
        tracking.check_store(f"postgresql://mlflow:wrong@127.0.0.1:{SERVER['pg_port']}/direct_uri")
