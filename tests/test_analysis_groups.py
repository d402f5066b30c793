"""The K-model study's table and figure (sweeps/tiny3.yaml) on a real MLflow SQLite store with known values.

A group of three tiny models (A, B, C): a GRPO n=8 group job, GRAFT on each of the three pairs, and GRAFT on
the group with two source rules, seeds 0-2. Scores are logged as fractions (tables show percent); every
expected number is worked out by hand in the comments (t quantile for 2 degrees of freedom: 4.302653).
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis import catalog, figures, readme, render, tables
from analysis.results import Analysis
from analysis.store import load_store
from analysis.synthetic import JobSpec, ModelSpec, write_jobs

A, B, C = "tiny-char-llama", "tiny-bpe-gpt2", "tiny-unigram-neox"
T975_2 = 4.302653
SEEDS = (0, 1, 2)
#: Avg per seed of model A (the other members score a flat 20 so that only A's rows are worked out).
A_AVG = {("grpo_n8", "none"): (30, 40, 50),
         ("graft", B): (34, 42, 56),        # -> vs GRPO 4, 2, 6: mean 4 (the best single peer: mean 44)
         ("graft", C): (31, 41, 51),        # -> vs GRPO 1, 1, 1: mean 1 (mean 41)
         ("most_successes", f"{B},{C}"): (36, 44, 58),   # -> vs GRPO 6, 4, 8; vs best single peer 2, 2, 2
         ("random", f"{B},{C}"): (33, 45, 55)}           # -> vs best single peer -1, 3, -1: mean 1/3


def flat(avg: float) -> dict[str, list[float]]:
    return {"add": [avg / 100] * 2, "sub": [avg / 100] * 2}


def success(*ks) -> pd.DataFrame:
    """prompt_success.parquet rows: step s has prompts 0..3 with successes ks[s - 1]."""
    return pd.DataFrame([{"step": s, "prompt_id": p, "k": k} for s, row in enumerate(ks, 1) for p, k in enumerate(row)])


# Of A's all-fail prompts, step 1 {0, 1, 2}: B solves 0, C solves 1 (1/3 each, any 2/3); step 2 {0, 2, 3}: B
# none, C solves 0 (0 and 1/3, any 1/3). Means over steps: B 1/6, C 1/3, any 1/2.
PROMPT_SUCCESS = {A: success([0, 0, 0, 5], [0, 1, 0, 0]), B: success([2, 0, 0, 0], [0, 0, 0, 0]),
                  C: success([0, 3, 0, 0], [4, 0, 0, 0])}


def jobs() -> list[JobSpec]:
    out = []
    for i, seed in enumerate(SEEDS):
        def member(model, role, peer, key, success_frame=None, i=i):
            avg = A_AVG[key][i] if model == A else 20
            return ModelSpec(model, role, peer, 8, 2, flat(avg), prompt_success=success_frame)

        out.append(JobSpec("grpo_n8", "tiny3", seed, [
            member(m, r, "none", ("grpo_n8", "none"), PROMPT_SUCCESS[m] if seed == 0 else None)
            for m, r in ((A, "A"), (B, "B"), (C, "C"))], "tiny3"))
        for pair, (x, y) in {"tiny": (A, B), "tiny_ac": (A, C), "tiny_bc": (B, C)}.items():
            out.append(JobSpec("graft", pair, seed, [member(x, "A", y, ("graft", y)),
                                                     member(y, "B", x, ("graft", x))], "tiny3"))
        for rule in ("most_successes", "random"):
            members = [(A, "A"), (B, "B"), (C, "C")]
            out.append(JobSpec("graft", "tiny3", seed, [
                member(m, r, ",".join(o for o, _ in members if o != m), (rule, f"{B},{C}"))
                for m, r in members], "tiny3", params={catalog.SOURCE_RULE_PARAM: rule}))
    return out


@pytest.fixture(scope="module")
def analysis(tmp_path_factory, new_store):
    where = tmp_path_factory.mktemp("groups")
    uri = new_store(where)
    write_jobs(uri, jobs(), where / "artifacts")
    return Analysis(load_store(uri))


def test_groups_are_found_by_their_members_roles_and_are_not_pairs(analysis):
    assert analysis.groups == {"tiny3": (A, B, C)}
    assert "tiny3" not in analysis.pairs and analysis.pairs["tiny_ac"] == (A, C)
    assert analysis.source_rules("tiny3") == [catalog.all_peers_method("graft", r) for r in ("most_successes", "random")]


def test_group_table_pairs_each_receiver_with_grpo_and_its_best_single_peer(analysis):
    table = tables.group_seeds(analysis)
    rows = {(r.updated_model, r.method, r.peer): r for r in table.rows}
    assert len(rows) == 3 * 5
    best = rows[(A, "graft", B)]
    assert best.label == f"GRAFT with {catalog.model_display(B)} (best single peer)"
    assert best.stats["avg_mean"] == pytest.approx(44) and best.extra["vs_grpo_n8_mean"] == pytest.approx(4)
    assert math.isnan(best.extra[f"vs_{catalog.BEST_PEER}_mean"])          # the reference itself
    assert rows[(A, "graft", C)].extra[f"vs_{catalog.BEST_PEER}_mean"] == pytest.approx(-3)   # 41 - 44
    most = rows[(A, catalog.all_peers_method("graft", "most_successes"), f"{B},{C}")]
    assert most.extra["vs_grpo_n8_mean"] == pytest.approx(6)
    halfwidth = T975_2 * 2 / math.sqrt(3)                                  # 6, 4, 8: s.d. 2
    assert most.extra["vs_grpo_n8_lo"] == pytest.approx(6 - halfwidth)
    assert most.extra[f"vs_{catalog.BEST_PEER}_mean"] == pytest.approx(2)   # 2, 2, 2: no spread
    assert most.extra[f"vs_{catalog.BEST_PEER}_lo"] == pytest.approx(2)
    rand = rows[(A, catalog.all_peers_method("graft", "random"), f"{B},{C}")]
    assert rand.extra[f"vs_{catalog.BEST_PEER}_mean"] == pytest.approx(1 / 3)
    assert rand.label == "GRAFT, all peers (random)"
    markdown = render.seeds_md(table)
    assert "Δ Avg vs best single peer [95% CI]" in markdown and "device-h, whole job" in markdown


def test_rescue_matrix_reads_the_group_grpo_runs(analysis, tmp_path):
    points = figures.rescue_matrix_points(analysis).set_index(["receiver", "source"])["rescued_pct"]
    assert points[(A, B)] == pytest.approx(100 / 6)
    assert points[(A, C)] == pytest.approx(100 / 3)
    assert points[(A, "any peer")] == pytest.approx(50)
    paths = figures.rescue_matrix(analysis, tmp_path)
    assert [p.name for p in paths] == ["rescue-matrix.png", "rescue-matrix.pdf", "rescue-matrix.csv"]
    assert paths[0].stat().st_size > 10_000


def test_group_page_section_is_generated_from_the_outputs(analysis, tmp_path):
    out = tmp_path / "tiny3"
    tables.build_all(analysis)                   # every table builds on a store that holds a group
    render.write_table(tables.group_seeds(analysis), out)
    figures.rescue_matrix(analysis, out)
    begin, end = readme.SECTIONS[readme.GROUP_STUDY][:2]
    path = tmp_path / "docs" / "groups.md"
    path.parent.mkdir()
    path.write_text(f"# R\n\n{begin}\nstale\n{end}\n")
    readme.write(out, path, readme.GROUP_STUDY)
    text = path.read_text()
    assert "stale" not in text and "**group-seeds**" in text and "](tiny3/rescue-matrix.png)" in text
    assert (path.parent / "tiny3" / "rescue-matrix.png").read_bytes() == (out / "rescue-matrix.png").read_bytes()
    # the separation line names the single peer where the method alone does not say it
    assert f"GRAFT with {catalog.model_display(C)} on {catalog.model_display(A)}: +1.00 [+1.00, +1.00]" in text
    assert (f"Paired differences to best single peer whose 95% interval excludes zero: GRAFT, all peers "
            f"(most successes) on {catalog.model_display(A)}: +2.00 [+2.00, +2.00].") in text
