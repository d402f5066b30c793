"""MLflow run lifecycle on a real SQLite store: store creation and checks before launch, skip of
FINISHED keys, resumption of unfinished ones (same run, each step once), refusal of a second live
copy, ownership of shared GRPO baselines, GPU accounting."""

import logging
import multiprocessing
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from support.ports import free_port

from graft_exp import tracking
from graft_exp.costs import accounted_gpus


@pytest.fixture
def uri(store_template, tmp_path) -> str:
    """A fresh store per test. Absolute: MLflow caches stores by URI within a process."""
    shutil.copy(store_template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def job_cfg(compose_cfg, uri):
    """Compose a job config that tracks into this test's store."""
    return lambda *overrides: compose_cfg(*overrides, f"tracking.uri={uri}")


@pytest.fixture
def cfg(job_cfg):
    return job_cfg("method=graft", "seed=3")


def test_missing_store_directory_fails_with_the_fix():
    with pytest.raises(tracking.TrackingError, match="missing or not writable"):
        tracking.ensure_store("sqlite:///no/such/dir/mlflow.db", "graft/x")


def test_dead_server_fails_fast():
    started = time.monotonic()
    with pytest.raises(tracking.TrackingError, match="does not answer"):
        tracking.ensure_store(f"http://127.0.0.1:{free_port()}", "graft/x")
    assert time.monotonic() - started < 15


def test_ensure_store_is_idempotent(uri):
    first = tracking.ensure_store(uri, "graft/main")
    assert tracking.ensure_store(uri, "graft/main") == first
    assert MlflowClient(uri).get_experiment(first).name == "graft/main"


def test_new_sqlite_store_is_copied_from_the_migrated_template(tmp_path, monkeypatch):
    """A new store is a copy of the cached empty template (MLflow's migrations run once per version,
    not per store): it is at MLflow's head revision, its Default experiment keeps its artifacts beside
    the first process that opens it (MLflow's ./mlruns, as in a store MLflow creates), and a file that
    appeared meanwhile is never replaced."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path / "cache"))
    template = tracking.empty_store_template()
    assert template.parent == tmp_path / "cache" / "mlflow"
    built = template.stat().st_mtime_ns
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        uri = f"sqlite:///{tmp_path / name / 'mlflow.db'}"
        experiment = tracking.ensure_store(uri, "graft/main")
        client = MlflowClient(uri)
        assert client.get_experiment(experiment).name == "graft/main"
        assert Path(client.get_experiment("0").artifact_location) == tmp_path / name / "mlruns" / "0"
        with sqlite3.connect(tmp_path / name / "mlflow.db") as db:
            assert db.execute("SELECT version_num FROM alembic_version").fetchone()[0] == _get_latest_schema_revision()
    assert template.stat().st_mtime_ns == built   # built once, copied twice
    existing = tmp_path / "c.db"
    existing.write_bytes(b"not replaced")
    tracking.create_sqlite_store(existing)
    assert existing.read_bytes() == b"not replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c.db", "cache"]   # no copy left behind


@pytest.mark.slow
def test_store_of_an_older_mlflow_is_migrated_before_launch(uri):
    """A store whose schema lacks the newest migration is brought to MLflow's head revision by the
    launching process, not by the first of many concurrent jobs."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config, _get_latest_schema_revision

    engine = sqlalchemy.create_engine(uri)
    config = _get_alembic_config(uri)
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "-1")
    with engine.connect() as conn:
        old = conn.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalar()
    assert old != _get_latest_schema_revision()
    tracking.ensure_store(uri, "graft/main")
    with engine.connect() as conn:
        assert conn.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalar() == (
            _get_latest_schema_revision())
    engine.dispose()


