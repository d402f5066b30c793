"""``python -m analysis {tables,figures,compare}``: the paper's tables and figures from MLflow."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table as RichTable

from analysis import compare, figures, render, tables
from analysis.results import Analysis
from analysis.store import StoreUnavailable, load_store

console = Console(stderr=True)


def _analysis(args) -> Analysis:
    return Analysis(load_store(args.tracking_uri, args.experiment or None, progress=True))


def _report_missing(a: Analysis, out: Path) -> None:
    """Warn about every missing cell (and which sweep file produces it); keep the list as missing.csv."""
    frame = a.missing_frame()
    frame.to_csv(out / "missing.csv", index=False)
    if frame.empty:
        console.print("[green]nothing missing[/green]")
        return
    a.warn_missing()
    summary = RichTable(title=f"{len(frame)} missing cells (see {out / 'missing.csv'})")
    for column in ("sweep", "table", "method", "model", "peer", "seed"):
        summary.add_column(column)
    for _, row in frame.drop_duplicates(["sweep", "method", "model", "peer", "seed"]).iterrows():
        summary.add_row(*(str(row[c]) for c in ("sweep", "table", "method", "model", "peer", "seed")))
    console.print(summary)


def cmd_tables(args) -> None:
    a = _analysis(args)
    args.out.mkdir(parents=True, exist_ok=True)
    for table in tables.build_all(a).values():
        render.write_table(table, args.out)
    render.write_preamble(args.out)
    console.print(f"wrote {len(tables.BUILDERS)} tables to {args.out}")
    _report_missing(a, args.out)


def cmd_figures(args) -> None:
    a = _analysis(args)
    paths = figures.build_all(a, args.out)
    console.print(f"wrote {len(paths)} figure files to {args.out}")
    _report_missing(a, args.out)


def cmd_compare(args) -> None:
    if args.tracking_uri_given:
        a = _analysis(args)
        regenerated = {label: table.frame() for label, table in tables.build_all(a).items()}
    else:
        regenerated = compare.read_tables(args.out)
    frame = compare.compare(regenerated)
    paths = compare.write(frame, args.out)
    console.print(f"compared {frame['ours'].notna().sum()} of {len(frame)} paper cells; wrote {paths[0]}")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m analysis", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)
    specs = {
        "tables": (cmd_tables, "write every table as <label>.csv/.md/.tex"),
        "figures": (cmd_figures, "write every figure as PNG and PDF"),
        "compare": (cmd_compare, ("each regenerated cell beside the paper's value (reads OUT/<label>.csv "
                                 "unless --tracking-uri is given)")),
    }
    for name, (handler, help_text) in specs.items():
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--tracking-uri", default=None,
                             help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
        command.add_argument("--experiment", action="append",
                             help="experiment name to read (repeatable; default: every experiment named graft/*)")
        command.add_argument("--out", type=Path, required=True, help="output directory")
        command.set_defaults(handler=handler)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.tracking_uri_given = args.tracking_uri is not None
    args.tracking_uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[RichHandler(console=console)])
    try:
        args.handler(args)
    except StoreUnavailable as error:
        console.print(f"[red]error:[/red] {error} (tracking URI: {args.tracking_uri})")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
