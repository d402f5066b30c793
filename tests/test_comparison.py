"""A multirun or a sweep ends with the comparison it was run for (graft_exp/launching/comparison.py): checked
against means, paired differences and intervals computed by hand on a small store of real MLflow runs."""

from __future__ import annotations

import re

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from graft_exp import tracking
from graft_exp.launching import comparison, summary

#: (method, seed) -> each model's final test averages over two evaluation runs.
SCORES = {("grpo_n8", 0): ((0.40, 0.50), (0.30, 0.30)), ("grpo_n8", 1): ((0.50, 0.50), (0.40, 0.40)),
          ("grpo_n8", 2): ((0.50, 0.60), (0.30, 0.40)), ("graft", 0): ((0.50, 0.50), (0.40, 0.40)),
          ("graft", 1): ((0.60, 0.60), (0.40, 0.40)), ("graft", 2): ((0.50, 0.60), (0.40, 0.50))}


def write_store(new_store, tmp_path, scores=SCORES) -> tuple[str, list[tuple[str, str]]]:
    uri = new_store(tmp_path)
    client = MlflowClient(uri)
    exp = client.create_experiment("graft/compare")
    jobs = []
    for (method, seed), models in scores.items():
        key = f"{method}-{seed}"
        steps = "20" if (method, seed) == ("graft", 2) else "30"
        job = client.create_run(exp, tags={"graft.run_key": key, "graft.method": method, "graft.seed": str(seed),
                                           "graft.pair": "tiny"}).info.run_id
        params = {"method": method, "seed": str(seed), "train.max_steps": steps, "method.name": method,
                  "method.delta": "0.7" if method == "graft" else "0.8", "tracking.uri": uri, "study": "compare"}
        client.log_batch(job, params=[Param(k, v) for k, v in params.items()],
                         metrics=[Metric("cost/gpu_hours", 0.01 * (1 + (method == "graft")), 0, 1)])
        for role, model, runs in zip("AB", ("tiny-char-llama", "tiny-bpe-gpt2"), models):
            child = client.create_run(exp, tags={"mlflow.parentRunId": job, "graft.role": role, "graft.model": model,
                                                 "graft.run_key": f"{key}-{role}"}).info.run_id
            client.log_batch(child, metrics=[Metric("test/avg", v, 0, i) for i, v in enumerate(runs)])
            client.set_terminated(child)
        client.set_terminated(job)
        jobs.append((f"{method} seed {seed}", key))
    return uri, jobs


def test_the_comparison_is_the_hand_computed_one(new_store, tmp_path, capsys):
    uri, jobs = write_store(new_store, tmp_path)
    summary.print_jobs(uri, jobs, "multirun of 6 jobs: results")
    out = capsys.readouterr().out
    # by seed, GRPO n=8: A 0.45, 0.50, 0.55 (s.d. 0.05); B 0.30, 0.40, 0.35 (s.d. 0.05); pair 0.375, 0.45, 0.45
    # (s.d. 0.0433). GRAFT: A 0.50, 0.60, 0.55 (0.05); B 0.40, 0.40, 0.45 (0.0289); pair 0.45, 0.50, 0.50 (0.0289).
    # "±" is the sample s.d. here as in every table of the project (intervals.mean_sd)
    assert "mean ± s.d. over seeds" in out
    assert re.search(r"grpo_n8 +│ +3 │ +50\.0 ± 5\.0 │ +35\.0 ± 5\.0 │ +42\.5 ± 4\.3 │ +reference │ +- │ +0\.0100", out), out
    assert re.search(r"graft +│ +3 │ +55\.0 ± 5\.0 │ +41\.7 ± 2\.9 │ +48\.3 ± 2\.9 │", out), out
    # paired differences 0.075, 0.05, 0.05: mean 0.0583, s.d. 0.01443, s.e. 0.00833; t(0.975, 2) = 4.302653
    half = 4.302653 * 0.0144338 / 3 ** 0.5
    assert f"+5.83 [{100 * (0.058333 - half):+.2f}, {100 * (0.058333 + half):+.2f}] (n=3)" in out, out
    assert "+5.83 [+2.25, +9.42] (n=3)" in out and "0.0200" in out
    # rliable's probability of improvement over the 3 x 3 pairs of seeds' pair scores, ties counted half:
    # 0.45 beats 0.375 and ties 0.45 twice (2), each 0.50 beats all three (3 + 3): 8 / 9
    assert re.search(r"\(n=3\) │ +0\.89 │", out), out
    assert "the compared jobs differ besides method and seed in: train.max_steps: 20, 30" in out


def test_no_comparison_where_methods_share_no_seed(new_store, tmp_path, capsys):
    uri, jobs = write_store(new_store, tmp_path)
    only_graft = [(label, key) for label, key in jobs if key.startswith("graft")]
    summary.print_jobs(uri, only_graft, "multirun of 3 jobs: results")
    assert "paired vs" not in capsys.readouterr().out
    assert tracking.find_run(MlflowClient(uri), "graft-0") is not None


def test_analysis_methods_writes_the_same_comparison_for_selected_runs(new_store, tmp_path, capsys):
    """``python -m analysis methods``: the same comparison for any finished jobs, selected by experiment and
    settings, written as CSV, Markdown and LaTeX; a filter that leaves no shared seeds says so (exit 2)."""
    import pandas as pd

    from analysis.__main__ import main

    uri, _ = write_store(new_store, tmp_path)
    out = tmp_path / "reports"
    assert main(["methods", "--tracking-uri", uri, "--experiment", "graft/compare", "--out", str(out)]) == 0
    printed = capsys.readouterr().err   # analysis reports on stderr (a narrow table there: the numbers wrap)
    assert "+5.83" in printed and "paired vs" in printed
    table = pd.read_csv(out / "methods.csv").set_index("method")
    assert table.loc["graft", "delta"] == pytest.approx(5.8333, abs=1e-3)
    assert table.loc["graft", "delta lo"] == pytest.approx(2.2478, abs=1e-3)
    assert table.loc["grpo_n8", "pair mean"] == pytest.approx(42.5) and table.loc["graft", "paired seeds"] == 3
    assert "| graft | 3 |" in (out / "methods.md").read_text() and "\\begin{tabular}" in (out / "methods.tex").read_text()
    # only the jobs trained 30 steps: graft seed 2 (20 steps) drops out, two pairs remain, the settings agree
    assert main(["methods", "--tracking-uri", uri, "--where", "train.max_steps=30", "--out", str(out)]) == 0
    table = pd.read_csv(out / "methods.csv").set_index("method")
    assert table.loc["graft", "paired seeds"] == 2 and table.loc["graft", "seeds"] == 2
    assert "the compared jobs have the same settings besides method and seed" in capsys.readouterr().err
    assert main(["methods", "--tracking-uri", uri, "--where", "method=graft", "--out", str(out)]) == 2


def test_the_reference_is_the_setting_s(new_store, tmp_path, capsys):
    """``compare_to`` (the multirun's and the sweep's reference): each method against it."""
    uri, jobs = write_store(new_store, tmp_path)
    summary.print_jobs(uri, jobs, "multirun of 6 jobs: results", reference="graft")
    out = capsys.readouterr().out
    assert "paired vs graft" in out and "-5.83 [-9.42, -2.25] (n=3)" in out
    assert re.search(r"graft +│ +3 │ .*│ +reference │", out), out


@pytest.mark.parametrize(("scores", "where", "said"), [
    (SCORES, ["--where", "train.max_step=30"], r"--where train.max_step: no job has that setting \(e.g. train.max_steps"),
    (SCORES, ["--where", "train.max_steps=7"], (r"no finished job matches: 6 finished jobs in graft/\*, none with "
                                              r"train.max_steps=7")),
    (SCORES, ["--where", "method=graft"], r"the 3 finished jobs selected are all method=graft: a comparison needs two"),
    ({k: v for k, v in SCORES.items() if (k[0] == "graft") == (k[1] == 2)}, [],
     r"the methods share no seed: graft \(seeds 2\); grpo_n8 \(seeds 0, 1\); run them with the same seeds"),
])
def test_analysis_methods_says_why_there_is_nothing_to_compare(new_store, tmp_path, capsys, scores, where, said):
    from analysis.__main__ import main

    uri, _ = write_store(new_store, tmp_path, scores)
    out = tmp_path / "reports"
    assert main(["methods", "--tracking-uri", uri, *where, "--out", str(out)]) == 2
    printed = " ".join(capsys.readouterr().err.split())
    assert re.search(said, printed), printed
    assert "Traceback" not in printed and not out.exists()


def test_analysis_methods_draws_each_seed_and_the_interval(new_store, tmp_path):
    import pandas as pd

    from analysis.__main__ import main

    uri, _ = write_store(new_store, tmp_path)
    out = tmp_path / "reports"
    assert main(["methods", "--tracking-uri", uri, "--out", str(out)]) == 0
    assert (out / "methods_figure.png").read_bytes()[:4] == b"\x89PNG" and (out / "methods_figure.pdf").stat().st_size
    points = pd.read_csv(out / "methods_figure.csv")
    assert len(points) == 6 and sorted(points["pair score %"].round(2)) == [37.5, 45.0, 45.0, 45.0, 50.0, 50.0]


