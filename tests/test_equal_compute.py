"""Equal compute: ``train.max_gpu_hours`` / ``train.gpu_hours_of`` stop a job once its charged cost
(``cost/gpu_hours``, App. D) reaches the budget, ``train.max_flops`` / ``train.flops_of`` once its counted cost
(``cost/flops``) does; with the in-memory backend.

Measured wall time is what a real job is charged; here each step's charge is fixed (``step_costs``
replaced) so that the step the budget runs out at is known exactly, whatever the machine's load. The
counted charge needs no such fix: it is a function of the job's tokens."""

from __future__ import annotations

import itertools
import math
import shutil

import pytest
from mlflow.tracking import MlflowClient
from support.memory_backend import factory
from support.mlflow_records import histories, model_runs

from graft_exp import driver, schema, tracking
from graft_exp.config import ConfigError, validate

FAST = ["train.batch_prompts=8", "train.minibatch_prompts=4", "train.max_steps=6", "eval.val_every=5",
        "eval.runs=1", "eval.samples=1", "backend.progress=false"]
STEP_HOURS = 0.25   # each step's joint charge


@pytest.fixture
def make_job(compose_cfg, store_template, tmp_path, monkeypatch):
    shutil.copy(store_template, tmp_path / "mlflow.db")

    def fixed_charge(busy, wall, devices, co_train, concurrent):
        return {role: STEP_HOURS * 3600 / len(busy) for role in busy}, STEP_HOURS * 3600

    monkeypatch.setattr(driver, "step_costs", fixed_charge)

    def _make(*overrides: str):
        cfg = compose_cfg(f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"checkpoint_root={tmp_path}/ckpt",
                          *FAST, *overrides)
        validate(cfg)
        return cfg, tracking.open_job(cfg)
    return _make


def job_cost_steps(job) -> list[int]:
    return [m.step for m in job.client.get_metric_history(job.run_id, schema.GPU_HOURS)]


