"""MLflow run lifecycle on a real SQLite store: store creation and checks before launch, skip of
FINISHED keys, resumption of unfinished ones (same run, each step once), refusal of a second live
copy, ownership of shared GRPO baselines, GPU accounting."""

import shutil
import socket
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from graft_exp import tracking


@pytest.fixture
def uri(store_template, tmp_path) -> str:
    """A fresh store per test. Absolute: MLflow caches stores by URI within a process."""
    shutil.copy(store_template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def job_cfg(compose_cfg, uri):
    """Compose a job config that tracks into this test's store."""
    return lambda *overrides: compose_cfg(*overrides, f"tracking.uri={uri}")


@pytest.fixture
def cfg(job_cfg):
    return job_cfg("method=graft", "seed=3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_store_directory_fails_with_the_fix():
    with pytest.raises(tracking.TrackingError, match="missing or not writable"):
        tracking.ensure_store("sqlite:///no/such/dir/mlflow.db", "graft/x")


def test_dead_server_fails_fast():
    started = time.monotonic()
    with pytest.raises(tracking.TrackingError, match="does not answer"):
        tracking.ensure_store(f"http://127.0.0.1:{free_port()}", "graft/x")
    assert time.monotonic() - started < 15


def test_ensure_store_is_idempotent(uri):
    first = tracking.ensure_store(uri, "graft/main")
    assert tracking.ensure_store(uri, "graft/main") == first
    assert MlflowClient(uri).get_experiment(first).name == "graft/main"


@pytest.mark.slow
def test_store_of_an_older_mlflow_is_migrated_before_launch(uri):
    """A store whose schema lacks the newest migration is brought to MLflow's head revision by the
    launching process, not by the first of many concurrent jobs."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config, _get_latest_schema_revision

    engine = sqlalchemy.create_engine(uri)
    config = _get_alembic_config(uri)
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "-1")
    with engine.connect() as conn:
        old = conn.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalar()
    assert old != _get_latest_schema_revision()
    tracking.ensure_store(uri, "graft/main")
    with engine.connect() as conn:
        assert conn.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalar() == (
            _get_latest_schema_revision())
    engine.dispose()


def test_finished_key_is_skipped_and_unfinished_key_resumed(cfg):
    job = tracking.open_job(cfg)
    assert job is not None and not job.resumed
    job.log_metrics({"cost/gpu_hours": 0.1}, step=1)
    # The process dies here (no finish): the next launch resumes the same run.
    again = tracking.open_job(cfg)
    assert again.run_id == job.run_id and again.resumed
    again.log_metrics({"cost/gpu_hours": 0.1}, step=1)    # replayed step: not logged twice
    again.log_metrics({"cost/gpu_hours": 0.2}, step=2)
    again.finish("FINISHED")
    assert tracking.open_job(cfg) is None
    history = MlflowClient(cfg.tracking.uri).get_metric_history(job.run_id, "cost/gpu_hours")
    assert sorted(m.step for m in history) == [1, 2]


@pytest.mark.parametrize("status", ["FAILED", "KILLED"])
def test_failed_or_killed_run_is_resumed_not_duplicated(cfg, status):
    job = tracking.open_job(cfg)
    job.finish(status)
    again = tracking.open_job(cfg)
    assert again.run_id == job.run_id and again.status == "RUNNING"


def test_rerun_trains_a_finished_key_again_but_resumes_its_new_run(job_cfg, uri):
    cfg = job_cfg("method=graft", "seed=4")
    tracking.open_job(cfg).finish("FINISHED")
    forced = job_cfg("method=graft", "seed=4", "rerun=true")
    new = tracking.open_job(forced)
    assert new is not None and not new.resumed
    # Requeued with rerun=true still on the command line: continues the new run, no third one.
    assert tracking.open_job(forced).run_id == new.run_id


def test_run_key_ignores_where_and_how_a_job_is_launched(job_cfg, uri):
    base = job_cfg("method=graft")
    moved = job_cfg("method=graft", "cluster=slurm", "study=other", "checkpoint_root=/elsewhere",
                    "tracking=sqlite", "hydra.launcher.partition=gpu")
    assert tracking.run_key(base) == tracking.run_key(moved)
    assert tracking.run_key(base) != tracking.run_key(job_cfg("method=graft", "seed=1"))


def test_live_copy_is_refused_dead_one_resumed(cfg):
    job = tracking.open_job(cfg)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        job.set_tags({"graft.pid": str(holder.pid), "graft.host": socket.gethostname()})
        with pytest.raises(tracking.AlreadyRunning, match=f"pid {holder.pid}"):
            tracking.open_job(cfg)
    finally:
        holder.kill()
        holder.wait()
    assert tracking.open_job(cfg).run_id == job.run_id


def test_requeued_slurm_job_resumes_its_own_run(cfg, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "41")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    job = tracking.open_job(cfg)
    assert job.client.get_run(job.run_id).data.tags["graft.slurm_job_id"] == "41_2"
    assert tracking.open_job(cfg).run_id == job.run_id


def test_shared_grpo_baseline_belongs_to_the_job_that_started_it(job_cfg, uri):
    """pair1 and pair2 both hold Qwen3: the pair2 GRPO job neither trains nor resumes pair1's
    unfinished Qwen3 baseline, and skips it once it is finished."""
    pair1 = job_cfg("pair=pair1", "method=grpo_n8")
    pair2 = job_cfg("pair=pair2", "method=grpo_n8")
    assert tracking.model_run_key(pair1, "B") == tracking.model_run_key(pair2, "B")
    job1 = tracking.open_job(pair1)
    qwen = tracking.open_model_run(pair1, job1, "B")
    job2 = tracking.open_job(pair2)
    assert tracking.open_model_run(pair2, job2, "B") is None           # pair1 is training it
    octo = tracking.open_model_run(pair2, job2, "A")
    assert octo is not None
    assert tracking.open_model_run(pair1, job1, "B").run_id == qwen.run_id   # pair1's resume
    qwen.finish("FINISHED")
    assert tracking.open_model_run(pair2, job2, "B") is None           # finished: shared
    tags = MlflowClient(uri).get_run(octo.run_id).data.tags
    assert (tags["graft.model"], tags["graft.peer"], tags[tracking.PARENT_TAG]) == (
        "octothinker-3b-hybrid-base", "none", job2.run_id)


def test_accounted_gpus(compose_cfg, monkeypatch):
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    assert tracking.accounted_gpus(compose_cfg("pair=pair1")) == 4
    assert tracking.accounted_gpus(compose_cfg("pair=tiny")) == 1
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert tracking.accounted_gpus(compose_cfg("pair=pair1")) == 16
