"""What a job found, in the terminal, read back from MLflow when it ends: each model's final score per
benchmark and their average (the best checkpoint's mean over the final evaluation runs), the selected step
and GPU-hours; for a multirun or a sweep, one table of its jobs.

Read from the store rather than from the driver's return value, so that a single run, a multirun's jobs
(other processes, other machines under Slurm) and a sweep's jobs are summarised by the same code from
the same record the analysis reads.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.table import Table

from graft_exp import schema, tracking
from graft_exp.launching import comparison
from graft_exp.scores import checkpoint_score, job_score

console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
AVG = schema.TEST + "avg"


@dataclass
class ModelResult:
    """One model run of a job: its final test scores (mean over evaluation runs), selected step, cost."""

    role: str
    model: str
    status: str
    scores: dict[str, float] = field(default_factory=dict)   # bench -> mean of test/<bench> (0..1)
    best_step: str | None = None
    gpu_hours: float | None = None


@dataclass
class JobResult:
    label: str
    status: str                  # MLflow's status of the job run, or "missing"
    gpu_hours: float | None
    models: list[ModelResult]
    method: str = ""
    seed: str = ""
    pair: str = ""
    params: dict[str, str] = field(default_factory=dict)   # the job run's params: its flattened config
    budget: float | None = None    # its equal-compute budget, if it ran under one, in ``budget_unit``
    last_step: int | None = None   # the last step it trained
    budget_unit: str | None = None  # gpu_hours | flops (``schema.CHARGES``)
    flops: float | None = None     # its counted cost (cost/flops), absent on runs from before that charge

    @property
    def pair_score(self) -> float | None:
        """The job's score: the mean over its models of each one's mean final test average (None unless every
        model was evaluated)."""
        return job_score([m.scores.get("avg") for m in self.models])


def _mean_history(client: MlflowClient, run_id: str, key: str) -> float:
    return checkpoint_score([m.value for m in client.get_metric_history(run_id, key)])


def job_result(client: MlflowClient, run, label: str) -> JobResult:
    """The result of the job run ``run`` (an MLflow Run) and its model runs."""
    children = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
    models = []
    for child in sorted(children, key=lambda r: r.data.tags.get("graft.role", "")):
        tags, metrics = child.data.tags, child.data.metrics
        tests = sorted(k for k in metrics if k.startswith(schema.TEST) and k != AVG)
        scores = {k.removeprefix(schema.TEST): _mean_history(client, child.info.run_id, k) for k in tests}
        if AVG in metrics:
            scores["avg"] = _mean_history(client, child.info.run_id, AVG)
        models.append(ModelResult(tags.get("graft.role", "?"), tags.get("graft.model", "?"), child.info.status,
                                  scores, tags.get("graft.best_step"), metrics.get("cost/gpu_hours")))
    tags = run.data.tags
    unit = schema.budget_unit(tags)
    return JobResult(label, run.info.status, run.data.metrics.get(schema.GPU_HOURS), models,
                     tags.get(schema.METHOD, ""), tags.get(schema.SEED, ""), tags.get(schema.PAIR, ""),
                     dict(run.data.params), float(tags[schema.budget_tag(unit)]) if unit else None,
                     int(tags[schema.LAST_STEP]) if schema.LAST_STEP in tags else None, unit,
                     run.data.metrics.get(schema.FLOPS))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _hours(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}" if value < 1 else f"{value:.1f}"


def job_table(result: JobResult) -> Table:
    """One job: a row per model, a column per benchmark, then the average, the selected step and cost."""
    benches = list(dict.fromkeys(b for m in result.models for b in m.scores if b != "avg"))
    table = Table(title=f"{result.label}: test % of the best checkpoint", title_justify="left")
    for column in ("model", *benches, "avg", "best step", "GPU-h"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for m in result.models:
        table.add_row(f"{m.role} {m.model}", *(_pct(m.scores.get(b)) for b in benches),
                      _pct(m.scores.get("avg")), m.best_step or "-", _hours(m.gpu_hours))
    return table


def jobs_table(results: list[JobResult], title: str) -> Table:
    """Several jobs: a row per (job, model) with its state, average test score, selected step and cost."""
    table = Table(title=title, title_justify="left")
    for column in ("job", "state", "model", "test avg %", "best step", "GPU-h (model)", "GPU-h (job)"):
        table.add_column(column, justify="right" if "%" in column or "GPU" in column or "step" in column
                         else "left")
    for result in results:
        rows = result.models or [None]
        for i, m in enumerate(rows):
            first = i == 0
            table.add_row(result.label if first else "", result.status.lower() if first else "",
                          f"{m.role} {m.model}" if m else "-", _pct(m.scores.get("avg")) if m else "-",
                          (m.best_step or "-") if m else "-", _hours(m.gpu_hours) if m else "-",
                          _hours(result.gpu_hours) if first else "")
    return table


def results_by_key(uri: str, jobs: list[tuple[str, str]], run_ids: dict[str, str] | None = None) -> list[JobResult]:
    """The newest job run of each ``(label, run_key)`` in the store at ``uri`` (any graft/ experiment): looked up by
    its key, or read by its id from ``run_ids`` (run key -> the id of its newest run) where the caller found them
    already (a sweep's last snapshot; a key it lacks has no run)."""
    client = MlflowClient(uri)
    results = []
    for label, key in jobs:
        if run_ids is None:
            run = tracking.find_run(client, key)
        else:
            run = client.get_run(run_ids[key]) if key in run_ids else None
        results.append(job_result(client, run, label) if run is not None else JobResult(label, "missing", None, []))
    return results


def print_job(uri: str, run_id: str, label: str) -> None:
    client = MlflowClient(uri)
    result = job_result(client, client.get_run(run_id), label)
    console.print(job_table(result))
    console.print(f"job cost: {_hours(result.gpu_hours)} GPU-hours (App. D: devices x training-step wall time), "
                  f"{'-' if result.flops is None else f'{result.flops:.3g}'} FLOPs counted (cost/flops)")


def print_jobs(uri: str, jobs: list[tuple[str, str]], title: str, reference: str | None = None,
               run_ids: dict[str, str] | None = None) -> bool:
    """The jobs table, then the comparison of their methods against ``reference`` (``compare_to``) wherever
    methods share seeds (``comparison``). False when the comparison could not be made: said in one line, with
    the command that makes it from the store (the jobs and their runs are recorded whatever it met).
    ``run_ids``: each key's newest run id where the caller has them (``results_by_key``)."""
    results = results_by_key(uri, jobs, run_ids)
    console.print(jobs_table(results, title))
    try:
        shown = comparison.tables(comparison.compare(results, reference))
    except Exception as err:  # noqa: BLE001 (any failure of the summary's statistics: the runs are safe)
        studies = sorted({r.params["study"] for r in results if "study" in r.params}) or ["<study>"]
        redo = " ".join(f"--experiment {schema.experiment_name(s)}" for s in studies)
        console.print(f"[red]the comparison failed:[/] {type(err).__name__}: {' '.join(str(err).split())}; the runs "
                      f"are recorded, compare them with: python -m analysis methods --tracking-uri {uri} {redo}",
                      soft_wrap=True, highlight=False)
        return False
    for table, note in shown:
        console.print(table)
        console.print(note)
    return True
