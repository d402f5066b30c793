"""The paper's figures from MLflow: validation curves (Fig. 5), rescue fraction (Fig. 1 right), pair score vs
GPU-hours (Fig. 3a), stored vs online (Fig. 3b) and per-model conservative accounting (Fig. 6). PNG and PDF."""

from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import mlflow
import pandas as pd

from analysis import catalog, rules, tables
from analysis.results import Analysis

log = logging.getLogger("analysis")
CURVE_METHODS = catalog.CURVE_METHODS
COLORS = {"grpo_n8": "#9aa5b1", "grpo_n16": "#6b7785", "grpo_n32": "#3d4853", "grpo_ds": "#8c6bb1",
          "hacpo": "#e6a141", "sgt": "#4a90c2", "graft": "#c0392b", "graft_stored": "#e07b6a"}


def _save(fig, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return paths


def _note_empty(ax, text: str = "no runs") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def validation_curves(a: Analysis, out: Path) -> list[Path]:
    """Fig. 5: validation average vs step per (updated model, peer); stars at the selected checkpoints."""
    pairs = a.pairs_with_runs()
    models = tables.updated_models(a, pairs)
    width = max(len(tables.peer_blocks(a, m, pairs)) for m in models)
    fig, axes = plt.subplots(len(models), width, figsize=(5 * width, 3.2 * len(models)), squeeze=False)
    scale = a.scale
    for i, model in enumerate(models):
        for j, (pair, peer) in enumerate(tables.peer_blocks(a, model, pairs)):
            ax = axes[i][j]
            drawn = 0
            for method in CURVE_METHODS:
                run_id = a.find("val-curves", method, model,
                                "none" if method in catalog.SINGLE_MODEL_METHODS else peer, need_tests=False)
                curve = a.store.series(run_id, "val/avg") * scale if run_id else pd.Series(dtype=float)
                if curve.empty:
                    continue
                color = COLORS[method]
                ax.plot(curve.index, curve.values, color=color, lw=1.4, label=catalog.method_display(method))
                best = a.best_step(run_id)
                if best in curve.index:
                    ax.plot([best], [curve[best]], marker="*", ms=12, color=color, markeredgecolor="black", mew=0.5)
                drawn += 1
            if not drawn:
                _note_empty(ax)
            ax.set_title(f"{catalog.model_display(model)} ← {catalog.model_display(peer)}", fontsize=9)
            ax.set_xlabel("training step")
            ax.set_ylabel("validation avg (%)")
            ax.grid(alpha=0.3)
        for j in range(len(tables.peer_blocks(a, model, pairs)), width):
            axes[i][j].axis("off")
    handles, labels = next(((h, lab) for ax in axes.flat for h, lab in [ax.get_legend_handles_labels()] if h),
                           ([], []))
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _save(fig, out, "val-curves")


def _prompt_success(a: Analysis, run_id: str) -> pd.DataFrame | None:
    """The run's ``prompt_success.parquet`` artifact (step, prompt_id, k), or None when it was not logged."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="prompt_success.parquet",
                                                       dst_path=tmp, tracking_uri=a.store.tracking_uri)
        except Exception as error:  # noqa: BLE001 - any artifact-store failure means "not available"
            log.warning("run %s has no prompt_success.parquet (%s)", run_id, error)
            return None
        return pd.read_parquet(path)


def rescue_fraction(a: Analysis, out: Path) -> list[Path]:
    """Fig. 1 (right): fraction of each model's all-fail prompts solved by the other, two independent GRPO runs."""
    pair = a.study_pairs(["grpo_n8"])[0]
    model_a, model_b = a.pairs[pair]
    success = {}
    for model in (model_a, model_b):
        run_id = a.find("rescue-fraction", "grpo_n8", model, "none", need_tests=False)
        success[model] = _prompt_success(a, run_id) if run_id else None
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    if all(frame is not None for frame in success.values()):
        for receiver, peer, color in ((model_b, model_a, "#4a90c2"), (model_a, model_b, "#c0392b")):
            fraction = rules.rescue_fraction(success[receiver], success[peer]) * 100
            label = f"{catalog.model_display(peer)} solves {catalog.model_display(receiver)}'s"
            ax.plot(fraction.index, fraction.values, color=color, lw=1.2, label=label)
            ax.axhline(fraction.mean(), color=color, ls=":", lw=1.2)
        ax.legend(fontsize=7, frameon=False)
    else:
        _note_empty(ax, "prompt_success.parquet missing")
    ax.set_xlabel("training step")
    ax.set_ylabel("all-fail prompts solved by peer (%)")
    ax.grid(alpha=0.3)
    return _save(fig, out, "rescue-fraction")


def _pair_points(a: Analysis, compute_table: tables.Table) -> pd.DataFrame:
    """Per method of the study pair: pair-mean Avg over evaluation runs, its 95% CI and the joint GPU-hours."""
    records = []
    by_method: dict[str, list[tables.Row]] = {}
    for row in compute_table.rows:
        by_method.setdefault(row.method, []).append(row)
    for method, rows in by_method.items():
        run_ids = [a.find("compute", method, r.updated_model, r.peer) for r in rows]
        if len(rows) != 2 or None in run_ids:
            continue
        per_eval = pd.concat([a.scores(r, compute_table.benches)[rules.AVG] for r in run_ids], axis=1).mean(
            axis=1, skipna=False)
        records.append({"method": method, "score": per_eval.mean(), "ci": rules.confidence_halfwidth(per_eval),
                        "gpuh": rows[0].extra.get("joint_gpuh_best", math.nan)})
    return pd.DataFrame(records, columns=["method", "score", "ci", "gpuh"])


def pair_budget(a: Analysis, compute_table: tables.Table, out: Path) -> list[Path]:
    """Fig. 3a: pair-mean score vs total GPU-hours to both selected checkpoints; dashed GRPO budget line."""
    points = _pair_points(a, compute_table).dropna(subset=["score", "gpuh"])
    fig, ax = plt.subplots(figsize=(5, 3.6))
    if points.empty:
        _note_empty(ax)
    for _, p in points.iterrows():
        ax.errorbar(p["gpuh"], p["score"], yerr=p["ci"], fmt="o", color=COLORS.get(p["method"], "black"),
                    capsize=3, label=catalog.method_display(p["method"]).replace("Dynamic Sampling", "DS"))
    grpo = points[points["method"].isin(["grpo_n8", "grpo_n16", "grpo_n32"])].sort_values("gpuh")
    ax.plot(grpo["gpuh"], grpo["score"], ls="--", color="gray", lw=1)
    ax.set_xlabel("total GPU-hours (both models, to selected checkpoints)")
    ax.set_ylabel("pair average score (%)")
    ax.grid(alpha=0.3)
    if len(points):
        ax.legend(fontsize=7, frameon=False)
    return _save(fig, out, "pair-budget")


def stored_vs_online(a: Analysis, out: Path) -> list[Path]:
    """Fig. 3b: per model block, GPU-hours to the reported checkpoint (top) and gain over GRPO n=8 (bottom)."""
    replay = tables.replay_results(a)
    records = []
    for row in replay.rows:
        if row.method in ("graft", "graft_stored"):
            run_id = a.find("replay-results", row.method, row.updated_model, row.peer)
            gpuh = rules.value_at_step(a.model_cost(run_id), a.best_step(run_id)) if run_id else math.nan
            records.append({"block": f"{catalog.MODEL_SHORT.get(row.updated_model, row.updated_model)}"
                                     f"←{catalog.MODEL_SHORT.get(row.peer, row.peer)}",
                            "method": row.method, "gpuh": gpuh, "gain": row.stats.get("delta", math.nan)})
    frame = pd.DataFrame(records, columns=["block", "method", "gpuh", "gain"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    blocks = list(dict.fromkeys(frame["block"]))
    for offset, method, label in ((-0.2, "graft", "online"), (0.2, "graft_stored", "stored")):
        part = frame[frame["method"] == method].set_index("block").reindex(blocks)
        x = [i + offset for i in range(len(blocks))]
        top.bar(x, part["gpuh"], width=0.4, color=COLORS[method], label=label)
        bottom.bar(x, part["gain"], width=0.4, color=COLORS[method], label=label)
    top.set_ylabel("GPU-hours to checkpoint")
    bottom.set_ylabel("gain over GRPO (n=8)")
    bottom.axhline(0, color="black", lw=0.8)
    bottom.set_xticks(range(len(blocks)), blocks)
    top.legend(fontsize=8, frameon=False)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    if not blocks:
        _note_empty(top)
    return _save(fig, out, "stored-vs-online")


def compute_conservative(a: Analysis, compute_table: tables.Table, out: Path) -> list[Path]:
    """Fig. 6 (App. D): per-model score vs GPU-hours charged under the conservative accounting, ±1 s.d."""
    models = list(dict.fromkeys(r.updated_model for r in compute_table.rows))
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5 * max(len(models), 1), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        drawn = 0
        for row in (r for r in compute_table.rows if r.updated_model == model):
            x, y = row.extra.get("conservative_gpuh", math.nan), row.stats.get(f"{rules.AVG}_mean", math.nan)
            if pd.isna(x) or pd.isna(y):
                continue
            ax.errorbar(x, y, yerr=row.stats.get(f"{rules.AVG}_std"), fmt="o", capsize=3,
                        color=COLORS.get(row.method, "black"), label=catalog.method_display(row.method))
            drawn += 1
        if not drawn:
            _note_empty(ax)
        else:
            ax.legend(fontsize=7, frameon=False)
        ax.set_title(catalog.model_display(model), fontsize=9)
        ax.set_xlabel("GPU-hours charged to this model")
        ax.set_ylabel("average score (%)")
        ax.grid(alpha=0.3)
    return _save(fig, out, "compute-conservative")


def build_all(a: Analysis, out: Path) -> list[Path]:
    """Every figure into ``out`` (PNG and PDF); missing runs leave gaps and are logged on ``a.missing``."""
    compute_table = tables.compute(a)
    return [*validation_curves(a, out), *rescue_fraction(a, out), *pair_budget(a, compute_table, out),
            *stored_vs_online(a, out), *compute_conservative(a, compute_table, out)]
