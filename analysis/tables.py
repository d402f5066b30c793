"""One builder per table of the paper: MLflow runs -> a :class:`Table` (rows, bands, marks, CSV frame).

Builders follow the paper's layout and rules (captions of Tables 1, 2, 3-8 and App. C, D, H); rendering to
.csv/.md/.tex lives in :mod:`analysis.render`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import pandas as pd

from analysis import catalog, rules
from analysis.results import Analysis, Missing
from graft_exp.intervals import standard_error
from graft_exp.schema import NO_PEER
from graft_exp.scores import job_score

AVG = rules.AVG
log = logging.getLogger("analysis")

#: What "±" is in each table (``intervals.mean_sd``: the sample standard deviation), named in its caption.
OVER_EVAL_RUNS = " ± : sample s.d. over the evaluation runs of one checkpoint."
OVER_SEEDS = " ± : sample s.d. over seeds (training runs)."


@dataclass
class Band:
    """A full-width label row: ``pair`` (shaded), ``model`` (lighter) or ``section`` (italic sub-header)."""

    text: str
    level: str
    group: str = ""  # Table 2: the subtable ("a" or "b") a section band belongs to


@dataclass
class Row:
    """One (updated model, peer, method) row; ``stats`` holds ``n``, ``<col>_mean``, ``<col>_std``, ``delta``."""

    updated_model: str
    peer: str
    method: str
    stats: dict
    label: str
    reference: bool = False
    ours: bool = False
    bold: set = field(default_factory=set)
    marks: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def record(self, benches: list[str]) -> dict:
        record = {"updated_model": self.updated_model, "peer": self.peer, "method": self.method,
                  "n": self.stats.get("n", 0)}
        for column in [*benches, AVG]:
            record[f"{column}_mean"] = self.stats.get(f"{column}_mean", math.nan)
            record[f"{column}_std"] = self.stats.get(f"{column}_std", math.nan)
        record["delta"] = self.stats.get("delta", math.nan)
        return record | self.extra


@dataclass
class Table:
    """A paper table: its label, caption, benchmark columns and the ordered bands and rows."""

    label: str
    caption: str
    benches: list[str]
    items: list = field(default_factory=list)
    kind: str = "results"
    frame_override: pd.DataFrame | None = None

    @property
    def rows(self) -> list[Row]:
        return [item for item in self.items if isinstance(item, Row)]

    def frame(self) -> pd.DataFrame:
        """The CSV: one row per (updated model, peer, method)."""
        if self.frame_override is not None:
            return self.frame_override
        return pd.DataFrame([row.record(self.benches) for row in self.rows])


def _pair_name(pair: str) -> str:
    return f"Pair {pair[4:]}" if pair.startswith("pair") and pair[4:].isdigit() else pair


def _empty_stats() -> dict:
    return {"n": 0}


def _checkpoint_row(a: Analysis, table: str, method: str, model: str, peer: str, benches: list[str],
                    label: str | None = None, seed: int = 0, **flags) -> Row:
    """A row from one training run: mean and std over the evaluation runs of its selected checkpoint."""
    run_id = a.find(table, method, model, peer, seed)
    stats = rules.checkpoint_summary(a.scores(run_id, benches)) if run_id else _empty_stats()
    return Row(model, peer, method, stats, label or catalog.method_display(method), **flags)


def _set_deltas(rows: list[Row], reference: Row) -> None:
    """Δ = Avg - Avg of the block's reference row (GRPO n=8 in Table 1, full GRAFT in the ablations)."""
    base = reference.stats.get(f"{AVG}_mean", math.nan)
    for row in rows:
        row.stats["delta"] = row.stats.get(f"{AVG}_mean", math.nan) - base
    reference.reference = True


