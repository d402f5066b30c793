"""The paper's reporting rules on hand-made frames (no MLflow)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis import catalog, rules


def test_avg_is_the_mean_of_benchmarks_per_evaluation_run_then_summarised():
    history = pd.DataFrame({"key": ["test/a", "test/a", "test/b", "test/b"], "step": [0, 1, 0, 1],
                            "value": [0.5, 0.7, 0.1, 0.1]})
    scores = rules.eval_scores(history, ["a", "b"], scale=100)
    assert scores["avg"].tolist() == pytest.approx([30, 40])
    summary = rules.checkpoint_summary(scores)
    assert summary["avg_mean"] == pytest.approx(35) and summary["avg_std"] == pytest.approx(math.sqrt(50))
    # A run lacking a benchmark has no average rather than a biased one.
    assert rules.eval_scores(history, ["a", "b", "c"])["avg"].isna().all()


def test_bold_needs_the_reference_and_skips_it_when_best():
    means = pd.DataFrame({"x": [5, 4, 6], "y": [9, 1, 2]}, index=["grpo_n8", "sgt", "graft"])
    assert rules.bold_cells(means, "grpo_n8") == {"grpo_n8": set(), "sgt": set(), "graft": {"x"}}
    assert rules.bold_cells(means.drop("grpo_n8"), "grpo_n8") == {"sgt": set(), "graft": set()}


def test_dagger_tiers_and_missing_baselines():
    ours = pd.Series({"x": 10.0, "y": 10.0, "z": 10.0})
    tier16 = pd.DataFrame({"x": [9, 9], "y": [9, 9], "z": [9, float("nan")]})
    tier32 = pd.DataFrame({"x": [9, 9, 9.5], "y": [9, 9, 11], "z": [9, float("nan"), 1]})
    assert rules.dagger_marks(ours, [("†", tier16), ("‡", tier32)]) == {"x": "‡", "y": "†"}


def test_cost_lookups_and_joint_checkpoint():
    cost = pd.Series([1.0, 2.0, 4.0], index=[2, 4, 8])
    assert rules.value_at_step(cost, 5) == 2.0
    assert math.isnan(rules.value_at_step(cost, 1))
    assert rules.joint_checkpoint_cost(cost, [4, 8]) == 4.0
    assert math.isnan(rules.joint_checkpoint_cost(cost, [4, float("nan")]))


def test_rescue_fraction_matches_prompts_per_step():
    receiver = pd.DataFrame({"step": [1, 1, 1, 2], "prompt_id": [1, 2, 3, 1], "k": [0, 0, 5, 3]})
    peer = pd.DataFrame({"step": [1, 1, 1, 2], "prompt_id": [1, 2, 3, 1], "k": [2, 0, 0, 0]})
    fraction = rules.rescue_fraction(receiver, peer)
    assert fraction[1] == 0.5 and math.isnan(fraction[2])


def test_seed_summary_uses_sample_std_of_per_run_means():
    runs = [pd.DataFrame({"avg": [v, v + 2]}) for v in (10, 12, 14)]  # per-run means 11, 13, 15
    summary = rules.seed_summary(runs)
    assert summary["avg_mean"] == 13 and summary["avg_std"] == 2 and summary["n"] == 3


def test_sweep_mapping_lives_in_one_place():
    assert catalog.sweep_for("main-results", "grpo_n32", 0) == "sweeps/main.yaml"
    assert catalog.sweep_for("training-variance", "graft", 2) == "sweeps/stability.yaml"
    assert catalog.sweep_for("compute", "grpo_ds", 0) == "sweeps/compute.yaml"
    assert catalog.sweep_for("ablation-full", catalog.delta_method(0.7), 0) == "sweeps/delta.yaml"
    assert catalog.sweep_for("clipfrac-position", "graft", 0) == "sweeps/clip_dynamics.yaml"
    # a method no sweep file runs is attributed to none (not to sweeps/main.yaml)
    assert catalog.sweep_for("main-results", "graft_top_half", 0).startswith("none of sweeps/")
    assert catalog.method_display(catalog.delta_method(0.9)) == "δ=0.9"


def test_best_checkpoint_is_a_trained_one():
    # Step 0 (the initial model) is validated for the curves but cannot be selected.
    assert rules.best_validation_step(pd.Series([0.5, 0.3, 0.4], index=[0, 5, 10])) == 10
    assert math.isnan(rules.best_validation_step(pd.Series([0.5], index=[0])))


def test_shares_of_a_joint_run_and_the_stored_cut():
    job = pd.Series([1.0, 2.0, 3.0], index=[1, 2, 3])
    assert rules.shares_mismatch(job, [job * 0.6, job * 0.4]) == pytest.approx(0)
    assert rules.shares_mismatch(job, [job, job.drop(3)]) == pytest.approx(1.0)  # compared where all logged
    assert math.isnan(rules.shares_mismatch(job, [pd.Series(dtype=float)]))
    assert rules.cost_cut(40.9, 11.1) == pytest.approx(1 - 11.1 / 40.9)
    assert math.isnan(rules.cost_cut(math.nan, 1.0)) and math.isnan(rules.cost_cut(0.0, 1.0))
