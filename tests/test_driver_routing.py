"""The driver's routing with the in-memory backend (tests/support/memory_backend.py): every declared method's step,
DAPO refills, HACPO's capability ratios, stored replay, checkpoint/resume and failure states, in well under
a second per job (the real-model versions of these are in test_local_training.py and test_verl_contract.py)."""

from __future__ import annotations

import shutil
import signal
import subprocess

import pytest
from support.memory_backend import factory
from support.mlflow_records import assert_same_records, histories, model_runs

from graft_exp import driver, methods, schema, tracking
from graft_exp.algorithms import hacpo_capability, hacpo_capability_ratio, hacpo_positive_rate
from graft_exp.config import validate

FAST = ["train.batch_prompts=8", "train.minibatch_prompts=4", "train.max_steps=2", "eval.val_every=1",
        "eval.runs=1", "eval.samples=1", "backend.progress=false"]


@pytest.fixture
def make_job(compose_cfg, store_template, tmp_path):
    shutil.copy(store_template, tmp_path / "mlflow.db")

    def _make(*overrides: str):
        cfg = compose_cfg(f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"checkpoint_root={tmp_path}/ckpt",
                          *FAST, *overrides)
        validate(cfg)
        return cfg, tracking.open_job(cfg)
    return _make


def fit(cfg, job, stop_at_step=None, **options):
    """driver.fit with the in-memory backend: (the backends it created, the final scores)."""
    created = []
    scores = driver.fit(cfg, job, factory(created, **options), stop_at_step=stop_at_step)
    return created, scores


#: The quick tier routes one method of each kind (GRPO alone, with dynamic sampling, GRAFT's online
#: exchange, SGT's rescue, HACPO's pooling); the slow tier routes every declared method.
QUICK = {"grpo_n8", "grpo_ds", "graft", "sgt", "hacpo"}


def quick_or_slow(names):
    return [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow) for name in names]


@pytest.mark.parametrize("name", quick_or_slow(m for m in methods.METHODS if not m.endswith("_stored")))
def test_every_method_routes_through_its_components(make_job, name):
    cfg, job = make_job(f"method={name}")
    (backend,), scores = fit(cfg, job)
    method = methods.resolve(cfg.method)
    assert set(scores) == {"A", "B"} and job.status == "FINISHED"
    assert [u.role for u in backend.updates] == ["A", "B"] * 2
    prompts = int(cfg.train.batch_prompts)
    for update in backend.updates:
        batch = update.batch
        assert update.spec == method.loss
        assert len(batch.group_is_peer) == method.peer_loss.receiver_groups(prompts)
        grouped = sorted(g for mb in update.minibatches for g in mb)
        assert grouped == sorted(set(grouped))                   # each group in one minibatch
        assert {r.group for r in batch.rows} <= set(grouped)
        peer_rows = [r for r in batch.rows if r.origin == "peer"]
        if not method.co_train:
            assert not peer_rows and not batch.nll and update.source is None
        if method.objective == "sgt":   # the NLL term only
            assert not peer_rows
        if method.objective == "hacpo":   # every own group stays, beside the peer's
            assert {r.prompt for r in batch.rows if r.origin == "self"} == set(range(prompts))
        if not (method.peer_loss.gated and cfg.method.gate):
            assert all(r.weight > 0 for r in peer_rows)
        elif cfg.method.admission == "gate":
            assert all(r.weight > cfg.method.delta for r in peer_rows)
    client = job.client
    job_metrics = histories(client, job.run_id)
    assert all(schema.known_metric(k, "job") for k in job_metrics)
    assert ("exchange/A_to_B" in job_metrics) == (method.co_train and not method.replays_stored_log)
    for run in model_runs(client, job.run_id).values():
        assert run.info.status == "FINISHED"
        metrics = histories(client, run.info.run_id)
        assert all(schema.known_metric(k, "model") for k in metrics), sorted(metrics)
        assert [s for s, _ in metrics["train/loss"]] == [1, 2]
        assert ("train/peer_groups" in metrics) == method.co_train


def test_a_co_trained_step_exchanges_complementary_prompts(make_job):
    cfg, job = make_job("method=graft", "train.batch_prompts=16")
    (backend,), _ = fit(cfg, job)
    exchanged = histories(job.client, job.run_id)
    assert all(v > 0 for _, v in exchanged["exchange/A_to_B"] + exchanged["exchange/B_to_A"])
    update = backend.updates[0]      # A receives B's groups where A failed and B did not
    for row in (r for r in update.batch.rows if r.origin == "peer"):
        assert update.own.rollouts.k[row.prompt] == 0 and 1 <= update.source.k[row.prompt] < update.source.n


