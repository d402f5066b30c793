"""The local backend trains the tiny pair for real: every method steps, GRAFT exchanges, the MLflow
records follow docs/design.md, runs are reproducible, a resumed job matches an uninterrupted one, and
stored-trajectory replay finds its source (or says which run to launch)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from support.mlflow_records import assert_same_records, histories, model_runs

from analysis.__main__ import main as analysis_main
from graft_exp import driver, methods, scheduler, schema, tracking
from graft_exp.backends import local
from graft_exp.config import ConfigError, validate
from graft_exp.methods import METHODS as declared_methods

# Small but real: 8 prompts x n samples per step, tiny evaluation.
SMALL = ["train.batch_prompts=8", "train.minibatch_prompts=4", "eval.max_problems=2", "eval.runs=2",
         "eval.samples=1", "eval.val_every=1", "backend.progress=false", "backend.threads=1"]
#: Every declared method but stored replay (which needs a GRPO n=8 log first: its own test below).
METHODS = [name for name in declared_methods if name != "graft_stored"]

@pytest.fixture
def make_job(compose_cfg, tmp_path):
    """(cfg, job) for overrides, with the MLflow store and checkpoints under ``store``."""
    def _make(*overrides: str, store=tmp_path):
        cfg = compose_cfg(f"tracking.uri=sqlite:///{store}/mlflow.db", f"checkpoint_root={store}/ckpt",
                          *SMALL, *overrides)
        validate(cfg)
        return cfg, tracking.open_job(cfg)
    return _make


@pytest.mark.slow
def test_one_step_of_every_kind_of_update_changes_the_parameters(make_job, compose_cfg):
    """The local backend is sent one kind of update per receiver loss (its ``LossSpec``), sampling and co-training;
    methods that differ only in what the driver selects send the same kind (their batches: test_driver_routing).
    One method of each kind, from the registry, trains a step on the tiny pair and changes both models."""
    kinds: dict[tuple, list[str]] = {}
    for name in METHODS:
        method = methods.resolve(compose_cfg(f"method={name}").method)
        kinds.setdefault((repr(method.loss), method.config.sampling, method.co_train), []).append(name)
    assert len(kinds) >= 8   # GRPO, DAPO's sampling, GRAFT, its sequence ratio, LUFFY, a peer scale, SGT, HACPO
    for method, *same_kind in kinds.values():
        cfg, job = make_job(f"method={method}")   # one store: each method its own run key
        trainer = driver.Driver(cfg, job, local.LocalBackend)
        policies = trainer.backend.policies
        before = {role: [p.detach().clone() for p in policy.model.parameters()] for role, policy in policies.items()}
        metrics, job_metrics = trainer.co_train_step(1)
        for role, policy in policies.items():
            changed = any(not torch.equal(a, b) for a, b in zip(before[role], policy.model.parameters()))
            assert changed, f"{method} (and {same_kind}): model {role} did not change"
            assert 0.0 <= metrics[role]["train/reward_mean"] <= 1.0
        assert job_metrics["cost/gpu_hours"] > 0


@pytest.mark.slow
def test_graft_step_exchanges_trajectories(make_job):
    cfg, job = make_job("train.batch_prompts=16")
    metrics, job_metrics = driver.Driver(cfg, job, local.LocalBackend).co_train_step(1)
    assert job_metrics["exchange/A_to_B"] > 0 and job_metrics["exchange/B_to_A"] > 0
    assert metrics["A"]["train/peer_groups"] > 0 and metrics["B"]["train/peer_groups"] > 0
    assert metrics["A"]["train/peer_admitted"] + metrics["B"]["train/peer_admitted"] > 0
    for role in ("A", "B"):   # complementarity of the shipped pair at the first RL step
        assert metrics[role]["train/peer_solved_frac"] >= 0.1
        assert 0 < metrics[role]["train/informative_frac"] < 1
        assert 0 < metrics[role]["train/compat_mean"]


@pytest.mark.slow
def test_job_records_follow_the_schema_and_the_same_seed_repeats(make_job, tmp_path):
    results = []
    # The second run's models take turns where the first's ran at the same time (on a machine with 2+ cores).
    for name, concurrent in (("first", "true"), ("second", "false")):
        store = tmp_path / name
        store.mkdir()
        cfg, job = make_job("train.max_steps=2", f"backend.concurrent={concurrent}", store=store)
        driver.fit(cfg, job, local.LocalBackend)
        results.append((job.client, job.run_id))
    client, job_id = results[0]
    job_metrics = histories(client, job_id)
    assert {"cost/gpu_hours", "exchange/A_to_B", "exchange/B_to_A"} <= set(job_metrics)
    assert all(schema.known_metric(k, "job") for k in job_metrics), sorted(job_metrics)
    assert "config.yaml" in [a.path for a in client.list_artifacts(job_id)]
    runs = model_runs(client, job_id)
    assert set(runs) == {"A", "B"}
    for role, run in runs.items():
        tags = run.data.tags
        assert tags["graft.model"] == ("tiny-char-llama" if role == "A" else "tiny-bpe-gpt2")
        assert tags["graft.peer"] == ("tiny-bpe-gpt2" if role == "A" else "tiny-char-llama")
        assert tags["graft.method"] == "graft" and tags["graft.n"] == "8"
        assert tags["graft.best_step"] in ("1", "2")       # a trained checkpoint: step 0 is no candidate
        assert run.info.status == "FINISHED" and run.data.params["train.batch_prompts"] == "8"
        metrics = histories(client, run.info.run_id)
        assert all(schema.known_metric(k, "model") for k in metrics), sorted(metrics)
        assert all(schema.known_tag(k) for k in tags if k.startswith("graft.")), sorted(tags)
        for key in ("train/reward_mean", "train/all_fail_frac", "train/peer_solved_frac", "train/peer_groups",
                    "train/peer_admitted", "train/clipfrac_self", "cost/gpu_hours"):
            assert [s for s, _ in metrics[key]] == [1, 2], key
        assert [s for s, _ in metrics["val/avg"]] == [0, 1, 2] and "val/mixed" in metrics
        assert [s for s, _ in metrics["test/avg"]] == [0, 1] and "test/add" in metrics
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"trajectories", "prompt_success.parquet"} <= artifacts
        assert len(client.list_artifacts(run.info.run_id, "trajectories")) == 2
    # The step's timeline: every phase and the wait, each step, for each model; on a CPU no MFU.
    steps = dict(job_metrics[schema.STEP_SECONDS])
    assert [s for s, _ in job_metrics[schema.RECORD_SECONDS]] == [1, 2]
    for run in runs.values():
        metrics = {k: dict(v) for k, v in histories(client, run.info.run_id).items()}
        parts = [*map(schema.phase_metric, schema.PHASES), schema.WAIT_SECONDS]
        assert all(list(metrics[key]) == [1, 2] for key in parts)
        for step, wall in steps.items():
            assert min(metrics[f"time/{p}_s"][step] for p in ("generate", "reward", "score", "update")) > 0
            assert metrics["time/logprob_s"][step] == metrics["time/sync_s"][step] == 0.0   # one engine, no sync
            assert sum(metrics[key][step] for key in parts) <= wall   # the wall before the record, split
        assert list(metrics[schema.VALIDATE_SECONDS]) == [0, 1, 2] and list(metrics[schema.TEST_SECONDS]) == [0]
        assert schema.MFU not in metrics
    written = tmp_path / "timeline"
    assert analysis_main(["timeline", "--tracking-uri", f"sqlite:///{tmp_path}/first/mlflow.db",
                          "--out", str(written)]) == 0
    table = pd.read_csv(written / "timeline.csv")
    assert list(table["model"]) == ["tiny-char-llama", "tiny-bpe-gpt2"] and (table["steps"] == 2).all()
    shares = table[[f"{p} %" for p in (*schema.PHASES, "wait")]].sum(axis=1)
    assert shares.between(99.5, 100.5).all() and (written / "timeline.png").stat().st_size > 10_000
    for refused in (["--experiment", "graft/none"], ["--tracking-uri", f"sqlite:///{tmp_path}/none.db"]):
        assert analysis_main(["timeline", "--tracking-uri", f"sqlite:///{tmp_path}/first/mlflow.db", *refused,
                              "--out", str(tmp_path / "refused")]) == 2   # nothing to read: one line, exit 2
    assert not (tmp_path / "none.db").exists() and not (tmp_path / "refused").exists()
    # GPU-hours: the two models' shares add up to the joint run's cost at every step.
    model_cost = [histories(client, r.info.run_id)["cost/gpu_hours"] for r in runs.values()]
    for (step, joint), (_, a), (_, b) in zip(job_metrics["cost/gpu_hours"], *model_cost):
        assert a + b == pytest.approx(joint, rel=1e-9) and a > 0 and b > 0, step
    # Same seed, same metrics (wall-clock cost aside), concurrent models or not.
    second_runs = model_runs(*results[1])
    for role in ("A", "B"):
        first, second = (histories(c, r.info.run_id) for c, r in
                         ((client, runs[role]), (results[1][0], second_runs[role])))
        assert_same_records(second, first, role)


def test_models_run_concurrently_on_cpu_unless_the_job_shares_its_cores(compose_cfg, monkeypatch):
    def backend(*overrides, roles=("A", "B")):
        cfg = compose_cfg("backend.device=cpu", *overrides)
        return local.LocalBackend(cfg, methods.resolve(cfg.method), list(roles))
    monkeypatch.setenv(scheduler.JOB_CORES_ENV, "2")
    assert backend().concurrent
    assert not backend("backend.concurrent=false").concurrent
    assert not backend("method=grpo_n8", roles=["B"]).concurrent
    # Several intra-op threads per model would spin against each other's: the models take turns.
    assert not backend("backend.threads=null").concurrent
    monkeypatch.setenv(scheduler.JOB_CORES_ENV, "1")    # a cluster=local multirun: one core per job
    assert not backend().concurrent


@pytest.mark.slow
def test_resumed_job_matches_an_uninterrupted_one(make_job, tmp_path):
    overrides = ("train.max_steps=3", "train.save_every=2")
    whole_store, split_store = tmp_path / "whole", tmp_path / "split"
    whole_store.mkdir(), split_store.mkdir()
    cfg, job = make_job(*overrides, store=whole_store)
    driver.fit(cfg, job, local.LocalBackend)
    whole = {role: histories(job.client, r.info.run_id) for role, r in model_runs(job.client, job.run_id).items()}

    cfg, job = make_job(*overrides, store=split_store)
    driver.fit(cfg, job, local.LocalBackend, stop_at_step=2)   # preempted after step 2's checkpoint
    job.finish("KILLED")
    cfg, resumed = make_job(*overrides, store=split_store)
    assert resumed.resumed and resumed.run_id == job.run_id
    driver.fit(cfg, resumed, local.LocalBackend)
    split = {role: histories(resumed.client, r.info.run_id) for role, r in model_runs(resumed.client, resumed.run_id).items()}
    for role in ("A", "B"):
        assert_same_records(split[role], whole[role], role)


@pytest.mark.slow
def test_stored_replay_needs_and_uses_the_peer_grpo_log(make_job, tmp_path):
    with pytest.raises(tracking.StoredLogMissing, match=r"launch `python -m graft_exp pair=tiny method=grpo_n8 seed=0`"):
        make_job("method=graft_stored", "train.max_steps=2")   # before any run is created
    cfg, job = make_job("method=grpo_n8", "train.max_steps=2")
    driver.fit(cfg, job, local.LocalBackend)
    cfg, job = make_job("method=graft_stored", "train.max_steps=2")
    trainer = driver.Driver(cfg, job, local.LocalBackend)
    source = trainer.members["B"].replayed        # B replays A's GRPO log
    assert sorted(source.step.unique()) == [1, 2] and len(source) == 2 * 8 * 8
    metrics, _ = trainer.co_train_step(1)
    for role in ("A", "B"):
        assert metrics[role]["train/reward_mean"] >= 0 and "train/peer_groups" in metrics[role]
    # The replayed step's prompts are the GRPO run's (same seed, same order).
    assert list(trainer.members["A"].replayed.query("step == 1").prompt_id.iloc[::8]) == \
        list(source.query("step == 1").prompt_id.iloc[::8])


def test_bad_pairs_fail_clearly(compose_cfg, tmp_path):
    store = [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"checkpoint_root={tmp_path}/ckpt"]
    with pytest.raises(ConfigError, match="not a known model"):
        validate(compose_cfg(*store, "pair.A=no-such-model"))
    with pytest.raises(ConfigError, match="twice"):
        validate(compose_cfg(*store, "pair.B=tiny-char-llama"))
    with pytest.raises(ValueError, match="backend=local trains the tiny models"):
        local.load_member_model("qwen3-1.7b-base", progress=False)


@pytest.mark.slow
def test_corrupt_checkpoint_is_a_clear_error(make_job, tmp_path):
    cfg, job = make_job("train.max_steps=2", "train.save_every=1")
    driver.fit(cfg, job, local.LocalBackend, stop_at_step=1)
    job.finish("KILLED")
    (tmp_path / "ckpt" / tracking.run_key(cfg) / "ckpt-1" / "state.pt").write_bytes(b"not a checkpoint")
    cfg, resumed = make_job("train.max_steps=2", "train.save_every=1")
    with pytest.raises(driver.CheckpointError, match=r"checkpoint .*ckpt-1 cannot be loaded.*rerun=true"):
        driver.fit(cfg, resumed, local.LocalBackend)
    assert resumed.status == "FAILED"        # the driver closes the job run it could not train


def test_prompt_stream_is_a_seeded_permutation_per_epoch():
    problems = list(range(10))
    first, again = driver.PromptStream(problems, seed=3), driver.PromptStream(problems, seed=3)
    epoch = first.next(10)
    assert sorted(epoch) == problems and epoch == again.next(10)
    assert first.next(4) != epoch[:4] or first.next(6) != epoch[4:]          # a new order next epoch
    resumed = driver.PromptStream(problems, seed=3, cursor=10)
    assert resumed.next(5) == driver.PromptStream(problems, seed=3, cursor=10).next(5)
    assert driver.PromptStream(problems, seed=4).next(10) != epoch


def test_top_p_keeps_the_smallest_nucleus():
    from graft_exp.backends.local_policy import top_p_filter

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    assert torch.allclose(top_p_filter(probs, 0.8), torch.tensor([[0.5, 0.3, 0.0, 0.0]]))
    assert torch.allclose(top_p_filter(probs, 0.81), torch.tensor([[0.5, 0.3, 0.15, 0.0]]))
    assert torch.allclose(top_p_filter(probs, 0.1), torch.tensor([[0.5, 0.0, 0.0, 0.0]]))


@pytest.mark.slow
def test_ppo_epochs_and_lr_warmup_are_honoured(make_job):
    """train.ppo_epochs passes over the minibatches; train.lr_warmup_steps ramps the learning rate from 0
    over that many optimizer steps (verl's constant schedule with warm-up)."""
    steps = {}
    for epochs in (1, 2):
        cfg, job = make_job(f"train.ppo_epochs={epochs}", "train.lr_warmup_steps=8", "method=grpo_n8",
                            f"study=epochs{epochs}")
        trainer = driver.Driver(cfg, job, local.LocalBackend)
        trainer.co_train_step(1)
        policy = trainer.backend.policies["A"]
        steps[epochs] = policy.lr_schedule.last_epoch
        assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(float(cfg.train.lr) * steps[epochs] / 8)
    assert steps == {1: 2, 2: 4}   # 8 prompts in minibatches of 4, once or twice
