"""Load what the analysis needs from MLflow into tidy pandas frames, in bulk.

Only MLflow APIs are used: ``mlflow.search_runs`` for tags, params and latest metrics, and for metric
histories the tracking store's own bulk query (``get_metric_history_bulk``, one query per metric key for
many runs) where the store offers it (SQLAlchemy stores: SQLite, PostgreSQL). Other stores (an
``http://`` tracking server) are read with ``MlflowClient.get_metric_history`` in a thread pool, since
those calls wait on the network rather than on the CPU.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from rich.progress import Progress

from analysis import catalog
from graft_exp import schema
from graft_exp.schema import ENV_TAGS
from graft_exp.tracking import TrackingError, check_store

#: Score metrics (logged as fractions or percent; see ``RunStore.score_scale``).
HISTORY_PREFIXES = ("test/", "val/")
TAGS = ("method", "pair", "seed", "model", "peer", "role", "n", "best_step", "run_key", "study")
_BULK_CHUNK = 500  # run ids per bulk query, far below SQLite's bound-parameter limit
_HISTORY_COLUMNS = ["run_id", "key", "step", "value", "timestamp"]
#: Tag of the runs ``python -m analysis ... --log-to-mlflow`` creates; they are outputs, not job or model runs.
ANALYSIS_TAG = schema.ANALYSIS


class StoreUnavailable(RuntimeError):
    """The tracking URI cannot be read, or holds no experiment to analyse."""


@dataclass
class RunStore:
    """Runs of the selected experiments.

    ``runs``: one row per run (index ``run_id``) with columns ``experiment``, ``status``, ``parent_id``,
    ``is_model`` and one column per ``graft.*`` tag (``method``, ``pair``, ``seed``, ``model``, ``peer``,
    ``role``, ``n``, ``best_step``, ``run_key``, ``study``), ``end_time``, plus ``param:<key>`` columns (a
    model run inherits its job run's params) and ``metric:<key>`` columns with the latest value.
    ``history``: long frame ``run_id, key, step, value`` (one value per step: the latest logged).
    """

    runs: pd.DataFrame
    history: pd.DataFrame
    tracking_uri: str = ""

    @property
    def model_runs(self) -> pd.DataFrame:
        return self.runs[self.runs["is_model"]]

    @property
    def job_runs(self) -> pd.DataFrame:
        return self.runs[~self.runs["is_model"]]

    def series(self, run_id: str, key: str) -> pd.Series:
        """History of one metric of one run as a step-indexed Series (empty when never logged)."""
        grouped = self._positions
        if (run_id, key) not in grouped:
            return pd.Series(dtype=float, name=key)
        rows = self.history.iloc[grouped[(run_id, key)]]
        return pd.Series(rows["value"].to_numpy(), index=rows["step"].to_numpy(), name=key).sort_index()

    def run_history(self, run_id: str) -> pd.DataFrame:
        """Every loaded history row of one run (``key, step, value``)."""
        positions = self._run_positions.get(run_id)
        return self.history.iloc[positions if positions is not None else []]

    @cached_property
    def _run_positions(self) -> dict:
        return self.history.groupby("run_id", sort=False).indices

    @cached_property
    def _positions(self) -> dict:
        return self.history.groupby(["run_id", "key"], sort=False).indices

    @property
    def score_scale(self) -> float:
        """100 when scores were logged as fractions in [0, 1], so that tables show percent like the paper."""
        scores = self.history.loc[self.history["key"].str.startswith(HISTORY_PREFIXES), "value"]
        return 100.0 if len(scores) and scores.abs().max() <= 1.0 else 1.0


def graft_experiments(client: MlflowClient, names: list[str] | None) -> dict[str, str]:
    """Experiment id -> name: the named ones, or every experiment whose name starts with ``graft/``."""
    try:
        experiments = client.search_experiments(max_results=50000)
    except MlflowException as error:
        raise StoreUnavailable(f"cannot read the tracking store: {error}") from error
    except Exception as error:
        raise StoreUnavailable(f"cannot reach the tracking store: {error}") from error
    found = {e.experiment_id: e.name for e in experiments}
    if names:
        selected = {i: n for i, n in found.items() if n in names}
        absent = sorted(set(names) - set(selected.values()))
        if absent:
            raise StoreUnavailable(f"no experiment named {', '.join(absent)} in the tracking store")
    else:
        selected = {i: n for i, n in found.items() if n.startswith(schema.EXPERIMENT_PREFIX)}
        if not selected:
            raise StoreUnavailable("the tracking store has no experiment whose name starts with 'graft/'")
    return selected


def _tidy_runs(raw: pd.DataFrame, experiments: dict[str, str]) -> pd.DataFrame:
    """One row per run with graft tags, inherited params and latest metrics under short column names."""
    runs = pd.DataFrame(index=pd.Index(raw["run_id"], name="run_id"))
    runs["experiment"] = raw["experiment_id"].map(experiments).to_numpy()
    runs["status"] = raw["status"].to_numpy()
    runs["end_time"] = raw["end_time"].to_numpy() if "end_time" in raw else pd.NaT
    parent = raw.get("tags.mlflow.parentRunId", pd.Series(index=raw.index, dtype=object))
    runs["parent_id"] = parent.to_numpy()
    model = raw.get("tags.graft.model", pd.Series(index=raw.index, dtype=object))
    runs["is_model"] = model.notna().to_numpy()
    for tag in TAGS:
        column = raw.get(f"tags.graft.{tag}", pd.Series(index=raw.index, dtype=object))
        runs[tag] = column.to_numpy()
    for tag in ("seed", "n", "best_step"):
        runs[tag] = pd.to_numeric(runs[tag], errors="coerce")
    # The job's environment (graft.env.* tags of the job run), inherited by its model runs.
    environment = pd.DataFrame({f"env:{tag.rsplit('.', 1)[-1]}": raw.get(f"tags.{tag}", pd.Series(
        index=raw.index, dtype=object)).to_numpy() for tag in ENV_TAGS}, index=runs.index)
    environment = environment.where(environment.notna(),
                                    environment.loc[~runs["is_model"]].reindex(runs["parent_id"]).set_axis(runs.index))
    params = raw.filter(like="params.").rename(columns=lambda c: "param:" + c[len("params."):])
    params.index = runs.index
    # A model run inherits the params of its job run (the flattened resolved config lives there).
    job_params = params.loc[~runs["is_model"]]
    inherited = job_params.reindex(runs["parent_id"]).set_axis(runs.index)
    params = params.where(params.notna(), inherited)
    metrics = raw.filter(like="metrics.").rename(columns=lambda c: "metric:" + c[len("metrics."):])
    metrics.index = runs.index
    return pd.concat([runs, environment, params, metrics], axis=1)


def seed_study_pairs(runs: pd.DataFrame) -> list[str]:
    """Pairs whose GRPO (n=8) baseline ran with more than one seed: their tables compare methods over seeds."""
    grpo = runs[runs["is_model"] & runs["method"].eq("grpo_n8")]
    seeds = grpo.groupby("model")["seed"].nunique()
    models = set(seeds.index[seeds > 1])
    pairs = runs.loc[runs["is_model"] & runs["model"].isin(models), "pair"].dropna()
    return sorted(set(pairs))


def _history_plan(runs: pd.DataFrame) -> dict[str, list[str]]:
    """Metric key -> the run ids whose history of it the tables and figures read.

    Reading a history costs MLflow ~30 us per value, so only what is used is read: ``test/<bench>`` of every
    model run (a handful of values each); ``val/avg`` for the validation-curve figure (first runs of its
    methods), for runs without a ``graft.best_step`` tag and for every run of a seed study's pair; cumulative
    ``cost/gpu_hours`` of the first runs of the costed methods (every seed of a seed study) and of their jobs;
    clipping metrics of the first runs of the clip-dynamics methods.
    """
    def logged(key, selected):
        column = f"metric:{key}"
        if column not in runs:
            return []
        return runs.index[selected & runs[column].notna()].tolist()

    model = runs["is_model"]
    # Curves and costs are read for the first run, and for every run of a seed study's pair (the tables
    # and figures over seeds).
    seed_study = runs["pair"].isin(seed_study_pairs(runs))
    first = runs["seed"].eq(0) | seed_study
    costed = model & first & runs["method"].isin(catalog.COMPUTE_METHODS)
    costed_jobs = runs.index.isin(runs.loc[costed, "parent_id"].dropna())
    plan = {}
    for column in runs.columns:
        key = column[len("metric:"):]
        if column.startswith("metric:test/") and key != "test/avg":
            plan[key] = logged(key, model)
    plan["val/avg"] = logged("val/avg", model & ((first & runs["method"].isin(catalog.CURVE_METHODS))
                                                 | seed_study | runs["best_step"].isna()))
    plan["cost/gpu_hours"] = logged("cost/gpu_hours", costed | costed_jobs)
    clipped = model & first & runs["method"].isin(catalog.CLIP_METHODS)
    for key in ("train/clipfrac_self", "train/clipfrac_peer", "train/peer_admitted"):
        plan[key] = logged(key, clipped)
    return {key: run_ids for key, run_ids in plan.items() if run_ids}


def _bulk_histories(store, key: str, run_ids: list[str]) -> list[tuple]:
    rows = []
    for start in range(0, len(run_ids), _BULK_CHUNK):
        chunk = run_ids[start:start + _BULK_CHUNK]
        for m in store.get_metric_history_bulk(chunk, key, max_results=np.iinfo(np.int32).max):
            rows.append((m.run_id, key, m.step, m.value, m.timestamp))
    return rows


def _threaded_histories(client: MlflowClient, key: str, run_ids: list[str]) -> list[tuple]:
    def one(run_id):
        return [(run_id, key, m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key)]

    with ThreadPoolExecutor(max_workers=16) as pool:
        return [row for rows in pool.map(one, run_ids) for row in rows]


def load_histories(client: MlflowClient, plan: dict[str, list[str]], progress: bool = False) -> pd.DataFrame:
    """Histories of every (key, runs) of ``plan``, the latest value per step (a resumed run may re-log)."""
    # The store is reached through the client because MLflow exposes its bulk query only on the store.
    store = client._tracking_client.store
    bulk = hasattr(store, "get_metric_history_bulk")
    rows = []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("metric histories", total=len(plan))
        for key, run_ids in plan.items():
            rows += _bulk_histories(store, key, run_ids) if bulk else _threaded_histories(client, key, run_ids)
            bar.advance(task)
    history = pd.DataFrame(rows, columns=_HISTORY_COLUMNS)
    history = history.sort_values(["run_id", "key", "step", "timestamp"], kind="stable")
    history = history.drop_duplicates(["run_id", "key", "step"], keep="last")
    return history.drop(columns="timestamp").reset_index(drop=True)


def check_sqlite_exists(tracking_uri: str) -> None:
    """A ``sqlite:///`` store the analysis reads must exist: MLflow would silently create an empty database at a
    missing path, and a missing file is a wrong path."""
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri[len("sqlite:///"):]).is_file():
        raise StoreUnavailable(f"no SQLite database at {tracking_uri[len('sqlite:///'):]}")


def load_store(tracking_uri: str, experiments: list[str] | None = None, progress: bool = False) -> RunStore:
    """Read the runs of ``experiments`` (default: every ``graft/*`` experiment) and the histories we use."""
    check_sqlite_exists(tracking_uri)
    try:
        check_store(tracking_uri, writing=False)
    except TrackingError as err:
        raise StoreUnavailable(str(err)) from None
    client = MlflowClient(tracking_uri=tracking_uri)
    selected = graft_experiments(client, experiments)
    previous_uri = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)
    try:
        raw = mlflow.search_runs(experiment_ids=list(selected), max_results=100000, output_format="pandas")
    finally:
        mlflow.set_tracking_uri(previous_uri)
    if f"tags.{ANALYSIS_TAG}" in raw:
        raw = raw[raw[f"tags.{ANALYSIS_TAG}"].isna()].reset_index(drop=True)
    if raw.empty:
        runs = pd.DataFrame(columns=["experiment", "status", "end_time", "parent_id", "is_model", *TAGS])
        runs.index.name = "run_id"
        runs["is_model"] = runs["is_model"].astype(bool)
        return RunStore(runs, pd.DataFrame(columns=_HISTORY_COLUMNS[:-1]), tracking_uri)
    runs = _tidy_runs(raw, selected)
    history = load_histories(client, _history_plan(runs), progress=progress)
    return RunStore(runs, history, tracking_uri)