def test_a_budget_stops_training_at_the_step_that_spends_it(make_job):
    cfg, job = make_job("method=graft", "train.max_gpu_hours=0.6")
    driver.fit(cfg, job, factory([]))
    assert job_cost_steps(job) == [1, 2, 3]                 # 0.5 < 0.6 <= 0.75: step 3 is the last
    run = job.client.get_run(job.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[schema.LAST_STEP] == "3" and float(run.data.tags[schema.BUDGET]) == 0.6
    for member in model_runs(job.client, job.run_id).values():
        hist = histories(job.client, member.info.run_id)
        assert [s for s, _ in hist["val/avg"]] == [0, 3]    # the budget's last step is validated ...
        assert member.data.tags[schema.BEST_STEP] == "3"    # ... and so a best-checkpoint candidate
        assert len(hist["test/avg"]) == 1                   # the final evaluation is unchanged


def test_a_reference_run_s_cost_is_the_budget(make_job):
    ref_cfg, ref = make_job("method=grpo_n8", "train.max_steps=2")
    driver.fit(ref_cfg, ref, factory([]))
    key = tracking.run_key(ref_cfg)
    cfg, job = make_job("method=graft", f"train.gpu_hours_of={key}")
    driver.fit(cfg, job, factory([]))
    assert job_cost_steps(job) == [1, 2]                    # GRPO's 2 steps x 0.25 h
    assert float(job.client.get_run(job.run_id).data.tags[schema.BUDGET]) == pytest.approx(0.5)


def test_a_missing_reference_fails_before_any_run_exists(make_job, compose_cfg, tmp_path):
    with pytest.raises(tracking.BudgetMissing, match=r"train.gpu_hours_of=0123abcd: that job is not in the store"):
        make_job("method=graft", "train.gpu_hours_of=0123abcd")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exps = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(exps) == []


@pytest.mark.parametrize("overrides, message", [
    (["train.max_gpu_hours=0"], r"train.max_gpu_hours=0.0 must be > 0 GPU-hours"),
    (["train.max_gpu_hours=-1"], r"train.max_gpu_hours=-1.0 must be > 0"),
    (["train.max_gpu_hours=1", "train.gpu_hours_of=abc"], r"all set the budget; keep one of them"),
    (["train.max_gpu_hours=1", "train.max_flops=1e12"],
     r"train.max_gpu_hours=1.0 and train.max_flops=1000000000000.0 all set the budget; keep one of them"),
    (["train.max_flops=0"], r"train.max_flops=0.0 must be > 0 FLOPs"),
    (["train.flops_of= "], r"train.flops_of is empty; give the run key"),
])
def test_bad_budgets_fail_in_one_line(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(compose_cfg(*overrides))
    assert "\n" not in str(err.value)


def test_the_equal_compute_table_finds_each_reference_by_the_key_it_names():
    """A budgeted job's reference is the run ``train.gpu_hours_of`` names, wherever it lives: the study
    that reused another study's GRPO n=8 jobs (same run key) has them in that study's experiment, as have
    the equal-steps twins (the same method at the reference's steps). Deltas are hand-computed."""
    import pandas as pd

    from analysis.decisions import equal_compute

    def job(key, method, seed, score, experiment, budget=math.nan, reference="None", steps=20, setting="s"):
        return {"run_key": key, "reference_key": reference, "experiment_id": experiment, "method": method,
                "pair": "tiny", "seed": seed, "budget": budget, "steps": steps, "gpu_hours": 1.0,
                "score": score, "setting": setting}

    jobs = pd.DataFrame([
        job("r0", "grpo_n8", 0, 30.0, "decide"), job("r1", "grpo_n8", 1, 32.0, "decide"),
        job("g0", "graft", 0, 35.0, "decide"), job("g1", "graft", 1, 36.0, "decide"),   # equal steps
        job("e0", "graft", 0, 33.0, "equal", budget=1.0, reference="r0", steps=14),
        job("e1", "graft", 1, 35.0, "equal", budget=1.0, reference="r1", steps=13),
        job("x0", "grpo_n8", 0, 99.0, "decide", setting="other"),   # another setting: never the reference
    ])
    table = equal_compute(jobs, "grpo_n8", study=["equal"]).set_index("method")
    assert list(table.index) == ["grpo_n8", "graft"]
    assert table.loc["grpo_n8", "score at equal compute"] == "31.00 ± 1.41"
    graft = table.loc["graft"]
    assert graft["steps (min-max)"] == "13-14" and graft["seeds at equal steps"] == 2
    assert graft["Δ vs grpo_n8, equal compute [95% CI]"].startswith("+3.00 [")   # (3 + 3) / 2
    assert graft["Δ vs grpo_n8, equal steps [95% CI]"].startswith("+4.50 [")     # (5 + 4) / 2
    assert graft["score at equal steps"] == "35.50"
    assert equal_compute(jobs, "grpo_n8", study=["decide"]).empty   # no budgeted job there


def job_flops(job) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in job.client.get_metric_history(job.run_id, schema.FLOPS)]


def test_a_counted_budget_stops_where_the_counted_cost_reaches_it(make_job):
    """The same job with and without ``train.max_flops``: the budgeted one stops at the first step whose
    cumulative ``cost/flops`` reaches the budget, and every step before it is counted identically."""
    ref_cfg, ref = make_job("method=graft", "study=plain")
    driver.fit(ref_cfg, ref, factory([]))
    plain = job_flops(ref)
    assert [s for s, _ in plain] == [1, 2, 3, 4, 5, 6] and all(b > a for (_, a), (_, b) in itertools.pairwise(plain))
    budget = (plain[2][1] + plain[3][1]) / 2                  # between step 3's and step 4's cost
    cfg, job = make_job("method=graft", f"train.max_flops={budget!r}")
    driver.fit(cfg, job, factory([]))
    assert job_flops(job) == plain[:4]
    run = job.client.get_run(job.run_id)
    assert run.data.tags[schema.LAST_STEP] == "4" and float(run.data.tags[schema.BUDGET_FLOPS]) == budget
    assert schema.BUDGET not in run.data.tags


def test_a_reference_run_s_counted_cost_is_the_budget(make_job):
    ref_cfg, ref = make_job("method=grpo_n8", "train.max_steps=2")
    driver.fit(ref_cfg, ref, factory([]))
    cfg, job = make_job("method=grpo_n16", f"train.flops_of={tracking.run_key(ref_cfg)}")
    driver.fit(cfg, job, factory([]))
    spent, budget = job_flops(job), job_flops(ref)[-1][1]
    assert float(job.client.get_run(job.run_id).data.tags[schema.BUDGET_FLOPS]) == budget
    assert [s for s, _ in spent] == [1, 2]                     # n=16 samples twice n=8's responses a step:
    assert spent[-1][1] >= budget > spent[-2][1] > budget / 2  # more than half the budget, then all of it


def test_a_reference_recorded_in_the_other_unit_fails_before_any_run(make_job, tmp_path):
    """A reference that ran before the counted charge existed recorded only ``cost/gpu_hours``."""
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("graft/old")
    old = client.create_run(experiment, tags={schema.RUN_KEY: "0ld0ld0ld"})
    client.log_metric(old.info.run_id, schema.GPU_HOURS, 0.5, step=20)
    client.set_terminated(old.info.run_id, "FINISHED")
    with pytest.raises(tracking.BudgetMissing, match=r"^train.flops_of=0ld0ld0ld: that job recorded no cost/flops "
                                                     r"\(it ran before that charge existed; it records cost/gpu_hours\): "
                                                     r"budget with train.gpu_hours_of instead, or retrain it"):
        make_job("method=graft", "train.flops_of=0ld0ld0ld")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [old.info.run_id]
