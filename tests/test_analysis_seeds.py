"""Seed-study tables and figures (sweeps/tiny.yaml's) on a real MLflow SQLite store with known values.

The tiny pair (A = tiny-char-llama, B = tiny-bpe-gpt2), two benchmarks (add, sub), seeds 0-2, scores logged as
fractions (tables show percent). Expected paired differences are worked out by hand in the comments; the
t quantile for 2 degrees of freedom at 97.5% is 4.302653.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from analysis import __main__ as cli
from analysis import figures, readme, rules, tables
from analysis.results import Analysis
from analysis.store import load_store
from analysis.synthetic import JobSpec, ModelSpec, with_costs, write_jobs
from analysis.tables import BOTH, build_all

A, B = "tiny-char-llama", "tiny-bpe-gpt2"
T975_2 = 4.302653


def scores(add, sub):
    return {"add": list(add), "sub": list(sub)}


def val(best):
    """A validation curve that peaks at ``best`` (so best_step is read from the tag and agrees with it)."""
    return {"val/avg": {s: 0.3 - 0.01 * abs(s - best) for s in range(5)}}


def grpo(seed, test_a, test_b):
    """One GRPO n=8 job training both tiny models alone; 1 device-hour per step each, best steps 2 and 4."""
    job = JobSpec("grpo_n8", "tiny", seed, [ModelSpec(A, "A", "none", 8, 2, test_a, val(2)),
                                            ModelSpec(B, "B", "none", 8, 4, test_b, val(4))], "tiny")
    return with_costs(job, {"A": [3600] * 4, "B": [3600] * 4}, {"A": 1, "B": 1})


def cotrain(method, seed, test_a, test_b):
    """A co-training job; each model's share 0.5 device-hours per step (joint 1 per step), best steps 3 and 1."""
    job = JobSpec(method, "tiny", seed, [ModelSpec(A, "A", B, 8, 3, test_a, val(3)),
                                         ModelSpec(B, "B", A, 8, 1, test_b, val(1))], "tiny")
    return with_costs(job, {"A": [1800] * 4, "B": [1800] * 4}, {"A": 1, "B": 1})


def seed_jobs() -> list[JobSpec]:
    return [
        # GRPO n=8, per seed Avg (mean of add and sub): A 30, 40, 50; B 20, 20, 20; both 25, 30, 35.
        grpo(0, scores([.40, .40], [.20, .20]), scores([.30, .30], [.10, .10])),
        grpo(1, scores([.50, .50], [.30, .30]), scores([.30, .30], [.10, .10])),
        grpo(2, scores([.60, .60], [.40, .40]), scores([.30, .30], [.10, .10])),
        # GRAFT: A 34 (eval runs 32 and 36), 42, 56 -> paired differences 4, 2, 6: mean 4, s.d. 2;
        # B 21, 23, 25 -> 1, 3, 5: mean 3, s.d. 2; both 27.5, 32.5, 40.5 -> 2.5, 2.5, 5.5: mean 3.5, s.d. sqrt(3).
        cotrain("graft", 0, scores([.42, .46], [.22, .26]), scores([.31, .31], [.11, .11])),
        cotrain("graft", 1, scores([.52, .52], [.32, .32]), scores([.33, .33], [.13, .13])),
        cotrain("graft", 2, scores([.66, .66], [.46, .46]), scores([.35, .35], [.15, .15])),
        # Stored trajectories, seeds 0 and 1 only: A 31, 41 -> differences 1, 1 (s.d. 0: a zero-width interval).
        cotrain("graft_stored", 0, scores([.41, .41], [.21, .21]), scores([.30, .30], [.10, .10])),
        cotrain("graft_stored", 1, scores([.51, .51], [.31, .31]), scores([.30, .30], [.10, .10])),
        # An ablation, seed 0 only: no interval from one pair.
        cotrain("graft_no_gate", 0, scores([.45, .45], [.25, .25]), scores([.30, .30], [.10, .10])),
    ]


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory, new_store):
    root = tmp_path_factory.mktemp("seeds")
    uri = new_store(root)
    write_jobs(uri, seed_jobs(), root / "artifacts")
    return uri


