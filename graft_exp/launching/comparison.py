"""The comparison a multirun or a sweep was run for, printed below its jobs table wherever methods share seeds: per
pair and method the mean ± sample standard deviation over seeds (``intervals.mean_sd``) of each model's and the pair's average final test score (a
job's score: ``scores.job_score``, as ``summary.JobResult.pair_score`` gives it), each method against a
reference (GRPO n=8 where it ran, else the first method launched; ``compare_to`` chooses) as the mean paired
difference with its 95 % Student-t interval (``intervals.paired_interval``) and, from ``RLIABLE_MIN_SEEDS`` paired
seeds on, rliable's probability of improvement and IQM with their bootstrap intervals, the mean cost per job, and
the settings the compared jobs differ in besides method and seed (a comparison across unequal settings is
flagged, not hidden)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from rich.table import Table

from graft_exp.config import BUDGET_KEYS
from graft_exp.intervals import mean_sd, paired_interval, rliable_measures
from graft_exp.tracking.identity import NON_IDENTITY_KEYS

REFERENCE = "grpo_n8"
#: rliable's measures from this many seeds both methods ran (fewer: its bootstrap has nothing to resample).
RLIABLE_MIN_SEEDS = 3
#: Params that name the compared things themselves, or say where a job ran: not a difference in settings.
COMPARED = ("method", "seed", "delta", "n", "pair", "backend")


@dataclass
class MethodRow:
    """One method's jobs of one pair, by seed."""

    method: str
    models: list[str]                       # "A qwen3-1.7b-base", ...
    scores: dict[str, dict[str, float]]     # seed -> {model label or "pair": score}
    gpu_hours: list[float]
    budgets: list[float]                    # the budgets its jobs ran under (equal compute), in ``budget_units``
    steps: list[int]                        # the steps its jobs trained
    budget_units: set[str] = field(default_factory=set)


def seed_order(seeds) -> list[str]:
    """Seeds (MLflow's strings) in numeric order."""
    return sorted(seeds, key=lambda s: (len(s), s))


def method_rows(results: list) -> dict[str, list[MethodRow]]:
    """The finished, fully evaluated jobs by pair and method, in launch order."""
    pairs: dict[str, dict[str, MethodRow]] = {}
    for job in results:
        if job.status != "FINISHED" or job.pair_score is None:
            continue
        models = [f"{m.role} {m.model}" for m in job.models]
        row = pairs.setdefault(job.pair, {}).setdefault(job.method, MethodRow(job.method, models, {}, [], [], []))
        row.scores[job.seed] = {**{label: m.scores["avg"] for label, m in zip(models, job.models)},
                                "pair": job.pair_score}
        if job.gpu_hours is not None:
            row.gpu_hours.append(job.gpu_hours)
        if job.budget is not None:
            row.budgets.append(job.budget)
            row.budget_units.add(job.budget_unit)
        if job.last_step is not None:
            row.steps.append(job.last_step)
    return {pair: list(rows.values()) for pair, rows in pairs.items()}


def differing_settings(results: list, by: str = "method") -> list[str]:
    """The settings (flattened config keys) whose values differ among ``results`` besides method and seed, the
    setting compared (``by``) and where or how they ran, as ``key: value, value`` lines."""
    keys = sorted({k for job in results for k in job.params})
    lines = []
    for key in keys:
        top = key.split(".")[0]
        if top in NON_IDENTITY_KEYS or top == "method" or key in COMPARED or key in BUDGET_KEYS or key == by:
            continue
        values = sorted({job.params.get(key, "<unset>") for job in results})
        if len(values) > 1:
            lines.append(f"{key}: {', '.join(values)}")
    return lines


@dataclass
class Comparison:
    """One pair's comparison: a row per method (numbers, test scores as fractions) and what the jobs differ in."""

    pair: str
    reference: str
    models: list[str]
    rows: list[dict]
    differ: list[str]
    pair_scores: dict[str, dict[str, float]]   # method -> seed -> the job's pair score

    @property
    def equal_compute(self) -> bool:
        """Whether the compared jobs ran under budgets: then steps differ by method."""
        return any(not math.isnan(row["budget"]) for row in self.rows)

    @property
    def budget_unit(self) -> str:
        """What the budgets were spent in: GPU-h (App. D's measured charge), FLOPs (counted), or both."""
        units = sorted({row["budget unit"] for row in self.rows if row["budget unit"]})
        return " or ".join({"gpu_hours": "GPU-h", "flops": "FLOPs"}[u] for u in units)

    @property
    def note(self) -> str:
        settings = ("the compared jobs differ besides method and seed in: " + "; ".join(self.differ)) if self.differ \
            else "the compared jobs have the same settings besides method and seed"
        return settings + (f"; at equal compute: each job trained until its budget ({self.budget_unit}) ran out (the "
                           "steps it bought per method)" if self.equal_compute else "")


