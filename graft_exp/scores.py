"""A job's score, one definition for every report (the job summary and its comparison, ``python -m analysis``'s
tables, decisions and methods): a model's final score is the mean over its evaluation runs (``eval.runs``, logged as
``test/avg`` at steps 0..R-1) of each run's unweighted benchmark average (App. B), and a job's the mean over its
models."""

from __future__ import annotations

import math
from collections.abc import Sequence


def checkpoint_score(run_averages: Sequence[float]) -> float:
    """A model's final score: the mean of its evaluation runs' benchmark averages (NaN without a run)."""
    return sum(run_averages) / len(run_averages) if len(run_averages) else math.nan


def job_score(model_scores: Sequence[float | None]):
    """A job's score: the mean over its models' final scores; None unless every model has one. Works on numbers
    and on pandas objects alike (a table's per-benchmark rows are averaged element-wise)."""
    if not len(model_scores) or any(score is None for score in model_scores):
        return None
    return sum(model_scores) / len(model_scores)
