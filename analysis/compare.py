"""Each regenerated cell beside the paper's value, for researchers checking a reproduction.

The paper's numbers are carried as data in ``paper_values.csv`` (one row per cell: table, updated_model,
peer, method, column, paper), transcribed from the paper's LaTeX tables.

``reproduction`` is the verdict per cell: each paper mean beside ours over the seeds the store holds (the seed
tables, ``tables.SEED_TABLES``, and Table 4's runs), the difference ours - paper and its 95 % interval, and
``within`` (the interval holds 0), ``outside`` or ``not enough seeds`` (fewer than 2: no spread to judge by). A
paper cell of one training run (Tables 1-3, 5 and App. G: the first run) is judged as one more run would be: the
Student-t prediction interval of a single run from ours, mean +- t(n-1) s sqrt(1 + 1/n). A cell that is a mean
over the paper's own runs (Table 4: three, with their s.d.) is judged as a difference of two means (Welch).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from scipy import stats

from analysis.tables import SEED_TABLES

PAPER_VALUES = Path(__file__).with_name("paper_values.csv")
KEYS = ["table", "updated_model", "peer", "method", "column"]
ROW = ["updated_model", "peer", "method"]
#: Paper tables whose cells are means over the paper's own training runs, and how many (App. C: three).
PAPER_RUNS = {"training-variance": 3}
#: Our tables whose rows are over seeds (``n``: the seeds), where a cell's spread over training runs is read.
OVER_SEEDS = (*SEED_TABLES, "training-variance")
WITHIN, OUTSIDE, FEW_SEEDS = "within", "outside", "not enough seeds"


def paper_values() -> pd.DataFrame:
    return pd.read_csv(PAPER_VALUES)


def read_tables(out: Path) -> dict[str, pd.DataFrame]:
    """Tables written earlier by ``python -m analysis tables``: those the paper has values for, and ours over
    seeds."""
    labels = [*paper_values()["table"].unique(), *OVER_SEEDS]
    # a table the store had no runs for is written as an empty file
    return {label: pd.read_csv(out / f"{label}.csv") for label in labels
            if (out / f"{label}.csv").exists() and (out / f"{label}.csv").stat().st_size > 1}


def long_cells(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Regenerated tables as one row per numeric cell (``KEYS`` + ``ours``)."""
    frames = []
    for label, frame in tables.items():
        if not {"updated_model", "peer", "method"} <= set(frame.columns):
            continue
        values = frame.drop(columns=[c for c in ("n", "pair", "best_step", "subtable") if c in frame.columns])
        long = values.melt(id_vars=["updated_model", "peer", "method"], var_name="column", value_name="ours")
        long["ours"] = pd.to_numeric(long["ours"], errors="coerce")
        frames.append(long.assign(table=label))
    if not frames:
        return pd.DataFrame(columns=[*KEYS, "ours"])
    # Shared rows (a GRPO baseline under two pairs) repeat the same value; keep one.
    return pd.concat(frames).drop_duplicates(KEYS)


