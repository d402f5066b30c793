"""The one paired interval every comparison of this project reports: the Student-t interval of a mean difference
over seeds (the job summary's comparison, ``python -m analysis`` tables and decisions, the sweep's adjusted
intervals of ``--until-decided``); and rliable's probability of improvement and IQM beside it (Agarwal et al.,
"Deep RL at the edge of the statistical precipice", 2021), where there are enough seeds.

"±" means one thing in every product of the project (the job summary, the tables, the decisions): the sample
standard deviation (n - 1) of the values averaged, ``mean_sd``; each table's header names over what (seeds, or the
evaluation runs of one checkpoint). The standard error of a mean is ``standard_error``, shown only where a column
says so."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import numpy as np


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """The mean of ``values`` and their sample standard deviation (n - 1): the two sides of every "±" the project
    prints (App. C: "mean and sample standard deviation"). NaN for what no value, or one, cannot give."""
    values = np.asarray(values, dtype=float)
    mean = float(values.mean()) if len(values) else math.nan
    return mean, float(values.std(ddof=1)) if len(values) > 1 else math.nan


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values``: their sample standard deviation / sqrt(n); NaN below two."""
    return mean_sd(values)[1] / math.sqrt(len(values)) if len(values) > 1 else math.nan


def t_halfwidth(values: Sequence[float], level: float = 0.95) -> float:
    """Half-width of the Student-t ``level`` interval of the mean of ``values`` (n - 1 degrees of freedom); NaN
    below two values."""
    # Here, not above: a launcher's checks, dry runs and refusals import this module and never ask for a t quantile
    # (scipy.stats: 0.6 s of each; a job that trains has it through transformers anyway).
    from scipy import stats

    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return math.nan
    return float(stats.t.ppf(0.5 + level / 2, len(values) - 1) * standard_error(values))


def paired_interval(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of the paired differences ``diffs`` (one per seed both sides ran): pairing removes the
    seed-to-seed spread both share, e.g. the prompt order. Low and high are NaN below two pairs."""
    diffs = np.asarray(diffs, dtype=float)
    mean = float(diffs.mean()) if len(diffs) else math.nan
    half = t_halfwidth(diffs, level)
    return mean, mean - half, mean + half


#: Stratified-bootstrap resamples of rliable's intervals, and their seed: the same runs give the same intervals in
#: the job summary, ``analysis methods`` and ``analysis decisions``, every time.
BOOTSTRAP_REPS = 2000
BOOTSTRAP_SEED = 0


def rliable_measures(method: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Probability of improvement (method over reference) and both IQMs, each with its 95%
    stratified-bootstrap interval (``rliable``; one task: the pair average)."""
    return dict(_rliable_measures(tuple(np.ravel(method).astype(float)), tuple(np.ravel(reference).astype(float))))


# A pure function of the scores (its resamples seeded) and a comparison's costliest step (4,000 resamples, ~2 s on
# one core): a process that reports the same scores again (each report of one store) gets the first answer.
@functools.lru_cache(maxsize=1024)
def _rliable_measures(method: tuple[float, ...], reference: tuple[float, ...]) -> tuple[tuple[str, float], ...]:
    from rliable import library as rly
    from rliable import metrics

    x, y = np.array(method).reshape(-1, 1), np.array(reference).reshape(-1, 1)
    iqm = lambda scores: np.array([metrics.aggregate_iqm(scores)])
    # rliable's stratified bootstraps draw their resamples from NumPy's global stream whatever their random_state:
    # seeded here, and the caller's stream put back.
    # Its per-measure progress lines ("Calculating estimates for m ...") would stand between a multirun's jobs table
    # and its comparison: its logger says warnings only while it runs.
    saved, progress = np.random.get_state(), logging.getLogger("absl")
    progress_level = progress.level
    np.random.seed(BOOTSTRAP_SEED)
    progress.setLevel(logging.WARNING)
    try:
        points, cis = rly.get_interval_estimates({"m": x, "r": y}, iqm, reps=BOOTSTRAP_REPS)
        poi_point, poi_ci = rly.get_interval_estimates({"p": (x, y)}, metrics.probability_of_improvement,
                                                       reps=BOOTSTRAP_REPS)
    finally:
        np.random.set_state(saved)
        progress.setLevel(progress_level)
    (poi,), (poi_lo, poi_hi) = np.ravel(poi_point["p"]), np.ravel(poi_ci["p"])   # one task: shapes (1,), (2, 1)
    return (("P(improve)", float(poi)), ("P(improve) lo", float(poi_lo)), ("P(improve) hi", float(poi_hi)),
            ("IQM method", float(points["m"][0])), ("IQM method lo", float(cis["m"][0, 0])),
            ("IQM method hi", float(cis["m"][1, 0])),
            ("IQM ref", float(points["r"][0])), ("IQM ref lo", float(cis["r"][0, 0])), ("IQM ref hi", float(cis["r"][1, 0])))
