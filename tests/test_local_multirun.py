"""``cluster=local`` (the default): a multirun's jobs run at the same time in worker processes of
Hydra's joblib launcher, one per core, into one SQLite store created before they start; jobs that
must not overlap (a graft_stored job after the GRPO n=8 job whose log it replays) run in order."""

import re
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
    output, jobs = multirun(tmp_path, store_template, "method=graft,sgt", "compare_to=sgt")
    assert "n_jobs=-1" in output and "is launching 2 jobs" in output
    assert list(jobs["status"]) == ["FINISHED", "FINISHED"], output[-4000:]
    first, second = jobs.to_dict("records")
    assert second["start_time"] < first["end_time"], "the second job started only after the first ended"
    # It ends with one table of its jobs: a row per (job, model), the swept override as the job's name.
    assert "multirun of 2 jobs: results" in output
    assert re.search(r"#0 method=graft +│ finished +│ A tiny-char-llama", output), output[-4000:]
    assert re.search(r"#1 method=sgt +│ finished +│ A tiny-char-llama", output), output[-4000:]
    # ... then the comparison it was run for, against compare_to's method; `python -m analysis methods` gives the
    # same from the store: each job's pair score the mean of its models' mean test/avg over evaluation runs.
    assert re.search(r"tiny: test avg % .* paired vs\s+sgt", output), output[-4000:]
    check_the_comparison_of(tmp_path, jobs)
    # The jobs share the cores, one each: each job's models take turns on its core.
    job_logs = [p.read_text() for p in (tmp_path / "multirun").glob("*/__main__.log")]
    assert len(job_logs) == 2 and all("the models take turns" in text for text in job_logs), job_logs


def check_the_comparison_of(tmp_path, jobs) -> None:
    """``python -m analysis methods`` on a multirun's store: graft against sgt, by hand from MLflow's histories."""
    import pandas as pd

    from analysis.__main__ import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    pair = {}
    for run_id, method in zip(jobs["run_id"], jobs["method"]):
        children = client.search_runs([client.get_run(run_id).info.experiment_id],
                                      f"tags.`mlflow.parentRunId` = '{run_id}'")
        means = [sum(m.value for m in h) / len(h) for h in
                 (client.get_metric_history(c.info.run_id, "test/avg") for c in children)]
        pair[method] = sum(means) / len(means)
    out = tmp_path / "methods"
    assert main(["methods", "--tracking-uri", uri, "--reference", "sgt", "--out", str(out)]) == 0
    table = pd.read_csv(out / "methods.csv").set_index("method")
    assert table.loc["graft", "delta"] == pytest.approx(100 * (pair["graft"] - pair["sgt"]), abs=1e-6)
    assert table.loc["sgt", "pair mean"] == pytest.approx(100 * pair["sgt"], abs=1e-6)
    assert table.loc["graft", "paired seeds"] == 1 and (out / "methods_figure.png").stat().st_size > 0


@pytest.mark.slow
def test_a_stored_trajectory_job_runs_after_the_log_it_replays(tmp_path, store_template):
    output, jobs = multirun(tmp_path, store_template, "method=grpo_n8,graft_stored")
    assert "the 2 jobs run one after another, in order: 1 graft_stored job(s) replay the log" in output
    assert "n_jobs=1" in output
    assert list(jobs["method"]) == ["grpo_n8", "graft_stored"]
    assert list(jobs["status"]) == ["FINISHED", "FINISHED"], output[-4000:]
    grpo, stored = jobs.to_dict("records")
    assert stored["start_time"] >= grpo["end_time"]


@pytest.mark.slow
def test_a_single_run_ends_with_what_it_found_then_the_link(tmp_path, store_template):
    """``python -m graft_exp``: the last lines are each model's test score per benchmark and average (the
    mean over its evaluation runs, as MLflow holds it), its selected step and GPU-hours, then the UI link."""
    shutil.copy(store_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = subprocess.run([sys.executable, "-m", "graft_exp", f"tracking.uri={uri}", f"hydra.run.dir={tmp_path / 'run'}",
                           f"checkpoint_root={tmp_path / 'ckpt'}", *TINY, "eval.runs=2"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert "compare the runs in the MLflow UI" in lines[-1]
    assert lines[-2].startswith("job cost:") and "GPU-hours" in lines[-2]
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("tiny / graft / seed 0: test %")):]
    header = [c.strip() for c in next(line for line in lines if "model" in line and "┃" in line).split("┃")[1:-1]]
    assert header == ["model", "add", "mixed", "mul", "sub", "avg", "best step", "GPU-h"]
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in lines if line.startswith("│")}
    client = MlflowClient(uri)
    children = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  "tags.`graft.role` = 'A'")
    model = children[0]
    scores = [m.value for m in client.get_metric_history(model.info.run_id, "test/avg")]
    assert len(scores) == 2
    shown = rows["A tiny-char-llama"]
    assert shown[4] == f"{100 * sum(scores) / 2:.1f}"
    assert shown[5] == model.data.tags["graft.best_step"]
    assert shown[6] == f"{model.data.metrics['cost/gpu_hours']:.4f}"
    assert "B tiny-bpe-gpt2" in rows