def compare(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every paper cell with ``paper``, ``ours`` (NaN where not regenerated) and ``diff = ours - paper``."""
    paper = paper_values().drop_duplicates(KEYS)
    merged = paper.merge(long_cells(tables), on=KEYS, how="left")
    merged["diff"] = merged["ours"] - merged["paper"]
    return merged


def seed_cells(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per (updated model, peer, method) and column: our mean, sample s.d. and number of seeds, from the first of
    ``OVER_SEEDS`` that has the row."""
    frames = []
    for label in OVER_SEEDS:
        frame = tables.get(label)
        if frame is None or frame.empty or "n" not in frame:
            continue
        means = [c for c in frame.columns if c.endswith("_mean") and c[:-len("_mean")] + "_std" in frame]
        long = frame.melt(id_vars=[*ROW, "n"], value_vars=means, var_name="column", value_name="seeds_mean")
        spread = frame[[*ROW, *(m[:-len("_mean")] + "_std" for m in means)]].set_axis([*ROW, *means], axis=1)
        long = long.merge(spread.melt(id_vars=ROW, var_name="column", value_name="seeds_std"), on=[*ROW, "column"])
        frames.append(long.rename(columns={"n": "seeds"}))
    if not frames:
        return pd.DataFrame(columns=[*ROW, "column", "seeds", "seeds_mean", "seeds_std"])
    return pd.concat(frames).drop_duplicates([*ROW, "column"])


def verdict(table: str, paper: float, paper_std: float, mean: float, sd: float, seeds: int) -> tuple:
    """(diff, lo, hi, verdict) of ours over ``seeds`` (mean, sample s.d.) against one paper cell (module docstring)."""
    if not seeds or math.isnan(mean) or math.isnan(paper):
        return math.nan, math.nan, math.nan, FEW_SEEDS
    diff = mean - paper
    if seeds < 2 or math.isnan(sd):
        return diff, math.nan, math.nan, FEW_SEEDS
    runs = PAPER_RUNS.get(table)
    if runs and not math.isnan(paper_std):   # two means: Welch's interval
        a, b = sd ** 2 / seeds, paper_std ** 2 / runs
        df = (a + b) ** 2 / (a ** 2 / (seeds - 1) + b ** 2 / (runs - 1)) if a + b > 0 else seeds - 1
        half = stats.t.ppf(0.975, df) * math.sqrt(a + b)
    else:   # one paper run: where one more of our runs would fall
        half = stats.t.ppf(0.975, seeds - 1) * sd * math.sqrt(1 + 1 / seeds)
    lo, hi = diff - half, diff + half
    return diff, lo, hi, WITHIN if lo <= 0 <= hi else OUTSIDE


def reproduction(tables: dict[str, pd.DataFrame], paper: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every paper mean (``<column>_mean`` cells) beside ours over seeds, with the difference, its interval and the
    verdict (module docstring)."""
    paper = (paper_values() if paper is None else paper).drop_duplicates(KEYS)
    stds = paper[paper["column"].str.endswith("_std")].assign(column=lambda f: f["column"].str[:-4] + "_mean")
    means = paper[paper["column"].str.endswith("_mean")].merge(
        stds.rename(columns={"paper": "paper_std"}), on=KEYS, how="left")
    cells = means.merge(seed_cells(tables), on=[*ROW, "column"], how="left")
    cells["seeds"] = cells["seeds"].fillna(0).astype(int)
    judged = [verdict(r.table, r.paper, r.paper_std, r.seeds_mean, r.seeds_std, r.seeds) for r in cells.itertuples()]
    cells[["diff", "diff_lo", "diff_hi", "verdict"]] = pd.DataFrame(judged, index=cells.index)
    return cells.rename(columns={"seeds_mean": "ours", "seeds_std": "ours_std"})[
        [*KEYS, "paper", "paper_std", "ours", "ours_std", "seeds", "diff", "diff_lo", "diff_hi", "verdict"]]


def write_reproduction(frame: pd.DataFrame, out: Path) -> list[Path]:
    """``reproduction.csv`` (every paper mean) and ``reproduction.md`` (per table: the verdicts counted)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "reproduction.csv", out / "reproduction.md"]
    frame.to_csv(paths[0], index=False, float_format="%.6g")
    counts = frame.groupby("table", sort=False)["verdict"].value_counts().unstack(fill_value=0)
    lines = [f"| Table | Paper means | {WITHIN} | {OUTSIDE} | {FEW_SEEDS} |", "|---|---|---|---|---|"]
    for table, row in counts.iterrows():
        lines.append(f"| {table} | {int(row.sum())} | " + " | ".join(str(int(row.get(v, 0)))
                                                             for v in (WITHIN, OUTSIDE, FEW_SEEDS)) + " |")
    lines += ["", ("Ours: the mean over the seeds the store holds (± s.d. over seeds). A paper cell of one training run "
                   "is judged by the 95 % prediction interval of one more of our runs; Table 4's means over three runs "
                   "by Welch's 95 % interval of the difference. Fewer than 2 seeds: no verdict.")]
    paths[1].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


def write(frame: pd.DataFrame, out: Path) -> list[Path]:
    """``compare.csv`` (every cell) and ``compare.md`` (per table: cells compared, mean and max |diff|)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "compare.csv", out / "compare.md"]
    frame.to_csv(paths[0], index=False, float_format="%.6g")
    summary = frame.groupby("table", sort=False).agg(
        cells=("paper", "size"), regenerated=("ours", "count"),
        mean_abs_diff=("diff", lambda d: d.abs().mean()), max_abs_diff=("diff", lambda d: d.abs().max()))
    lines = ["| Table | Paper cells | Regenerated | Mean abs. diff | Max abs. diff |", "|---|---|---|---|---|"]
    for table, row in summary.iterrows():
        lines.append(f"| {table} | {int(row['cells'])} | {int(row['regenerated'])} | {row['mean_abs_diff']:.2f} | "
                     f"{row['max_abs_diff']:.2f} |")
    paths[1].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths
