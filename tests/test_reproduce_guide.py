"""Every command of docs/reproduce.md, read from the page (as test_adding_a_method reads its page), each exercised:
run where it runs here, validated and planned where the run needs what CI lacks (GPU nodes, the hub, the cluster's
tracking server). What each case stands in for is said beside it. A command added to the page fails
``test_every_command_of_the_guide_is_exercised`` until a case here covers it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from support.paper_standins import prepare_data, prepare_models

from graft_exp import preflight, resources
from graft_exp.config import validate_job

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "reproduce.md"


def guide_commands() -> list[str]:
    """Each command line of the guide's ``bash`` blocks, its comment dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


COMMANDS = guide_commands()


def case_of(command: str) -> str:
    """The case of this module that exercises ``command``."""
    words = shlex.split(command)
    if words[:2] == ["pip", "install"]:
        return "pip"
    if words[:2] == ["python", "-m"]:
        return words[2] + (f" {words[3]}" if words[2] == "analysis" else "")
    return "unknown"


CASES = {"pip", "graft_exp.prepare", "graft_exp.plan", "graft_exp.preflight", "graft_exp.sweep", "analysis tables",
         "analysis compare"}


def test_every_command_of_the_guide_is_exercised():
    assert len(COMMANDS) >= 10
    assert {case_of(c) for c in COMMANDS} <= CASES, [c for c in COMMANDS if case_of(c) not in CASES]


def of_case(case: str) -> list[str]:
    return [c for c in COMMANDS if case_of(c) == case]


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> dict[str, str]:
    """The paper's data and models as prepare leaves them (tokenizers and revision records; no weights), where
    the guide's commands find them (GRAFT_DATA_DIR, GRAFT_MODEL_DIR)."""
    root = tmp_path_factory.mktemp("prepared")
    prepare_data(root / "data")
    prepare_models(root / "models")
    return {"GRAFT_DATA_DIR": str(root / "data"), "GRAFT_MODEL_DIR": str(root / "models")}


def run(command: str, cwd: Path, env: dict[str, str], *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    words = [sys.executable if w == "python" else w for w in shlex.split(command)]
    return subprocess.run([*words, *extra], cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_pip_lines_name_the_project_s_extras_and_pins():
    """Installing is CI's own first step (README's command); the guide's lines name extras and pins that exist."""
    extras_known = set(metadata.metadata("graft-exp").get_all("Provides-Extra"))
    for command in of_case("pip"):
        words = shlex.split(command)
        if "-e" in words:
            extras = re.search(r"\[(.*)\]", words[words.index("-e") + 1]).group(1).split(",")
            assert set(extras) <= extras_known, command
        else:
            (pinned,) = [w for w in words if "==" in w]
            dist = pinned.split("==")[0]
            assert str(preflight.requirement(dist, "verl", gpu=True)) == pinned, command


def test_prepare_is_validated_here_its_downloads_need_the_hub(tmp_path):
    (command,) = of_case("graft_exp.prepare")
    done = run(command, tmp_path, {}, "--help")
    assert done.returncode == 0 and "--data-dir" in done.stdout and "--model-dir" in done.stdout


@pytest.mark.slow
def test_plan_runs_as_written(standins, tmp_path):
    for command in of_case("graft_exp.plan"):
        done = run(command, tmp_path, standins)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "slurm request: --nodes=1 --gpus-per-node=4" in done.stdout and "peak disk per job" in done.stdout


@pytest.mark.slow
def test_preflight_commands_validate_and_plan_their_miniature(standins, tmp_path, monkeypatch):
    """The preflight's own checks before it launches (composed, shrunk, validated, planned), on the stand-ins; its
    run needs GPU nodes (pair1) or is test_preflight's (the tiny pair, there through the private Slurm)."""
    for key, value in standins.items():
        monkeypatch.setenv(key, value)
    for command in of_case("graft_exp.preflight"):
        overrides = shlex.split(command)[3:]
        full = preflight.compose(overrides)
        cfg = preflight.compose([*overrides, *preflight.miniature(full, tmp_path / "ckpt")])
        validate_job(cfg)
        resources.check(resources.job_plan(cfg), cfg)
        assert int(cfg.train.max_steps) == 2 and cfg.pair.name == full.pair.name


@pytest.mark.slow
def test_sweep_commands_plan_and_validate_every_job_they_would_submit(standins, tmp_path, monkeypatch, capsys):
    """Each submission as a dry run, in this process (``python -m graft_exp.sweep``'s own ``main``: every job
    composed, validated and planned, its state read from the store): ``tracking=server`` stands for the cluster's
    server, here a SQLite store of the same schema."""
    from graft_exp.sweep.__main__ import main as sweep_main

    for key, value in standins.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    for command in of_case("graft_exp.sweep"):
        words = [w for w in shlex.split(command)[3:] if w not in ("tracking=server", "--dry-run")]
        uri = f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"
        assert sweep_main([*words, "--dry-run", uri, "--out", str(tmp_path / "multirun")]) == 0, capsys.readouterr()
        out = " ".join(capsys.readouterr().out.split())
        jobs = int(re.search(r"(\d+) jobs?:", out).group(1))
        assert jobs == (2 if "method=graft,grpo_n8" in command else 15 if "--only" not in command else 6), out[-2000:]
        if "--only" not in command:   # the page's "Cost" table is what the dry run totals
            total = re.search(r"GPU-hours: ([\d.]+) to run.*?: ([\d.]+) h summed over the jobs to run, the longest "
                              r"([\d.]+) h", out)
            gpu_hours, wall, longest = (float(g) for g in total.groups())
            row = f"| {jobs} | {gpu_hours:.0f} | {wall:.0f} h | {longest:.1f} h"
            assert row in GUIDE.read_text(), (row, out[-600:])


@pytest.mark.slow
def test_the_table_commands_run_on_a_store_of_the_main_study(tmp_path, new_store):
    """``tables`` then ``compare`` as written, on a store of paper-like runs (synthetic values, every study;
    the stability study's three seeds give Table 4's cells a verdict)."""
    from analysis.synthetic import paper_like_jobs, write_jobs

    uri = new_store(tmp_path)
    write_jobs(uri, paper_like_jobs(steps=10), tmp_path / "artifacts")
    for command in of_case("analysis tables") + of_case("analysis compare"):
        done = run(command, tmp_path, {"MLFLOW_TRACKING_URI": uri})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = tmp_path / "reports" / "main"
    assert (out / "main-results.csv").exists() and (out / "compare.csv").exists()
    report = (out / "reproduction.md").read_text()
    assert "| main-results |" in report and "not enough seeds" in report
