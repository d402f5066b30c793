"""Sweep files and ``python -m graft_exp.sweep``: every paper table's job list, shared GRPO
baselines trained once, dependencies, the fast composer against Hydra, and --dry-run / --status
against a real store holding finished, failed, crashed and missing runs."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from graft_exp import scheduler, tracking
from graft_exp.config import validate
from graft_exp.launching import status
from graft_exp.launching.jobs import Composer
from graft_exp.sweep import SweepError, expand, plan, replace
from graft_exp.sweep.__main__ import main as sweep_main
from graft_exp.sweep.launch import Launch, busy_cores, by_priority, exclusive_batch, launch_commands

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))
PAPER_MODELS = ("smollm3-3b-base", "qwen3-1.7b-base", "octothinker-3b-hybrid-base")


@pytest.fixture(scope="module")
def composer(tmp_path_factory):
    """One composer (fresh cache) for every sweep file of the module."""
    c = Composer([], cache_dir=tmp_path_factory.mktemp("compose-cache"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def sweeps(composer):
    return {path.stem: plan(path, [], composer) for path in SWEEPS}


#: A test that reads ``sweeps`` pays for planning every sweep file, each of its jobs composed: the slow tier.
plans_every_sweep = pytest.mark.slow


def methods(sweep, pair=None) -> set[str]:
    return {sj.job.cfg.method.name for sj in sweep.jobs if pair in (None, sj.job.cfg.pair.name)}


def test_expand_is_a_product_in_written_order():
    assert expand({"pair": ["pair1", "pair2"], "method": "graft", "seed": [0, 1]}) == [
        ("pair=pair1", "method=graft", "seed=0"), ("pair=pair1", "method=graft", "seed=1"),
        ("pair=pair2", "method=graft", "seed=0"), ("pair=pair2", "method=graft", "seed=1")]
    assert expand({"method": "graft", "method.delta": [0.7, None], "after": {"method": "x"}}) == [
        ("method=graft", "method.delta=0.7"), ("method=graft", "method.delta=null")]
    assert replace(("pair=pair1", "method=graft_stored", "seed=0"), {"method": "grpo_n8"}) == (
        "pair=pair1", "seed=0", "method=grpo_n8")


@pytest.mark.slow   # composes every job of every sweep file
def test_one_file_per_table_with_its_study(sweeps):
    assert set(sweeps) == {"main", "ablation", "alternatives", "delta", "stability", "stored",
                           "clip_dynamics", "compute", "tiny", "tiny_lr", "tiny3",
                           "tiny_decide", "tiny_decide_paired", "tiny_equal_compute", "tiny_transfers"}
    for name, sweep in sweeps.items():
        assert sweep.study == name
        for sj in sweep.jobs:   # the paper's sweep files run the paper's pairs on verl as shipped
            assert sj.job.cfg.backend.name == ("local" if sj.job.cfg.pair.name.startswith("tiny") else "verl")
            validate(sj.job.cfg)


@plans_every_sweep
def test_main_table_runs(sweeps):
    main = sweeps["main"]
    for pair in ("pair1", "pair2", "pair3"):
        assert {"hacpo", "sgt", "graft"} <= methods(main, pair)
    assert {sj.job.cfg.seed for sj in main.jobs} == {0}
    # Every paper model gets its GRPO n=8/16/32 baseline exactly once.
    trained = [(sj.job.cfg.pair[role], sj.job.cfg.method.name) for sj in main.jobs if sj.job.single_model
               for role in sj.roles]
    baselines = ("grpo_n8", "grpo_n16", "grpo_n32")
    assert sorted(trained) == sorted((m, g) for m in PAPER_MODELS for g in baselines)
    assert len(main.shared) == 3      # pair3's GRPO jobs: both models trained by pair1/pair2 jobs


@plans_every_sweep
def test_shared_baseline_jobs_run_after_the_job_that_trains_the_model(sweeps):
    main = sweeps["main"]
    by_label = {sj.job.label: sj for sj in main.jobs}
    pair2 = by_label["pair=pair2 backend=verl method=grpo_n8 seed=0"]
    assert pair2.roles == ("A",)
    assert [f.job.label for f in pair2.follows] == ["pair=pair1 backend=verl method=grpo_n8 seed=0"]


@plans_every_sweep
def test_table_job_lists(sweeps):
    assert methods(sweeps["ablation"]) == {
        "graft", "graft_no_gate", "graft_no_floor", "graft_no_balance", "graft_seq_ratio",
        "graft_random_prompts", "graft_random_admission", "graft_peer_first", "graft_peer_uniform", "grpo_n8"}
    assert methods(sweeps["alternatives"]) == {
        "graft", "graft_pooled", "graft_success_only", "graft_success_only_no_floor", "hacpo_which",
        "sgt_which", "graft_no_balance", "graft_luffy", "hacpo", "sgt", "grpo_n8"}
    deltas = {sj.job.cfg.method.delta for sj in sweeps["delta"].jobs if sj.job.cfg.method.name == "graft"}
    assert deltas == {0.7, 0.8, 0.9} and "graft_no_floor" in methods(sweeps["delta"])
    stability = sweeps["stability"]
    pair1 = {(sj.job.cfg.method.name, sj.job.cfg.seed) for sj in stability.jobs
             if sj.job.cfg.pair.name == "pair1"}
    assert pair1 == {(m, s) for m in ("grpo_n8", "graft") for s in (0, 1, 2)}
    assert methods(sweeps["clip_dynamics"]) == {"graft", "graft_peer_first", "graft_peer_uniform"}
    assert methods(sweeps["compute"]) == {"grpo_n8", "grpo_n16", "grpo_n32", "grpo_ds", "hacpo", "sgt",
                                          "graft", "graft_stored"}
    for name in ("ablation", "alternatives", "delta", "clip_dynamics", "compute"):
        assert {sj.job.cfg.pair.name for sj in sweeps[name].jobs} == {"pair1"}


@plans_every_sweep
def test_group_study_jobs_and_their_launch_commands(sweeps, tmp_path):
    """sweeps/tiny3.yaml: per model GRPO n=8, GRAFT with each single peer, GRAFT with both peers per source
    rule. A group's multirun is launched with ``group=...`` (no pair config has the group's name)."""
    study = sweeps["tiny3"]
    jobs = {(sj.job.cfg.pair.name, sj.job.cfg.method.name, sj.job.cfg.method.source_rule) for sj in study.jobs}
    assert jobs == {("tiny3", "graft", rule) for rule in ("most_successes", "compatibility", "random")} | {
        ("tiny3", "grpo_n8", "most_successes")} | {(p, "graft", "most_successes") for p in ("tiny", "tiny_ac", "tiny_bc")}
    assert {sj.job.cfg.seed for sj in study.jobs} == set(range(5)) and len(study.jobs) == 35
    commands = launch_commands(study, study.jobs, [], tmp_path)
    assert [c[0][4] for c in commands] == ["group=tiny3", "pair=tiny", "pair=tiny_ac", "pair=tiny_bc"]
    group_jobs = sorted((commands[0][1] / "jobs" / "sweep_job").glob("*.yaml"))
    settings = [line for p in group_jobs for line in p.read_text().splitlines() if not line.startswith("#")]
    assert len(group_jobs) == 20 and not any("group" in line or "pair" in line for line in settings)


@plans_every_sweep
def test_same_config_is_the_same_run_across_sweeps(sweeps):
    """Full GRAFT on pair 1 is one run for the main table, the ablations and the delta sweep
    (method.delta=0.8 is the default), so whichever sweep trains it, the others find it."""
    labels = ("pair=pair1 backend=verl method=graft seed=0", "pair=pair1 backend=verl method=graft method.delta=0.8 seed=0")

    def graft_key(sweep):
        return {sj.key for sj in sweep.jobs if sj.job.label in labels}
    keys = [graft_key(sweeps[name]) for name in ("main", "ablation", "delta", "clip_dynamics", "compute")]
    assert all(k == keys[0] and len(k) == 1 for k in keys)


@plans_every_sweep
def test_stored_runs_wait_for_the_grpo_runs_they_replay(sweeps):
    for name in ("stored", "compute"):
        for sj in sweeps[name].jobs:
            if sj.job.cfg.method.name != "graft_stored":
                continue
            pair = sj.job.cfg.pair
            needed = {(n.job.cfg.pair[r], n.job.cfg.method.name, n.job.cfg.seed)
                      for n in sj.needs for r in n.roles}
            assert {(pair.A, "grpo_n8", sj.job.cfg.seed), (pair.B, "grpo_n8", sj.job.cfg.seed)} <= needed


@plans_every_sweep
def test_jobs_that_others_need_are_launched_first(sweeps):
    """The tiny study's GRPO n=8 runs train first, so each graft_stored job can take the first core
    that frees after its log exists instead of waiting for every other job to end."""
    tiny = sweeps["tiny"]
    order = [sj.job.cfg.method.name for sj in by_priority(tiny, tiny.jobs)]
    assert order[:5] == ["grpo_n8"] * 5 and order[-5:] == ["graft_stored"] * 5
    rest = [sj for sj in by_priority(tiny, tiny.jobs) if sj.job.cfg.method.name != "grpo_n8"]
    assert [sj.index for sj in rest] == sorted(sj.index for sj in rest)   # then the file's order


def test_a_multiruns_tail_frees_its_cores():
    """An exclusive cluster's multirun occupies its workers until fewer jobs than workers are left;
    jobs launched but not started yet (no run) hold a core too."""
    states = {"a": (status.DONE, None), "b": (status.RUNNING, None), "c": (status.FAILED, None),
              "d": (status.MISSING, None), "e": (status.CRASHED, None)}
    wave = Launch(proc=None, keys=["a", "b", "c", "d", "e"], workers=4)
    assert busy_cores([wave], states) == 2
    assert busy_cores([wave, Launch(proc=None, keys=["d"], workers=1)], states) == 3
    assert busy_cores([Launch(proc=None, keys=["a", "c"], workers=2)], states) == 0


@plans_every_sweep
def test_an_exclusive_cluster_starts_one_multirun_at_a_time(sweeps):
    """Ready jobs of several pairs and a group on 2 idle cores: one multirun (the first pair or group's
    jobs, 2 workers), not one per pair each taking both cores; a tail takes as many jobs as idle cores."""
    ready = sweeps["tiny3"].jobs
    first = exclusive_batch(ready, 2, tail=False)
    assert {sj.job.cfg.pair.name for sj in first} == {"tiny3"} and len(first) == 20
    assert len(exclusive_batch(ready, 1, tail=True)) == 1
    later = exclusive_batch([sj for sj in ready if sj.job.cfg.pair.name != "tiny3"], 2, tail=True)
    assert len(later) == 2 and len({sj.job.cfg.pair.name for sj in later}) == 1


@plans_every_sweep
def test_gpu_hours_estimate_from_the_paper(sweeps):
    compute = {sj.job.cfg.method.name: sj.gpu_hours for sj in sweeps["compute"].jobs}
    # App. D: GRPO n=8 both models 29.9, GRAFT 43.3 GPU-hours for three epochs on pair 1.
    assert compute["grpo_n8"] == pytest.approx(29.9) and compute["graft"] == pytest.approx(43.3)


@pytest.mark.slow
def test_fast_composition_equals_hydra(sweeps, composer):
    """The composer's grafted configs give every job of every sweep Hydra's own run_key."""
    seen = set()
    for sweep in sweeps.values():
        for sj in sweep.jobs:
            if sj.key in seen:
                continue
            seen.add(sj.key)
            assert tracking.run_key(composer._full(list(sj.job.overrides))) == sj.key, sj.job.label


@pytest.mark.parametrize("override", ["study=other", "pair=tiny", "seed=3"])
def test_keys_the_sweep_file_sets_cannot_be_overridden(override):
    with pytest.raises(SweepError, match=override.split("=")[0]):
        plan(ROOT / "sweeps" / "main.yaml", [override])


def test_only_selects_a_pair_or_methods_of_a_sweep_file_with_the_jobs_they_need():
    """sweeps/stored.yaml on one pair and one method: GRAFT with stored trajectories and the GRPO runs it replays."""
    sweep = plan(ROOT / "sweeps" / "stored.yaml", [], only=["pair=pair1", "method=graft_stored"])
    jobs = {(sj.job.cfg.pair.name, sj.job.cfg.method.name) for sj in sweep.jobs}
    assert jobs == {("pair1", "graft_stored"), ("pair1", "grpo_n8")}
    (stored,) = [sj for sj in sweep.jobs if sj.job.cfg.method.name == "graft_stored"]
    assert {n.job.cfg.method.name for n in stored.needs} == {"grpo_n8"}
    with pytest.raises(SweepError, match="no job of .* has these values"):
        plan(ROOT / "sweeps" / "main.yaml", [], only=["pair=pair9"])
    with pytest.raises(SweepError, match="with a key .* sweeps"):
        plan(ROOT / "sweeps" / "main.yaml", [], only=["train.lr=1e-5"])


# ---------------------------------------------------------------------------------------------
# --dry-run and --status on a real store


TINY_SWEEP = """\
study: tinytable
runs:
  - {pair: tiny, method: [graft, sgt, hacpo, grpo_n8], seed: [0, 1]}
