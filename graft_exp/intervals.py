"""The one paired interval every comparison of this project reports: the Student-t interval of a mean difference
over seeds (the job summary's comparison, ``python -m analysis`` tables and decisions, the sweep's adjusted
intervals of ``--until-decided``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats


def t_halfwidth(values: Sequence[float], level: float = 0.95) -> float:
    """Half-width of the Student-t ``level`` interval of the mean of ``values`` (n - 1 degrees of freedom); NaN
    below two values."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return math.nan
    return float(stats.t.ppf(0.5 + level / 2, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))


def paired_interval(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of the paired differences ``diffs`` (one per seed both sides ran): pairing removes the
    seed-to-seed spread both share, e.g. the prompt order. Low and high are NaN below two pairs."""
    diffs = np.asarray(diffs, dtype=float)
    mean = float(diffs.mean()) if len(diffs) else math.nan
    half = t_halfwidth(diffs, level)
    return mean, mean - half, mean + half
