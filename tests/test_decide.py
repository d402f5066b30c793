"""Seeds until decided: the rule (AdaStop through ``graft_exp.sweep.decide``), the rounds a sweep plans
and what MLflow records of them, and the command line's checks before anything exists."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from graft_exp.sweep import __main__ as sweep_main
from graft_exp.sweep import until
from graft_exp.sweep.decide import (
    BETTER,
    CONTINUE,
    EQUIVALENT,
    UNDECIDED,
    DecideError,
    Decider,
    Settings,
    settings,
)

PAIRS = (("graft", "grpo_n8"), ("sgt", "grpo_n8"))


def synthetic(seeds, gain: dict[str, float], sd: float = 0.3) -> dict[str, dict[int, float]]:
    """Scores per method and seed: a seed effect shared by the methods, a method's gain, small noise."""
    out = {}
    for method in ("grpo_n8", "graft", "sgt"):
        out[method] = {}
        for s in seeds:
            rng = np.random.default_rng([s, len(method)])
            out[method][s] = 40 + np.random.default_rng(s).normal(0, 2) + gain.get(method, 0.0) + rng.normal(0, sd)
    return out


def test_a_clear_difference_is_decided_and_only_undecided_methods_get_seeds():
    s = Settings(PAIRS, alpha=0.05, margin=1.0, per_round=4, max_seeds=12, permutations=2000)
    decider = Decider(s)
    scores = synthetic(range(12), {"graft": 5.0})
    first = decider.look([0, 1, 2, 3], scores)
    # 4 seeds a method: 70 permutations, none below the first look's share of alpha/2: no decision yet.
    assert set(first.decisions.values()) == {CONTINUE}
    assert first.next_seeds == [4, 5, 6, 7]
    second = decider.look(first.next_seeds, scores)
    assert second.decisions["graft vs grpo_n8"] == BETTER
    assert second.decisions["sgt vs grpo_n8"] == CONTINUE
    assert second.next_reason == {"sgt": ["sgt vs grpo_n8"], "grpo_n8": ["sgt vs grpo_n8"]}   # graft is done
    third = decider.look(second.next_seeds, {m: v for m, v in scores.items() if m != "graft"})
    assert third.seeds["graft"] == list(range(8)) and third.seeds["sgt"] == list(range(12))
    assert third.decisions["graft vs grpo_n8"] == BETTER                     # kept from round 1
    lo, hi = third.intervals["sgt vs grpo_n8"]
    assert third.decisions["sgt vs grpo_n8"] == (EQUIVALENT if -1 < lo and hi < 1 else UNDECIDED)
    assert third.decisions["sgt vs grpo_n8"] == EQUIVALENT                   # noise 0.3 x sqrt(2): narrow
    assert decider.finished and not third.next_seeds


def test_the_adjusted_interval_is_bonferroni_over_comparisons_and_looks():
    s = Settings(PAIRS, alpha=0.05, margin=1.0, per_round=4, max_seeds=12)
    diffs = np.array([1.0, 2.0, 3.0, 2.0, 1.5, 2.5])
    from scipy import stats

    from graft_exp.sweep.decide import adjusted_interval
    lo, hi = adjusted_interval(diffs, s)
    half = stats.t.ppf(1 - 0.05 / (2 * 2 * 3), 5) * diffs.std(ddof=1) / np.sqrt(6)
    assert (lo, hi) == pytest.approx((diffs.mean() - half, diffs.mean() + half))


def test_a_missing_score_names_the_job():
    decider = Decider(Settings(PAIRS, 0.05, 1.0, 4, 12, permutations=200))
    scores = synthetic(range(4), {})
    del scores["sgt"][2]
    with pytest.raises(DecideError, match="no score for sgt seed 2"):
        decider.look([0, 1, 2, 3], scores)


@pytest.mark.parametrize("section, cap, message", [
    (None, None, "needs a `decide:` section with `comparisons:`"),
    ({"comparisons": [["graft"]]}, None, r"entry \['graft'\] must be \[method, reference\]"),
    ({"comparisons": [["graft", "grpo_n8"]], "alpha": 1.5}, None, r"decide.alpha=1.5 must be in \(0, 1\)"),
    ({"comparisons": [["graft", "grpo_n8"]], "margin": 0}, None, r"decide.margin=0.0 must be > 0"),
    ({"comparisons": [["graft", "grpo_n8"]]}, 6, r"--max-seeds=6 leaves no second round: .* at least 8"),
])
def test_bad_decide_sections_fail_in_one_line(section, cap, message):
    spec = {"study": "x", "runs": [{"method": "graft", "seed": [0, 1, 2, 3]}], **({"decide": section} if section else {})}
    with pytest.raises(DecideError, match=message) as err:
        settings(spec, until.file_seeds(spec), cap, "sweeps/x.yaml")
    assert "\n" not in str(err.value)


