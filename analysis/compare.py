"""Each regenerated cell beside the paper's value, for researchers checking a reproduction.

The paper's numbers are carried as data in ``paper_values.csv`` (one row per cell: table, updated_model,
peer, method, column, paper), transcribed from the paper's LaTeX tables.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

PAPER_VALUES = Path(__file__).with_name("paper_values.csv")
KEYS = ["table", "updated_model", "peer", "method", "column"]


def paper_values() -> pd.DataFrame:
    return pd.read_csv(PAPER_VALUES)


def read_tables(out: Path) -> dict[str, pd.DataFrame]:
    """Tables written earlier by ``python -m analysis tables`` (only those the paper has values for)."""
    labels = paper_values()["table"].unique()
    return {label: pd.read_csv(out / f"{label}.csv") for label in labels if (out / f"{label}.csv").exists()}


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
