"""Golden tests: a real MLflow SQLite store with known values -> every table, checked cell by cell.

The store holds Pair 1 only (S = SmolLM3, Q = Qwen3), two benchmarks, scores logged as fractions (so tables
show percent), and deliberately missing runs. Expected values are worked out by hand in the comments.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import __main__ as cli
from analysis.results import Analysis
from analysis.store import load_store
from analysis.synthetic import JobSpec, ModelSpec, write_jobs
from analysis.tables import build_all

S, Q = "smollm3-3b-base", "qwen3-1.7b-base"


def scores(math500, aime2024):
    return {"math500": list(math500), "aime2024": list(aime2024)}


def single(method, model, role, seed, test, cost=None, best=None, study="main", prompts=None):
    """A GRPO-style job: one model run (peer none)."""
    metrics = {"cost/gpu_hours": cost} if cost else {}
    n = int(method.rsplit("_n", 1)[1]) if method.startswith("grpo_n") else 8
    spec = ModelSpec(model, role, "none", n, best, test, metrics, prompts)
    return JobSpec(method, "pair1", seed, [spec], study, {"train.lr": 1e-6}, metrics)


def joint(method, seed, test_s, test_q, study="main", params=None, metrics_s=None, metrics_q=None, job_metrics=None,
          best=(None, None)):
    models = [ModelSpec(S, "A", Q, 8, best[0], test_s, metrics_s or {}) if test_s is not None else None,
              ModelSpec(Q, "B", S, 8, best[1], test_q, metrics_q or {}) if test_q is not None else None]
    return JobSpec(method, "pair1", seed, [m for m in models if m], study,
                   {"train.lr": 1e-6, "train.batch_prompts": 128, "train.total_epochs": 3, **(params or {})}, job_metrics or {})


def steps(f, last=10, every=1):
    return {s: f(s) for s in range(every, last + 1, every)}


PROMPTS_S = pd.DataFrame({"step": [1, 1, 1, 2, 2], "prompt_id": [1, 2, 3, 1, 2], "k": [0, 0, 4, 0, 8]})
PROMPTS_Q = pd.DataFrame({"step": [1, 1, 1, 2, 2], "prompt_id": [1, 2, 3, 1, 2], "k": [2, 0, 0, 0, 0]})


def golden_jobs() -> list[JobSpec]:
    clip_steps = range(1, 51)
    return [
        # S: GRPO n8 seed 0: per eval run avg (60+10)/2=35, (62+12)/2=37 -> 36 ± 1.41; cost 0.5/step, best 6.
        single("grpo_n8", S, "A", 0, scores([.60, .62], [.10, .12]), steps(lambda s: .5 * s), 6, prompts=PROMPTS_S),
        single("grpo_n16", S, "A", 0, scores([.63, .63], [.13, .13])),  # 63, 13, avg 38
        single("grpo_n32", S, "A", 0, scores([.64, .64], [.20, .20])),  # 64, 20, avg 42
        # Q: GRPO n8 50, 5 -> 27.5; cost 0.4/step, best 10. GRPO n32 of Q is missing.
        single("grpo_n8", Q, "B", 0, scores([.50, .50], [.05, .05]), steps(lambda s: .4 * s), 10, prompts=PROMPTS_Q),
        single("grpo_n16", Q, "B", 0, scores([.52, .52], [.06, .06])),  # avg 29
        joint("hacpo", 0, scores([.58, .58], [.14, .14]), scores([.40, .40], [.03, .03])),  # S avg 36, Q 21.5
        joint("sgt", 0, scores([.62, .62], [.16, .16]), None),  # S avg 39; SGT of Q is missing
        # GRAFT: S 67, 15, avg (40, 42) -> 41 ± 1.41; Q 49, 4 -> 26.5. Job cost 1/step, S share .6, Q .4,
        # best steps 4 and 8. S clips own tokens 0.1%, peer tokens 0.2% on steps 1-20 and 0 on 21-40 (admitted),
        # 50% on 41-48 (nothing admitted: excluded) and 90% after step 48 (outside the window).
        joint("graft", 0, scores([.66, .68], [.14, .16]), scores([.49, .49], [.04, .04]),
              job_metrics={"cost/gpu_hours": steps(float)}, best=(4, 8),
              metrics_s={"cost/gpu_hours": steps(lambda s: .6 * s),
                         "train/clipfrac_self": {s: .001 for s in clip_steps},
                         "train/clipfrac_peer": {s: (.002 if s <= 20 else 0.0 if s <= 40 else .5 if s <= 48 else .9)
                                                 for s in clip_steps},
                         "train/peer_admitted": {s: (3 if s <= 40 else 0) for s in clip_steps},
                         "val/avg": {5: .30, 10: .35}},
              metrics_q={"cost/gpu_hours": steps(lambda s: .4 * s)}),
        # Training stability: S seeds 1, 2 (avg 38, 34 for GRPO; 44, 38 for GRAFT); none for Q.
        single("grpo_n8", S, "A", 1, scores([.64, .64], [.12, .12]), study="stability"),
        single("grpo_n8", S, "A", 2, scores([.58, .58], [.10, .10]), study="stability"),
        joint("graft", 1, scores([.70, .70], [.18, .18]), None, study="stability"),
        joint("graft", 2, scores([.64, .64], [.12, .12]), None, study="stability"),
        # Stored trajectories, S only: 65, 13 -> 39; own cost logged every 2 steps, best 5 -> value at step 4.
        JobSpec("graft_stored", "pair1", 0, [ModelSpec(S, "A", Q, 8, 5, scores([.65, .65], [.13, .13]),
                                                       {"cost/gpu_hours": steps(lambda s: .3 * s, every=2)})],
                "stored", {"train.lr": 1e-6}),
        # Ablations: S without the gate (55, 9 -> 32) and the delta=0.7 sweep point (60, 14 -> 37).
        joint("graft_no_gate", 0, scores([.55, .55], [.09, .09]), None, study="ablation"),
        joint("graft", 0, scores([.60, .60], [.14, .14]), None, study="delta", params={"method.delta": 0.7}),
        # Clip dynamics: peer-first, S only: own 0.2%, peer 0 on all 48 steps (no peer_admitted logged).
        joint("graft_peer_first", 0, scores([.5, .5], [.1, .1]), None, study="clip_dynamics",
              metrics_s={"train/clipfrac_self": {s: .002 for s in clip_steps},
                         "train/clipfrac_peer": {s: 0.0 for s in clip_steps}}),
    ]


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory, new_store):
    root = tmp_path_factory.mktemp("golden")
    uri = new_store(root)
    write_jobs(uri, golden_jobs(), root / "artifacts")
    return uri


@pytest.fixture(scope="module")
def built(store_uri):
    analysis = Analysis(load_store(store_uri))
    return analysis, build_all(analysis)


def row(frame, model, peer, method):
    found = frame[(frame["updated_model"] == model) & (frame["peer"] == peer) & (frame["method"] == method)]
    assert len(found) >= 1, (model, peer, method)
    return found.iloc[0]


def check(found, expected: dict):
    for column, value in expected.items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            assert pd.isna(found[column]), (column, found[column])
        elif isinstance(value, str):
            assert found[column] == value, (column, found[column], value)
        else:
            assert found[column] == pytest.approx(value, abs=1e-9), (column, found[column], value)


SQRT2 = math.sqrt(2)


def test_main_results_cells(built):
    _, tables = built
    frame = tables["main-results"].frame()
    assert list(frame.columns) == ["updated_model", "peer", "method", "n", "math500_mean", "math500_std",
                                   "aime2024_mean", "aime2024_std", "avg_mean", "avg_std", "delta"]
    check(row(frame, S, "none", "grpo_n8"), {"n": 2, "math500_mean": 61, "math500_std": SQRT2, "aime2024_mean": 11,
                                             "avg_mean": 36, "avg_std": SQRT2, "delta": 0})
    check(row(frame, S, "none", "grpo_n16"), {"avg_mean": 38, "avg_std": 0, "delta": 2})
    check(row(frame, S, "none", "grpo_n32"), {"math500_mean": 64, "aime2024_mean": 20, "avg_mean": 42, "delta": 6})
    check(row(frame, S, Q, "hacpo"), {"math500_mean": 58, "aime2024_mean": 14, "avg_mean": 36, "delta": 0})
    check(row(frame, S, Q, "sgt"), {"avg_mean": 39, "delta": 3})
    check(row(frame, S, Q, "graft"), {"math500_mean": 67, "math500_std": SQRT2, "aime2024_mean": 15,
                                      "avg_mean": 41, "avg_std": SQRT2, "delta": 5})
    check(row(frame, Q, "none", "grpo_n8"), {"avg_mean": 27.5, "avg_std": 0, "delta": 0})
    check(row(frame, Q, "none", "grpo_n32"), {"n": 0, "avg_mean": None, "delta": None})
    check(row(frame, Q, S, "sgt"), {"n": 0, "math500_mean": None, "delta": None})
    check(row(frame, Q, S, "graft"), {"avg_mean": 26.5, "delta": -1})


def test_main_results_bold_and_daggers(built):
    _, tables = built
    rows = {(r.updated_model, r.method): r for r in tables["main-results"].rows}
    # S block: GRAFT best on MATH500 and Avg; SGT best on AIME2024 (16 > 15).
    assert rows[(S, "graft")].bold == {"math500", "avg"}
    assert rows[(S, "sgt")].bold == {"aime2024"}
    assert rows[(S, "hacpo")].bold == set()
    # MATH500 67 beats GRPO n=32 (64): ‡; Avg 41 beats everything up to n=16 (39) but not n=32 (42): †.
    assert rows[(S, "graft")].marks == {"math500": "‡", "avg": "†"}
    # Q block: GRPO (n=8) is best everywhere -> no bold; n=32 and SGT are missing -> no marks.
    assert all(not rows[(Q, m)].bold for m in ("hacpo", "sgt", "graft"))
    assert rows[(Q, "graft")].marks == {}


def test_training_variance_cells(built):
    _, tables = built
    frame = tables["training-variance"].frame()
    # GRPO seeds: avg 36, 38, 34 -> 36 ± 2; MATH500 61, 64, 58 -> 61 ± 3. GRAFT avg 41, 44, 38 -> 41 ± 3.
    check(row(frame, S, "none", "grpo_n8"), {"n": 3, "avg_mean": 36, "avg_std": 2, "math500_mean": 61,
                                             "math500_std": 3, "delta": 0})
    check(row(frame, S, Q, "graft"), {"n": 3, "avg_mean": 41, "avg_std": 3, "aime2024_mean": 15, "delta": 5})
    check(row(frame, Q, S, "graft"), {"n": 1, "avg_mean": 26.5, "avg_std": None, "delta": -1})
    rows = {(r.updated_model, r.method): r for r in tables["training-variance"].rows}
    assert rows[(S, "graft")].bold == {"math500", "aime2024", "avg"}
    assert rows[(Q, "grpo_n8")].bold == {"math500", "aime2024", "avg"}


def test_replay_ablation_and_which_how_cells(built):
    _, tables = built
    replay = tables["replay-results"].frame()
    check(row(replay, S, Q, "graft_stored"), {"avg_mean": 39, "delta": 3})
    check(row(replay, Q, S, "graft_stored"), {"n": 0, "avg_mean": None})
    full = tables["ablation-full"].frame()
    check(row(full, S, Q, "graft"), {"avg_mean": 41, "delta": 0})
    check(row(full, S, Q, "graft_no_gate"), {"math500_mean": 55, "avg_mean": 32, "delta": -9})
    check(row(full, S, Q, "graft method.delta=0.7"), {"avg_mean": 37, "delta": -4})
    check(row(full, S, "none", "grpo_n8"), {"avg_mean": 36, "delta": -5})
    check(row(full, S, Q, "graft_pooled"), {"n": 0, "avg_mean": None, "delta": None})
    compact = tables["ablation"].frame()
    check(row(compact, S, Q, "graft_no_gate"), {"avg_mean": 32, "delta": -9, "subtable": "a"})
    check(row(compact, S, Q, "sgt"), {"avg_mean": 39, "delta": -2, "subtable": "b"})
    which = tables["which-how-full"].frame()
    check(row(which, S, Q, "hacpo"), {"avg_mean": 36, "delta": -5})
    check(row(which, Q, S, "hacpo"), {"avg_mean": 21.5, "delta": -5})


def test_compute_cells(built):
    _, tables = built
    frame = tables["compute"].frame()
    # GRPO: S 3.0 at step 6 of 5.0; Q 4.0 at step 10 of 4.0; both = sums.
    check(row(frame, S, "none", "grpo_n8"), {"avg_mean": 36, "best_step": 6, "gpuh_best": 3.0, "gpuh_full": 5.0,
                                             "joint_gpuh_best": 7.0, "joint_gpuh_full": 9.0, "conservative_gpuh": 3.0})
    # GRAFT: own shares 2.4 (step 4) and 3.2 (step 8); joint run through step 8 = 8.0, full 10.0;
    # conservative = joint cost up to each model's own checkpoint: 4.0 and 8.0.
    check(row(frame, S, Q, "graft"), {"gpuh_best": 2.4, "gpuh_full": 6.0, "joint_gpuh_best": 8.0,
                                      "joint_gpuh_full": 10.0, "conservative_gpuh": 4.0})
    check(row(frame, Q, S, "graft"), {"gpuh_best": 3.2, "gpuh_full": 4.0, "joint_gpuh_best": 8.0,
                                      "conservative_gpuh": 8.0})
    # Stored: cost logged at even steps; the checkpoint at step 5 costs the value at step 4 (1.2); the peer's
    # stored run is missing, so the pair total is unknown.
    check(row(frame, S, Q, "graft_stored"), {"gpuh_best": 1.2, "gpuh_full": 3.0, "joint_gpuh_best": None})


def test_clipfrac_cells(built):
    _, tables = built
    frame = tables["clipfrac-position"].frame()
    check(row(frame, S, Q, "graft"), {"clipfrac_self": 0.1, "clipfrac_peer": 0.1, "zero_peer_clip_steps_pct": 50})
    check(row(frame, S, Q, "graft_peer_first"), {"clipfrac_self": 0.2, "clipfrac_peer": 0.0,
                                                 "zero_peer_clip_steps_pct": 100})
    check(row(frame, Q, S, "graft_peer_uniform"), {"clipfrac_self": None, "zero_peer_clip_steps_pct": None})


def test_training_hparams_from_job_params(built):
    _, tables = built
    frame = tables["training-hparams"].frame().set_index("hyperparameter")
    assert frame.loc["Learning rate", "value"] == "1e-06"
    assert frame.loc["Learning rate", "param_keys"] == "train.lr"
    assert frame.loc["Prompt batch size", "value"] == "128"
    assert frame.loc["Training epochs", "param_keys"] == "train.total_epochs"
    assert pd.isna(frame.loc["Optimizer", "value"])


def test_missing_cells_name_their_sweep(built):
    analysis, _ = built
    missing = analysis.missing_frame()
    expected = [
        ("main-results", "grpo_n32", Q, "none", 0, "sweeps/main.yaml"),
        ("main-results", "sgt", Q, S, 0, "sweeps/main.yaml"),
        ("training-variance", "graft", Q, S, 1, "sweeps/stability.yaml"),
        ("replay-results", "graft_stored", Q, S, 0, "sweeps/stored.yaml"),
        ("ablation-full", "graft method.delta=0.9", S, Q, 0, "sweeps/delta.yaml"),
        ("ablation-full", "graft_pooled", S, Q, 0, "sweeps/alternatives.yaml"),
        ("ablation-full", "graft_no_floor", S, Q, 0, "sweeps/ablation.yaml"),
        ("compute", "grpo_ds", S, "none", 0, "sweeps/compute.yaml"),
        ("clipfrac-position", "graft_peer_uniform", S, Q, 0, "sweeps/clip_dynamics.yaml"),
    ]
    found = set(missing[["table", "method", "model", "peer", "seed", "sweep"]].itertuples(index=False, name=None))
    for entry in expected:
        assert entry in found
    # Present runs are never reported.
    assert ("main-results", "graft", S, Q, 0, "sweeps/main.yaml") not in found


def test_renderers_show_paper_layout(built):
    from analysis.render import results_md, results_tex

    table = built[1]["main-results"]
    tex, md = results_tex(table), results_md(table)
    assert r"\pairband{Updated policy: SmolLM3-3B-Base}" in tex
    assert r"\modelband{Peer policy: Qwen3-1.7B-Base (Pair 1)}" in tex
    assert r"\oursrow \quad \textbf{\method{}} & \best{67.00$^{\ddagger}$\stdv{1.41}}" in tex
    assert r"\best{41.00$^{\dagger}$\stdv{1.41}} & \up{5.00} \\" in tex
    assert r"\quad GRPO ($n{=}8$) & 61.00\stdv{1.41}" in tex and r"\refrow \\" in tex
    assert r"\dn{1.00}" in tex and "& -- &" in tex
    assert "| **GRAFT** | **67.00‡ ± 1.41** |" in md
    assert "| SGT | – | – | – | – |" in md


def test_cli_writes_every_table(store_uri, tmp_path):
    assert cli.main(["tables", "--tracking-uri", store_uri, "--out", str(tmp_path)]) == 0
    for label in ("main-results", "ablation", "ablation-full", "which-how-full", "training-variance",
                  "replay-results", "compute", "clipfrac-position", "training-hparams"):
        for ext in ("csv", "md", "tex"):
            assert (tmp_path / f"{label}.{ext}").stat().st_size > 0
    missing = pd.read_csv(tmp_path / "missing.csv")
    assert {"sweeps/main.yaml", "sweeps/stability.yaml"} <= set(missing["sweep"])
    main = pd.read_csv(tmp_path / "main-results.csv")
    assert row(main, S, Q, "graft")["avg_mean"] == pytest.approx(41)

    assert cli.main(["compare", "--out", str(tmp_path)]) == 0
    compared = pd.read_csv(tmp_path / "compare.csv")
    cell = compared[(compared["table"] == "main-results") & (compared["updated_model"] == S)
                    & (compared["peer"] == Q) & (compared["method"] == "graft") & (compared["column"] == "avg_mean")]
    assert cell["paper"].item() == pytest.approx(37.06)
    assert cell["diff"].item() == pytest.approx(41 - 37.06)


def test_cli_reports_unreachable_store(store_uri, tmp_path, capsys):
    assert cli.main(["tables", "--tracking-uri", f"sqlite:///{tmp_path / 'absent.db'}", "--out", str(tmp_path)]) == 2
    assert cli.main(["tables", "--tracking-uri", store_uri, "--experiment", "graft/absent", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no SQLite database" in err and "graft/absent" in err


def test_all_fraction_scale_detection(built):
    analysis, _ = built
    assert analysis.scale == 100.0
    assert np.isclose(analysis.scores(analysis.find("t", "graft", S, Q), ["math500"])["math500"].mean(), 67)


def test_tables_say_when_they_mix_environments(tmp_path, capsys, new_store):
    """A table whose runs ran on different library versions or GPUs says so, naming the difference."""
    def env(torch):
        return {"graft.env.torch": torch, "graft.env.vllm": "0.11.0", "graft.env.gpu": "NVIDIA H100 80GB HBM3"}
    jobs = [single("grpo_n8", S, "A", 0, scores([.60, .62], [.10, .12])),
            single("grpo_n8", Q, "B", 0, scores([.50, .50], [.05, .05]))]
    jobs[0].environment, jobs[1].environment = env("2.8.0"), env("2.9.1")
    uri = new_store(tmp_path)
    write_jobs(uri, jobs, tmp_path / "artifacts")
    analysis = Analysis(load_store(uri))
    build_all(analysis)
    lines = analysis.mixed_environments()
    assert lines and all("torch 2.8.0 (1 runs) vs 2.9.1 (1 runs)" in line for line in lines)
    assert not any("vllm" in line or "gpu" in line for line in lines)
    assert cli.main(["tables", "--tracking-uri", uri, "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr()
    assert "mixes environments: torch 2.8.0 (1 runs) vs 2.9.1 (1 runs)" in said.out + said.err


def test_one_environment_is_not_reported(built):
    analysis, _ = built
    assert analysis.mixed_environments() == []