@pytest.fixture(scope="module")
def built(store_uri):
    analysis = Analysis(load_store(store_uri, ["graft/tiny"]))
    return analysis, {label: table.frame() for label, table in build_all(analysis).items()}


def cell(frame, model, method):
    found = frame[(frame["updated_model"] == model) & (frame["method"] == method)]
    assert len(found) == 1, (model, method, frame[["updated_model", "method"]])
    return found.iloc[0]


def interval(mean, sd, n=3, t=T975_2):
    half = t * sd / math.sqrt(n)
    return pytest.approx([mean, mean - half, mean + half, n])


def paired(row, reference="grpo_n8"):
    return [row[f"vs_{reference}_{k}"] for k in ("mean", "lo", "hi", "n")]


def test_paired_difference_rule():
    values = pd.Series({0: 34.0, 1: 42.0, 2: 56.0, 3: 70.0})
    reference = pd.Series({0: 30.0, 1: 40.0, 2: 50.0})      # seed 3 has no partner: left out
    assert list(rules.paired_difference(values, reference).values()) == interval(4, 2)


def test_main_seeds_paired_with_grpo(built):
    analysis, frames = built
    assert analysis.seed_study_pairs() == ["tiny"] and analysis.seeds_of("tiny") == [0, 1, 2]
    main = frames["main-seeds"]
    assert set(main["method"]) == {"grpo_n8", "graft"}   # methods that never ran on the pair are not rows
    graft_a = cell(main, A, "graft")
    assert graft_a["avg_mean"] == pytest.approx(44)
    assert graft_a["avg_std"] == pytest.approx(math.sqrt((10 ** 2 + 2 ** 2 + 12 ** 2) / 2))
    assert graft_a["add_mean"] == pytest.approx(54)      # (44 + 52 + 66) / 3
    assert paired(graft_a) == interval(4, 2)
    assert paired(cell(main, B, "graft")) == interval(3, 2)
    assert paired(cell(main, BOTH, "graft")) == interval(3.5, math.sqrt(3))
    # Evaluation noise: GRAFT's A checkpoint of seed 0 scored Avg 32 and 36 in its two runs (s.d. 2.83, s.e. 2),
    # every other checkpoint the same in both runs (s.e. 0); mean over 3 seeds 2/3. Both models: sqrt(2² + 0²) / 2.
    assert graft_a["eval_se"] == pytest.approx(2 / 3)
    assert cell(main, B, "graft")["eval_se"] == pytest.approx(0)
    assert cell(main, BOTH, "graft")["eval_se"] == pytest.approx(1 / 3)
    grpo_a = cell(main, A, "grpo_n8")
    assert paired(grpo_a) == pytest.approx([0, 0, 0, 3])
    assert grpo_a["seeds"] == 3 and grpo_a["of_seeds"] == 3


def test_missing_seeds_shrink_the_pairs_and_are_reported(built):
    analysis, frames = built
    stored = cell(frames["replay-seeds"], A, "graft_stored")
    assert paired(stored) == pytest.approx([1, 1, 1, 2])     # differences 1 and 1
    assert stored["seeds"] == 2
    gate = cell(frames["ablation-seeds"], A, "graft_no_gate")
    assert gate["vs_grpo_n8_mean"] == pytest.approx(5) and pd.isna(gate["vs_grpo_n8_lo"])
    assert gate["vs_graft_mean"] == pytest.approx(1)         # 35 - 34 on seed 0
    missing = analysis.missing_frame()
    found = set(missing[["table", "method", "model", "seed", "sweep"]].itertuples(index=False, name=None))
    assert ("replay-seeds", "graft_stored", A, 2, "sweeps/tiny.yaml") in found
    assert ("ablation-seeds", "graft_no_gate", B, 1, "sweeps/tiny.yaml") in found


def test_compute_seeds_costs(built):
    _, frames = built
    compute = frames["compute-seeds"]
    grpo_row, graft_row = cell(compute, BOTH, "grpo_n8"), cell(compute, BOTH, "graft")
    # GRPO: each model's own cost to its checkpoint, 2 + 4 device-hours; full runs 4 + 4.
    assert (grpo_row["joint_gpuh_best"], grpo_row["joint_gpuh_full"]) == pytest.approx((6, 8))
    # GRAFT: the joint run through the later checkpoint (step 3), 3 device-hours; full run 4.
    assert (graft_row["joint_gpuh_best"], graft_row["joint_gpuh_full"]) == pytest.approx((3, 4))
    assert paired(graft_row) == interval(3.5, math.sqrt(3))