def compare(results: list, reference: str | None = None, by: str = "method") -> list[Comparison]:
    """Per pair whose methods share seeds with the reference (``reference``, else GRPO n=8 where it ran, else the
    first method): each method's mean and s.e. over seeds of each model's and the pair's score, its mean paired
    difference to the reference with the 95 % interval, and its mean cost per job. ``by``: the setting whose
    values the "methods" are (``analysis methods --by``), left out of what the jobs differ in."""
    out = []
    for pair, rows in method_rows(results).items():
        if len(rows) < 2:
            continue
        ref = next((r for r in rows if r.method == (reference or REFERENCE)), rows[0])
        if not any(r is not ref and set(r.scores) & set(ref.scores) for r in rows):
            continue
        numbers = []
        for row in rows:
            seeds = seed_order(row.scores)
            both = seed_order(set(row.scores) & set(ref.scores))
            entry = {"pair": pair, "method": row.method, "seeds": len(seeds)}
            for label in [*ref.models, "pair"]:
                values = [row.scores[s][label] for s in seeds if label in row.scores[s]]
                entry[f"{label} mean"], entry[f"{label} sd"] = mean_sd(values)
            mean, lo, hi = paired_interval([row.scores[s]["pair"] - ref.scores[s]["pair"] for s in both]) \
                if row is not ref else (math.nan, math.nan, math.nan)
            entry |= {"delta": mean, "delta lo": lo, "delta hi": hi, "paired seeds": len(both),
                      "gpu_hours per job": sum(row.gpu_hours) / len(row.gpu_hours) if row.gpu_hours else math.nan,
                      "budget": sum(row.budgets) / len(row.budgets) if row.budgets else math.nan,
                      "budget unit": ",".join(sorted(row.budget_units)),
                      "steps min": min(row.steps, default=math.nan), "steps max": max(row.steps, default=math.nan)}
            if row is not ref and len(both) >= RLIABLE_MIN_SEEDS:
                measures = rliable_measures(np.array([row.scores[s]["pair"] for s in both]),
                                            np.array([ref.scores[s]["pair"] for s in both]))
                entry |= {key: value for key, value in measures.items() if not key.startswith("IQM ref")}
            numbers.append(entry)
        compared = [job for job in results if job.pair == pair and job.status == "FINISHED"]
        out.append(Comparison(pair, ref.method, ref.models, numbers, differing_settings(compared, by),
                              {row.method: {seed: s["pair"] for seed, s in row.scores.items()} for row in rows}))
    return out


def _pct(mean: float, sd: float) -> str:
    if math.isnan(mean):
        return "-"
    return f"{100 * mean:.1f}" + ("" if math.isnan(sd) else f" ± {100 * sd:.1f}")


def delta_text(row: dict, reference: str) -> str:
    """``+5.83 [+2.25, +9.42] (n=3)`` in points, or ``reference``."""
    if row["method"] == reference:
        return "reference"
    interval = "" if math.isnan(row["delta lo"]) else f" [{100 * row['delta lo']:+.2f}, {100 * row['delta hi']:+.2f}]"
    return f"{100 * row['delta']:+.2f}{interval} (n={row['paired seeds']})"


def tables(comparisons: list[Comparison]) -> list[tuple[Table, str]]:
    """The comparisons of ``compare`` as terminal tables, each with its note."""
    out = []
    for c in comparisons:
        table = Table(title=f"{c.pair}: test avg % of the best checkpoints, mean ± s.d. over seeds; paired vs "
                            f"{c.reference}", title_justify="left")
        budget = (f"budget {c.budget_unit}", "steps") if c.equal_compute else ()
        for column in ("method", "seeds", *c.models, "pair avg", f"Δ pair vs {c.reference} [95% CI]", "P(improve)",
                       "GPU-h / job", *budget):
            table.add_column(column, justify="left" if column == "method" else "right")
        for row in c.rows:
            cost = row["gpu_hours per job"]
            bought = (f"{row['budget']:.4g}", f"{row['steps min']}-{row['steps max']}") if budget else ()
            table.add_row(row["method"], str(row["seeds"]),
                          *(_pct(row[f"{label} mean"], row[f"{label} sd"]) for label in [*c.models, "pair"]),
                          delta_text(row, c.reference), f"{row['P(improve)']:.2f}" if "P(improve)" in row else "-",
                          "-" if math.isnan(cost) else f"{cost:.4f}", *bought)
        out.append((table, c.note))
    return out