def test_finished_key_is_skipped_and_unfinished_key_resumed(cfg):
    job = tracking.open_job(cfg)
    assert job is not None and not job.resumed
    job.log_metrics({"cost/gpu_hours": 0.1}, step=1)
    # The process dies here (no finish): the next launch resumes the same run.
    again = tracking.open_job(cfg)
    assert again.run_id == job.run_id and again.resumed
    again.log_metrics({"cost/gpu_hours": 0.1}, step=1)    # replayed step: not logged twice
    again.log_metrics({"cost/gpu_hours": 0.2}, step=2)
    again.finish("FINISHED")
    assert tracking.open_job(cfg) is None
    history = MlflowClient(cfg.tracking.uri).get_metric_history(job.run_id, "cost/gpu_hours")
    assert sorted(m.step for m in history) == [1, 2]


@pytest.mark.parametrize("status", ["FAILED", "KILLED"])
def test_failed_or_killed_run_is_resumed_not_duplicated(cfg, status):
    job = tracking.open_job(cfg)
    job.finish(status)
    again = tracking.open_job(cfg)
    assert again.run_id == job.run_id and again.status == "RUNNING"


def test_rerun_trains_a_finished_key_again_but_resumes_its_new_run(job_cfg, uri):
    cfg = job_cfg("method=graft", "seed=4")
    tracking.open_job(cfg).finish("FINISHED")
    forced = job_cfg("method=graft", "seed=4", "rerun=true")
    new = tracking.open_job(forced)
    assert new is not None and not new.resumed
    # Requeued with rerun=true still on the command line: continues the new run, no third one.
    assert tracking.open_job(forced).run_id == new.run_id


def test_run_key_ignores_where_and_how_a_job_is_launched(job_cfg, uri):
    base = job_cfg("method=graft")
    moved = job_cfg("method=graft", "cluster=slurm", "study=other", "checkpoint_root=/elsewhere",
                    "tracking=sqlite", "hydra.launcher.partition=gpu")
    assert tracking.run_key(base) == tracking.run_key(moved)
    assert tracking.run_key(base) != tracking.run_key(job_cfg("method=graft", "seed=1"))


def test_live_copy_is_refused_dead_one_resumed(cfg):
    job = tracking.open_job(cfg)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        job.set_tags({"graft.pid": str(holder.pid), "graft.host": socket.gethostname()})
        with pytest.raises(tracking.AlreadyRunning, match=f"pid {holder.pid}"):
            tracking.open_job(cfg)
    finally:
        holder.kill()
        holder.wait()
    assert tracking.open_job(cfg).run_id == job.run_id


def test_requeued_slurm_job_resumes_its_own_run(cfg, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "41")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    job = tracking.open_job(cfg)
    assert job.client.get_run(job.run_id).data.tags["graft.slurm_job_id"] == "41_2"
    assert tracking.open_job(cfg).run_id == job.run_id


def test_shared_grpo_baseline_belongs_to_the_job_that_started_it(job_cfg, uri):
    """pair1 and pair2 both hold Qwen3: the pair2 GRPO job neither trains nor resumes pair1's
    unfinished Qwen3 baseline, and skips it once it is finished."""
    pair1 = job_cfg("pair=pair1", "method=grpo_n8")
    pair2 = job_cfg("pair=pair2", "method=grpo_n8")
    assert tracking.model_run_key(pair1, "B") == tracking.model_run_key(pair2, "B")
    job1 = tracking.open_job(pair1)
    qwen = tracking.open_model_run(pair1, job1, "B")
    job2 = tracking.open_job(pair2)
    assert tracking.open_model_run(pair2, job2, "B") is None           # pair1 is training it
    octo = tracking.open_model_run(pair2, job2, "A")
    assert octo is not None
    assert tracking.open_model_run(pair1, job1, "B").run_id == qwen.run_id   # pair1's resume
    qwen.finish("FINISHED")
    assert tracking.open_model_run(pair2, job2, "B") is None           # finished: shared
    tags = MlflowClient(uri).get_run(octo.run_id).data.tags
    assert (tags["graft.model"], tags["graft.peer"], tags[tracking.PARENT_TAG]) == (
        "octothinker-3b-hybrid-base", "none", job2.run_id)


