"""``python -m graft_exp.preflight``: the tiny pair's job in miniature through the in-process launcher, its report
from what the job recorded, kept out of every analysis; and each check failing for its own cause, with the line
that says what to change."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from graft_exp import preflight, resources, schema
from graft_exp.preflight import FAIL, NOT_HERE, PASS

ROOT = Path(__file__).resolve().parents[1]


def run_preflight(tmp_path: Path, new_store, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    uri = new_store(tmp_path)
    done = subprocess.run([sys.executable, "-m", "graft_exp.preflight", f"tracking.uri={uri}",
                           f"checkpoint_root={tmp_path}/ckpt", "backend.progress=false", *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    return done, uri


@pytest.mark.slow
@pytest.mark.service
def test_the_tiny_pair_passes_its_preflight_through_slurm_and_no_analysis_sees_it(tmp_path, new_store, slurm,
                                                                               monkeypatch):
    """Submitted as the user's would be: ``cluster=slurm``, the job on a node of the private cluster, the store and
    the checkpoint folder on the file system it shares with the submitting machine."""
    from analysis.store import StoreUnavailable, graft_experiments

    monkeypatch.chdir(tmp_path)
    done, uri = run_preflight(tmp_path, new_store, "cluster=slurm", "cluster.poll_s=2", *slurm.launcher_overrides)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name.startswith("graft-preflight/")]
    (job,) = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert job.data.tags[preflight.PREFLIGHT_TAG] == PASS and job.info.status == "FINISHED"
    assert job.data.tags["graft.slurm_job_id"]   # it ran as a Slurm job
    report = Path(client.download_artifacts(job.info.run_id, "preflight/report.md", str(tmp_path)))
    rows = {(line.split("|")[1].strip(), line.split("|")[2].strip()): line.split("|")[3].strip()
            for line in report.read_text().splitlines()[2:]}
    for model in ("tiny-char-llama", "tiny-bpe-gpt2"):
        assert rows["prompt", model] == rows["stopping", model] == PASS
        assert rows["weight sync", model] == NOT_HERE     # one engine on the local backend: never a pass
    assert rows["job", "job"] == rows["tracking", "job"] == rows["checkpoint", "job"] == PASS
    assert rows["host memory", "job"] == NOT_HERE   # the job ran on a node: sacct's MaxRSS, not this process's
    assert rows["checkpoint time", "job"] == PASS and job.data.tags[schema.SIGNAL_LEAD] == "120"   # Slurm's USR2 lead
    assert rows["package torch", "job"] == PASS and rows["time", "job"] == "info"   # no App. D figure for CPU pairs
    assert "generated tokens per device-s" in report.read_text()
    assert "preflight" in done.stdout and "tiny-char-llama" in done.stdout
    for model in ("tiny-char-llama", "tiny-bpe-gpt2"):   # each pool's shares of step 2; no MFU without a GPU
        assert rows["timeline", model] == "info" and rows["MFU", model] == NOT_HERE
    assert "wait" in report.read_text() and "of a" in report.read_text()
    # the plan now projects the job from what the preflight measured, not from App. D
    step = float(job.data.tags[schema.PREFLIGHT_STEP_S])
    plan = subprocess.run([sys.executable, "-m", "graft_exp.plan", f"tracking.uri={uri}"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)
    assert plan.returncode == 0 and step > 0, plan.stderr
    assert re.search(r"cost: ~[\d.]+ GPU-h, ~[\d.]+ h wall \(30 steps; measured by the preflight of \d{4}-\d\d-\d\d on ",
                     plan.stdout), plan.stdout
    with pytest.raises(StoreUnavailable, match="no experiment whose name starts with 'graft/'"):
        graft_experiments(client, None)   # the analysis, comparisons and run lookups read graft/ only


@pytest.mark.slow
def test_responses_that_never_stop_fail_the_stopping_check(tmp_path, new_store):
    """A response limit with no room for an answer: nothing ends on a stop id."""
    done, _ = run_preflight(tmp_path, new_store, "train.max_response_length=2")
    assert done.returncode == 1
    assert "fail stopping (tiny-char-llama): responses do not stop" in " ".join(done.stdout.split())


def test_a_dead_store_stops_the_preflight_before_anything_runs(tmp_path, monkeypatch, capsys):
    """In this process: the module's own runs (``run_preflight``) show the exit code reaching the shell."""
    monkeypatch.chdir(tmp_path)
    rc = preflight.main(["tracking.uri=http://127.0.0.1:9", f"checkpoint_root={tmp_path}/ckpt"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("preflight: ") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_library_at_another_version_fails_with_its_install_line():
    env = {schema.ENV_LIBRARY_TAGS["torch"]: "2.11.0", schema.ENV_LIBRARY_TAGS["transformers"]: "5.9.0",
           schema.ENV_LIBRARY_TAGS["mlflow"]: "3.16.0", schema.ENV_LIBRARY_TAGS["math-verify"]: "0.9.0"}
    rows = {r.check: r for r in preflight.check_packages(env, "local")}
    assert rows["package mlflow"].status == FAIL and rows["package mlflow"].fix == \
        "pip install 'mlflow[auth]==3.17.2' in the job's environment"
    assert rows["package torch"].status == PASS
    on_a_gpu = {**env, schema.ENV_GPU: "NVIDIA H200", schema.ENV_LIBRARY_TAGS["flash-attn"]: "none",
                schema.ENV_LIBRARY_TAGS["vllm"]: "0.24.0", schema.ENV_LIBRARY_TAGS["verl"]: "0.9.1",
                schema.ENV_LIBRARY_TAGS["ray"]: "2.60.0"}
    rows = {r.check: r for r in preflight.check_packages(on_a_gpu, "verl")}
    assert rows["package flash-attn"].status == FAIL and "flash-attn==2.8.3" in rows["package flash-attn"].fix
    assert rows["package vllm"].status == rows["package torch"].status == PASS   # the verl extra's pins on a GPU
    rows = {r.check: r for r in preflight.check_packages({**env, schema.ENV_LIBRARY_TAGS["vllm"]: "none"}, "verl")}
    assert rows["package vllm"].status == rows["package flash-attn"].status == NOT_HERE   # no GPU: never a pass


def test_a_sync_that_delivers_nothing_fails_the_weight_sync_check():
    """vLLM's log-probs of the responses it sampled against the trainer's: the same weights give a gap of kernel
    noise; weights the engine never received (those of another update) give the update's effect."""
    from verl import DataProto

    from graft_exp.backends.verl import batch as vb

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 50, generator=generator)
    tokens = torch.randint(0, 50, (4, 6), generator=generator)
    trainer = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    stale = torch.log_softmax(logits + 0.8 * torch.randn(4, 6, 50, generator=generator), -1).gather(
        -1, tokens[..., None])[..., 0]
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[0, 4:] = 0

    def gap(rollout):
        batch = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "old_log_probs": trainer,
                                             "response_mask": mask})
        return vb.logprob_gap(batch)

    synced, unsynced = gap(trainer + 1e-3 * torch.randn(4, 6, generator=generator)), gap(stale)
    assert synced < 2e-3 and unsynced > preflight.SYNC_GAP_BOUND
    assert preflight.check_sync("qwen3-1.7b-base", {1: synced, 2: synced}).status == PASS
    failed = preflight.check_sync("qwen3-1.7b-base", {1: synced, 2: unsynced})
    assert failed.status == FAIL and "weight sync" in failed.fix
    assert vb.logprob_gap(DataProto.from_dict(tensors={"old_log_probs": trainer, "response_mask": mask})) is None
    # one small update not delivered (vLLM's CPU engine, the tiny models: 1e-4 on step 1, 0.0115 on step 2):
    # far below the absolute bound, but many times the engines' own noise on step 1
    assert preflight.check_sync("tiny-qwen3-vocab", {1: 1e-4, 2: 4e-4}).status == PASS
    assert preflight.check_sync("tiny-qwen3-vocab", {1: 1e-4, 2: 0.0115}).status == FAIL


