"""Reading a job's MLflow records back in tests: metric histories and the model runs under a job run."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from graft_exp import schema


def histories(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run as its sorted (step, value) history."""
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in run.data.metrics}


def model_runs(client: MlflowClient, job_id: str) -> dict[str, object]:
    """The model runs (children) of a job run, by role."""
    exp = client.get_run(job_id).info.experiment_id
    runs = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{job_id}'")
    return {r.data.tags["graft.role"]: r for r in runs}


def assert_same_records(got: dict[str, list[tuple[int, float]]], expected: dict[str, list[tuple[int, float]]],
                        label: str = "") -> None:
    """Two runs' ``histories`` alike: the metrics measured on the clock (``schema.WALL_CLOCK``) at the same steps,
    every other metric bit for bit."""
    got, expected = dict(got), dict(expected)
    for key in schema.WALL_CLOCK:
        assert [s for s, _ in got.pop(key, [])] == [s for s, _ in expected.pop(key, [])], (label, key)
    assert got == expected, label
