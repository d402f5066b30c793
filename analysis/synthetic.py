"""Write MLflow stores that follow docs/design.md's schema exactly, for the analysis tests and the scale benchmark.

A :class:`JobSpec` is one Hydra job (the parent run) and its :class:`ModelSpec` children; :func:`write_jobs`
logs them with ``MlflowClient.log_batch``. :func:`with_costs` derives the ``cost/gpu_hours`` histories of a job
and its model runs from chosen per-step seconds and GPU counts, the way the backends log them.
:func:`paper_like_jobs` generates a store that fills every table and figure of the paper with plausible,
seeded random values.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from analysis import catalog
from graft_exp import schema
from graft_exp.schema import NO_PEER

_MAX_METRICS, _MAX_PARAMS = 1000, 100  # MLflow's log_batch limits per request


@dataclass
class ModelSpec:
    """A model run: tags, per-step metric histories and the evaluation scores of its best checkpoint."""

    model: str
    role: str
    peer: str = NO_PEER
    n: int = 8
    best_step: int | None = None
    test: dict[str, list[float]] = field(default_factory=dict)  # bench -> one value per evaluation run
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)  # key -> {step: value}
    prompt_success: pd.DataFrame | None = None  # step, prompt_id, k


@dataclass
class JobSpec:
    """A job run (one Hydra job) with its model runs."""

    method: str
    pair: str
    seed: int
    models: list[ModelSpec]
    study: str = "main"
    params: dict[str, object] = field(default_factory=dict)
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)   # graft.env.* tags of the job run


def _metric_entities(histories: dict[str, dict[int, float]], start_ms: int) -> list[Metric]:
    return [Metric(key, float(value), start_ms + int(step), int(step))
            for key, steps in histories.items() for step, value in steps.items()]


def _log(client: MlflowClient, run_id: str, metrics: list[Metric], params: dict, tags: dict) -> None:
    tag_entities = [RunTag(k, str(v)) for k, v in tags.items()]
    param_entities = [Param(k, str(v)) for k, v in params.items()]
    client.log_batch(run_id, tags=tag_entities)
    for start in range(0, len(param_entities), _MAX_PARAMS):
        client.log_batch(run_id, params=param_entities[start:start + _MAX_PARAMS])
    for start in range(0, len(metrics), _MAX_METRICS):
        client.log_batch(run_id, metrics=metrics[start:start + _MAX_METRICS])


def _experiment_id(client: MlflowClient, name: str, artifact_root: Path) -> str:
    found = client.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    return client.create_experiment(name, artifact_location=(artifact_root / name.replace("/", "_")).as_uri())


def write_jobs(tracking_uri: str, jobs: list[JobSpec], artifact_root: Path) -> list[str]:
    """Log every job and model run into experiments ``graft/<study>``; returns the model run ids."""
    client = MlflowClient(tracking_uri=tracking_uri)
    start_ms = int(time.time() * 1000)
    model_run_ids = []
    for job in jobs:
        experiment = _experiment_id(client, schema.experiment_name(job.study), artifact_root)
        common = {"graft.method": job.method, "graft.pair": job.pair, "graft.seed": job.seed}
        parent = client.create_run(experiment, tags={**common, "graft.study": job.study, "graft.backend": "verl",
                                                     "graft.run_key": f"{job.study}-{job.method}-{job.pair}-{job.seed}",
                                                     "graft.git_sha": "0" * 40, **job.environment})
        params = {"method.name": job.method, "seed": job.seed, "pair.name": job.pair, **job.params}
        _log(client, parent.info.run_id, _metric_entities(job.metrics, start_ms), params, {})
        for spec in job.models:
            child = client.create_run(experiment, tags={"mlflow.parentRunId": parent.info.run_id})
            tags = {**common, "graft.model": spec.model, "graft.peer": spec.peer, "graft.role": spec.role,
                    "graft.n": spec.n}
            if spec.best_step is not None:
                tags["graft.best_step"] = spec.best_step
            tests = {f"test/{b}": dict(enumerate(v)) for b, v in spec.test.items()}
            if spec.test:
                tests["test/avg"] = dict(enumerate(np.mean(list(spec.test.values()), axis=0)))
            _log(client, child.info.run_id, _metric_entities({**spec.metrics, **tests}, start_ms), {}, tags)
            if spec.prompt_success is not None:
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "prompt_success.parquet"
                    spec.prompt_success.to_parquet(path)
                    client.log_artifact(child.info.run_id, str(path))
            client.set_terminated(child.info.run_id)
            model_run_ids.append(child.info.run_id)
        client.set_terminated(parent.info.run_id)
    return model_run_ids


# --- costs from step timings ---------------------------------------------------------------------------------

COST_KEY = "cost/gpu_hours"


def gpu_hours(step_seconds, gpus: int) -> dict[int, float]:
    """Cumulative ``cost/gpu_hours`` at steps 1, 2, ... as the backends log it (App. D): GPUs x the summed wall
    seconds of the training steps so far, in hours."""
    seconds = np.asarray(step_seconds, dtype=float)
    if int(gpus) < 1 or seconds.ndim != 1 or not len(seconds) or (seconds < 0).any() or not np.isfinite(seconds).all():
        raise ValueError(f"need at least one finite, non-negative step time and >= 1 GPU; got {gpus} GPUs and "
                         f"{step_seconds!r}")
    return dict(zip(range(1, len(seconds) + 1), (np.cumsum(seconds) * int(gpus) / 3600).tolist()))


def with_costs(job: JobSpec, seconds: dict[str, list[float]], gpus: dict[str, int]) -> JobSpec:
    """Give ``job`` the cost histories the backends log, from each model's (by role) per-step seconds and GPUs.

    A model run's ``cost/gpu_hours`` is its own cumulative cost: an independent model's own steps on its own
    GPUs; a co-trained model's own generation, scoring and training time on the GPUs it used (its share of the
    joint run). The job run's is the joint run's cost, the sum of its models' at every step (a model that
    finished earlier counts with its final cost).
    """
    roles = {spec.role for spec in job.models}
    if set(seconds) != roles or set(gpus) != roles:
        raise ValueError(f"step times and GPU counts must name exactly the job's roles {sorted(roles)}; got "
                         f"{sorted(seconds)} and {sorted(gpus)}")
    shares = {}
    for spec in job.models:
        spec.metrics[COST_KEY] = shares[spec.role] = gpu_hours(seconds[spec.role], gpus[spec.role])
    joint = pd.DataFrame({role: pd.Series(cost) for role, cost in shares.items()}).sort_index().ffill()
    job.metrics[COST_KEY] = joint.sum(axis=1).to_dict()
    return job


# --- a paper-like store -------------------------------------------------------------------------------------

#: Which (method, seeds, pairs) each study runs; "study" pairs are pair1 only, as in the paper.
STUDY_METHODS = {
    "main": ("grpo_n8", "grpo_n16", "grpo_n32", "hacpo", "sgt", "graft"),
    "stability": ("grpo_n8", "graft"),
    "compute": ("grpo_ds",),
    "stored": ("graft_stored",),
    "ablation": catalog.ABLATION_COMPONENTS,
    "alternatives": catalog.ALTERNATIVE_DESIGNS,
    "delta": ("graft",),
}
_TRAIN_KEYS = ("reward_mean", "all_fail_frac", "peer_solved_frac", "peer_groups", "peer_admitted", "compat_mean",
               "clipfrac_self", "clipfrac_peer")


def _model_spec(rng: np.random.Generator, model: str, role: str, peer: str, n: int, quality: float,
                offsets: dict[str, float], steps: int, benches: tuple[str, ...], eval_runs: int, val_every: int,
                with_prompts: bool) -> ModelSpec:
    """Histories of one model run: validation every ``val_every`` steps, best checkpoint = argmax val/avg."""
    train_steps = np.arange(1, steps + 1)
    metrics = {f"train/{k}": dict(zip(train_steps.tolist(), rng.uniform(0, 0.01 if "clip" in k else 1, steps)))
               for k in _TRAIN_KEYS}
    val_steps = list(range(val_every, steps + 1, val_every))
    curve = quality * (1 - 0.3 * np.exp(-np.array(val_steps) / (steps / 3)))
    for bench in benches:
        metrics[f"val/{bench}"] = dict(zip(val_steps, np.clip(curve + offsets[bench] + rng.normal(0, 0.01, len(
            val_steps)), 0, 1)))
    metrics["val/avg"] = dict(zip(val_steps, np.mean([list(metrics[f"val/{b}"].values()) for b in benches], axis=0)))
    best = max(metrics["val/avg"], key=metrics["val/avg"].get)
    test = {b: np.clip(quality + offsets[b] + rng.normal(0, 0.01, eval_runs), 0, 1).tolist() for b in benches}
    prompts = None
    if with_prompts:
        # Same seed, same prompt order: both models of a pair see the same prompt ids at each step.
        prompt_ids = np.arange(64 * steps) % 7500
        prompts = pd.DataFrame({"step": np.repeat(train_steps, 64), "prompt_id": prompt_ids,
                                "k": rng.binomial(n, rng.uniform(0.05, 0.6, 64 * steps))})
    return ModelSpec(model, role, peer, n, best, test, metrics, prompts)


def paper_like_jobs(steps: int = 174, seeds: int = 1, pairs: tuple[str, ...] = catalog.PAPER_PAIRS,
                    benches: tuple[str, ...] = catalog.BENCH_ORDER, eval_runs: int = 5, val_every: int = 5,
                    rng_seed: int = 0) -> list[JobSpec]:
    """Jobs that fill every table and figure: every study's methods on ``seeds`` seeds (the stability study
    always has three), single-pair studies on the first pair, random but reproducible values."""
    rng = np.random.default_rng(rng_seed)
    quality = {m: rng.uniform(0.2, 0.4) for p in pairs for m in catalog.PAIRS[p]}
    # Per-model benchmark difficulty, so that methods differ by their gain rather than by noise.
    offsets = {m: {b: rng.uniform(-0.15, 0.35) for b in benches} for m in quality}
    study_pair = pairs[0]
    jobs, grpo_done = [], set()
    for study, methods in STUDY_METHODS.items():
        study_seeds = range(max(seeds, 3)) if study == "stability" else range(seeds)
        for method in methods:
            for seed in study_seeds:
                if study == "stability" and seed == 0:
                    continue  # seed 0 is the main study's run
                deltas = (0.7, 0.9) if study == "delta" else (None,)
                for pair in (pairs if study in ("main", "stability", "stored") else (study_pair,)):
                    model_a, model_b = catalog.PAIRS[pair]
                    for delta in deltas:
                        jobs += _jobs_for(rng, method, pair, seed, study, delta, model_a, model_b, quality,
                                          offsets, steps, benches, eval_runs, val_every, grpo_done)
    return jobs


#: Seconds per training step of one model at n = 8 on the pair's four GPUs (a single model's GRPO step, or its
#: phases of a co-training step, which add the scoring of the peer's responses).
_STEP_SECONDS = {"grpo": 90.0, "co_train": 108.0}
_GPUS = 4


def _step_seconds(rng: np.random.Generator, kind: str, n: int, steps: int) -> list[float]:
    return (_STEP_SECONDS[kind] * n / 8 * rng.uniform(0.5, 1.5, steps)).tolist()


def _jobs_for(rng, method, pair, seed, study, delta, model_a, model_b, quality, offsets, steps, benches,
              eval_runs, val_every, grpo_done) -> list[JobSpec]:
    n = int(method.rsplit("_n", 1)[1]) if method.startswith("grpo_n") else 8
    params = {"method.n": n, "method.delta": delta if delta is not None else catalog.DEFAULT_DELTA,
              "train.lr": 1e-6, "train.total_epochs": 3, "train.batch_prompts": 128, "train.temperature": 1.0}
    common = {"steps": steps, "benches": benches, "eval_runs": eval_runs, "val_every": val_every}
    gain = 0.0 if method.startswith("grpo") else rng.uniform(-0.02, 0.05)
    if method in catalog.SINGLE_MODEL_METHODS:
        # One job trains the pair's models that have no baseline of this (method, seed) yet, as the launcher does.
        specs = []
        for role, model in (("A", model_a), ("B", model_b)):
            if (method, model, seed) in grpo_done:
                continue  # one GRPO baseline per (model, n, seed), shared by every pair
            grpo_done.add((method, model, seed))
            specs.append(_model_spec(rng, model, role, NO_PEER, n, quality[model] + 0.01 * (n // 8), offsets[model],
                                     with_prompts=(method == "grpo_n8" and seed == 0), **common))
        if not specs:
            return []
        job = JobSpec(method, pair, seed, specs, study, params)
        return [with_costs(job, {s.role: _step_seconds(rng, "grpo", n, steps) for s in specs},
                           {s.role: _GPUS for s in specs})]
    # Co-trained methods, and graft_stored, whose job trains both receivers, each against the other's stored log.
    specs = [_model_spec(rng, model, role, peer, 8, quality[model] + gain, offsets[model], with_prompts=False,
                         **common) for role, model, peer in (("A", model_a, model_b), ("B", model_b, model_a))]
    exchange = {} if method == "graft_stored" else {
        "exchange/A_to_B": dict(zip(range(1, steps + 1), rng.integers(0, 10, steps))),
        "exchange/B_to_A": dict(zip(range(1, steps + 1), rng.integers(0, 10, steps)))}
    job = JobSpec(method, pair, seed, specs, study, params, exchange)
    return [with_costs(job, {s.role: _step_seconds(rng, "co_train", 8, steps) for s in specs},
                       {s.role: _GPUS for s in specs})]