def test_until_decided_without_comparisons_fails_before_anything_is_created(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump({"study": "plain", "runs": [{"pair": "tiny", "method": "graft", "seed": [0, 1]}]}))
    assert sweep_main.main([str(path), "--until-decided"]) == 2
    assert "needs a `decide:` section" in capsys.readouterr().out
    assert sweep_main.main([str(path), "--max-seeds", "8"]) == 2
    assert "--max-seeds caps --until-decided" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.yaml"]   # no store, no multirun folder


def test_rounds_plan_only_undecided_methods_and_mlflow_records_them(tmp_path, monkeypatch):
    spec = {"study": "decide_test", "runs": [{"pair": "tiny", "train.max_steps": 2, "seed": [0, 1, 2, 3],
                                              "method": ["grpo_n8", "graft", "sgt"]}],
            "decide": {"comparisons": [list(p) for p in PAIRS], "alpha": 0.05, "margin": 1.0, "permutations": 2000}}
    path = tmp_path / "decide_test.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    planned = []

    def run_round(sweep):   # stands in for the launch loop: records what a round would train
        planned.append(sorted((str(sj.job.cfg.method.name), int(sj.job.cfg.seed)) for sj in sweep.jobs))
        return 0

    scores = synthetic(range(12), {"graft": 5.0})
    monkeypatch.setattr(until, "job_scores", lambda sweep, client: scores)
    s = settings(spec, until.file_seeds(spec), 12, path)
    assert until.until_decided(path, spec, s, [f"tracking.uri={uri}"], run_round) == 0
    assert [len(r) for r in planned] == [12, 12, 8]
    assert {m for m, _ in planned[2]} == {"grpo_n8", "sgt"} and {x for _, x in planned[2]} == {8, 9, 10, 11}

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("graft/decide_test").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["graft.analysis"] == "until-decided"
    assert run.data.params["alpha"] == "0.05" and "AdaStop" in run.data.params["rule"]
    assert run.data.tags["graft.decision.graft_vs_grpo_n8"] == BETTER
    assert [m.value for m in client.get_metric_history(run.info.run_id, "decide/undecided")] == [2, 1, 0]
    rounds = [json.loads((tmp_path / "r" / "rounds" / f"round_{k}.json").read_text())
              for k in range(3) if client.download_artifacts(run.info.run_id, "rounds", str(tmp_path / "r"))]
    assert rounds[1]["next_reason"] == {"sgt": ["sgt vs grpo_n8"], "grpo_n8": ["sgt vs grpo_n8"]}
    assert rounds[2]["scores"]["sgt"] == pytest.approx([scores["sgt"][x] for x in range(12)])


def test_rliable_measures_of_one_task():
    """rliable's probability of improvement and IQMs of one task (the pair average), with intervals: a
    method ahead on every seed improves with probability 1; the IQM of 8 seeds is the mean of the middle 4."""
    from graft_exp.intervals import rliable_measures

    reference = np.arange(8, dtype=float)
    out = rliable_measures(reference + 10, reference)
    assert out["P(improve)"] == out["P(improve) lo"] == out["P(improve) hi"] == 1.0
    assert out["IQM ref"] == 3.5 and out["IQM method"] == 13.5
    assert out["IQM ref lo"] <= 3.5 <= out["IQM ref hi"]
    even = rliable_measures(reference, reference)
    assert even["P(improve)"] == 0.5


def test_rliable_says_nothing_between_a_multiruns_jobs_and_its_comparison(caplog):
    """Under Hydra's INFO logging rliable's progress lines ("Calculating estimates for m ...") printed between the
    jobs table and the comparison; they are held back while it runs, and its logger's level is put back."""
    import logging

    from graft_exp.intervals import rliable_measures

    caplog.set_level(logging.INFO)
    before = logging.getLogger("absl").level
    rliable_measures(np.arange(4, dtype=float) + 1, np.arange(4, dtype=float))
    assert not [r for r in caplog.records if r.name == "absl"]
    assert logging.getLogger("absl").level == before