@pytest.mark.parametrize("rule", ["most_successes", pytest.param("compatibility", marks=pytest.mark.slow),
                                  pytest.param("random", marks=pytest.mark.slow)])
def test_a_group_of_three_exchanges_along_every_ordered_pair(make_job, rule):
    cfg, job = make_job("group=tiny3", "method=graft", "train.batch_prompts=16", f"method.source_rule={rule}")
    (backend,), _ = fit(cfg, job)
    runs = model_runs(job.client, job.run_id)
    assert sorted(runs) == ["A", "B", "C"] and all(r.info.status == "FINISHED" for r in runs.values())
    assert runs["A"].data.tags["graft.peer"] == "tiny-bpe-gpt2,tiny-unigram-neox"
    exchanged = histories(job.client, job.run_id)
    pairs = [f"exchange/{s}_to_{r}" for s in "ABC" for r in "ABC" if s != r]
    assert all(len(exchanged[name]) == 2 for name in pairs)
    assert sum(v for name in pairs for _, v in exchanged[name]) > 0
    for role, run in runs.items():    # any peer solved at least as much as each peer alone
        metrics = histories(job.client, run.info.run_id)
        per_peer = [metrics[f"train/peer_solved_frac/{p}"] for p in "ABC" if p != role]
        assert all(any_v >= max(v[i][1] for v in per_peer) for i, (_, any_v) in
                   enumerate(metrics["train/peer_solved_frac"]))
    for update in backend.updates:   # each peer group is one source's whole group on a prompt the receiver failed
        for row in (r for r in update.batch.rows if r.origin == "peer"):
            assert update.own.rollouts.k[row.prompt] == 0 and 1 <= update.source.k[row.prompt] < update.source.n


def test_dynamic_sampling_refills_with_informative_groups(make_job):
    cfg, job = make_job("method=grpo_ds")
    (backend,), _ = fit(cfg, job)
    assert backend.gathered == 4                                # each role, each step
    for update in backend.updates:
        k, n = update.own.rollouts.k, update.own.rollouts.n
        assert len(k) == 8 and bool(((k > 0) & (k < n)).all())


def test_hacpo_gets_each_direction_s_capability_ratio(make_job):
    cfg, job = make_job("method=hacpo")
    (backend,), _ = fit(cfg, job)
    rates = {"A": [], "B": []}
    for step in (0, 1):
        a, b = backend.updates[2 * step], backend.updates[2 * step + 1]
        for update in (a, b):
            rates[update.role].append(float(hacpo_positive_rate(update.own.rollouts.rewards)))
        cap = {role: hacpo_capability(r) for role, r in rates.items()}
        assert a.capability_ratio == hacpo_capability_ratio(cap["B"], cap["A"])
        assert b.capability_ratio == hacpo_capability_ratio(cap["A"], cap["B"])
    assert backend.updates[0].capability_ratio != 1.0           # the complementary roles differ


