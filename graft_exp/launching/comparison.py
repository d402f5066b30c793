"""The comparison a multirun or a sweep was run for, printed below its jobs table wherever methods share seeds: per
pair and method the mean ± standard error over seeds of each model's and the pair's average final test score (a
job's score: the mean over its evaluation runs, as ``summary.JobResult.pair_score``), each method against a
reference (GRPO n=8 where it ran, else the first method launched) as the mean paired difference with its 95 %
Student-t interval (``intervals.paired_interval``), the mean cost per job, and the settings the compared jobs
differ in besides method and seed (a comparison across unequal settings is flagged, not hidden)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

from graft_exp.intervals import paired_interval
from graft_exp.tracking.identity import NON_IDENTITY_KEYS

REFERENCE = "grpo_n8"
#: Params that name the compared things themselves, or say where a job ran: not a difference in settings.
COMPARED = ("method", "seed", "delta", "n", "pair", "backend")


@dataclass
class MethodRow:
    """One method's jobs of one pair, by seed."""

    method: str
    models: list[str]                       # "A qwen3-1.7b-base", ...
    scores: dict[str, dict[str, float]]     # seed -> {model label or "pair": score}
    gpu_hours: list[float]


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (NaN below two values) of ``values``."""
    n = len(values)
    mean = sum(values) / n
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else math.nan
    return mean, se


def method_rows(results: list) -> dict[str, list[MethodRow]]:
    """The finished, fully evaluated jobs by pair and method, in launch order."""
    pairs: dict[str, dict[str, MethodRow]] = {}
    for job in results:
        if job.status != "FINISHED" or job.pair_score is None:
            continue
        models = [f"{m.role} {m.model}" for m in job.models]
        row = pairs.setdefault(job.pair, {}).setdefault(job.method, MethodRow(job.method, models, {}, []))
        row.scores[job.seed] = {**{label: m.scores["avg"] for label, m in zip(models, job.models)},
                                "pair": job.pair_score}
        if job.gpu_hours is not None:
            row.gpu_hours.append(job.gpu_hours)
    return {pair: list(rows.values()) for pair, rows in pairs.items()}


def differing_settings(results: list) -> list[str]:
    """The settings (flattened config keys) whose values differ among ``results`` besides method and seed and
    where or how they ran, as ``key: value, value`` lines."""
    keys = sorted({k for job in results for k in job.params})
    lines = []
    for key in keys:
        top = key.split(".")[0]
        if top in NON_IDENTITY_KEYS or top == "method" or key in COMPARED:
            continue
        values = sorted({job.params.get(key, "<unset>") for job in results})
        if len(values) > 1:
            lines.append(f"{key}: {', '.join(values)}")
    return lines


def _pct(mean: float, se: float) -> str:
    return f"{100 * mean:.1f}" + ("" if math.isnan(se) else f" ± {100 * se:.1f}")


def tables(results: list) -> list[tuple[Table, str]]:
    """Per pair whose methods share seeds: the comparison table and its note (reference, what differs)."""
    out = []
    for pair, rows in method_rows(results).items():
        if len(rows) < 2:
            continue
        reference = next((r for r in rows if r.method == REFERENCE), rows[0])
        shared = [r for r in rows if r is not reference and set(r.scores) & set(reference.scores)]
        if not shared:
            continue
        models = reference.models
        table = Table(title=f"{pair}: test avg % of the best checkpoints, mean ± s.e. over seeds; paired vs "
                            f"{reference.method}", title_justify="left")
        for column in ("method", "seeds", *models, "pair avg", f"Δ pair vs {reference.method} [95% CI]",
                       "GPU-h / job"):
            table.add_column(column, justify="left" if column == "method" else "right")
        for row in rows:
            seeds = sorted(row.scores, key=lambda s: (len(s), s))
            cells = [_pct(*mean_se([row.scores[s][label] for s in seeds])) if label in row.scores[seeds[0]]
                     else "-" for label in models]
            both = sorted(set(row.scores) & set(reference.scores), key=lambda s: (len(s), s))
            if row is reference:
                delta = "reference"
            else:
                mean, lo, hi = paired_interval([row.scores[s]["pair"] - reference.scores[s]["pair"] for s in both])
                delta = f"{100 * mean:+.2f}" + ("" if math.isnan(lo) else f" [{100 * lo:+.2f}, {100 * hi:+.2f}]") \
                    + f" (n={len(both)})"
            cost = f"{sum(row.gpu_hours) / len(row.gpu_hours):.4f}" if row.gpu_hours else "-"
            table.add_row(row.method, str(len(seeds)), *cells, _pct(*mean_se([row.scores[s]["pair"] for s in seeds])),
                          delta, cost)
        compared = [job for job in results if job.pair == pair and job.status == "FINISHED"]
        differ = differing_settings(compared)
        note = ("the compared jobs differ besides method and seed in: " + "; ".join(differ)) if differ else \
            "the compared jobs have the same settings besides method and seed"
        out.append((table, note))
    return out