# ------------------------------------------------------------------ the paired rule
def test_the_sign_flip_p_value_by_hand():
    """[1, 2, 3]: the 8 sign patterns sum to +-6, +-4, +-2, +-0 (|.|: 6, 4, 2, 0, 0, 2, 4, 6); 2 reach 6."""
    from graft_exp.sweep.decide import sign_flip_p

    rng = np.random.default_rng(0)
    assert sign_flip_p(np.array([1.0, 2.0, 3.0]), 100, rng) == 2 / 8
    assert sign_flip_p(np.array([1.0, -2.0, 3.0]), 100, rng) == 6 / 8     # |2| reached by 6 of 8
    assert sign_flip_p(np.ones(8), 100, rng) == 2 / 256                  # the smallest p of 8 seeds
    many = sign_flip_p(np.ones(20), 999, rng)                            # Monte Carlo past 16: (1 + hits) / (B + 1)
    assert 1 / 1000 <= many <= 3 / 1000


def test_the_level_goes_to_the_looks_that_can_reject():
    """Four seeds cannot reach p <= 0.05 (2/16 = 0.125): the first look gets nothing, the others half each."""
    from graft_exp.sweep.decide import look_levels

    assert look_levels(0.05, [4, 8, 12], 2) == [0.0, 0.025, 0.025]
    assert look_levels(0.05, [8, 16, 24], 2) == pytest.approx([0.05 / 3] * 3)
    assert sum(look_levels(0.05, [4, 8, 12, 16], 3)) == pytest.approx(0.05)


def test_the_paired_rule_sees_a_difference_the_seed_effect_hides_from_adastop():
    """A seed effect of +-15 points shared by both methods, a true gain of 2 points with little noise of its own: every
    per-seed difference is positive, so the paired rule decides at 8 seeds; AdaStop, comparing two samples, sees the
    seed effect as noise."""
    rng = np.random.default_rng(3)
    effect = rng.normal(0, 15, 12)
    scores = {"grpo_n8": {s: 40 + effect[s] + rng.normal(0, 0.3) for s in range(12)},
              "graft": {s: 42 + effect[s] + rng.normal(0, 0.3) for s in range(12)}}
    found = {}
    for rule in ("paired", "adastop"):
        decider = Decider(Settings((("graft", "grpo_n8"),), alpha=0.05, margin=1.0, per_round=4, max_seeds=12,
                                   permutations=2000, rule=rule))
        for k in range(3):
            seeds = list(range(4 * k, 4 * k + 4))
            record = decider.look(seeds, {m: {s: v[s] for s in seeds} for m, v in scores.items()})
            if decider.finished:
                break
        found[rule] = (record.decisions["graft vs grpo_n8"], len(decider.seeds))
    assert found["paired"] == (BETTER, 8)
    assert found["adastop"][0] != BETTER


def test_the_paired_rule_stops_early_for_equivalence():
    scores = synthetic(range(4), {"graft": 0.0, "sgt": 0.0}, sd=0.05)
    for rule, expected in (("paired", EQUIVALENT), ("adastop", CONTINUE)):
        decider = Decider(Settings(PAIRS, alpha=0.05, margin=1.0, per_round=4, max_seeds=12, permutations=500,
                                   rule=rule))
        record = decider.look(list(range(4)), scores)
        assert set(record.decisions.values()) == {expected}, rule


def test_a_sweep_is_not_resumed_under_another_rule(tmp_path, new_store):
    """An until-decided run that did not finish keeps its rule: a rerun naming the other one stops in one line."""
    from types import SimpleNamespace

    from graft_exp import schema

    uri = new_store(tmp_path)
    client = MlflowClient(uri)
    experiment = client.create_experiment("graft/tiny_decide")
    sweep = SimpleNamespace(uri=uri, study="tiny_decide", path="sweeps/tiny_decide.yaml")
    run = client.create_run(experiment, tags={schema.ANALYSIS: "until-decided", schema.SWEEP: sweep.path})
    client.log_param(run.info.run_id, until.RULE_PARAM, "adastop")
    paired = Settings(PAIRS, alpha=0.05, margin=1.0, per_round=4, max_seeds=12, rule="paired")
    with pytest.raises(DecideError, match="started with decide.rule=adastop and has not finished"):
        until.check_resumed_rule(sweep, paired)
    until.check_resumed_rule(sweep, Settings(PAIRS, alpha=0.05, margin=1.0, per_round=4, max_seeds=12))
    client.set_terminated(run.info.run_id, "FINISHED")
    until.check_resumed_rule(sweep, paired)    # a finished sweep may be decided again under another rule


def test_an_unknown_rule_is_refused(tmp_path):
    spec = {"study": "x", "runs": [{"seed": [0, 1, 2, 3]}],
            "decide": {"comparisons": [["graft", "grpo_n8"]], "rule": "bayes"}}
    with pytest.raises(DecideError, match="decide.rule='bayes' is not one of adastop, paired"):
        settings(spec, [0, 1, 2, 3], None, "x.yaml")