def test_accounted_gpus(compose_cfg, monkeypatch):
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    assert accounted_gpus(compose_cfg("pair=pair1")) == 4
    assert accounted_gpus(compose_cfg("pair=tiny")) == 1
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert accounted_gpus(compose_cfg("pair=pair1")) == 16


def test_runs_carry_what_the_mlflow_ui_reads(job_cfg, uri):
    """The experiment is a model-training one; job and model runs have MLflow's source tags, the
    short key params beside the flattened config, a description, and (model runs) their data as
    dataset inputs, logged once however often the run is resumed."""
    cfg = job_cfg("method=graft", "seed=2")
    job = tracking.open_job(cfg)
    model = tracking.open_model_run(cfg, job, "A")
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("graft/default")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    for run_id in (job.run_id, model.run_id):
        run = client.get_run(run_id)
        tags, params = run.data.tags, run.data.params
        assert tags["mlflow.source.name"] == "python -m graft_exp" and tags["mlflow.source.type"] == "LOCAL"
        assert tags["mlflow.source.git.commit"] == tags.get("graft.git_sha", tracking.git_sha())
        assert {k: params[k] for k in ("method", "pair", "seed", "delta", "n", "backend")} == {
            "method": "graft", "pair": "tiny", "seed": "2", "delta": "0.8", "n": "8", "backend": "local"}
        assert params["method.delta"] == "0.8" and params["train.batch_prompts"] == "16"
    assert client.get_run(job.run_id).data.tags["mlflow.note.content"] == (
        "graft on pair tiny (tiny-char-llama and tiny-bpe-gpt2, co-trained), seed 2, n=8, local backend")
    assert client.get_run(model.run_id).data.tags["mlflow.note.content"] == (
        "tiny-char-llama (role A) trained with graft, peer tiny-bpe-gpt2 (online), seed 2")

    def inputs():
        found = client.get_run(model.run_id).inputs.dataset_inputs
        return {(d.dataset.name, d.dataset.digest, d.dataset.source_type, d.tags[0].value) for d in found}

    first = inputs()
    assert {(name, context) for name, _, _, context in first} == {
        ("tiny_arith/train", "training"), *((f"tiny_arith/{b}", "evaluation") for b in ("add", "sub", "mul", "mixed"))}
    assert all(source == "code" and len(digest) == 8 for _, digest, source, _ in first)
    assert tracking.open_model_run(cfg, job, "A").resumed
    assert inputs() == first
    # A GRPO baseline has no compatibility floor: its delta param says so.
    assert tracking.key_params(job_cfg("method=grpo_n8"))["delta"] == "none"


def test_prepared_parquet_files_are_the_dataset_inputs_of_paper_pairs(job_cfg, uri, tmp_path):
    """pair1's model runs name prepare.py's Parquet files, with a digest of their bytes; a benchmark
    not prepared yet is left out (the backend reports it when it reads it)."""
    import hashlib

    import pandas as pd

    from graft_exp.prepare import SOURCES

    data = tmp_path / "data"
    for key in ("math", "math500", "aime2024"):
        path = data / key / f"{SOURCES[key].output}.parquet"
        path.parent.mkdir(parents=True)
        pd.DataFrame({"data_source": [key] * 3, "prompt": [[{"role": "user", "content": f"{key} {i}"}] for i in range(3)],
                      "reward_model": [{"ground_truth": str(i), "style": "rule"} for i in range(3)]}).to_parquet(path)
    cfg = job_cfg("pair=pair1", "method=grpo_n8", "backend=verl", f"backend.data_dir={data}")
    job = tracking.open_job(cfg)
    model = tracking.open_model_run(cfg, job, "A")
    found = {d.dataset.name: d for d in MlflowClient(uri).get_run(model.run_id).inputs.dataset_inputs}
    assert set(found) == {"math", "math500", "aime2024"}
    train = data / "math" / "train.parquet"
    assert found["math"].dataset.digest == hashlib.sha256(train.read_bytes()).hexdigest()[:16]
    assert found["math"].dataset.source == f'{{"uri": "{train}"}}'
    assert found["math"].tags[0].value == "training" and found["aime2024"].tags[0].value == "evaluation"