"""


def run_cli(capsys, *args) -> str:
    """``python -m graft_exp.sweep ARGS`` in this process (its ``main``): what it printed."""
    capsys.readouterr()
    assert sweep_main(list(args)) == 0, capsys.readouterr().out
    return capsys.readouterr().out


@pytest.mark.slow   # plans and reads the states of an 8-job sweep twice
def test_dry_run_and_status_count_finished_failed_crashed_missing(tmp_path, store_template, capsys, monkeypatch):
    shutil.copy(store_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "tiny.yaml").write_text(TINY_SWEEP)
    sweep = plan(tmp_path / "tiny.yaml", [f"tracking.uri={uri}"])
    assert len(sweep.jobs) == 8
    by_label = {sj.job.label: sj for sj in sweep.jobs}
    client = MlflowClient(uri)
    # seed 0 of graft trained under another study: found by its run_key all the same.
    finished = by_label["pair=tiny method=graft seed=0"]
    other_study = tracking.ensure_store(uri, "graft/main")
    client.set_terminated(client.create_run(other_study, tags={"graft.run_key": finished.key}).info.run_id)
    exp = tracking.ensure_store(uri, "graft/tinytable")
    failed = by_label["pair=tiny method=sgt seed=0"]
    run = client.create_run(exp, tags={"graft.run_key": failed.key, "graft.log": "/logs/sgt-0.log"})
    client.set_terminated(run.info.run_id, "FAILED")
    crashed = by_label["pair=tiny method=hacpo seed=0"]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    client.create_run(exp, tags={"graft.run_key": crashed.key, "graft.log": "/logs/hacpo-0.log",
                                 "graft.host": socket.gethostname(), "graft.pid": str(dead.pid)})
    running = by_label["pair=tiny method=grpo_n8 seed=0"]
    client.create_run(exp, tags={"graft.run_key": running.key, "graft.host": socket.gethostname(),
                                 "graft.pid": str(os.getpid())})

    started = time.monotonic()
    monkeypatch.chdir(tmp_path)
    dry = run_cli(capsys, str(tmp_path / "tiny.yaml"), "--dry-run", f"tracking.uri={uri}")
    elapsed = time.monotonic() - started
    # MLflow alone cannot tell a crashed RUNNING run from a live one: both count as running.
    assert "8 jobs: 1 finished, 2 running, 0 pending, 0 held, 1 failed, 4 missing" in dry
    assert elapsed < 60

    states = run_cli(capsys, str(tmp_path / "tiny.yaml"), "--status", f"tracking.uri={uri}")
    assert "8 jobs: 1 finished, 1 running, 0 pending, 0 held, 2 failed, 4 missing" in states
    assert f"failed #{failed.index} pair=tiny method=sgt seed=0: log /logs/sgt-0.log" in states
    assert f"crashed #{crashed.index} pair=tiny method=hacpo seed=0: log /logs/hacpo-0.log" in states


def test_a_job_slurm_holds_is_held_with_the_way_out_not_pending():
    """Slurm holds a job whose launch failed ("launch failed requeued held") until a person acts: the
    sweep reports it held, with scontrol release / scancel, and does not wait for it."""
    for reason in ("launch_failed_requeued_held", "launch failed requeued held", "JobHeldAdmin", "JobHeldUser"):
        assert scheduler.queue_state("PENDING", reason) == scheduler.SLURM_HELD
    assert scheduler.queue_state("PENDING", "Resources") == "PENDING"
    assert scheduler.queue_state("RUNNING", "None") == "RUNNING"
    run = {"status": "RUNNING", "slurm_job_id": "42_3", "log": "/logs/42_3.out"}
    state, hint = status.run_state(run, {"42_3": scheduler.SLURM_HELD})
    assert state == status.HELD
    assert "scontrol release 42_3" in hint and "scancel 42_3" in hint
    assert status.HELD not in status.TO_SUBMIT   # still in the queue: never submitted twice


# ---------------------------------------------------------------------------------------------
# Checks in the launching process, before anything is submitted


def launch(tmp_path, *overrides) -> subprocess.CompletedProcess:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return subprocess.run([sys.executable, "-m", "graft_exp", "-m", f"tracking.uri={uri}",
                           f"hydra.sweep.dir={tmp_path / 'multirun'}", *overrides],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)


@pytest.mark.slow   # a python -m graft_exp -m launch
def test_one_invalid_job_stops_the_whole_multirun(tmp_path, store_template):
    shutil.copy(store_template, tmp_path / "mlflow.db")
    done = launch(tmp_path, "cluster=submitit_local", "method=graft", "method.delta=0.5,1.5")
    assert done.returncode == 2
    assert "invalid configuration, nothing launched" in done.stdout + done.stderr
    assert "method.delta=1.5" in done.stdout + done.stderr
    assert not (tmp_path / "multirun" / ".submitit").exists()


@pytest.mark.slow   # a python -m graft_exp -m launch
def test_parallel_jobs_sharing_a_grpo_baseline_are_refused(tmp_path, store_template):
    shutil.copy(store_template, tmp_path / "mlflow.db")
    # Two pairs holding the same model (as pair1 and pair2 hold Qwen3), on the CPU test bed.
    done = launch(tmp_path, "cluster=submitit_local", "pair.name=tiny,tiny_again", "method=grpo_n8")
    assert done.returncode == 2
    assert "both train tiny-char-llama (grpo_n8, seed 0)" in done.stdout + done.stderr
    assert not (tmp_path / "multirun" / ".submitit").exists()


@pytest.mark.parametrize("unit, setting", [(None, "train.gpu_hours_of"), ("flops", "train.flops_of")])
def test_compute_of_budgets_each_job_by_its_reference_in_the_unit_asked(tmp_path, unit, setting):
    """``compute_of`` names the reference job; ``compute_unit`` (gpu_hours by default, or flops) says which of
    its recorded costs is the budget: the budgeted job carries the reference's key in that unit's setting."""
    grid = "{method: graft, seed: 0, compute_of: {method: grpo_n8}" + (f", compute_unit: {unit}}}" if unit else "}")
    path = tmp_path / "equal.yaml"
    path.write_text(f"study: equal\nruns:\n  - {{method: grpo_n8, seed: 0}}\n  - {grid}\n")
    sweep = plan(path, [])
    reference, budgeted = (sj.job for sj in sweep.jobs)
    assert f"{setting}={reference.key}" in budgeted.overrides
    assert budgeted.cfg.train[setting.split(".")[1]] == reference.key


@pytest.mark.parametrize("grid, message", [
    ("{method: graft, compute_of: {method: grpo_n8}, compute_unit: tokens}",
     r"runs\[0\].compute_unit='tokens': no job records cost/tokens; a budget is in gpu_hours or flops"),
    ("{method: graft, compute_unit: flops}", r"runs\[0\].compute_unit=flops without compute_of"),
    ("{method: graft, compute_of: {method: grpo_n8}, train.max_flops: 1.0e12}",
     r"runs\[0\] sets both compute_of and train.max_flops; keep one of them"),
])
def test_a_budget_in_a_unit_no_job_records_fails_at_planning(tmp_path, grid, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"study: bad\nruns:\n  - {grid}\n")
    with pytest.raises(SweepError, match=message):
        plan(path, [])
