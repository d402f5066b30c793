"""The end-of-job summary (graft_exp.launching.summary) read back from a real MLflow store: each model's
final test score per benchmark is the mean over its evaluation runs, the average, the selected step and
the GPU-hours are the recorded ones, and a multirun's table has a row per (job, model), a missing job
included. The terminal output of a real single run and a real 2-job multirun is checked in
tests/test_local_multirun.py."""

from __future__ import annotations

import re

import pytest

from analysis.synthetic import JobSpec, ModelSpec, write_jobs
from graft_exp.launching import status, summary


@pytest.fixture
def uri(tmp_path, new_store) -> str:
    """A store holding one finished GRAFT job on pair1 with its two model runs."""
    uri = new_store(tmp_path)
    graft = JobSpec("graft", "pair1", 0, metrics={"cost/gpu_hours": {1: 0.5, 2: 1.25}}, models=[
        ModelSpec("smollm3-3b-base", "A", peer="qwen3-1.7b-base", best_step=2,
                  test={"math500": [0.5, 0.7], "aime2024": [0.1, 0.2], "avg": [0.3, 0.45]},
                  metrics={"cost/gpu_hours": {1: 0.25, 2: 0.75}}),
        ModelSpec("qwen3-1.7b-base", "B", peer="smollm3-3b-base", best_step=1,
                  test={"math500": [0.6, 0.6], "aime2024": [0.0, 0.1], "avg": [0.3, 0.35]},
                  metrics={"cost/gpu_hours": {1: 0.25, 2: 0.5}}),
    ])
    write_jobs(uri, [graft], tmp_path / "artifacts")
    return uri


def test_a_jobs_table_has_each_models_mean_scores_step_and_cost(uri, capsys):
    run = summary.tracking.find_run(summary.MlflowClient(uri), "main-graft-pair1-0")
    summary.print_job(uri, run.info.run_id, "pair1 / graft / seed 0")
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.splitlines() if line.startswith("│")}
    # Columns: aime2024, math500, avg, best step, GPU-h (benchmarks in the order MLflow lists them).
    assert rows["A smollm3-3b-base"] == ["15.0", "60.0", "37.5", "2", "0.7500"]
    assert rows["B qwen3-1.7b-base"] == ["5.0", "60.0", "32.5", "1", "0.5000"]
    assert "job cost: 1.2 GPU-hours" in out


def test_a_multiruns_table_lists_every_job_and_says_which_are_missing(uri, capsys):
    summary.print_jobs(uri, [("#0 method=graft", "main-graft-pair1-0"), ("#1 method=sgt", "no-such-key")],
                       "multirun of 2 jobs: results")
    out = capsys.readouterr().out
    assert "multirun of 2 jobs: results" in out
    lines = [re.sub(r"\s+", " ", line) for line in out.splitlines() if line.startswith("│")]
    assert lines[0] == "│ #0 method=graft │ finished │ A smollm3-3b-base │ 37.5 │ 2 │ 0.7500 │ 1.2 │"
    assert lines[1] == "│ │ │ B qwen3-1.7b-base │ 32.5 │ 1 │ 0.5000 │ │"
    assert lines[2] == "│ #1 method=sgt │ missing │ - │ - │ - │ - │ - │"


def test_a_sweeps_results_from_its_snapshots_run_ids_are_the_lookup_by_key(uri, capsys, monkeypatch):
    """A sweep hands its last snapshot's run ids (``Snapshot.run_ids``, the newest run of each key) to the summary:
    the tables are the ones a lookup of every key prints, and no key is looked up."""
    jobs = [("#0 method=graft", "main-graft-pair1-0"), ("#1 method=sgt", "no-such-key")]
    summary.print_jobs(uri, jobs, "sweep: results")
    by_key = capsys.readouterr().out
    run_ids = {key: row["run_id"] for key, row in status.newest_by_key(status.fetch_runs(uri)).items()}
    monkeypatch.setattr(summary.tracking, "find_run", lambda *_: pytest.fail("a key looked up again"))
    summary.print_jobs(uri, jobs, "sweep: results", run_ids=run_ids)
    assert capsys.readouterr().out == by_key
