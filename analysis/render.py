"""Render :class:`analysis.tables.Table` objects to .csv, .md and .tex (booktabs, the paper's macros).

The .tex files use the paper's own macros (``\\pairband``, ``\\modelband``, ``\\stdv``, ``\\best``, ``\\up``,
``\\dn``, ``\\refrow``, ``\\oursrow``, ``\\method``); :data:`PREAMBLE` defines them and is written next to the
tables as ``preamble.tex`` so that the tables compile on their own.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from analysis import catalog
from analysis.tables import AVG, CLIP_ORDERINGS, Band, Row, Table

MISSING = "–"
PREAMBLE = r"""% Packages and macros used by the generated tables (the paper's own definitions).
\usepackage{booktabs,multirow,graphicx,subcaption}
\usepackage[table]{xcolor}
\definecolor{pairbg}{HTML}{E8ECF4}
\definecolor{modelbg}{HTML}{F5F6F8}
\definecolor{oursbg}{HTML}{FDF4E3}
\definecolor{gainpos}{HTML}{1A7F37}
\definecolor{gainneg}{HTML}{B42318}
\newcommand{\best}[1]{\bfseries #1}
\newcommand{\up}[1]{{\color{gainpos}\scriptsize$\uparrow$#1}}
\newcommand{\dn}[1]{{\color{gainneg}\scriptsize$\downarrow$#1}}
\newcommand{\refrow}{{\scriptsize --}}
\newcommand{\oursrow}{\rowcolor{oursbg}}
\newcommand{\stdv}[1]{{\scriptsize\,$\pm$#1}}
\newcommand{\NC}{8}
\newcommand{\bandstrut}{\rule[-0.9ex]{0pt}{3.2ex}}
\newcommand{\pairband}[1]{%
  \rowcolor{pairbg}\multicolumn{\NC}{@{}l@{}}{\bandstrut\textbf{#1}}\\}
\newcommand{\modelband}[1]{%
  \rowcolor{modelbg}\multicolumn{\NC}{@{}l@{}}{\bandstrut\quad\textit{#1}}\\}
\newcommand{\method}{GRAFT}
"""
TEX_MARKS = {"†": r"$^{\dagger}$", "‡": r"$^{\ddagger}$"}


def fmt(value: float, digits: int = 2) -> str:
    return MISSING if value is None or pd.isna(value) else f"{value:.{digits}f}"


def tex_text(text: str) -> str:
    """Display text -> LaTeX: the paper's macros and math for GRAFT, n=8, δ, arrows; specials escaped."""
    text = re.sub(r"([&%#_])", r"\\\1", text)
    text = re.sub(r"\bn=(\d+)", r"$n{=}\1$", text)
    text = re.sub(r"δ=([0-9.]+)", r"$\\delta{=}\1$", text)
    for plain, tex in (("GRAFT", r"\method{}"), (" + ", r" $+$ "), ("↔", r"$\leftrightarrow$"),
                       ("←", r"\,$\leftarrow$\,"), ("β", r"$\beta$"), ("ε", r"$\varepsilon$"), ("–", "--"),
                       ("±", r"$\pm$")):
        text = text.replace(plain, tex)
    return text.replace("+ w/o", "$+$ w/o")


# --- result tables (Tables 1, 4, 5, 6, 7) ---------------------------------------------------------------

def _cell_parts(row: Row, column: str, digits: int = 2) -> tuple[str, str, bool, str]:
    mean, std = row.stats.get(f"{column}_mean"), row.stats.get(f"{column}_std")
    return fmt(mean, digits), ("" if std is None or pd.isna(std) else fmt(std, digits)), \
        column in row.bold, row.marks.get(column, "")


def _md_cell(row: Row, column: str) -> str:
    mean, std, bold, mark = _cell_parts(row, column)
    if mean == MISSING:
        return MISSING
    text = f"{mean}{mark}" + (f" ± {std}" if std else "")
    return f"**{text}**" if bold else text


def _tex_cell(row: Row, column: str) -> str:
    mean, std, bold, mark = _cell_parts(row, column)
    if mean == MISSING:
        return "--"
    text = f"{mean}{TEX_MARKS.get(mark, '')}" + (rf"\stdv{{{std}}}" if std else "")
    return rf"\best{{{text}}}" if bold else text


def _delta_md(row: Row) -> str:
    if row.reference:
        return "—"
    delta = row.stats.get("delta", math.nan)
    return MISSING if pd.isna(delta) else ("↑" if delta >= 0 else "↓") + f"{abs(delta):.2f}"


def _delta_tex(row: Row) -> str:
    if row.reference:
        return r"\refrow"
    delta = row.stats.get("delta", math.nan)
    return "--" if pd.isna(delta) else (r"\up" if delta >= 0 else r"\dn") + f"{{{abs(delta):.2f}}}"


def _band_md(text: str, columns: int) -> str:
    """A full-width label row: the text in the first cell and ``columns - 1`` empty cells after it."""
    return f"| {text} |" + " |" * (columns - 1)


def results_md(table: Table) -> str:
    columns = [*table.benches, AVG]
    header = ["Method", *map(catalog.bench_display, table.benches), "Avg.", "Δ Avg"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for item in table.items:
        if isinstance(item, Band):
            text = {"pair": f"**{item.text}**", "model": f"*{item.text}*", "section": f"_{item.text}_"}[item.level]
            lines.append(_band_md(text, len(header)))
        else:
            label = f"**{item.label}**" if item.ours else item.label
            lines.append("| " + " | ".join([label, *(_md_cell(item, c) for c in columns), _delta_md(item)]) + " |")
    return "\n".join(lines) + "\n"


def results_tex(table: Table) -> str:
    columns = [*table.benches, AVG]
    width = len(columns) + 2
    head = [r"\textbf{Method}", *(f"{{{catalog.bench_display(b)}}}" for b in table.benches),
            r"{\textbf{Avg.}}", r"{$\Delta$\textsubscript{Avg}}"]
    lines = [r"\begin{table*}[t]", r"\centering", r"\small", rf"\renewcommand{{\NC}}{{{width}}}",
             rf"\caption{{\textbf{{{tex_text(table.caption)}}}}}", rf"\label{{tab:{table.label}}}",
             r"\resizebox{\textwidth}{!}{", rf"\begin{{tabular}}{{l {' '.join('c' * (width - 1))}}}", r"\toprule",
             " & ".join(head) + r" \\", r"\midrule"]
    previous = None
    for item in table.items:
        if isinstance(item, Band):
            if item.level == "pair" and previous is not None:
                lines.append(r"\midrule")
            elif item.level == "model" and isinstance(previous, Row):
                lines.append(r"\addlinespace[3pt]")
            if item.level == "section":
                lines.append(rf"\multicolumn{{{width}}}{{l}}{{\emph{{{tex_text(item.text)}}}}} \\")
            else:
                lines.append(rf"\{item.level}band{{{tex_text(item.text)}}}")
        else:
            label = tex_text(item.label)
            label = (r"\oursrow \quad \textbf{" + label + "}") if item.ours else r"\quad " + label
            lines.append(" & ".join([label, *(_tex_cell(item, c) for c in columns), _delta_tex(item)]) + r" \\")
        previous = item
    lines += [r"\bottomrule", r"\end{tabular}", "}", r"\end{table*}"]
    return "\n".join(lines) + "\n"


# --- Table 2 (compact ablation) ----------------------------------------------------------------------------

def _ablation_blocks(table: Table) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r.updated_model, r.peer) for r in table.rows if r.method == "graft"))


def _ablation_lines(table: Table, subtable: str) -> list[tuple[str, object]]:
    """(kind, payload) lines of one subtable, with the rows of every model block side by side."""
    blocks = _ablation_blocks(table)
    by_block: dict[tuple, list] = {b: [] for b in blocks}
    block = None
    for item in table.items:
        if isinstance(item, Band) and item.level == "model":
            continue
        if isinstance(item, Row) and item.method == "graft" and item.extra.get("subtable") == "ab":
            block = (item.updated_model, item.peer)
        if block is None:
            continue
        if subtable in (item.group if isinstance(item, Band) else item.extra.get("subtable", "")):
            by_block[block].append(item)
    return list(zip(*by_block.values())) if blocks else []


def _short(model: str) -> str:
    return catalog.MODEL_SHORT.get(model, catalog.model_display(model))


def ablation_md(table: Table) -> str:
    out = []
    for subtable, title in (("a", "(a) Component ablation"), ("b", "(b) Alternative designs")):
        blocks = _ablation_blocks(table)
        header = ["", *(f"{_short(m)} {h}" for m, _ in blocks for h in ("Avg.", "Δ"))]
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for items in _ablation_lines(table, subtable):
            first = items[0]
            if isinstance(first, Band):
                lines.append(_band_md(f"_{first.text}_", len(header)))
                continue
            cells = [c for row in items for c in (_md_cell(row, AVG), _delta_md(row))]
            label = first.label if first.method in ("graft", "grpo_n8") else f"  {first.label}"
            lines.append("| " + " | ".join([f"**{label}**" if first.ours and first.method == "graft" else label,
                                            *cells]) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def ablation_tex(table: Table) -> str:
    blocks = _ablation_blocks(table)
    width = 1 + 2 * len(blocks)
    lines = [r"\begin{table}[t]", r"\centering", r"\small", r"\setlength{\tabcolsep}{4pt}",
             r"\caption{\textbf{Ablations and alternative designs} ($\Delta$: change vs.\ full \method{}).}",
             rf"\label{{tab:{table.label}}}"]
    for subtable, title in (("a", "Component ablation"), ("b", "Alternative designs")):
        lines += [r"\begin{subtable}[t]{0.495\linewidth}", r"\centering", rf"\caption{{{title}}}",
                  r"\resizebox{\linewidth}{!}{", rf"\begin{{tabular}}{{l {' '.join(['cc'] * len(blocks))}}}",
                  r"\toprule",
                  "& " + " & ".join(rf"\multicolumn{{2}}{{c}}{{\textbf{{{_short(m)}}}}}" for m, _ in blocks) + r" \\",
                  " ".join(rf"\cmidrule(lr){{{2 + 2 * i}-{3 + 2 * i}}}" for i in range(len(blocks))),
                  "& " + " & ".join(["Avg. & $\\Delta$"] * len(blocks)) + r" \\", r"\midrule"]
        for items in _ablation_lines(table, subtable):
            first = items[0]
            if isinstance(first, Band):
                if lines[-1] != r"\midrule":
                    lines.append(r"\midrule")
                lines.append(rf"\multicolumn{{{width}}}{{l}}{{\emph{{{tex_text(first.text)}}}}} \\")
                continue
            cells = [c for row in items for c in (_tex_cell(row, AVG), _delta_tex(row))]
            if first.method == "grpo_n8":
                lines.append(r"\midrule")
            label = tex_text(first.label)
            label = (r"\oursrow " + label) if first.ours and first.method == "graft" else (
                label if first.method == "grpo_n8" else r"\quad " + label)
            lines.append(" & ".join([label, *cells]) + r" \\")
            if first.method == "graft" and first.reference:
                lines.append(r"\midrule")
        lines += [r"\bottomrule", r"\end{tabular}}", r"\end{subtable}" + (r"\hfill" if subtable == "a" else "")]
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


# --- Table 3 of the compute section (App. D) ---------------------------------------------------------------

def _compute_grid(table: Table) -> tuple[list[str], list[tuple[str, str, dict]]]:
    """Models (column groups) and one (method, label, {model: row}) entry per method."""
    models = list(dict.fromkeys(r.updated_model for r in table.rows))
    grid: dict[str, dict] = {}
    labels = {}
    for row in table.rows:
        grid.setdefault(row.method, {})[row.updated_model] = row
        labels[row.method] = row.label
    return models, [(m, labels[m], cells) for m, cells in grid.items()]


def _joint(cells: dict, key: str) -> float:
    values = [row.extra.get(key, math.nan) for row in cells.values()]
    present = [v for v in values if not pd.isna(v)]
    return present[0] if present else math.nan


def compute_md(table: Table) -> str:
    models, grid = _compute_grid(table)
    header = ["Method", *(f"{catalog.model_display(m)} {h}" for m in models
                          for h in ("Avg. (%)", "Best ckpt (GPU-h)", "3 epochs (GPU-h)")),
              "Both: Best ckpt (GPU-h)", "Both: 3 epochs (GPU-h)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, label, cells in grid:
        values = [label]
        for model in models:
            row = cells.get(model)
            values += [_md_cell(row, AVG), fmt(row.extra.get("gpuh_best"), 1), fmt(row.extra.get("gpuh_full"), 1)] \
                if row else [MISSING] * 3
        values += [fmt(_joint(cells, "joint_gpuh_best"), 1), fmt(_joint(cells, "joint_gpuh_full"), 1)]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def compute_tex(table: Table) -> str:
    models, grid = _compute_grid(table)
    groups = " ".join(["ccc"] * len(models))
    lines = [r"\begin{table}[t]", r"\centering", r"\small", r"\setlength{\tabcolsep}{6pt}",
             rf"\caption{{\textbf{{{tex_text(table.caption)}}}}}", rf"\label{{tab:{table.label}}}",
             r"\resizebox{\textwidth}{!}{", rf"\begin{{tabular}}{{l {groups} cc}}", r"\toprule",
             "& " + " & ".join(rf"\multicolumn{{3}}{{c}}{{\textbf{{{tex_text(catalog.model_display(m))}}}}}"
                               for m in models) + r" & \multicolumn{2}{c}{\textbf{Both models}} \\",
             " ".join(rf"\cmidrule(lr){{{2 + 3 * i}-{4 + 3 * i}}}" for i in range(len(models) + 1)).replace(
                 f"{2 + 3 * len(models)}-{4 + 3 * len(models)}", f"{2 + 3 * len(models)}-{3 + 3 * len(models)}"),
             "& " + " & ".join(["Avg. & Best ckpt & 3 epochs"] * len(models)) + r" & Best ckpt & 3 epochs \\",
             "& " + " & ".join([r"(\%) & (GPU-h) & (GPU-h)"] * len(models)) + r" & (GPU-h) & (GPU-h) \\",
             r"\midrule"]
    for method, label, cells in grid:
        values = [(r"\oursrow " if method.startswith("graft") else "") + tex_text(label)]
        for model in models:
            row = cells.get(model)
            values += [_tex_cell(row, AVG), fmt(row.extra.get("gpuh_best"), 1).replace(MISSING, "--"),
                       fmt(row.extra.get("gpuh_full"), 1).replace(MISSING, "--")] if row else ["--"] * 3
        values += [fmt(_joint(cells, k), 1).replace(MISSING, "--") for k in ("joint_gpuh_best", "joint_gpuh_full")]
        lines.append(" & ".join(values) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", "}", r"\end{table}"]
    return "\n".join(lines) + "\n"


# --- Table 8 (App. H clipping) and Table 3 of App. B (hyper-parameters) ----------------------------------

def _clip_rows(frame: pd.DataFrame) -> list[tuple[str, str, list[str]]]:
    """(group, label, values per ordering) rows in the paper's layout, fractions with three decimals."""
    rows = []
    for group, column, arrow in (("Self-generated", "clipfrac_self", False), ("Grafted (peer)", "clipfrac_peer", True)):
        for (model, peer), cells in frame.groupby(["updated_model", "peer"], sort=False):
            by_method = cells.set_index("method")[column]
            label = catalog.model_display(model) + (f" ← {catalog.model_display(peer)}" if arrow else "")
            rows.append((group, label, [fmt(by_method.get(m), 3) for m, _ in CLIP_ORDERINGS]))
    zero = frame.drop_duplicates("method").set_index("method")["zero_peer_clip_steps_pct"]
    rows.append(("", "Steps with zero clipping on peer tokens (%)", [fmt(zero.get(m), 1) for m, _ in CLIP_ORDERINGS]))
    return rows


def clipfrac_md(table: Table) -> str:
    header = ["Clipped-token fraction (%)", "Update", *(name for _, name in CLIP_ORDERINGS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group, label, values in _clip_rows(table.frame()):
        lines.append("| " + " | ".join([group, label, *values]) + " |")
    return "\n".join(lines) + "\n"


def clipfrac_tex(table: Table) -> str:
    lines = [r"\begin{table}[H]", r"\centering", r"\small", r"\setlength{\tabcolsep}{6pt}",
             rf"\caption{{{tex_text(table.caption)}}}", rf"\label{{tab:{table.label}}}",
             r"\begin{tabular}{llccc}", r"\toprule", r"& & \multicolumn{3}{c}{Peer minibatch position} \\",
             r"\cmidrule(lr){3-5}",
             r"Clipped-token fraction (\%) & Update & " + " & ".join(n for _, n in CLIP_ORDERINGS) + r" \\",
             r"\midrule"]
    rows = _clip_rows(table.frame())
    for i, (group, label, values) in enumerate(rows):
        values = [v.replace(MISSING, "--") for v in values]
        if not group:
            lines += [r"\midrule", rf"\multicolumn{{2}}{{l}}{{{tex_text(label)}}} & " + " & ".join(values) + r" \\"]
            continue
        first_of_group = i == 0 or rows[i - 1][0] != group
        if first_of_group and i:
            lines.append(r"\addlinespace")
        size = sum(1 for g, _, _ in rows if g == group)
        head = rf"\multirow{{{size}}}{{*}}{{{group}}}" if first_of_group else ""
        lines.append(" & ".join([head, tex_text(label), *values]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def hparams_md(table: Table) -> str:
    lines = ["| Hyperparameter | Value | Config keys |", "|---|---|---|"]
    for _, r in table.frame().iterrows():
        value = MISSING if pd.isna(r["value"]) else r["value"]
        lines.append(f"| {r['hyperparameter']} | {value} | {r['param_keys'] or MISSING} |")
    return "\n".join(lines) + "\n"


def hparams_tex(table: Table) -> str:
    lines = [r"\begin{table}[H]", r"\centering", r"\small", r"\setlength{\tabcolsep}{8pt}",
             r"\caption{\textbf{Training hyperparameters.}}", rf"\label{{tab:{table.label}}}",
             r"\begin{tabular}{@{}ll@{}}", r"\toprule", r"Hyperparameter & Value \\", r"\midrule"]
    for _, r in table.frame().iterrows():
        value = "--" if pd.isna(r["value"]) else tex_text(str(r["value"]))
        lines.append(rf"{tex_text(r['hyperparameter'])} & {value} \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


# --- seed-study tables (main-seeds, ablation-seeds, replay-seeds, compute-seeds) ---------------------------

def _references(table: Table) -> list[str]:
    """The references of a seed table's paired-difference columns, GRPO (n=8) first."""
    found = {k[len("vs_"):-len("_mean")] for row in table.rows for k in row.extra if k.startswith("vs_")
             and k.endswith("_mean")}
    return sorted(found, key=lambda r: (r != "grpo_n8", r))


def _paired(row: Row, reference: str, tex: bool = False) -> str:
    if row.method == reference:
        return r"\refrow" if tex else "—"
    mean, lo, hi = (row.extra.get(f"vs_{reference}_{k}", math.nan) for k in ("mean", "lo", "hi"))
    if pd.isna(mean):
        return "--" if tex else MISSING
    interval = "" if pd.isna(lo) else f" [{lo:+.2f}, {hi:+.2f}]"
    return f"${mean:+.2f}${interval}" if tex else f"{mean:+.2f}{interval}"


EXTRA_HEADERS = {"eval_se": ("eval s.e.", 2), "joint_gpuh_best": ("device-h to best ckpts", 4),
                 "joint_gpuh_full": ("device-h, full runs", 4), "gpuh_model": ("device-h, this model", 4),
                 "gpuh_job": ("device-h, whole job", 4)}


def _seed_columns(table: Table) -> tuple[list[str], list[str]]:
    """The header after "Method", and the extra columns present (evaluation noise; the compute table's costs)."""
    extras = [c for c in EXTRA_HEADERS if any(c in r.extra for r in table.rows)]
    header = [*map(catalog.bench_display, table.benches), "Avg. (± s.d. over seeds)", "seeds",
              *(f"Δ Avg vs {catalog.method_display(r)} [95% CI]" for r in _references(table)),
              *(EXTRA_HEADERS[c][0] for c in extras)]
    return header, extras


def _seed_cells(row: Row, table: Table, extras: list[str], tex: bool) -> list[str]:
    cell = _tex_cell if tex else _md_cell
    seeds = f"{row.extra.get('seeds', 0)}/{row.extra.get('of_seeds', 0)}"
    return [*(cell(row, c) for c in [*table.benches, AVG]), seeds,
            *(_paired(row, r, tex) for r in _references(table)),
            *(fmt(row.extra.get(c), EXTRA_HEADERS[c][1]) for c in extras)]


def seeds_md(table: Table) -> str:
    header, extras = _seed_columns(table)
    header = ["Method", *header]
    note = (f"{table.caption} Each training run counts once: the mean of its evaluation runs. Δ: paired (same "
            "seed) difference of Avg., mean over seeds with its 95% Student-t interval."
            + (" eval s.e.: the standard error of a checkpoint's Avg. over its evaluation runs, mean over seeds."
               if "eval_se" in extras else ""))
    lines = [note, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for item in table.items:
        if isinstance(item, Band):
            mark = "**" if item.level == "pair" else "*"
            lines.append(_band_md(f"{mark}{item.text}{mark}", len(header)))
        else:
            label = f"**{item.label}**" if item.ours else item.label
            lines.append("| " + " | ".join([label, *_seed_cells(item, table, extras, tex=False)]) + " |")
    return "\n".join(lines) + "\n"


def seeds_tex(table: Table) -> str:
    header, extras = _seed_columns(table)
    columns = len(header) + 1
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{tex_text(table.caption)}}}",
             rf"\label{{tab:{table.label}}}", r"\renewcommand{\NC}{" + str(columns) + "}", r"\resizebox{\linewidth}{!}{",
             rf"\begin{{tabular}}{{@{{}}l{'c' * (columns - 1)}@{{}}}}", r"\toprule",
             " & ".join(["Method", *(tex_text(h).replace("Δ", r"$\Delta$")
                                     for h in header)]) + r" \\", r"\midrule"]
    for item in table.items:
        if isinstance(item, Band):
            lines.append(rf"\{'pairband' if item.level == 'pair' else 'modelband'}{{{tex_text(item.text)}}}")
        else:
            prefix = r"\oursrow " if item.ours else ""
            lines.append(prefix + " & ".join([tex_text(item.label), *_seed_cells(item, table, extras, tex=True)])
                         + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}}", r"\end{table}"]
    return "\n".join(lines) + "\n"


RENDERERS = {
    "seeds": (seeds_md, seeds_tex),
    "results": (results_md, results_tex),
    "ablation": (ablation_md, ablation_tex),
    "compute": (compute_md, compute_tex),
    "clipfrac": (clipfrac_md, clipfrac_tex),
    "hparams": (hparams_md, hparams_tex),
}


def write_table(table: Table, out: Path) -> list[Path]:
    """Write ``<label>.csv``, ``.md`` and ``.tex`` into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    to_md, to_tex = RENDERERS[table.kind]
    paths = [out / f"{table.label}.{ext}" for ext in ("csv", "md", "tex")]
    table.frame().to_csv(paths[0], index=False, float_format="%.6g")
    paths[1].write_text(to_md(table), encoding="utf-8")
    paths[2].write_text(to_tex(table), encoding="utf-8")
    return paths


def write_preamble(out: Path) -> Path:
    path = out / "preamble.tex"
    path.write_text(PREAMBLE, encoding="utf-8")
    return path
