"""The paper's figures from MLflow: validation curves (Fig. 5), rescue fraction (Fig. 1 right), pair score vs
GPU-hours (Fig. 3a), stored vs online (Fig. 3b) and per-model conservative accounting (Fig. 6). PNG and PDF.

The three cost figures are drawn from a frame of exactly the plotted values (``*_points``/``*_bars``), written
next to them as ``<name>.csv``; every GPU-hour value in them comes from :func:`analysis.tables.compute_costs`.
"""

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
import numpy as np
import pandas as pd

from analysis import catalog, rules, tables
from analysis.results import Analysis
from graft_exp.schema import NO_PEER

log = logging.getLogger("analysis")
CURVE_METHODS = catalog.CURVE_METHODS
COLORS = {"grpo_n8": "#9aa5b1", "grpo_n16": "#6b7785", "grpo_n32": "#3d4853", "grpo_ds": "#8c6bb1",
          "hacpo": "#e6a141", "sgt": "#4a90c2", "graft": "#c0392b", "graft_stored": "#e07b6a"}


def _save(fig, out: Path, name: str, data: pd.DataFrame | None = None) -> list[Path]:
    """``<name>.png`` and ``.pdf``, and ``<name>.csv`` with the plotted values when ``data`` is given."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    if data is not None:
        paths.append(out / f"{name}.csv")
        data.to_csv(paths[-1], index=False)
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
                                catalog.peer_of(method, peer), need_tests=False)
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
        run_id = a.find("rescue-fraction", "grpo_n8", model, NO_PEER, need_tests=False)
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


def rescue_matrix_points(a: Analysis) -> pd.DataFrame:
    """Per group: of receiver R's all-fail prompts (GRPO n=8, seed 0), the share that each other member S
    solved -- and that at least one did ("any peer") -- averaged over training steps. The group's GRPO job
    trains its members independently on the same prompt batches, as Fig. 1 (right) does for two models."""
    rows = []
    for group, members in a.groups.items():
        success = {}
        for model in members:
            run_id = a.find("group-rescue-matrix", "grpo_n8", model, NO_PEER, need_tests=False)
            if run_id and a.model_runs.loc[run_id, "pair"] == group:
                success[model] = _prompt_success(a, run_id)
        for receiver in members:
            peers = [m for m in members if m != receiver]
            for source in [*peers, "any peer"]:
                sources = peers if source == "any peer" else [source]
                frames = [success.get(m) for m in (receiver, *sources)]
                share = (rules.rescue_fraction(frames[0], *frames[1:]).mean() * 100
                         if all(f is not None for f in frames) else float("nan"))
                rows.append({"group": group, "receiver": receiver, "source": source, "rescued_pct": share})
    return pd.DataFrame(rows, columns=["group", "receiver", "source", "rescued_pct"])


def draw_rescue_matrix(points: pd.DataFrame):
    groups = list(dict.fromkeys(points["group"])) or ["no group"]
    fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 3.6), squeeze=False)
    for ax, group in zip(axes[0], groups):
        frame = points[points["group"] == group]
        if frame.empty or frame["rescued_pct"].isna().all():
            _note_empty(ax, "no GRPO n=8 group run with prompt_success.parquet")
            continue
        receivers = list(dict.fromkeys(frame["receiver"]))
        sources = [*receivers, "any peer"]
        matrix = frame.pivot(index="receiver", columns="source", values="rescued_pct").reindex(
            index=receivers, columns=sources)
        image = ax.imshow(matrix.to_numpy(dtype=float), cmap="Blues", vmin=0, vmax=100)
        for (i, j), value in np.ndenumerate(matrix.to_numpy(dtype=float)):
            ax.text(j, i, "—" if np.isnan(value) else f"{value:.0f}", ha="center", va="center", fontsize=8,
                    color="white" if value > 60 else "black")
        ax.set_xticks(range(len(sources)), [catalog.model_display(s) for s in sources], rotation=30,
                      ha="right", fontsize=7)
        ax.set_yticks(range(len(receivers)), [catalog.model_display(r) for r in receivers], fontsize=7)
        ax.set_xlabel("solved by (source S)")
        ax.set_ylabel("all-fail prompts of (receiver R)")
        ax.set_title(f"{group}: % of R's all-fail prompts S solved", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return fig


def rescue_matrix(a: Analysis, out: Path) -> list[Path]:
    """The K x K rescue matrix of each group (docs/exchange-k.md): which member rescues which."""
    if not a.groups:
        return []
    points = rescue_matrix_points(a)
    return _save(draw_rescue_matrix(points), out, "rescue-matrix", points)


def pair_budget_points(a: Analysis, compute_table: tables.Table) -> pd.DataFrame:
    """Fig. 3a's points: per method of the study pair, the pair-mean Avg over evaluation runs, its 95% CI and
    the GPU-hours of obtaining both selected checkpoints (the compute table's "both models, best ckpt")."""
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


def draw_pair_budget(points: pd.DataFrame):
    """Fig. 3a from :func:`pair_budget_points`: one point per method, GRPO's budgets joined by a dashed line."""
    points = points.dropna(subset=["score", "gpuh"])
    fig, ax = plt.subplots(figsize=(5, 3.6))
    if points.empty:
        _note_empty(ax)
    for _, p in points.iterrows():
        ax.errorbar(p["gpuh"], p["score"], yerr=p["ci"], fmt="o", color=COLORS.get(p["method"], "black"),
                    capsize=3, label=catalog.method_display(p["method"]).replace("Dynamic Sampling", "DS"))
    # The dashed line traces GRPO with increasing rollout budget (n = 8, 16, 32), whatever each one cost.
    budgets = ["grpo_n8", "grpo_n16", "grpo_n32"]
    grpo = points.set_index("method").reindex([m for m in budgets if m in set(points["method"])])
    ax.plot(grpo["gpuh"], grpo["score"], ls="--", color="gray", lw=1)
    ax.set_xlabel("total GPU-hours (both models, to selected checkpoints)")
    ax.set_ylabel("pair average score (%)")
    ax.grid(alpha=0.3)
    if len(points):
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: no overlap
    return fig


def pair_budget(a: Analysis, compute_table: tables.Table, out: Path) -> list[Path]:
    """Fig. 3a: pair-mean score vs total GPU-hours to both selected checkpoints; dashed GRPO budget line."""
    points = pair_budget_points(a, compute_table)
    return _save(draw_pair_budget(points), out, "pair-budget", points)


def stored_vs_online_bars(a: Analysis) -> pd.DataFrame:
    """Fig. 3b's bars: per model block, online and stored GRAFT's GPU-hours to the reported checkpoint and their
    gain over GRPO (n=8).

    Online GRAFT cannot produce one model without training the other, so its bar is the joint run's cost up to
    this model's selected checkpoint; a stored-trajectory receiver pays only its own run up to its checkpoint,
    not the GRPO runs that wrote the logs (App. D). ``cut`` is the fraction of the online cost saved.
    """
    replay = tables.replay_results(a)
    records = []
    for row in replay.rows:
        if row.method in ("graft", "graft_stored"):
            run_id = a.find("replay-results", row.method, row.updated_model, row.peer)
            gpuh = tables.compute_costs(a, row.method, row.updated_model, row.peer, run_id, None)[
                "conservative_gpuh"] if run_id else math.nan
            records.append({"block": f"{catalog.MODEL_SHORT.get(row.updated_model, row.updated_model)}"
                                     f"←{catalog.MODEL_SHORT.get(row.peer, row.peer)}",
                            "updated_model": row.updated_model, "peer": row.peer, "method": row.method,
                            "gpuh": gpuh, "gain": row.stats.get("delta", math.nan)})
    frame = pd.DataFrame(records, columns=["block", "updated_model", "peer", "method", "gpuh", "gain"])
    online = frame[frame["method"] == "graft"].set_index("block")["gpuh"]
    frame["cut"] = [rules.cost_cut(online.get(b, math.nan), g) if m == "graft_stored" else math.nan
                    for b, m, g in zip(frame["block"], frame["method"], frame["gpuh"])]
    return frame


def draw_stored_vs_online(bars: pd.DataFrame):
    """Fig. 3b from :func:`stored_vs_online_bars`: cost (top, stored bars labelled with the cut) and gain."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    blocks = list(dict.fromkeys(bars["block"]))
    for offset, method, label in ((-0.2, "graft", "online"), (0.2, "graft_stored", "stored")):
        part = bars[bars["method"] == method].set_index("block").reindex(blocks)
        x = [i + offset for i in range(len(blocks))]
        cost = top.bar(x, part["gpuh"], width=0.4, color=COLORS[method], label=label)
        bottom.bar(x, part["gain"], width=0.4, color=COLORS[method], label=label)
        if method == "graft_stored":
            top.bar_label(cost, labels=["" if pd.isna(c) else f"−{100 * c:.0f}%" for c in part["cut"]], fontsize=7)
    top.set_ylabel("GPU-hours to checkpoint")
    bottom.set_ylabel("gain over GRPO (n=8)")
    bottom.axhline(0, color="black", lw=0.8)
    bottom.set_xticks(range(len(blocks)), blocks)
    top.legend(fontsize=8, frameon=False)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    if not blocks:
        _note_empty(top)
    return fig


def stored_vs_online(a: Analysis, out: Path) -> list[Path]:
    """Fig. 3b: per model block, GPU-hours to the reported checkpoint (top) and gain over GRPO n=8 (bottom)."""
    bars = stored_vs_online_bars(a)
    return _save(draw_stored_vs_online(bars), out, "stored-vs-online", bars)


def conservative_points(compute_table: tables.Table) -> pd.DataFrame:
    """Fig. 6's points: per model and method, Avg ± std over evaluation runs against the GPU-hours charged to
    that model under the conservative accounting (the compute table's ``conservative_gpuh``)."""
    records = [{"updated_model": r.updated_model, "method": r.method, "gpuh": r.extra.get("conservative_gpuh"),
                "score": r.stats.get(f"{rules.AVG}_mean"), "std": r.stats.get(f"{rules.AVG}_std")}
               for r in compute_table.rows]
    return pd.DataFrame(records, columns=["updated_model", "method", "gpuh", "score", "std"]).astype(
        {"gpuh": float, "score": float, "std": float})


def draw_compute_conservative(points: pd.DataFrame):
    """Fig. 6 from :func:`conservative_points`: one panel per model."""
    models = list(dict.fromkeys(points["updated_model"]))
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5 * max(len(models), 1), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        drawn = points[(points["updated_model"] == model)].dropna(subset=["gpuh", "score"])
        for _, p in drawn.iterrows():
            ax.errorbar(p["gpuh"], p["score"], yerr=p["std"], fmt="o", capsize=3,
                        color=COLORS.get(p["method"], "black"), label=catalog.method_display(p["method"]))
        if drawn.empty:
            _note_empty(ax)
        ax.set_title(catalog.model_display(model), fontsize=9)
        ax.set_xlabel("GPU-hours charged to this model")
        ax.set_ylabel("average score (%)")
        ax.grid(alpha=0.3)
    # One legend for both panels, right of them, so that it hides no point.
    legend = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if legend:
        fig.legend(legend.values(), legend.keys(), fontsize=7, frameon=False, loc="center left",
                   bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig


def compute_conservative(a: Analysis, compute_table: tables.Table, out: Path) -> list[Path]:
    """Fig. 6 (App. D): per-model score vs GPU-hours charged under the conservative accounting, ±1 s.d."""
    points = conservative_points(compute_table)
    return _save(draw_compute_conservative(points), out, "compute-conservative", points)


# --- seed studies (sweeps/tiny.yaml) ------------------------------------------------------------------------

SEED_CURVE_METHODS = ("grpo_n8", "grpo_n16", "grpo_n32", "grpo_ds", "hacpo", "sgt", "graft", "graft_stored")


def seed_curve_points(a: Analysis) -> pd.DataFrame:
    """Validation average (%) per (pair, updated model, method, step): mean over seeds, its 95% Student-t
    half-width and the number of seeds; the selected checkpoints' steps are in ``best_steps``."""
    records = []
    for pair in a.seed_study_pairs():
        model_a, model_b = a.pairs[pair]
        for model, peer in ((model_a, model_b), (model_b, model_a)):
            for method in [m for m in SEED_CURVE_METHODS if a.ran(m, pair)]:
                curves, best = {}, []
                for seed in a.seeds_of(pair):
                    run_id = a.find("val-curves-seeds", method, model,
                                    catalog.peer_of(method, peer), seed,
                                    need_tests=False)
                    if run_id:
                        curves[seed] = a.store.series(run_id, "val/avg") * a.scale
                        best.append(a.best_step(run_id))
                if not curves:
                    continue
                frame = pd.DataFrame(curves)
                for step, values in frame.iterrows():
                    records.append({"pair": pair, "updated_model": model, "method": method, "step": step,
                                    "mean": values.mean(), "ci": rules.confidence_halfwidth(values),
                                    "seeds": int(values.notna().sum()),
                                    "best_steps": " ".join(f"{b:g}" for b in best)})
    return pd.DataFrame(records, columns=["pair", "updated_model", "method", "step", "mean", "ci", "seeds",
                                          "best_steps"])


def draw_seed_curves(points: pd.DataFrame):
    """One panel per updated model: each method's mean validation curve over seeds with its 95% band."""
    panels = list(dict.fromkeys(zip(points["pair"], points["updated_model"]))) or [("", "")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
    for ax, (pair, model) in zip(axes[0], panels):
        part = points[(points["pair"] == pair) & (points["updated_model"] == model)]
        for method, curve in part.groupby("method", sort=False):
            color = COLORS.get(method, "black")
            ax.plot(curve["step"], curve["mean"], color=color, lw=1.4, label=catalog.method_display(method))
            ax.fill_between(curve["step"], curve["mean"] - curve["ci"].fillna(0),
                            curve["mean"] + curve["ci"].fillna(0), color=color, alpha=0.12, lw=0)
        if part.empty:
            _note_empty(ax, "no seed study")
        ax.set_title(f"{catalog.model_display(model)} ({pair})" if model else "", fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylabel("validation avg (%), mean over seeds")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=7, frameon=False, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig


def seed_curves(a: Analysis, out: Path) -> list[Path]:
    """The validation curves of a seed study: mean over seeds with 95% bands (the tiny Fig. 5)."""
    points = seed_curve_points(a)
    return _save(draw_seed_curves(points), out, "val-curves-seeds", points)


def seed_budget_points(compute_table: tables.Table) -> pd.DataFrame:
    """Pair-average score (mean over seeds, and the 95% interval of its paired difference to GRPO (n=8))
    against the device-hours of both models to their selected checkpoints, mean over seeds."""
    records = [{"pair": r.extra.get("pair"), "method": r.method, "score": r.stats.get(f"{rules.AVG}_mean"),
                "score_std": r.stats.get(f"{rules.AVG}_std"), "seeds": r.extra.get("seeds"),
                "vs_grpo_n8": r.extra.get("vs_grpo_n8_mean"), "vs_grpo_n8_lo": r.extra.get("vs_grpo_n8_lo"),
                "vs_grpo_n8_hi": r.extra.get("vs_grpo_n8_hi"), "gpuh": r.extra.get("joint_gpuh_best")}
               for r in compute_table.rows]
    return pd.DataFrame(records, columns=["pair", "method", "score", "score_std", "seeds", "vs_grpo_n8",
                                          "vs_grpo_n8_lo", "vs_grpo_n8_hi", "gpuh"])


def draw_seed_budget(points: pd.DataFrame):
    """Score vs device-hours, one point per method; error bars: the 95% interval of the paired difference
    to GRPO (n=8), drawn around the method's mean (GRPO (n=8) itself has none)."""
    drawn = points.dropna(subset=["score", "gpuh"])
    fig, ax = plt.subplots(figsize=(5, 3.6))
    if drawn.empty:
        _note_empty(ax, "no seed study")
    for _, p in drawn.iterrows():
        lo, hi = p["vs_grpo_n8_lo"] - p["vs_grpo_n8"], p["vs_grpo_n8_hi"] - p["vs_grpo_n8"]
        yerr = None if pd.isna(lo) else [[-lo], [hi]]
        ax.errorbar(p["gpuh"], p["score"], yerr=yerr, fmt="o", capsize=3, color=COLORS.get(p["method"], "black"),
                    label=catalog.method_display(p["method"]).replace("Dynamic Sampling", "DS"))
    ax.set_xlabel("device-hours (both models, to selected checkpoints)")
    ax.set_ylabel("pair average score (%), mean over seeds")
    ax.grid(alpha=0.3)
    if len(drawn):
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def seed_budget(a: Analysis, out: Path) -> list[Path]:
    """The compute figure of a seed study (the tiny Fig. 3a), from the compute-seeds table."""
    points = seed_budget_points(tables.compute_seeds(a))
    return _save(draw_seed_budget(points), out, "pair-budget-seeds", points)


def build_all(a: Analysis, out: Path) -> list[Path]:
    """Every figure into ``out`` (PNG and PDF); missing runs leave gaps and are logged on ``a.missing``."""
    compute_table = tables.compute(a)
    return [*validation_curves(a, out), *rescue_fraction(a, out), *pair_budget(a, compute_table, out),
            *stored_vs_online(a, out), *compute_conservative(a, compute_table, out), *seed_curves(a, out),
            *seed_budget(a, out), *rescue_matrix(a, out)]