def test_cli_writes_seed_tables_and_figures(store_uri, tmp_path, monkeypatch):
    assert cli.main(["tables", "--tracking-uri", store_uri, "--experiment", "graft/tiny", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "main-seeds.md").read_text()
    assert "| **GRAFT** |" in text and "+4.00 [-0.97, +8.97] | 0.67 |" in text and "3/3" in text
    assert r"\Delta" in (tmp_path / "main-seeds.tex").read_text()
    rows = [line for line in text.splitlines() if line.startswith("|") and not line.startswith("|---")]
    assert len({line.count(" |") for line in rows}) == 1, "band rows must span every column"
    assert cli.main(["figures", "--tracking-uri", store_uri, "--experiment", "graft/tiny",
                     "--out", str(tmp_path)]) == 0
    curves = pd.read_csv(tmp_path / "val-curves-seeds.csv")
    peak = curves[(curves["updated_model"] == A) & (curves["method"] == "graft") & (curves["step"] == 3)]
    assert peak["mean"].item() == pytest.approx(30) and peak["seeds"].item() == 3
    budget = pd.read_csv(tmp_path / "pair-budget-seeds.csv").set_index("method")
    assert budget.loc["graft", "gpuh"] == pytest.approx(3)
    assert budget.loc["graft", "score"] == pytest.approx(33.5)      # (27.5 + 32.5 + 40.5) / 3
    for name in ("val-curves-seeds", "pair-budget-seeds", "rescue-fraction"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0

    # The page's section is rebuilt from exactly these files; the text around it is kept, and the figures go
    # beside the page, linked relative to it.
    docs = tmp_path / "project" / "docs"
    docs.mkdir(parents=True)
    page = docs / "tiny.md"
    before = f"# Results\n\nintro\n\n{readme.BEGIN}\nstale table\n{readme.END}\n\noutro\n"
    page.write_text(before)
    assert cli.main(["readme", str(page), "--out", str(tmp_path)]) == 0
    text = page.read_text()
    assert text.startswith("# Results\n\nintro\n\n") and text.endswith(f"{readme.END}\n\noutro\n")
    assert "stale table" not in text and (tmp_path / "main-seeds.md").read_text().strip() in text
    assert (docs / tmp_path.name / "val-curves-seeds.png").read_bytes() == \
        (tmp_path / "val-curves-seeds.png").read_bytes()
    assert f"]({tmp_path.name}/rescue-fraction.png)" in text
    # GRAFT's intervals all include 0 (above); the stored runs' two paired differences are equal (s.d. 0), so
    # their zero-width intervals exclude it: A +1 on both seeds, B 0, both models (1 + 0) / 2.
    assert ("Paired differences to GRPO (n=8) whose 95% interval excludes zero: GRAFT w/ stored traj. on "
            "Tiny-Char-Llama: +1.00 [+1.00, +1.00]; GRAFT w/ stored traj. on both models: +0.50 [+0.50, +0.50].") in text
    assert "No method's paired difference to GRPO (n=8) has a 95% interval that excludes zero (3 paired seeds" in text
    # Regenerating is idempotent, and a page without the markers is refused, unchanged.
    assert cli.main(["readme", str(page), "--out", str(tmp_path)]) == 0
    assert page.read_text() == text
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "OTHER.md").write_text("no markers\n")
    assert cli.main(["readme", str(elsewhere / "OTHER.md"), "--out", str(tmp_path)]) == 2
    assert (elsewhere / "OTHER.md").read_text() == "no markers\n" and not (elsewhere / tmp_path.name).exists()
    # An output directory that tables/figures never wrote into is refused, the page unchanged.
    assert cli.main(["readme", str(page), "--out", str(elsewhere)]) == 2
    assert page.read_text() == text
    # Without a page, the command rebuilds the section's own page (docs/tiny.md from the repository root).
    page.write_text(before)
    monkeypatch.chdir(tmp_path / "project")
    assert cli.main(["readme", "--out", str(tmp_path)]) == 0
    assert page.read_text() == text


def test_seed_figure_points_match_tables(built):
    analysis, frames = built
    points = figures.seed_budget_points(tables.compute_seeds(analysis))
    assert set(points["method"]) == set(frames["compute-seeds"]["method"])


def test_tiny_page_section_is_generated_and_its_figures_exist():
    """docs/tiny.md carries one generated tiny-study section (from `python -m analysis readme`), with every
    table and figure it links to, the figures linked relative to the page."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    text = (docs / "tiny.md").read_text(encoding="utf-8")
    readme.splice(text, "")     # exactly one well-formed section, or SectionError
    generated = text.split(readme.BEGIN, 1)[1].split(readme.END, 1)[0]
    for label in readme.TABLES:
        assert f"**{label}**" in generated
    for name in readme.FIGURES:
        assert (docs / "tiny" / f"{name}.png").stat().st_size > 0
        assert f"](tiny/{name}.png)" in generated


def test_the_reproduction_report_judges_each_paper_mean_by_our_seeds(built, store_uri, tmp_path):
    """Paper values made up for the tiny pair, judged by the store's known seeds. GRAFT on A: Avg 34, 42, 56 (mean
    44, s.d. sqrt(124)); on B: 21, 23, 25 (mean 23, s.d. 2); the ablation ran one seed."""
    from analysis import compare

    paper = pd.DataFrame([
        # one paper run, judged by where one more of our runs would fall: 44 +- 4.302653 sqrt(124) sqrt(4/3)
        ("main-results", A, B, "graft", "avg_mean", 40.0), ("main-results", A, B, "graft", "avg_std", 1.0),
        # B: 23 +- 4.302653 * 2 * sqrt(4/3) = 23 +- 9.94: 40 is outside
        ("main-results", B, A, "graft", "avg_mean", 40.0),
        ("main-results", A, B, "graft_no_gate", "avg_mean", 35.0),
        # Table 4's mean over the paper's three runs (s.d. 2) against ours (mean 23, s.d. 2, 3 seeds): Welch
        ("training-variance", B, A, "graft", "avg_mean", 30.0), ("training-variance", B, A, "graft", "avg_std", 2.0),
    ], columns=[*compare.KEYS, "paper"])
    _, frames = built
    judged = compare.reproduction(frames, paper).set_index(["table", "updated_model", "method"])
    a = judged.loc[("main-results", A, "graft")]
    half = T975_2 * math.sqrt(124) * math.sqrt(4 / 3)
    assert (a["ours"], a["seeds"], a["diff"]) == (pytest.approx(44), 3, pytest.approx(4))
    assert (a["diff_lo"], a["diff_hi"], a["verdict"]) == (pytest.approx(4 - half), pytest.approx(4 + half), "within")
    b = judged.loc[("main-results", B, "graft")]
    assert b["diff"] == pytest.approx(-17) and b["diff_hi"] == pytest.approx(-17 + T975_2 * 2 * math.sqrt(4 / 3))
    assert b["verdict"] == "outside"
    assert judged.loc[("main-results", A, "graft_no_gate"), "verdict"] == "not enough seeds"
    welch = judged.loc[("training-variance", B, "graft")]   # equal s.d. and n: 4 degrees of freedom
    assert welch["diff_hi"] == pytest.approx(-7 + 2.776445 * math.sqrt(4 / 3 + 4 / 3))
    assert welch["verdict"] == "outside"

    # the command: tables written, then compared from the files, the report beside compare.csv
    assert cli.main(["tables", "--tracking-uri", store_uri, "--experiment", "graft/tiny", "--out", str(tmp_path)]) == 0
    judged_from_files = compare.reproduction(compare.read_tables(tmp_path), paper)
    assert list(judged_from_files["verdict"]) == ["within", "outside", "not enough seeds", "outside"]
    compare.write_reproduction(judged_from_files, tmp_path)
    assert "| main-results | 3 | 1 | 1 | 1 |" in (tmp_path / "reproduction.md").read_text()