def test_stored_log_lookup_single_and_multirun(job_cfg, uri):
    """graft_stored needs both models' FINISHED GRPO n=8 runs with its seed: checked before any
    run is created, and before a multirun launches unless an earlier job of a sequential multirun
    trains them."""
    from graft_exp.launching.callbacks import PlannedJob, missing_stored_logs

    stored = job_cfg("method=graft_stored")
    grpo = job_cfg("method=grpo_n8")
    client = MlflowClient(uri)
    tracking.ensure_store(uri, "graft/default")
    with pytest.raises(tracking.StoredLogMissing, match=r"of tiny-char-llama and tiny-bpe-gpt2, .* launch "
                       r"`python -m graft_exp pair=tiny method=grpo_n8 seed=0` first"):
        tracking.open_job(stored)
    assert client.search_runs([client.get_experiment_by_name("graft/default").experiment_id]) == []

    def plan(*cfgs):
        return [PlannedJob(i, [c.method.name], c) for i, c in enumerate(cfgs)]

    assert missing_stored_logs(plan(grpo, stored), parallel=False) == []
    assert len(missing_stored_logs(plan(grpo, stored), parallel=True)) == 1
    assert "tiny-char-llama and tiny-bpe-gpt2" in missing_stored_logs(plan(stored, grpo), parallel=False)[0]
    job = tracking.open_job(grpo)
    for role in ("A", "B"):
        tracking.open_model_run(grpo, job, role).finish("FINISHED")
    job.finish("FINISHED")
    assert tracking.stored_log_run(client, stored, "tiny-bpe-gpt2").data.tags["graft.role"] == "B"
    assert missing_stored_logs(plan(stored), parallel=True) == []
    assert tracking.open_job(stored) is not None