@pytest.mark.parametrize("unit, amount, shown, label", [("gpu_hours", "0.01", r"0\.01", "GPU-h"),
                                                          ("flops", "2.5e12", r"2\.5e\+12", "FLOPs")])
def test_jobs_under_a_budget_show_what_it_bought(new_store, tmp_path, capsys, unit, amount, shown, label):
    """Jobs that ran under a budget (equal compute: App. D's GPU-hours or the counted FLOPs): the comparison
    says so, in which unit, and shows the budget and the steps it bought per method."""
    from graft_exp import schema

    uri, jobs = write_store(new_store, tmp_path)
    client = MlflowClient(uri)
    for _, key in jobs:
        run = tracking.find_run(client, key)
        client.set_tag(run.info.run_id, schema.budget_tag(unit), amount)
        client.set_tag(run.info.run_id, schema.LAST_STEP, "12" if key.startswith("graft") else "20")
    summary.print_jobs(uri, jobs, "multirun of 6 jobs: results")
    out = capsys.readouterr().out
    assert f"at equal compute: each job trained until its budget ({label}) ran out" in " ".join(out.split())
    assert re.search(rf"graft +│ +3 │ .* │ +0\.0200 │ +{shown} │ +12-12 │", out), out
    assert re.search(rf"grpo_n8 +│ +3 │ .* │ +0\.0100 │ +{shown} │ +20-20 │", out), out


def test_analysis_methods_compares_any_setting_and_a_sweep_file_s_jobs(new_store, tmp_path, capsys):
    """``--by KEY`` compares the values of any setting, paired by seed (here method.delta, which follows the
    method in this store); ``--sweep FILE`` keeps the jobs that file composes, in its study's experiment."""
    import pandas as pd

    from analysis.__main__ import main

    uri, _ = write_store(new_store, tmp_path)
    out = tmp_path / "reports"
    assert main(["methods", "--tracking-uri", uri, "--by", "method.delta", "--reference", "method.delta=0.8",
                 "--out", str(out)]) == 0
    table = pd.read_csv(out / "methods.csv").set_index("method")
    assert table.loc["method.delta=0.7", "delta"] == pytest.approx(5.8333, abs=1e-3)
    assert "paired vs method.delta=0.8" in " ".join(capsys.readouterr().err.split())
    assert main(["methods", "--tracking-uri", uri, "--by", "method.delt", "--out", str(out)]) == 2
    assert "--by method.delt: no job has that setting (e.g. method.delta" in " ".join(capsys.readouterr().err.split())
    sweep = tmp_path / "compare.yaml"
    sweep.write_text("study: compare\nruns:\n  - {method: [graft, grpo_n8], seed: [0, 1]}\n")
    assert main(["methods", "--tracking-uri", uri, "--sweep", str(sweep), "--out", str(out)]) == 2
    assert "no finished job matches: 0 finished jobs in graft/compare" in " ".join(capsys.readouterr().err.split())


def test_the_compared_setting_is_no_difference_in_settings():
    """``analysis methods --by train.max_steps`` compares jobs by that setting: it is what they are compared by,
    not a difference to warn about; another setting that differs still is."""
    from types import SimpleNamespace

    from graft_exp.launching.comparison import differing_settings

    jobs = [SimpleNamespace(params={"train.max_steps": steps, "train.lr": lr, "seed": seed, "method.name": "graft"})
            for steps, lr, seed in (("10", "1e-6", "0"), ("20", "1e-6", "1"), ("20", "2e-6", "0"))]
    assert differing_settings(jobs) == ["train.lr: 1e-6, 2e-6", "train.max_steps: 10, 20"]
    assert differing_settings(jobs, by="train.max_steps") == ["train.lr: 1e-6, 2e-6"]


def test_a_comparison_that_fails_says_so_in_one_line_with_the_command_that_redoes_it(new_store, tmp_path, capsys,
                                                                                    monkeypatch):
    """rliable's bootstrap failing (here: made to fail) loses no run: the jobs table is printed, then one line naming
    the command that compares the same runs from the store, and the caller exits non-zero (print_jobs: False)."""
    uri, jobs = write_store(new_store, tmp_path)

    def fails(*_):
        raise ValueError("bootstrap\nfailed")

    monkeypatch.setattr(comparison, "rliable_measures", fails)
    assert summary.print_jobs(uri, jobs, "multirun of 6 jobs: results") is False
    out = capsys.readouterr().out
    assert "multirun of 6 jobs: results" in out and "Traceback" not in out
    (line,) = [line for line in out.splitlines() if "comparison failed" in line]
    assert line == (f"the comparison failed: ValueError: bootstrap failed; the runs are recorded, compare them with: "
                    f"python -m analysis methods --tracking-uri {uri} --experiment graft/compare")