def test_a_plan_below_the_measured_peak_fails(compose_cfg):
    plan = resources.job_plan(compose_cfg())
    assert preflight.check_host_memory(plan.slurm["mem_gb"] - 0.5, plan).status == PASS
    over = preflight.check_host_memory(plan.slurm["mem_gb"] + 0.5, plan)
    assert over.status == FAIL and "raise it" in over.fix
    assert preflight.check_host_memory(None, plan).status == NOT_HERE


def test_a_trainer_above_the_plan_s_gpu_memory_fails(compose_cfg):
    """verl's update reports the trainer's peak reserved memory (train/gpu_peak_reserved_gb): against the plan's
    per-GPU train term of each model of pair 1 (0 GiB on a CPU: not measurable)."""
    cfg = compose_cfg("pair=pair1", "backend=verl", "cluster=slurm")
    plan = resources.job_plan(cfg)
    on_gpu = {schema.ENV_GPU: "NVIDIA H200"}
    terms = {pool.model: pool.gpu_mem_gb.train for pool in plan.pools}
    rows = preflight.check_gpu_memory(on_gpu, plan, {m: t - 1 for m, t in terms.items()})
    assert {r.status for r in rows} == {PASS}
    over = preflight.check_gpu_memory(on_gpu, plan, {m: t + 1 for m, t in terms.items()})
    assert {r.status for r in over} == {FAIL} and "raise it" in over[0].fix
    assert {r.status for r in preflight.check_gpu_memory({}, plan, {})} == {NOT_HERE}