@pytest.mark.slow   # a python -m graft_exp launch per case
@pytest.mark.parametrize("args, message", [
    (["seed=abc"], "Value 'abc' of type 'str' could not be converted to Integer"),
    (["cluster=slurm", "seed=1"], "Submit it as a one-job sweep: python -m graft_exp -m cluster=slurm seed=1"),
    (["method=graft_stored"], "launch `python -m graft_exp pair=tiny method=grpo_n8 seed=0` first"),
    (["-m", "method=graft_stored", "seed=0,1"], "nothing launched: stored-trajectory jobs have no log to replay"),
])
def test_rough_edges_stop_with_a_message_and_no_run(uri, tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "graft_exp", *args, f"tracking.uri={uri}",
                           f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    client = MlflowClient(uri)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


def test_sacct_warning_is_reported_once(caplog):
    """Without Slurm accounting submitit warns at every poll; the launching process says it once."""
    from graft_exp.launching.callbacks import SacctWarningOnce, report_sacct_errors_once

    SacctWarningOnce.reported = False
    report_sacct_errors_once()
    report_sacct_errors_once()   # a second multirun in the process installs no second filter
    submitit_log = logging.getLogger("submitit")
    with caplog.at_level(logging.INFO):
        for call in range(1, 4):
            submitit_log.warning(f"Call #{call} - Bypassing sacct error Command '['sacct', '-o', 'JobID']' "
                                 "returned non-zero exit status 1., status may be inaccurate.")
        submitit_log.warning("another submitit warning")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("sacct" in m for m in messages) == 1
    assert "Slurm accounting is not available" in messages[0] and "another submitit warning" in messages


def test_analysis_outputs_logged_as_a_run_the_analysis_skips(uri, tmp_path):
    """python -m analysis tables|figures --log-to-mlflow: an analysis run in the study's experiment
    holds exactly the files written; reading the store again ignores it."""
    from analysis import __main__ as cli
    from analysis.store import ANALYSIS_TAG, load_store
    from analysis.synthetic import JobSpec, ModelSpec, write_jobs

    s, q = "smollm3-3b-base", "qwen3-1.7b-base"
    write_jobs(uri, [JobSpec("graft", "pair1", 0, [ModelSpec(s, "A", q, 8, 5, {"math500": [.6, .62]}),
                                                   ModelSpec(q, "B", s, 8, 5, {"math500": [.4, .42]})])],
               tmp_path / "artifacts")
    before = sorted(load_store(uri).runs.index)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("graft/main").experiment_id
    for command in ("tables", "figures"):
        out = tmp_path / command
        assert cli.main([command, "--tracking-uri", uri, "--out", str(out), "--log-to-mlflow"]) == 0
        [run] = client.search_runs([experiment], f"tags.`{ANALYSIS_TAG}` = '{command}'")
        assert run.info.run_name == f"analysis-{command}" and run.info.status == "FINISHED"
        logged = {Path(f.path).name for f in client.list_artifacts(run.info.run_id, command)}
        assert logged == {p.name for p in out.iterdir()} and len(logged) > 5
    assert sorted(load_store(uri).runs.index) == before


def _log_inputs_together(uri, experiment_ids, cfg, barrier, results):
    """One of several processes: in each experiment, create a run, wait for the others, then log the same
    datasets as they do (several fresh experiments, so that the race is run several times)."""
    client = MlflowClient(uri)
    for experiment_id in experiment_ids:
        run_id = client.create_run(experiment_id).info.run_id
        barrier.wait()
        try:
            tracking.log_dataset_inputs(client, run_id, cfg)
            results.put((run_id, "ok"))
        except Exception as error:  # noqa: BLE001 - reported to the test
            results.put((run_id, f"{type(error).__name__}: {error}"))


@pytest.mark.slow   # four spawned processes racing over five experiments
def test_jobs_starting_together_log_the_same_datasets(cfg, uri):
    """Jobs of a multirun log the same dataset inputs at the same moment into a fresh experiment: MLflow
    finds-or-creates each dataset in two statements, and the loser of that race must not fail its job
    (without the retry, most runs of this test see at least one such failure)."""
    experiment_ids = [tracking.ensure_store(uri, f"graft/together-{i}") for i in range(5)]
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(4), context.Queue()
    workers = [context.Process(target=_log_inputs_together, args=(uri, experiment_ids, cfg, barrier, results))
               for _ in range(4)]
    for worker in workers:
        worker.start()
    outcomes = dict(results.get(timeout=240) for _ in range(len(workers) * len(experiment_ids)))
    for worker in workers:
        worker.join(timeout=60)
    assert set(outcomes.values()) == {"ok"}, outcomes
    expected = {d.dataset.name for d in tracking.dataset_inputs(cfg)}
    client = MlflowClient(uri)
    for run_id in outcomes:
        assert {d.dataset.name for d in client.get_run(run_id).inputs.dataset_inputs} == expected


def test_job_run_records_its_environment(cfg):
    """Library versions (and the GPU, driver and CUDA where there is one) as graft.env.* tags."""
    from importlib import metadata

    from graft_exp import schema

    job = tracking.open_job(cfg)
    tags = job.client.get_run(job.run_id).data.tags
    env = {k: v for k, v in tags.items() if k.startswith("graft.env.")}
    assert set(env) <= set(schema.ENV_TAGS)
    assert env["graft.env.torch"] == metadata.version("torch")
    assert env["graft.env.mlflow"] == metadata.version("mlflow")
    assert env["graft.env.math_verify"] == metadata.version("math-verify")
    assert {"graft.env.transformers", "graft.env.verl", "graft.env.vllm"} <= set(env)
