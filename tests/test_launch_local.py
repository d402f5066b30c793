"""``cluster=local`` (the default): a multirun's jobs run at the same time in worker processes of
Hydra's joblib launcher, one per core, into one SQLite store created before they start; jobs that
must not overlap (a graft_stored job after the GRPO n=8 job whose log it replays) run in order."""

import shutil
import subprocess
import sys

import joblib
import pytest
from mlflow.tracking import MlflowClient

from graft_exp.launching import status

# One training step and a two-problem evaluation: seconds of training, the whole job path.
TINY = ["train.max_steps=1", "train.save_every=1", "eval.val_every=1", "eval.max_problems=2", "eval.runs=1",
        "eval.samples=1", "backend.progress=false", "cluster.poll_s=2"]


def multirun(tmp_path, store_template, *overrides):
    """Run ``python -m graft_exp -m`` on the default cluster; its output and its job runs (not the
    nested model runs) with their MLflow state and times, oldest first."""
    shutil.copy(store_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = subprocess.run([sys.executable, "-m", "graft_exp", "-m", f"tracking.uri={uri}",
                           f"hydra.sweep.dir={tmp_path / 'multirun'}", f"checkpoint_root={tmp_path / 'ckpt'}",
                           *TINY, *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=900,
                          check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    runs = status.fetch_runs(uri)
    jobs = runs[runs["parent"].isna()].sort_values("start_time")
    client = MlflowClient(uri)
    jobs["method"] = [client.get_run(r).data.tags["graft.method"] for r in jobs["run_id"]]
    return output, jobs


@pytest.mark.slow
def test_jobs_of_a_multirun_overlap_and_finish(tmp_path, store_template):
    if joblib.cpu_count() < 2:
        pytest.skip("one core: the joblib launcher runs one job at a time")
    output, jobs = multirun(tmp_path, store_template, "method=graft,sgt")
    assert "n_jobs=-1" in output and "is launching 2 jobs" in output
    assert list(jobs["status"]) == ["FINISHED", "FINISHED"], output[-4000:]
    first, second = jobs.to_dict("records")
    assert second["start_time"] < first["end_time"], "the second job started only after the first ended"
    # The jobs share the cores, one each: each job's models take turns on its core.
    job_logs = [p.read_text() for p in (tmp_path / "multirun").glob("*/__main__.log")]
    assert len(job_logs) == 2 and all("the models take turns" in text for text in job_logs), job_logs


@pytest.mark.slow
def test_a_stored_trajectory_job_runs_after_the_log_it_replays(tmp_path, store_template):
    output, jobs = multirun(tmp_path, store_template, "method=grpo_n8,graft_stored")
    assert "the 2 jobs run one after another, in order: 1 graft_stored job(s) replay the log" in output
    assert "n_jobs=1" in output
    assert list(jobs["method"]) == ["grpo_n8", "graft_stored"]
    assert list(jobs["status"]) == ["FINISHED", "FINISHED"], output[-4000:]
    grpo, stored = jobs.to_dict("records")
    assert stored["start_time"] >= grpo["end_time"]