def test_stored_replay_trains_on_the_peer_s_logged_rollouts(make_job):
    cfg, job = make_job("method=grpo_n8")
    (grpo,), _ = fit(cfg, job)
    cfg, job = make_job("method=graft_stored")
    (stored,), _ = fit(cfg, job)
    assert "exchange/A_to_B" not in histories(job.client, job.run_id)
    logged = {(u.role, i // 2): u.own.rollouts for i, u in enumerate(grpo.updates)}
    for i, update in enumerate(stored.updates):
        peer_role = "B" if update.role == "A" else "A"
        source = logged[peer_role, i // 2]
        assert update.source.responses == source.responses and update.source.prompt_ids == source.prompt_ids


@pytest.mark.parametrize("name", ["graft", "hacpo"])
def test_a_pair_s_receivers_score_their_peers_at_the_same_time(make_job, name):
    """On disjoint devices the two receivers' scorers run at once (each waits in its call for the other's: scored
    in turn, the barrier would break); the step's timeline gives each its own scoring time."""
    cfg, job = make_job(f"method={name}")
    (backend,), _ = fit(cfg, job, concurrent=True, meet_in_scoring_s=30.0)
    assert job.status == "FINISHED" and not backend.meeting.broken
    for run in model_runs(job.client, job.run_id).values():
        assert [s for s, v in histories(job.client, run.info.run_id)["time/score_s"] if v > 0] == [1, 2]


def test_a_resumed_job_matches_an_uninterrupted_one(make_job, tmp_path):
    cfg, job = make_job("method=hacpo", "train.max_steps=3", "train.save_every=1", "study=whole")
    fit(cfg, job)
    whole = {r: histories(job.client, run.info.run_id) for r, run in model_runs(job.client, job.run_id).items()}
    cfg, job = make_job("method=hacpo", "train.max_steps=3", "train.save_every=1", "study=split", "rerun=true")
    fit(cfg, job, stop_at_step=2)
    assert job.status == "RUNNING"                              # as a preempted job leaves it
    cfg, resumed = make_job("method=hacpo", "train.max_steps=3", "train.save_every=1", "study=split")
    assert resumed.resumed and resumed.run_id == job.run_id
    (backend,), _ = fit(cfg, resumed)
    assert [u.role for u in backend.updates] == ["A", "B"]      # only step 3 was trained again
    for role, run in model_runs(resumed.client, resumed.run_id).items():
        split = histories(resumed.client, run.info.run_id)
        assert_same_records(split, whole[role], role)


def test_a_failing_update_closes_every_run_failed(make_job):
    cfg, job = make_job("method=graft")
    with pytest.raises(RuntimeError, match="update failed"):
        fit(cfg, job, fail_update_at=1)
    assert job.status == "FAILED"
    assert {r.info.status for r in model_runs(job.client, job.run_id).values()} == {"FAILED"}
    cfg, again = make_job("method=graft")                       # a re-launch resumes the failed run
    assert again.resumed and again.run_id == job.run_id


def test_a_requeue_that_stops_its_own_scontrol_is_a_preemption(make_job):
    """submitit's preemption handler runs ``scontrol requeue``; Slurm stops the job's processes as it requeues, the
    ``scontrol`` among them when it has not returned yet, and submitit raises CalledProcessError (return code: minus
    the signal) into the training. The job leaves as a preempted one (SystemExit, its runs RUNNING for the requeued
    job to resume); a ``scontrol requeue`` that failed on its own is a failure."""
    cfg, job = make_job("method=graft")
    stopped = subprocess.CalledProcessError(-signal.SIGTERM, ["scontrol", "requeue", "3"])
    with pytest.raises(SystemExit):
        fit(cfg, job, fail_update_at=1, failure=stopped)
    assert job.status == "RUNNING"
    assert {r.info.status for r in model_runs(job.client, job.run_id).values()} == {"RUNNING"}
    cfg, again = make_job("method=graft")
    assert again.resumed and again.run_id == job.run_id
    refused = subprocess.CalledProcessError(1, ["scontrol", "requeue", "3"])   # e.g. a job Slurm does not know
    cfg, job = make_job("method=graft", "seed=1")
    with pytest.raises(subprocess.CalledProcessError):
        fit(cfg, job, fail_update_at=1, failure=refused)
    assert job.status == "FAILED"


def test_the_backend_is_closed_however_the_job_ends(make_job):
    """The driver closes the backend (verl: its vLLM replicas, workers and Ray) when the job ends: finished,
    failed, or stopped as a preempted job, so the next job of the same process starts from free devices."""
    cfg, job = make_job("method=graft")
    (backend,), _ = fit(cfg, job)
    assert backend.closed
    cfg, job = make_job("method=graft", "seed=1")
    created = []
    with pytest.raises(RuntimeError, match="update failed"):
        driver.fit(cfg, job, factory(created, fail_update_at=1))
    assert created[0].closed
    cfg, job = make_job("method=graft", "seed=2")
    (backend,), _ = fit(cfg, job, stop_at_step=1)
    assert backend.closed and job.status == "RUNNING"


@pytest.mark.parametrize("name", ["graft", "sgt"])
def test_peer_copies_over_the_receiver_s_limit_are_dropped_or_trained_as_the_method_says(make_job, name):
    """An 11-token limit cuts every copy of a boxed answer (the memory backend counts a character per token):
    ``method.cut_copies=drop`` (transferring methods' default) leaves them out of the update, ``train`` trains them;
    both count them at each step."""
    for rule in ("drop", "train"):
        cfg, job = make_job(f"method={name}", "train.batch_prompts=16", "train.max_response_length=11",
                            f"method.cut_copies={rule}")
        (backend,), _ = fit(cfg, job)
        copies = [len(u.source.responses[q][i]) for u in backend.updates
                  for q, i in [(r.prompt, r.sample) for r in u.batch.rows if r.origin == "peer"] + u.batch.nll]
        assert not copies if rule == "drop" else copies and min(copies) > 11
        runs = model_runs(job.client, job.run_id)
        cut_counts = [v for run in runs.values() for _, v in histories(job.client, run.info.run_id)["train/peer_copies_cut"]]
        assert len(cut_counts) == 4 and sum(cut_counts) >= (len(copies) if rule == "train" else 1)