def test_a_job_far_slower_than_the_paper_s_fails_the_time_check(compose_cfg):
    """Step 2's device-hours scaled to the full job (its prompts per step, its 174 steps) against App. D."""
    full = compose_cfg("pair=pair1", "backend=verl", "cluster=slurm")
    mini = compose_cfg("pair=pair1", "backend=verl", "cluster=slurm", *preflight.miniature(full, Path("/tmp/x")))
    assert int(mini.train.batch_prompts) == 32 and int(mini.train.max_steps) == 2
    per_step_ok = 43.3 / 174 / 4     # GRAFT on pair 1: 43.3 GPU-h, 174 steps of 128 prompts (32 here)
    walls = {1: 50.0, 2: 56.0}       # the miniature's time/step_s: a quarter of the job's prompts
    step = preflight.step_time(mini, full, [(1, per_step_ok), (2, 2 * per_step_ok)], walls)
    assert step.device_s == pytest.approx(43.3 / 174 * 3600) and step.wall_s == 4 * 56.0
    ok = preflight.check_time(full, step)
    assert ok.status == PASS and "full job ~43.30 GPU-h, ~10.83 h wall (174 steps)" in ok.measured
    slow = preflight.check_time(full, preflight.step_time(mini, full, [(1, per_step_ok), (2, 4 * per_step_ok)], walls))
    assert slow.status == FAIL and "App. D: 43.3 GPU-h" == slow.expected
    assert preflight.check_time(full, preflight.step_time(mini, full, [(1, per_step_ok)], walls)).status == FAIL


def test_the_preflight_reports_each_pool_s_shares_and_says_mfu_is_not_measurable_without_a_gpu():
    history = {"time/generate_s": 6.0, "time/update_s": 3.0, "time/wait_s": 1.0}
    row = preflight.check_timeline("qwen3-1.7b-base", history, 10.0)
    assert row.status == preflight.INFO
    assert row.measured == ("generate 60%, reward 0%, logprob 0%, score 0%, update 30%, sync 0%, wait 10% of a "
                            "10.0 s step")
    assert preflight.check_timeline("qwen3-1.7b-base", {}, None).status == FAIL
    assert preflight.check_mfu("qwen3-1.7b-base", {}, []).status == NOT_HERE
    on_h200 = preflight.check_mfu("qwen3-1.7b-base", {schema.ENV_GPU: "NVIDIA H200"}, [0.21, 0.25])
    assert on_h200.status == preflight.INFO and on_h200.measured.startswith("25.0%")


def test_a_checkpoint_slower_than_the_warning_before_the_time_limit_fails():
    assert preflight.check_checkpoint_time([3.0, 41.5], "120").status == PASS
    slow = preflight.check_checkpoint_time([3.0, 130.0], "120")
    assert slow.status == FAIL and "hydra.launcher.signal_delay_s above 260" in slow.fix
    assert preflight.check_checkpoint_time([3.0], None).status == preflight.INFO   # cluster=local: no time limit
    assert preflight.check_checkpoint_time([], "120").status == FAIL


def test_help_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as done:
        preflight.main(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m graft_exp.preflight")
