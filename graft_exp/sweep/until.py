"""``python -m graft_exp.sweep SWEEP --until-decided``: rounds of seeds until the ``decide:`` comparisons are
decided (the rule: :mod:`graft_exp.sweep.decide`), each round recorded in MLflow.

Round 0 runs the file's seeds; each later round runs the next seeds, only for the methods of comparisons
still undecided (with the jobs they need: ``after``, ``compute_of``). The sweep's own MLflow run (tagged
``graft.analysis=until-decided`` and ``graft.sweep``, which the analysis skips as a training run) holds the
rule, alpha and the other settings as params, ``decide/undecided`` and ``decide/seeds`` per round, one
``rounds/round_<k>.json`` per round (the seeds each score came from, the decisions, the adjusted
intervals, and why each next seed was added) and a tag ``graft.decision.<method>_vs_<reference>`` per
comparison: enough to rebuild and audit the tables (``python -m analysis decisions``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from graft_exp import schema, tracking
from graft_exp.launching import status
from graft_exp.sweep.decide import DecideError, Decider, Settings
from graft_exp.sweep.planning import Sweep, plan
from graft_exp.sweep.state import console


def file_seeds(spec: dict) -> list[int]:
    """Every seed the file's grids list, in order."""
    seeds = []
    for grid in spec["runs"]:
        value = grid.get("seed")
        seeds += list(value) if isinstance(value, list) else ([] if value is None else [value])
    return sorted(dict.fromkeys(int(x) for x in seeds))


def round_spec(spec: dict, seeds: list[int], methods: set[str]) -> dict:
    """The sweep file restricted to ``seeds`` and to the grids' ``methods`` still compared."""
    runs = []
    for grid in spec["runs"]:
        listed = grid.get("method")
        kept = [m for m in (listed if isinstance(listed, list) else [listed]) if m in methods]
        if kept:
            runs.append({**grid, "method": kept, "seed": seeds})
    return {**spec, "runs": runs}


def job_scores(sweep: Sweep, client: MlflowClient) -> dict[str, dict[int, float]]:
    """``scores[method][seed]``: a finished job's final test average in points, the mean over its models
    (each model: the mean over its evaluation runs), as the study's "both models" rows."""
    newest = status.newest_by_key(status.fetch_runs(sweep.uri))
    scores: dict[str, dict[int, float]] = {}
    for sj in sweep.jobs:
        per_model = []
        for key in sj.job.model_keys.values():
            run = newest.get(key)
            history = client.get_metric_history(run["run_id"], schema.TEST + "avg") if run else []
            per_model.append(100 * float(np.mean([m.value for m in history])) if history else math.nan)
        if per_model and not any(math.isnan(v) for v in per_model):
            scores.setdefault(str(sj.job.cfg.method.name), {})[int(sj.job.cfg.seed)] = float(np.mean(per_model))
    return scores


#: The until-decided run's param naming its rule (a key of ``decide.RULES``); runs before it ran AdaStop.
RULE_PARAM = "decide_rule"


def check_resumed_rule(sweep: Sweep, s: Settings) -> None:
    """Refuse to resume, with another rule, a sweep whose last until-decided run did not finish: its rounds were
    looked at under the first rule, and the second's level would not hold over the looks of both."""
    client = MlflowClient(sweep.uri)
    experiment = client.get_experiment_by_name(schema.experiment_name(sweep.study))
    if experiment is None:
        return
    runs = client.search_runs([experiment.experiment_id], f"tags.`{schema.ANALYSIS}` = 'until-decided' and "
                              f"tags.`{schema.SWEEP}` = '{sweep.path}'", order_by=["attributes.start_time DESC"],
                              max_results=1)
    if runs and runs[0].info.status != "FINISHED":
        before = runs[0].data.params.get(RULE_PARAM, "adastop")
        if before != s.rule:
            raise DecideError(f"{sweep.path} was started with decide.rule={before} and has not finished: resume it "
                              f"with rule {before} (its level holds only under one rule), or change its study to "
                              f"start afresh with {s.rule}")


def open_record(sweep: Sweep, s: Settings) -> tuple[MlflowClient, str]:
    """The sweep's own MLflow run, with the rule and its settings."""
    experiment_id = tracking.ensure_store(sweep.uri, schema.experiment_name(sweep.study))
    client = MlflowClient(sweep.uri)
    run = client.create_run(experiment_id, run_name=f"until-decided-{sweep.path.stem}", tags={
        schema.ANALYSIS: "until-decided", schema.SWEEP: str(sweep.path), schema.STUDY: sweep.study,
        tracking.DESCRIPTION_TAG: f"seeds until decided for {sweep.path}: {s.description}"})
    params = {"rule": s.description, RULE_PARAM: s.rule, "alpha": s.alpha, "margin_points": s.margin, "seeds_per_round": s.per_round,
              "max_seeds": s.max_seeds, "rounds": s.rounds, "permutations": s.permutations,
              "permutation_seed": s.seed, "comparisons": "; ".join(s.label(p) for p in s.comparisons),
              "metric": "test/avg, mean of the job's models, points"}
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    return client, run.info.run_id


def until_decided(path: Path, spec: dict, s: Settings, overrides: list[str], run_round) -> int:
    """Run rounds until every comparison is decided or the cap is reached; 0 when every round's jobs
    finished. ``run_round(sweep)`` launches a planned round and returns its exit status."""
    decider = Decider(s)
    seeds, methods = file_seeds(spec), set(s.methods)
    client = run_id = None
    while True:
        sweep = plan(path, overrides, spec=round_spec(spec, seeds, methods))
        if client is None:
            client, run_id = open_record(sweep, s)
        console.print(f"[bold]round {len(decider.rounds)}[/] ({s.rule}): seeds {seeds} for {', '.join(sorted(methods))} "
                      f"({len(sweep.jobs)} jobs)")
        code = run_round(sweep)
        if code != 0:
            client.set_terminated(run_id, "FAILED")
            console.print("[red]a job of this round did not finish; rerun the same command to resume[/]")
            return code
        try:
            record = decider.look(seeds, job_scores(sweep, client))
        except DecideError as err:
            client.set_terminated(run_id, "FAILED")
            console.print(f"[red]error:[/] {err}")
            return 1
        client.log_text(run_id, record.as_json(), f"rounds/round_{record.index}.json")
        undecided = sum(d == "continue" for d in record.decisions.values())
        client.log_metric(run_id, "decide/undecided", undecided, step=record.index)
        client.log_metric(run_id, "decide/seeds", len(decider.seeds), step=record.index)
        for label, verdict in record.decisions.items():
            lo, hi = record.intervals[label]
            console.print(f"  {label}: {verdict}  mean diff {record.mean_diff[label]:+.2f} "
                          f"[{lo:+.2f}, {hi:+.2f}] over {len(record.seeds[label.split(' vs ')[0]])} seeds")
        if decider.finished:
            break
        for method, why in record.next_reason.items():
            console.print(f"  + seeds {record.next_seeds} for {method}: {'; '.join(why)} undecided")
        seeds, methods = record.next_seeds, set(record.next_reason)
    for pair in s.comparisons:
        client.set_tag(run_id, schema.DECISION_PREFIX + f"{pair[0]}_vs_{pair[1]}", decider.decision(pair))
    client.set_terminated(run_id, "FINISHED")
    console.print(f"[green]decided[/] by decide.rule={s.rule} after {len(decider.rounds)} round(s); MLflow run {run_id}")
    return 0

