"""Find the model run behind each table cell, its scores and costs, and log what is missing.

A cell is addressed by (method, updated model, peer, seed). GRPO-style single-model runs have peer
``none`` and are shared by every pair containing their model, whatever pair launched them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import cached_property

import pandas as pd

from analysis import catalog, rules
from analysis.store import RunStore, seed_study_pairs
from graft_exp.schema import NO_PEER

log = logging.getLogger("analysis")


@dataclass(frozen=True)
class Missing:
    """A cell the store cannot fill, and the sweep file whose runs would fill it."""

    table: str
    method: str
    model: str
    peer: str
    seed: int
    sweep: str
    reason: str


@dataclass
class Analysis:
    """The selected runs of a store, with lookups by cell and a log of missing cells."""

    store: RunStore
    missing: list[Missing] = field(default_factory=list)
    used: dict[str, set[str]] = field(default_factory=dict)   # table label -> the model runs its cells read

    def mixed_environments(self) -> list[str]:
        """One line per table whose runs come from different environments (``graft.env.*``), naming
        each difference and how many runs had each value."""
        columns = [c for c in self.store.runs.columns if c.startswith("env:")]
        lines = []
        for table, run_ids in sorted(self.used.items()):
            env = self.store.runs.loc[sorted(run_ids), columns].fillna("unrecorded")
            differences = [f"{c.removeprefix('env:')} " + " vs ".join(
                f"{value} ({count} runs)" for value, count in env[c].value_counts().sort_index().items())
                for c in columns if env[c].nunique() > 1]
            if differences:
                lines.append(f"table {table} mixes environments: {'; '.join(differences)}")
        return lines

    @cached_property
    def scale(self) -> float:
        return self.store.score_scale

    @cached_property
    def model_runs(self) -> pd.DataFrame:
        runs = self.store.model_runs.copy()
        runs["peer"] = runs["peer"].fillna(NO_PEER)
        runs["method_key"] = [self._method_key(r) for _, r in runs.iterrows()]
        has_tests = self.store.history[self.store.history["key"].str.startswith("test/")]["run_id"].unique()
        runs["has_tests"] = runs.index.isin(has_tests)
        runs["finished"] = runs["status"].eq("FINISHED")
        # Several runs of one cell (a study repeated, a requeue that started afresh): prefer a run with test
        # scores, then a finished one, then the newest.
        return runs.sort_values(["has_tests", "finished", "end_time"], ascending=False, na_position="last")

    @staticmethod
    def _method_key(run: pd.Series) -> str:
        method = run["method"]
        if "," in str(run["peer"]):   # a group member that learnt from several peers at once
            return catalog.all_peers_method(method, run.get(f"param:{catalog.SOURCE_RULE_PARAM}"))
        delta = pd.to_numeric(run.get(f"param:{catalog.DELTA_PARAM}"), errors="coerce")
        if method == "graft" and pd.notna(delta) and not math.isclose(delta, catalog.DEFAULT_DELTA):
            return catalog.delta_method(delta)
        return method

    @cached_property
    def _cells(self) -> dict:
        cells = {}
        for run_id, run in self.model_runs.iterrows():
            key = (run["method_key"], run["model"], run["peer"], run["seed"])
            cells.setdefault(key, run_id)
        return cells

    @cached_property
    def pairs(self) -> dict[str, tuple[str, str]]:
        """Pair -> (model A, model B): tagged model runs first, the catalog for pairs nobody ran."""
        found = {}
        for pair, members in self._members().items():
            if len(members) == 2:
                found[pair] = members
        pairs = {p: found.get(p, catalog.PAIRS[p]) for p in catalog.PAPER_PAIRS}
        for pair in sorted(found):
            pairs.setdefault(pair, found[pair])
        return pairs

    def _members(self) -> dict[str, tuple[str, ...]]:
        """Pair or group name -> its models in member order (A, B, C, ...), from the model runs' tags."""
        found = {}
        for name, runs in self.model_runs.dropna(subset=["pair", "role"]).groupby("pair"):
            roles = runs.drop_duplicates("role").set_index("role")["model"].sort_index()
            if {"A", "B"} <= set(roles.index):
                found[name] = tuple(roles)
        return found

    @cached_property
    def groups(self) -> dict[str, tuple[str, ...]]:
        """Group (``group=...``, more than two models) -> its models in member order."""
        return {name: members for name, members in self._members().items() if len(members) > 2}

    def group_seeds(self, group: str) -> list[int]:
        """Every seed any run of ``group``'s models ran with (with any peer, or alone)."""
        runs = self.model_runs[self.model_runs["model"].isin(self.groups[group])]
        return sorted(int(s) for s in runs["seed"].dropna().unique())

    def source_rules(self, group: str) -> list[str]:
        """Method keys of the all-peers runs of ``group`` (one per source rule that ran), sorted."""
        runs = self.model_runs[self.model_runs["pair"].eq(group)]
        return sorted(k for k in runs["method_key"].unique() if f" all peers {catalog.SOURCE_RULE_PARAM}=" in k)

    def pairs_with_runs(self, default: tuple[str, ...] = catalog.PAPER_PAIRS) -> list[str]:
        """Pairs that any model run names, in catalog order; ``default`` when the store names none."""
        named = set(self.model_runs["pair"].dropna())
        ordered = [p for p in self.pairs if p in named]
        return ordered or list(default)

    def study_pairs(self, methods) -> list[str]:
        """The pairs of the single-pair studies (ablations, compute, clipping): where any of ``methods`` ran."""
        runs = self.model_runs[self.model_runs["method_key"].isin(methods)]
        named = set(runs["pair"].dropna())
        return [p for p in self.pairs if p in named] or [catalog.STUDY_PAIR]

    def seed_study_pairs(self) -> list[str]:
        """Pairs whose GRPO (n=8) baseline ran with several seeds (sweeps/tiny.yaml), in catalog order."""
        found = set(seed_study_pairs(self.store.runs))
        return [p for p in self.pairs if p in found]

    def _pair_runs(self, pair: str) -> pd.DataFrame:
        """Model runs of ``pair``'s two models: co-trained with each other, or trained alone."""
        models = set(self.pairs[pair])
        runs = self.model_runs
        return runs[runs["model"].isin(models) & (runs["peer"].isin(models) | runs["peer"].eq(NO_PEER))]

    def seeds_of(self, pair: str) -> list[int]:
        """Every seed any method ran with on ``pair`` (a seed table's columns to fill)."""
        return sorted(int(s) for s in self._pair_runs(pair)["seed"].dropna().unique())

    def ran(self, method: str, pair: str) -> bool:
        """Whether any run of ``method`` trained a model of ``pair`` (seed tables list only those methods)."""
        return bool(self._pair_runs(pair)["method_key"].eq(method).any())

    @cached_property
    def benches(self) -> list[str]:
        keys = self.store.history["key"].unique()
        return catalog.order_benches([k[len("test/"):] for k in keys if k.startswith("test/") and k != "test/avg"])

    def benches_of(self, run_ids) -> list[str]:
        """Benchmarks any of ``run_ids`` was tested on (the paper's five when none was)."""
        history = self.store.history
        keys = history.loc[history["run_id"].isin(list(run_ids)), "key"].unique()
        found = [k[len("test/"):] for k in keys if k.startswith("test/") and k != "test/avg"]
        return catalog.order_benches(found) if found else list(catalog.BENCH_ORDER)

    def find(self, table: str, method: str, model: str, peer: str, seed: int = 0,
             need_tests: bool = True) -> str | None:
        """The run id of a cell, or None after logging it as missing (with the sweep that produces it)."""
        run_id = self._cells.get((method, model, peer, seed))
        reason = None
        if run_id is None:
            reason = "no run"
        elif need_tests and not self.model_runs.loc[run_id, "has_tests"]:
            reason = f"run {run_id} has no test/* scores (training or evaluation unfinished)"
        if reason is None:
            self.used.setdefault(table, set()).add(run_id)
            return run_id
        entry = Missing(table, method, model, peer, seed, catalog.sweep_for(table, method, seed, model), reason)
        if entry not in self.missing:
            self.missing.append(entry)
        return None

    def scores(self, run_id: str, benches: list[str]) -> pd.DataFrame:
        """Evaluation runs x (benches + avg) of a run's selected checkpoint, in percent."""
        return rules.eval_scores(self.store.run_history(run_id), benches, self.scale)

    def best_step(self, run_id: str) -> float:
        """The run's selected checkpoint: its ``graft.best_step`` tag, else the best validation step."""
        step = self.model_runs.loc[run_id, "best_step"]
        return step if pd.notna(step) else rules.best_validation_step(self.store.series(run_id, "val/avg"))

    def parent(self, run_id: str) -> str | None:
        parent = self.model_runs.loc[run_id, "parent_id"]
        return parent if isinstance(parent, str) else None

    def siblings(self, run_id: str) -> list[str]:
        """Model runs of the same job (both models of a co-training run)."""
        parent = self.parent(run_id)
        if parent is None:
            return [run_id]
        return self.model_runs.index[self.model_runs["parent_id"] == parent].tolist()

    def model_cost(self, run_id: str) -> pd.Series:
        """Cumulative GPU-hours charged to this model: its own share, else its job's when it trained alone."""
        cost = self.store.series(run_id, "cost/gpu_hours")
        parent = self.parent(run_id)
        if cost.empty and parent is not None and len(self.siblings(run_id)) == 1:
            cost = self.store.series(parent, "cost/gpu_hours")
        return cost

    def job_cost(self, run_id: str) -> pd.Series:
        """Cumulative GPU-hours of the whole job that trained this model."""
        parent = self.parent(run_id)
        return self.store.series(parent, "cost/gpu_hours") if parent else pd.Series(dtype=float)

    def warn_missing(self) -> None:
        for entry in self.missing:
            log.warning("missing %s: method=%s model=%s peer=%s seed=%s (%s) -> run %s", entry.table,
                        entry.method, entry.model, entry.peer, entry.seed, entry.reason, entry.sweep)

    def missing_frame(self) -> pd.DataFrame:
        return pd.DataFrame([vars(m) for m in self.missing],
                            columns=["table", "method", "model", "peer", "seed", "sweep", "reason"])
