"""GPU-hours under the paper's rules (App. D), from known step timings through a real MLflow store.

Every job's ``cost/gpu_hours`` histories are derived by :func:`analysis.synthetic.with_costs` from chosen
per-model step seconds and GPU counts, as the backends log them: a model run's own cumulative cost (an
independent model's own steps on its own GPUs; a co-trained model's share of the joint run) and the job run's
joint cost (the sum). Every cost column of the compute table and every cost plotted in Fig. 3a, Fig. 3b and
Fig. 6 is checked against numbers worked out by hand below (1 GPU-hour = 900 s on 4 GPUs).
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest
from test_analysis_tables import check, row

from analysis import __main__ as cli
from analysis import figures, tables
from analysis.results import Analysis
from analysis.store import load_store
from analysis.synthetic import JobSpec, ModelSpec, gpu_hours, with_costs, write_jobs

S, Q = "smollm3-3b-base", "qwen3-1.7b-base"
STEPS = 10


def model(name, role, method, avg, best):
    """A model run whose two evaluation runs score ``avg`` ± 1 point on one benchmark."""
    peer = "none" if method.startswith("grpo") else (Q if name == S else S)
    n = int(method.rsplit("_n", 1)[1]) if method.startswith("grpo_n") else 8
    return ModelSpec(name, role, peer, n, best, {"math500": [avg - .01, avg + .01]})


def job(method, models, seconds, gpus, study="main"):
    return with_costs(JobSpec(method, "pair1", 0, models, study, {"train.lr": 1e-6}), seconds, gpus)


def every(seconds, steps=STEPS):
    return [seconds] * steps


def timed_jobs() -> list[JobSpec]:
    return [
        # GRPO n=8, one job training both models on their own 4 GPUs: S 900 s/step = 1.0 GPU-h/step, Q 450 s =
        # 0.5. S to step 6: 6.0, full 10.0; Q to step 10: 5.0 = full. Both: 11.0 and 15.0. (The job's own cost,
        # 1.5/step, is never a GRPO model's: S at step 6 would be charged 9.0.)
        job("grpo_n8", [model(S, "A", "grpo_n8", .30, 6), model(Q, "B", "grpo_n8", .20, 10)],
            {"A": every(900), "B": every(450)}, {"A": 4, "B": 4}),
        # GRPO n=16, each model in its own job (a shared baseline): S 1800 s on 4 GPUs = 2.0/step, best 5 -> 10.0
        # of 20.0; Q 1800 s on 2 GPUs = 1.0/step, best 8 -> 8.0 of 10.0. Both: 18.0 and 30.0.
        job("grpo_n16", [model(S, "A", "grpo_n16", .32, 5)], {"A": every(1800)}, {"A": 4}),
        job("grpo_n16", [model(Q, "B", "grpo_n16", .22, 8)], {"B": every(1800)}, {"B": 2}),
        # GRPO n=32: S's step s takes 360 s x s on 4 GPUs = 0.4 s GPU-h, cumulative 0.2 s (s + 1): best 5 -> 6.0,
        # full 22.0; Q 450 s on 8 GPUs = 1.0/step, best 7 -> 7.0 of 10.0. Both: 13.0 and 32.0.
        job("grpo_n32", [model(S, "A", "grpo_n32", .36, 5), model(Q, "B", "grpo_n32", .24, 7)],
            {"A": [360.0 * s for s in range(1, STEPS + 1)], "B": every(450)}, {"A": 4, "B": 8}),
        # GRPO n=8 + DS: S trains 5 steps of 1800 s on 4 GPUs = 2.0/step, best 5 -> 10.0 = full; Q 10 steps of
        # 900 s = 1.0/step, best 4 -> 4.0 of 10.0. Both: 14.0 and 20.0.
        job("grpo_ds", [model(S, "A", "grpo_ds", .35, 5), model(Q, "B", "grpo_ds", .25, 4)],
            {"A": every(1800, 5), "B": every(900)}, {"A": 4, "B": 4}),
        # HACPO, co-trained on 4 GPUs: S's phases 720 s = 0.8/step, Q's 180 s = 0.2; joint 1.0/step. S best 9:
        # share 7.2 of 8.0; Q best 2: share 0.4 of 2.0. Both: joint through step 9 = 9.0 (not 7.2 + 0.4), 10.0.
        # Conservative: the joint run up to each model's own checkpoint, 9.0 and 2.0.
        job("hacpo", [model(S, "A", "hacpo", .31, 9), model(Q, "B", "hacpo", .19, 2)],
            {"A": every(720), "B": every(180)}, {"A": 4, "B": 4}),
        # SGT: S's phases alternate 900 s and 450 s (1.0, 0.5), Q's 450 s (0.5); both best 3: S 2.5 of 7.5, Q 1.5
        # of 5.0; joint through step 3 = 4.0, full 12.5; conservative 4.0 for both.
        job("sgt", [model(S, "A", "sgt", .33, 3), model(Q, "B", "sgt", .21, 3)],
            {"A": [900.0 if s % 2 else 450.0 for s in range(1, STEPS + 1)], "B": every(450)}, {"A": 4, "B": 4}),
        # GRAFT: S 540 s = 0.6/step, Q 360 s = 0.4; S best 4: 2.4 of 6.0; Q best 8: 3.2 of 4.0; joint through
        # step 8 = 8.0, full 10.0; conservative 4.0 and 8.0.
        job("graft", [model(S, "A", "graft", .38, 4), model(Q, "B", "graft", .26, 8)],
            {"A": every(540), "B": every(360)}, {"A": 4, "B": 4}),
        # GRAFT w/ stored traj., one job training both receivers, each against the other's GRPO n=8 log (not
        # charged): S 450 s = 0.5/step, best 6 -> 3.0 of 5.0; Q 270 s = 0.3/step, best 10 -> 3.0 = full. Both:
        # 3.0 + 3.0 = 6.0 (the job's cost at step 10 would be 8.0) and 8.0; conservative 3.0 and 3.0.
        job("graft_stored", [model(S, "A", "graft_stored", .37, 6), model(Q, "B", "graft_stored", .25, 10)],
            {"A": every(450), "B": every(270)}, {"A": 4, "B": 4}, study="stored"),
    ]


#: (model, method) -> best_step, gpuh_best, gpuh_full, joint_gpuh_best, joint_gpuh_full, conservative_gpuh.
EXPECTED = {
    (S, "grpo_n8"): (6, 6.0, 10.0, 11.0, 15.0, 6.0),
    (Q, "grpo_n8"): (10, 5.0, 5.0, 11.0, 15.0, 5.0),
    (S, "grpo_n16"): (5, 10.0, 20.0, 18.0, 30.0, 10.0),
    (Q, "grpo_n16"): (8, 8.0, 10.0, 18.0, 30.0, 8.0),
    (S, "grpo_n32"): (5, 6.0, 22.0, 13.0, 32.0, 6.0),
    (Q, "grpo_n32"): (7, 7.0, 10.0, 13.0, 32.0, 7.0),
    (S, "grpo_ds"): (5, 10.0, 10.0, 14.0, 20.0, 10.0),
    (Q, "grpo_ds"): (4, 4.0, 10.0, 14.0, 20.0, 4.0),
    (S, "hacpo"): (9, 7.2, 8.0, 9.0, 10.0, 9.0),
    (Q, "hacpo"): (2, 0.4, 2.0, 9.0, 10.0, 2.0),
    (S, "sgt"): (3, 2.5, 7.5, 4.0, 12.5, 4.0),
    (Q, "sgt"): (3, 1.5, 5.0, 4.0, 12.5, 4.0),
    (S, "graft"): (4, 2.4, 6.0, 8.0, 10.0, 4.0),
    (Q, "graft"): (8, 3.2, 4.0, 8.0, 10.0, 8.0),
    (S, "graft_stored"): (6, 3.0, 5.0, 6.0, 8.0, 3.0),
    (Q, "graft_stored"): (10, 3.0, 3.0, 6.0, 8.0, 3.0),
}
COLUMNS = ("best_step", "gpuh_best", "gpuh_full", "joint_gpuh_best", "joint_gpuh_full", "conservative_gpuh")
#: Fig. 3a: "both models, best ckpt" per method; pair-mean score = mean of the two models' Avg (percent).
PAIR_BUDGET = {"grpo_n8": (11.0, 25.0), "grpo_n16": (18.0, 27.0), "grpo_n32": (13.0, 30.0), "grpo_ds": (14.0, 30.0),
               "hacpo": (9.0, 25.0), "sgt": (4.0, 27.0), "graft": (8.0, 32.0), "graft_stored": (6.0, 31.0)}
#: Fig. 3b: (block, method) -> GPU-hours to the checkpoint, gain over GRPO (n=8), cost cut of stored vs online.
STORED_BARS = {("S←Q", "graft"): (4.0, 8.0, None), ("S←Q", "graft_stored"): (3.0, 7.0, 0.25),
               ("Q←S", "graft"): (8.0, 6.0, None), ("Q←S", "graft_stored"): (3.0, 5.0, 0.625)}


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory, new_store):
    root = tmp_path_factory.mktemp("costs")
    uri = new_store(root)
    write_jobs(uri, timed_jobs(), root / "artifacts")
    return uri


@pytest.fixture(scope="module")
def analysis(store_uri):
    return Analysis(load_store(store_uri))


@pytest.fixture(scope="module")
def compute_table(analysis):
    return tables.compute(analysis)


def test_costs_are_logged_as_the_backends_log_them(store_uri, analysis):
    """The store holds what the rules assume: shares add up to the joint cost of every co-trained job."""
    runs = analysis.model_runs
    graft = runs[runs["method"] == "graft"]
    shares = [analysis.store.series(r, "cost/gpu_hours") for r in graft.index]
    joint = analysis.job_cost(graft.index[0])
    assert np.allclose(shares[0] + shares[1], joint) and joint[STEPS] == pytest.approx(10.0)


def test_every_cost_column_of_the_compute_table(compute_table):
    frame = compute_table.frame()
    assert len(frame) == len(EXPECTED)
    for (name, method), values in EXPECTED.items():
        peer = "none" if method.startswith("grpo") else (Q if name == S else S)
        check(row(frame, name, peer, method), dict(zip(COLUMNS, values)))


def test_rendered_compute_table_shows_the_pair_totals(compute_table):
    from analysis.render import compute_md

    lines = {line.split(" | ")[0].lstrip("| "): line for line in compute_md(compute_table).splitlines()}
    # Method | S Avg | S best | S 3 epochs | Q Avg | Q best | Q 3 epochs | both best | both 3 epochs
    assert lines["HACPO"].endswith("| 7.2 | 8.0 | 19.00 ± 1.41 | 0.4 | 2.0 | 9.0 | 10.0 |")
    assert lines["GRAFT w/ stored traj."].endswith("| 3.0 | 5.0 | 25.00 ± 1.41 | 3.0 | 3.0 | 6.0 | 8.0 |")
    assert lines["GRPO (n=8)"].endswith("| 6.0 | 10.0 | 20.00 ± 1.41 | 5.0 | 5.0 | 11.0 | 15.0 |")


def assert_drawn(ax, expected) -> None:
    """The errorbar points drawn on ``ax`` are exactly ``expected`` (x, y) pairs, in any order."""
    drawn = []
    for container in ax.containers:
        line = container.lines[0]
        drawn += list(zip(line.get_xdata(), line.get_ydata()))
    np.testing.assert_allclose(sorted(drawn), sorted(expected), atol=1e-9)


def test_pair_budget_plots_both_models_to_their_checkpoints(analysis, compute_table):
    points = figures.pair_budget_points(analysis, compute_table).set_index("method")
    assert set(points.index) == set(PAIR_BUDGET)
    for method, (gpuh, score) in PAIR_BUDGET.items():
        assert points.loc[method, ["gpuh", "score"]].tolist() == pytest.approx([gpuh, score]), method
    fig = figures.draw_pair_budget(points.reset_index())
    ax = fig.axes[0]
    assert_drawn(ax, PAIR_BUDGET.values())
    dashed = next(line for line in ax.lines if line.get_linestyle() == "--")
    assert list(dashed.get_xdata()) == pytest.approx([11.0, 18.0, 13.0])  # GRPO n=8, 16, 32: by budget, not cost


def test_conservative_figure_charges_co_trained_models_the_joint_run(compute_table):
    points = figures.conservative_points(compute_table)
    fig = figures.draw_compute_conservative(points)
    for ax, name in zip(fig.axes, (S, Q)):
        expected = {m: (EXPECTED[(n, m)][5], 100 * avg) for (n, m), avg in AVGS.items() if n == name}
        assert_drawn(ax, expected.values())
        drawn = points[points["updated_model"] == name].set_index("method")["gpuh"].to_dict()
        assert drawn == pytest.approx({m: x for m, (x, _) in expected.items()})


def test_stored_vs_online_cuts_the_joint_cost_to_each_checkpoint(analysis):
    bars = figures.stored_vs_online_bars(analysis).set_index(["block", "method"])
    assert set(bars.index) == set(STORED_BARS)
    for key, (gpuh, gain, cut) in STORED_BARS.items():
        assert bars.loc[key, ["gpuh", "gain"]].tolist() == pytest.approx([gpuh, gain]), key
        assert (pd.isna(bars.loc[key, "cut"]) if cut is None else bars.loc[key, "cut"] == pytest.approx(cut)), key
    fig = figures.draw_stored_vs_online(bars.reset_index())
    top = fig.axes[0]
    heights = {(round(p.get_x() + p.get_width() / 2, 6)): p.get_height() for p in top.patches}
    # Blocks at x = 0 (S←Q) and 1 (Q←S); online bars left of each tick, stored ones right.
    assert heights == pytest.approx({-0.2: 4.0, 0.2: 3.0, 0.8: 8.0, 1.2: 3.0})
    assert [t.get_text() for t in top.texts if t.get_text()] == ["−25%", "−62%"]


def test_figure_csvs_hold_the_plotted_values(store_uri, tmp_path):
    assert cli.main(["figures", "--tracking-uri", store_uri, "--out", str(tmp_path)]) == 0
    budget = pd.read_csv(tmp_path / "pair-budget.csv").set_index("method")["gpuh"].to_dict()
    assert budget == pytest.approx({m: g for m, (g, _) in PAIR_BUDGET.items()})
    stored = pd.read_csv(tmp_path / "stored-vs-online.csv").set_index(["block", "method"])["gpuh"].to_dict()
    assert stored == pytest.approx({k: v[0] for k, v in STORED_BARS.items()})
    conservative = pd.read_csv(tmp_path / "compute-conservative.csv")
    assert len(conservative) == len(EXPECTED)
    assert conservative.set_index(["updated_model", "method"])["gpuh"].to_dict() == pytest.approx(
        {k: v[5] for k, v in EXPECTED.items()})


#: The models' Avg (fraction) at their checkpoints, as ``timed_jobs`` logs them.
AVGS = {(S, "grpo_n8"): .30, (Q, "grpo_n8"): .20, (S, "grpo_n16"): .32, (Q, "grpo_n16"): .22,
        (S, "grpo_n32"): .36, (Q, "grpo_n32"): .24, (S, "grpo_ds"): .35, (Q, "grpo_ds"): .25,
        (S, "hacpo"): .31, (Q, "hacpo"): .19, (S, "sgt"): .33, (Q, "sgt"): .21, (S, "graft"): .38,
        (Q, "graft"): .26, (S, "graft_stored"): .37, (Q, "graft_stored"): .25}


def test_shares_that_do_not_add_up_are_reported(tmp_path, caplog, new_store):
    """A backend that charges each co-trained model the whole step logs shares summing to twice the job."""
    uri = new_store(tmp_path)
    legacy = job("graft", [model(S, "A", "graft", .38, 4), model(Q, "B", "graft", .26, 8)],
                 {"A": every(900), "B": every(900)}, {"A": 4, "B": 4})
    legacy.metrics["cost/gpu_hours"] = {s: v / 2 for s, v in legacy.metrics["cost/gpu_hours"].items()}
    write_jobs(uri, [legacy], tmp_path / "artifacts")
    with caplog.at_level(logging.WARNING, logger="analysis"):
        tables.compute(Analysis(load_store(uri)))
    assert "differ from the job's cost/gpu_hours by up to 100.0%" in caplog.text


def test_costs_from_timings_reject_bad_input():
    assert gpu_hours([900, 1800], 4) == pytest.approx({1: 1.0, 2: 3.0})
    with pytest.raises(ValueError, match="GPU"):
        gpu_hours([900], 0)
    with pytest.raises(ValueError, match="step time"):
        gpu_hours([-1.0], 4)
    with pytest.raises(ValueError, match="roles"):
        job("graft", [model(S, "A", "graft", .3, 1)], {"B": every(1)}, {"B": 1})
