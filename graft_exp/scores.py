"""Scores, one definition each for every report and rule. A prompt a transfer can rescue (``rescue_candidate``).
A job's score, one definition for every report (the job summary and its comparison, ``python -m analysis``'s
tables, decisions and methods): a model's final score is the mean over its evaluation runs (``eval.runs``, logged as
``test/avg`` at steps 0..R-1) of each run's unweighted benchmark average (App. B), and a job's the mean over its
models."""

from __future__ import annotations

import math
from collections.abc import Sequence


def rescue_candidate(k_receiver, k_source):
    """Whether a prompt is one a transfer can rescue: the receiver failed all its rollouts and the source solved
    it at least once (SGT's selection, App. B; GRAFT's C of eq. 3 is those with the source's k < n). Element-wise
    on success counts: tensors (the exchange, the probe) and pandas columns (the transfer log) alike."""
    return (k_receiver == 0) & (k_source >= 1)


def checkpoint_score(run_averages: Sequence[float]) -> float:
    """A model's final score: the mean of its evaluation runs' benchmark averages (NaN without a run)."""
    return sum(run_averages) / len(run_averages) if len(run_averages) else math.nan


def job_score(model_scores: Sequence[float | None]):
    """A job's score: the mean over its models' final scores; None unless every model has one. Works on numbers
    and on pandas objects alike (a table's per-benchmark rows are averaged element-wise)."""
    if not len(model_scores) or any(score is None for score in model_scores):
        return None
    return sum(model_scores) / len(model_scores)