def _means(rows: list[Row], columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({row.method: {c: row.stats.get(f"{c}_mean", math.nan) for c in columns} for row in rows}).T


def _run_benches(a: Analysis, pairs: list[str]) -> list[str]:
    models = {m for p in pairs for m in a.pairs[p]}
    run_ids = a.model_runs.index[a.model_runs["model"].isin(models)]
    return a.benches_of(run_ids)


def updated_models(a: Analysis, pairs: list[str]) -> list[str]:
    """Updated models in order of first appearance over the pairs (A before B)."""
    return list(dict.fromkeys(m for p in pairs for m in a.pairs[p]))


def peer_blocks(a: Analysis, model: str, pairs: list[str]) -> list[tuple[str, str]]:
    """(pair, peer) for each pair that contains ``model``, in pair order."""
    return [(p, a.pairs[p][1] if a.pairs[p][0] == model else a.pairs[p][0]) for p in pairs if model in a.pairs[p]]


def main_results(a: Analysis) -> Table:
    """Table 1: first training run, mean ± std over evaluation runs, bold and †/‡ marks, Δ vs GRPO (n=8)."""
    label = "main-results"
    pairs = a.pairs_with_runs()
    benches = _run_benches(a, pairs)
    columns = [*benches, AVG]
    table = Table(label, "Results of cross-model rollout exchange during co-training." + OVER_EVAL_RUNS, benches)
    for model in updated_models(a, pairs):
        table.items.append(Band(f"Updated policy: {catalog.model_display(model)}", "pair"))
        grpo = {m: _checkpoint_row(a, label, m, model, NO_PEER, benches) for m in ("grpo_n8", "grpo_n16", "grpo_n32")}
        table.items += list(grpo.values())
        block_rows = list(grpo.values())
        for pair, peer in peer_blocks(a, model, pairs):
            table.items.append(Band(f"Peer policy: {catalog.model_display(peer)} ({_pair_name(pair)})", "model"))
            rows = {m: _checkpoint_row(a, label, m, model, peer, benches, ours=(m == "graft"))
                    for m in ("hacpo", "sgt", "graft")}
            table.items += list(rows.values())
            block_rows += list(rows.values())
            n8 = [grpo["grpo_n8"], rows["hacpo"], rows["sgt"], rows["graft"]]
            for row_method, cells in rules.bold_cells(_means(n8, columns), "grpo_n8").items():
                if row_method != "grpo_n8":
                    rows[row_method].bold = cells
            up_to_16 = _means([grpo["grpo_n8"], grpo["grpo_n16"], rows["hacpo"], rows["sgt"]], columns)
            up_to_32 = _means([*(grpo.values()), rows["hacpo"], rows["sgt"]], columns)
            ours = _means([rows["graft"]], columns).iloc[0]
            rows["graft"].marks = rules.dagger_marks(ours, [("†", up_to_16), ("‡", up_to_32)])
        _set_deltas(block_rows, grpo["grpo_n8"])
    return table


ABLATION_FULL_SECTIONS = (
    ("Removing one component", ("graft_no_gate", "graft_no_balance", "graft_seq_ratio")),
    ("Count-matched random selection", ("graft_random_prompts", "graft_random_admission")),
    ("Position of peer minibatches", ("graft_peer_first", "graft_peer_uniform")),
    ("Advantage computation", ("graft_pooled",)),
    ("Varying the compatibility gate threshold",
     ("graft_no_floor", catalog.delta_method(0.7), catalog.delta_method(0.9))),
)
WHICH_HOW_ROWS = (
    ("hacpo", "HACPO"), ("hacpo_which", "HACPO + GRAFT which"),
    ("sgt", "SGT"), ("graft_no_balance", "SGT + GRAFT how"), ("sgt_which", "SGT + GRAFT which"),
    ("graft_luffy", "GRAFT + LUFFY update"),
)
ABLATION_COMPACT = (
    ("a", "Component removal", (("graft_no_gate", "compat. gate"), ("graft_no_floor", "compat. floor"),
                                ("graft_no_balance", "balancing"), ("graft_seq_ratio", "token ratio"))),
    ("a", "Random selection", (("graft_random_prompts", "prompts"), ("graft_random_admission", "admission"))),
    ("a", "Peer position", (("graft_peer_first", "first"), ("graft_peer_uniform", "uniform"))),
    ("b", "Transfer rule", (("graft_pooled", "pooled groups"), ("graft_success_only", "success-only"),
                            ("graft_success_only_no_floor", "+ w/o floor"))),
    ("b", "Our which, prior how", (("hacpo_which", "HACPO update"), ("sgt_which", "SFT update (SGT)"),
                                   ("graft_luffy", "LUFFY update"))),
    ("b", "Original methods", (("hacpo", "HACPO"), ("sgt", "SGT"))),
)


def _study_block(a: Analysis, table: Table, model: str, peer: str, sections, full_label: str) -> None:
    """A model block of the Pair-1 studies: full GRAFT, sectioned variants, GRPO (n=8); Δ vs full GRAFT."""
    benches = table.benches
    full = _checkpoint_row(a, table.label, "graft", model, peer, benches, full_label, ours=True)
    table.items += [Band(catalog.model_display(model), "model"), full]
    rows = [full]
    for title, methods in sections:
        if title:
            table.items.append(Band(title, "section"))
        for method, label in methods:
            row = _checkpoint_row(a, table.label, method, model,
                                  catalog.peer_of(method, peer), benches, label)
            table.items.append(row)
            rows.append(row)
    grpo = _checkpoint_row(a, table.label, "grpo_n8", model, NO_PEER, benches)
    table.items.append(grpo)
    _set_deltas([*rows, grpo], full)


def _study_models(a: Analysis, methods) -> list[tuple[str, str]]:
    """(updated model, peer) of the Pair-1 studies, for every pair where those studies ran."""
    blocks = []
    for pair in a.study_pairs(methods):
        model_a, model_b = a.pairs[pair]
        blocks += [(model_a, model_b), (model_b, model_a)]
    return blocks


def ablation_full(a: Analysis) -> Table:
    """Table 6 (App. F): per-benchmark ablation and threshold sweep on Pair 1, Δ vs full GRAFT."""
    methods = [m for _, ms in ABLATION_FULL_SECTIONS for m in ms]
    blocks = _study_models(a, methods)
    table = Table("ablation-full", "Full ablation of GRAFT." + OVER_EVAL_RUNS,
                  _run_benches(a, a.study_pairs(methods)))
    sections = [(title, [(m, None) for m in ms]) for title, ms in ABLATION_FULL_SECTIONS]
    for model, peer in blocks:
        _study_block(a, table, model, peer, sections, "GRAFT (full, δ=0.8)")
    return table


def which_how_full(a: Analysis) -> Table:
    """Table 7 (App. F): prior methods with GRAFT's which or how on Pair 1, Δ vs full GRAFT."""
    methods = [m for m, _ in WHICH_HOW_ROWS if m not in ("hacpo", "sgt")]  # those two ran on every pair
    table = Table("which-how-full", "Full results for prior methods with one side replaced." + OVER_EVAL_RUNS,
                  _run_benches(a, a.study_pairs(methods)))
    for model, peer in _study_models(a, methods):
        _study_block(a, table, model, peer, [(None, WHICH_HOW_ROWS)], "GRAFT")
    return table


def ablation(a: Analysis) -> Table:
    """Table 2: Avg ± std and Δ vs full GRAFT per model of Pair 1; (a) components, (b) alternative designs."""
    methods = [m for _, _, rows in ABLATION_COMPACT for m, _ in rows if m not in ("hacpo", "sgt")]
    table = Table("ablation", "Ablations and alternative designs." + OVER_EVAL_RUNS,
                  _run_benches(a, a.study_pairs(methods)), kind="ablation")
    for model, peer in _study_models(a, methods):
        block = Table("ablation", "", table.benches)
        _study_block(a, block, model, peer, [(t, rows) for _, t, rows in ABLATION_COMPACT], "GRAFT (full)")
        subtable_of = {m: s for s, _, rows in ABLATION_COMPACT for m, _ in rows}
        subtable_of |= {title: s for s, title, _ in ABLATION_COMPACT}
        for item in block.items:
            if isinstance(item, Row):
                item.extra["subtable"] = subtable_of.get(item.method, "ab")
            elif item.level == "section":
                item.group = subtable_of[item.text]
        table.items += block.items
    return table


STABILITY_SEEDS = (0, 1, 2)


def _seed_row(a: Analysis, table: str, method: str, model: str, peer: str, benches: list[str], **flags) -> Row:
    scores = []
    for seed in STABILITY_SEEDS:
        run_id = a.find(table, method, model, peer, seed)
        if run_id:
            scores.append(a.scores(run_id, benches))
    stats = rules.seed_summary(scores) if scores else _empty_stats()
    return Row(model, peer, method, stats, catalog.method_display(method), **flags)


def _pair_band(a: Analysis, pair: str) -> Band:
    model_a, model_b = a.pairs[pair]
    return Band(f"{_pair_name(pair)}  {catalog.model_display(model_a)} ↔ {catalog.model_display(model_b)}", "pair")


def training_variance(a: Analysis) -> Table:
    """Table 4 (App. C): per training run the mean over evaluation runs, then mean and sample std over seeds."""
    label = "training-variance"
    pairs = a.pairs_with_runs()
    benches = _run_benches(a, pairs)
    table = Table(label, "Training stability across three independent runs." + OVER_SEEDS, benches)
    for pair in pairs:
        table.items.append(_pair_band(a, pair))
        for model, peer in ((a.pairs[pair][0], a.pairs[pair][1]), (a.pairs[pair][1], a.pairs[pair][0])):
            grpo = _seed_row(a, label, "grpo_n8", model, NO_PEER, benches)
            ours = _seed_row(a, label, "graft", model, peer, benches, ours=True)
            table.items += [Band(catalog.model_display(model), "model"), grpo, ours]
            for row, cells in zip((grpo, ours), rules.better_of_two(_means([grpo, ours], [*benches, AVG])).values()):
                row.bold = cells
            _set_deltas([grpo, ours], grpo)
    return table


def replay_results(a: Analysis) -> Table:
    """Table 5 (App. E): GRPO (n=8), online GRAFT and GRAFT with stored peer trajectories, Δ vs GRPO."""
    label = "replay-results"
    pairs = a.pairs_with_runs()
    benches = _run_benches(a, pairs)
    table = Table(label, "Effect of learning from peer-model training trajectories." + OVER_EVAL_RUNS, benches)
    for pair in pairs:
        table.items.append(_pair_band(a, pair))
        for model, peer in ((a.pairs[pair][0], a.pairs[pair][1]), (a.pairs[pair][1], a.pairs[pair][0])):
            rows = [_checkpoint_row(a, label, "grpo_n8", model, NO_PEER, benches),
                    _checkpoint_row(a, label, "graft", model, peer, benches, ours=True),
                    _checkpoint_row(a, label, "graft_stored", model, peer, benches)]
            table.items += [Band(catalog.model_display(model), "model"), *rows]
            _set_deltas(rows, rows[0])
    return table


COMPUTE_METHODS = catalog.COMPUTE_METHODS
#: Methods whose models train independently: a model's cost is its own run's, the pair's the sum of the two.
#: A stored-trajectory receiver learns from a log, not from the other receiver, so it is costed like GRPO even
#: when one job trains both receivers; the GRPO runs that wrote the logs are not charged (App. D).
SEPARATE_RUN_METHODS = (*catalog.SINGLE_MODEL_METHODS, "graft_stored")
#: Largest relative gap tolerated between a joint run's cost and the sum of its models' shares.
SHARE_TOLERANCE = 0.01


def compute_costs(a: Analysis, method: str, model: str, peer: str, run_id: str, sibling: str | None) -> dict:
    """GPU-hours of one model under App. D's accounting (``cost/gpu_hours``: GPUs x training-step seconds).

    ``gpuh_best``/``gpuh_full``: the model's own cost (its model run's ``cost/gpu_hours``) to its selected
    checkpoint / for the full run: an independent model's own steps on its own GPUs; a co-trained model's
    share of the joint run. ``joint_gpuh_best``/``joint_gpuh_full`` ("both models"): for co-training, the joint
    run (its job run's ``cost/gpu_hours``) through the later of the two selected checkpoints / to its end; for
    independent runs, the sum of the two models' own costs (``sibling`` is the other model's run).
    ``conservative_gpuh`` (Fig. 6, and Fig. 3b's bars): an independent model's own cost to its checkpoint; a
    co-trained model is charged the whole joint run up to its own checkpoint.
    """
    own = a.model_cost(run_id)
    best = a.best_step(run_id)
    costs = {"best_step": best, "gpuh_best": rules.value_at_step(own, best), "gpuh_full": rules.final_value(own)}
    if method in SEPARATE_RUN_METHODS:
        costs["conservative_gpuh"] = costs["gpuh_best"]
        if sibling is None:
            costs |= {"joint_gpuh_best": math.nan, "joint_gpuh_full": math.nan}
        else:
            other = a.model_cost(sibling)
            costs["joint_gpuh_best"] = costs["gpuh_best"] + rules.value_at_step(other, a.best_step(sibling))
            costs["joint_gpuh_full"] = costs["gpuh_full"] + rules.final_value(other)
        return costs
    job = a.job_cost(run_id)
    steps = [a.best_step(r) for r in a.siblings(run_id)]
    costs["conservative_gpuh"] = rules.value_at_step(job, best)
    costs["joint_gpuh_best"] = rules.joint_checkpoint_cost(job, steps) if len(steps) == 2 else math.nan
    costs["joint_gpuh_full"] = rules.final_value(job)
    return costs


def _check_shares(a: Analysis, run_id: str, checked: set) -> None:
    """Warn when the models' shares of a multi-model job do not add up to the job's logged cost."""
    parent = a.parent(run_id)
    siblings = a.siblings(run_id)
    if parent is None or parent in checked or len(siblings) < 2:
        return
    checked.add(parent)
    job = a.job_cost(run_id)
    shares = [a.store.series(r, "cost/gpu_hours") for r in siblings]
    if job.empty or any(share.empty for share in shares):
        return
    gap = rules.shares_mismatch(job, shares)
    if gap > SHARE_TOLERANCE:
        log.warning("job run %s: its models' cost/gpu_hours shares differ from the job's cost/gpu_hours by up to "
                    "%.1f%%; per-model GPU-hours follow the shares, joint ones the job", parent, 100 * gap)


def compute(a: Analysis) -> Table:
    """Table 3 (App. D): Avg and GPU-hours to the selected checkpoint and for the full run, per model and pair."""
    label = "compute"
    pairs = a.study_pairs(["grpo_ds"])
    benches = _run_benches(a, pairs)
    table = Table(label, "Score and training cost." + OVER_EVAL_RUNS, benches, kind="compute")
    checked: set = set()
    for pair in pairs:
        model_a, model_b = a.pairs[pair]
        table.items.append(_pair_band(a, pair))
        for method in COMPUTE_METHODS:
            separate = method in catalog.SINGLE_MODEL_METHODS
            found = {}
            for model, peer in ((model_a, model_b), (model_b, model_a)):
                found[model] = (peer if not separate else NO_PEER,
                                a.find(label, method, model, NO_PEER if separate else peer))
            for model, (peer, run_id) in found.items():
                row = _checkpoint_row(a, label, method, model, peer, benches, ours=method.startswith("graft"))
                other = found[model_b if model == model_a else model_a][1]
                if run_id:
                    row.extra = compute_costs(a, method, model, peer, run_id, other)
                    if not separate:
                        _check_shares(a, run_id, checked)
                row.extra = {"pair": pair} | {k: row.extra.get(k, math.nan) for k in
                             ("best_step", "gpuh_best", "gpuh_full", "joint_gpuh_best", "joint_gpuh_full",
                              "conservative_gpuh")}
                table.items.append(row)
    return table


CLIP_ORDERINGS = tuple(zip(catalog.CLIP_METHODS, ("First", "Uniform", "Last (ours)")))


def clipfrac_position(a: Analysis) -> Table:
    """Table 8 (App. H): clipped-token fractions (%) over steps 1-48 by peer-minibatch position."""
    label = "clipfrac-position"
    records = []
    for pair in a.study_pairs(["graft_peer_first", "graft_peer_uniform"]):
        for model, peer in ((a.pairs[pair][0], a.pairs[pair][1]), (a.pairs[pair][1], a.pairs[pair][0])):
            for method, _ in CLIP_ORDERINGS:
                run_id = a.find(label, method, model, peer, need_tests=False)
                series = {k: a.store.series(run_id, f"train/{k}") if run_id else pd.Series(dtype=float)
                          for k in ("clipfrac_self", "clipfrac_peer", "peer_admitted")}
                fractions = rules.clip_fractions(series["clipfrac_self"], series["clipfrac_peer"],
                                                 series["peer_admitted"])
                records.append({"pair": pair, "updated_model": model, "peer": peer, "method": method} | fractions)
    frame = pd.DataFrame(records)
    pooled = frame.groupby(["pair", "method"])[["zero_peer_steps", "peer_steps"]].transform("sum")
    frame["zero_peer_clip_steps_pct"] = 100 * pooled["zero_peer_steps"] / pooled["peer_steps"].where(
        pooled["peer_steps"] > 0)
    return Table(label, "Token-level clipping under different peer-minibatch orderings, steps 1-48.", [],
                 kind="clipfrac", frame_override=frame.drop(columns=["zero_peer_steps", "peer_steps"]))


#: Table 3 (App. B) rows -> the flattened config keys (conf/config.yaml, conf/method) that hold them.
HPARAM_ROWS = (
    ("Training epochs", ("train.total_epochs",)),
    ("Prompt batch size", ("train.batch_prompts",)),
    ("Rollouts per prompt per model", ("method.n",)),
    ("Optimization minibatch size (prompts)", ("train.minibatch_prompts",)),
    ("Optimization epochs per rollout batch", ("train.ppo_epochs",)),
    ("Maximum prompt length", ("train.max_prompt_length",)),
    ("Maximum response length", ("train.max_response_length",)),
    ("Rollout temperature", ("train.temperature",)),
    ("Rollout top-p", ("train.top_p",)),
    ("Optimizer", ("train.optimizer",)),
    ("Learning rate", ("train.lr",)),
    ("LR warm-up steps (constant schedule)", ("train.lr_warmup_steps",)),
    ("Adam coefficients (β1, β2)", ("train.betas",)),
    ("Weight decay", ("train.weight_decay",)),
    ("Maximum gradient norm", ("train.grad_clip",)),
    ("PPO clipping ε_low", ("method.clip_low",)),
    ("PPO clipping ε_high", ("method.clip_high",)),
    ("GRPO normalization stabilizer", ("method.adv_eps",)),
    ("KL coefficient", ("train.kl_coef",)),
    ("Entropy coefficient", ("train.entropy_coef",)),
    ("Precision", ("train.precision",)),
)
HPARAM_METHODS = ("graft", "grpo_n8")


def _hparam_keys(params: list[str], names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that the job runs logged."""
    return [k for k in names if k in params]


def training_hparams(a: Analysis) -> Table:
    """Table 3 (App. B) from the params of the GRAFT and GRPO (n=8) job runs of the paper's pairs."""
    jobs = a.store.job_runs
    jobs = jobs[jobs["method"].isin(HPARAM_METHODS)]
    paper_jobs = jobs[jobs["pair"].isin(catalog.PAPER_PAIRS)]
    jobs = paper_jobs if len(paper_jobs) else jobs
    params = [c[len("param:"):] for c in jobs.columns if c.startswith("param:") and jobs[c].notna().any()]
    records = []
    for name, candidates in HPARAM_ROWS:
        keys = _hparam_keys(params, candidates)
        values = sorted({str(v) for k in keys for v in jobs[f"param:{k}"].dropna()})
        if not keys:
            a.missing.append(Missing("training-hparams", ",".join(HPARAM_METHODS), "-", "-", 0,
                                     catalog.sweep_for("training-hparams", "graft", 0),
                                     f"no logged config key for '{name}'"))
        records.append({"hyperparameter": name, "value": " / ".join(values) if values else math.nan,
                        "param_keys": " ".join(keys)})
    return Table("training-hparams", "Training hyperparameters.", [], kind="hparams",
                 frame_override=pd.DataFrame(records))


# --- seed studies (the tiny pair's sweeps/tiny.yaml): every method over the same seeds, paired with GRPO (n=8) --

SEED_TABLES = {
    # label: (caption, methods, extra references besides GRPO (n=8))
    "main-seeds": ("Main methods over seeds.", ("grpo_n8", "grpo_n16", "grpo_n32", "grpo_ds", "hacpo", "sgt",
                                                 "graft"), ()),
    "ablation-seeds": ("Ablations of GRAFT over seeds.", ("grpo_n8", "graft", "graft_no_gate",
                                                         "graft_random_prompts", "graft_random_admission",
                                                         "graft_pooled", "graft_peer_first"), ("graft",)),
    "replay-seeds": ("Stored peer trajectories over seeds.", ("grpo_n8", "graft", "graft_stored"), ()),
}
BOTH = "both"   # the "updated model" of a seed table's pair-average block


EVAL_SE = "eval_se"  # a seed table's evaluation noise: the standard error of a checkpoint's Avg over its runs


def _seed_scores(a: Analysis, label: str, method: str, model: str, peer: str, seeds: list[int],
                 benches: list[str]) -> pd.DataFrame:
    """Seeds x (benches + avg + eval_se): per training run, the mean over the evaluation runs of its checkpoint,
    and the standard error of that mean's Avg (s.d. over the evaluation runs / sqrt(runs); NaN for one run)."""
    rows = {}
    for seed in seeds:
        run_id = a.find(label, method, model, catalog.peer_of(method, peer), seed)
        if run_id:
            runs = a.scores(run_id, benches)
            rows[seed] = runs.mean()
            rows[seed][EVAL_SE] = standard_error(runs[AVG])
    return pd.DataFrame.from_dict(rows, orient="index", columns=[*benches, AVG, EVAL_SE])


def _paired_row(a: Analysis, method: str, model: str, peer: str, per_seed: pd.DataFrame,
              references: dict[str, pd.DataFrame], seeds: list[int]) -> Row:
    """Mean and sample std over seeds, and the paired difference of Avg to each reference (same seeds); with
    an ``eval_se`` column, its mean over seeds (one model's evaluation noise, to set beside those differences)."""
    stats = rules.mean_std(per_seed.drop(columns=EVAL_SE, errors="ignore"))
    row = Row(model, peer, method, stats, catalog.method_display(method), ours=method == "graft",
              reference=method == "grpo_n8")
    row.extra = {"seeds": len(per_seed), "of_seeds": len(seeds)}
    if EVAL_SE in per_seed:
        row.extra[EVAL_SE] = per_seed[EVAL_SE].mean()
    for name, ref in references.items():
        diff = rules.paired_difference(per_seed[AVG], ref[AVG]) if len(per_seed) else {
            "mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
        row.extra |= {f"vs_{name}_mean": diff["mean"], f"vs_{name}_lo": diff["lo"], f"vs_{name}_hi": diff["hi"],
                      f"vs_{name}_n": diff["n"]}
    row.stats["delta"] = row.extra["vs_grpo_n8_mean"]
    return row


def seed_table(a: Analysis, label: str) -> Table:
    """A seed-study table: per updated model, and for the pair average (both models, per seed), each method's
    mean ± sample std over seeds and its paired difference to GRPO (n=8) (and to full GRAFT in the ablation):
    mean over seeds of (method - reference) on the same seed, with its 95% Student-t interval."""
    caption, methods, extra_refs = SEED_TABLES[label]
    pairs = a.seed_study_pairs()
    table = Table(label, caption, _run_benches(a, pairs), kind="seeds")
    benches = table.benches
    for pair in pairs:
        model_a, model_b = a.pairs[pair]
        seeds = a.seeds_of(pair)
        table.items.append(Band(f"{_pair_name(pair)}: {catalog.model_display(model_a)} ↔ "
                                f"{catalog.model_display(model_b)}, seeds {', '.join(map(str, seeds))}", "pair"))
        ran = [m for m in methods if a.ran(m, pair)]
        scores = {(m, model): _seed_scores(a, label, m, model, peer, seeds, benches)
                  for m in ran for model, peer in ((model_a, model_b), (model_b, model_a))}
        for model, peer in ((model_a, model_b), (model_b, model_a), (BOTH, "")):
            if model == BOTH:
                # A seed counts for the pair average only when both of its models have scores.
                for m in ran:
                    a_scores, b_scores = scores[(m, model_a)], scores[(m, model_b)]
                    both = (a_scores + b_scores) / 2
                    # the two models' evaluations are independent: their errors add in quadrature
                    both[EVAL_SE] = (a_scores[EVAL_SE] ** 2 + b_scores[EVAL_SE] ** 2) ** 0.5 / 2
                    scores[(m, BOTH)] = both.dropna(subset=[AVG])
                title = "Both models (mean of the two per seed)"
            else:
                title = f"Updated policy: {catalog.model_display(model)}"
            table.items.append(Band(title, "model"))
            references = {r: scores.get((r, model), pd.DataFrame(columns=[AVG])) for r in ("grpo_n8", *extra_refs)}
            for m in ran:
                table.items.append(_paired_row(a, m, model, peer if model != BOTH else "", scores[(m, model)],
                                             references, seeds))
    return table


def compute_seeds(a: Analysis) -> Table:
    """Compute over seeds: per method, the pair-average Avg (mean ± std over seeds, paired difference to GRPO
    (n=8)) and the device-hours of both models to their selected checkpoints and for the full runs (App. D's
    "both models" accounting, :func:`compute_costs`), mean over seeds."""
    label = "compute-seeds"
    pairs = a.seed_study_pairs()
    table = Table(label, "Score and training cost over seeds.", _run_benches(a, pairs), kind="seeds")
    for pair in pairs:
        model_a, model_b = a.pairs[pair]
        seeds = a.seeds_of(pair)
        table.items.append(Band(f"{_pair_name(pair)}: both models, seeds {', '.join(map(str, seeds))}", "pair"))
        per_method = {}
        for method in [m for m in COMPUTE_METHODS if a.ran(m, pair)]:
            separate = method in catalog.SINGLE_MODEL_METHODS
            records = {}
            for seed in seeds:
                found = {model: a.find(label, method, model, NO_PEER if separate else peer, seed)
                         for model, peer in ((model_a, model_b), (model_b, model_a))}
                if None in found.values():
                    continue
                run_a, run_b = found[model_a], found[model_b]
                costs = compute_costs(a, method, model_a, model_b, run_a, run_b)
                avg = job_score([a.scores(run_a, table.benches).mean(), a.scores(run_b, table.benches).mean()])
                records[seed] = {**avg.to_dict(), "joint_gpuh_best": costs["joint_gpuh_best"],
                                 "joint_gpuh_full": costs["joint_gpuh_full"]}
            per_method[method] = pd.DataFrame.from_dict(records, orient="index",
                                                        columns=[*table.benches, AVG, "joint_gpuh_best",
                                                                 "joint_gpuh_full"])
        reference = {"grpo_n8": per_method.get("grpo_n8", pd.DataFrame(columns=[AVG]))}
        for method, frame in per_method.items():
            row = _paired_row(a, method, BOTH, "", frame[[*table.benches, AVG]], reference, seeds)
            row.extra |= {"pair": pair, "joint_gpuh_best": frame["joint_gpuh_best"].mean(),
                          "joint_gpuh_full": frame["joint_gpuh_full"].mean()}
            table.items.append(row)
    return table


def _mean_costs(a: Analysis, label: str, method: str, model: str, peer: str, seeds: list[int]) -> dict:
    """Device-hours of the model's training (its own share of its job) and of its whole job, mean over seeds."""
    own, job = [], []
    for seed in seeds:
        run_id = a.find(label, method, model, catalog.peer_of(method, peer), seed)
        if run_id:
            cost, job_cost = a.model_cost(run_id), a.job_cost(run_id)
            own.append(cost.iloc[-1] if len(cost) else math.nan)
            job.append(job_cost.iloc[-1] if len(job_cost) else math.nan)
    return {"gpuh_model": pd.Series(own, dtype=float).mean(), "gpuh_job": pd.Series(job, dtype=float).mean()}


def group_seeds(a: Analysis) -> Table:
    """The K-model study (sweeps/tiny3.yaml): per member R of each group, GRPO (n=8), GRAFT with each single
    peer (the runs of R's pairs), and GRAFT with all peers once per source rule (the group runs). Paired
    differences to GRPO (n=8) and to R's best single peer -- the single peer with the higher mean Avg over
    seeds, chosen after the fact, so that comparison favours the single peer -- and device-hours: R's own
    share, and its whole job's (two models in a pair, K in a group)."""
    label = "group-seeds"
    groups = a.groups
    table = Table(label, "Co-training with several peers: each model of a group with GRPO (n=8), with each "
                  "single peer, and with all its peers.", a.benches_of(a.model_runs.index[
                      a.model_runs["model"].isin([m for ms in groups.values() for m in ms])]), kind="seeds")
    benches = table.benches
    for group, members in groups.items():
        seeds = a.group_seeds(group)
        table.items.append(Band(f"{group}: {' · '.join(map(catalog.model_display, members))}, seeds "
                                f"{', '.join(map(str, seeds))}", "pair"))
        all_peers = a.source_rules(group)
        for model in members:
            others = [m for m in members if m != model]
            cells = [("grpo_n8", NO_PEER), *(("graft", peer) for peer in others),
                     *((method, ",".join(others)) for method in all_peers)]
            scores = {(method, peer): _seed_scores(a, label, method, model, peer, seeds, benches)
                      for method, peer in cells}
            singles = {peer: scores[("graft", peer)][AVG].mean() for peer in others
                       if not scores[("graft", peer)].empty}
            best = max(singles, key=singles.get) if singles else None
            references = {"grpo_n8": scores[("grpo_n8", NO_PEER)],
                          catalog.BEST_PEER: scores[("graft", best)] if best else pd.DataFrame(columns=[AVG])}
            table.items.append(Band(f"Updated policy: {catalog.model_display(model)}", "model"))
            for method, peer in cells:
                row = _paired_row(a, method, model, peer, scores[(method, peer)], references, seeds)
                if method == "graft":
                    row.label = f"GRAFT with {catalog.model_display(peer)}" + (" (best single peer)"
                                                                                if peer == best else "")
                    row.extra["label"] = row.label
                    if peer == best:   # the reference itself: no difference to show
                        row.extra |= {f"vs_{catalog.BEST_PEER}_{k}": math.nan for k in ("mean", "lo", "hi")}
                row.ours = method != "grpo_n8" and method != "graft"
                row.extra |= _mean_costs(a, label, method, model, peer, seeds)
                table.items.append(row)
    return table


BUILDERS = {
    "main-results": main_results,
    "ablation": ablation,
    "ablation-full": ablation_full,
    "which-how-full": which_how_full,
    "training-variance": training_variance,
    "replay-results": replay_results,
    "compute": compute,
    "clipfrac-position": clipfrac_position,
    "training-hparams": training_hparams,
    **{label: (lambda a, label=label: seed_table(a, label)) for label in SEED_TABLES},
    "compute-seeds": compute_seeds,
    "group-seeds": group_seeds,
}


def build_all(a: Analysis) -> dict[str, Table]:
    return {label: build(a) for label, build in BUILDERS.items()}
