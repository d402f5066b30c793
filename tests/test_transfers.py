"""The transfer log (``graft_exp.transfers``) and ``python -m analysis transfers``: what a step's log holds against
what the receiver trained on, that writing it and probing change no draw, and absorption rates by hand."""

from __future__ import annotations

import math
import shutil

import pandas as pd
import pytest
from support.memory_backend import MemoryBackend
from support.mlflow_records import histories, model_runs

from analysis.transfers import newcombe, prompt_rows, rates, wilson
from graft_exp import driver, schema, tracking
from graft_exp.config import validate
from graft_exp.methods.receiver import PEER
from graft_exp.transfers import read_log

FAST = ["train.max_steps=2", "train.batch_prompts=8", "train.minibatch_prompts=4", "eval.runs=1", "eval.samples=1",
        "backend.progress=false"]


@pytest.fixture
def train(compose_cfg, store_template, tmp_path):
    """``train(*overrides) -> (job, backend, run directory)``: one job of the in-memory backend in its own store."""
    def _train(*overrides: str, name: str = "a"):
        where = tmp_path / name
        where.mkdir()
        shutil.copy(store_template, where / "mlflow.db")
        cfg = compose_cfg(f"tracking.uri=sqlite:///{where}/mlflow.db", f"checkpoint_root={where}/ckpt", *FAST,
                          *overrides)
        validate(cfg)
        backends = []

        def factory(*args):
            backends.append(MemoryBackend(*args))
            return backends[0]
        job = tracking.open_job(cfg)
        driver.fit(cfg, job, factory)
        return job, backends[0], driver.run_directory(cfg)
    return _train


def test_the_log_holds_every_considered_group_and_exactly_the_trained_peer_rows(train):
    _, backend, root = train("method=graft", "train.probe_transfers=true")
    for update in backend.updates:
        step = 1 + backend.updates.index(update) // 2
        log = read_log(root / "transfers" / update.role)
        log = log[log["step"] == step]
        prompts, n = update.own.rollouts.rewards.shape
        assert len(log) == prompts * n and set(log["source"]) == {update.source.model}
        admitted = {(r.prompt, r.sample) for r in update.batch.rows if r.origin == PEER}
        assert set(zip(log.loc[log["admitted"], "prompt_index"], log.loc[log["admitted"], "sample"])) == admitted
        weights = {(r.prompt, r.sample): r.weight for r in update.batch.rows if r.origin == PEER}
        for _, row in log[log["admitted"]].iterrows():
            assert row["weight"] == pytest.approx(weights[row["prompt_index"], row["sample"]])
            assert row["minibatch"] == next(i for i, groups in enumerate(update.minibatches)
                                            if any(g == row["prompt_index"] for g in groups))
            assert not math.isnan(row["receiver_logp_mean"]) and row["receiver_tokens"] > 0
        assert (log["k_receiver"] == update.own.rollouts.k.numpy()[log["prompt_index"].to_numpy()]).all()
        assert (log["k_source"] == update.source.k.numpy()[log["prompt_index"].to_numpy()]).all()
        assert set(log.loc[~log["selected"], "reason"]) <= {"not selected"}
        probed = log[log["selected"] | ((log["k_receiver"] == 0) & (log["k_source"] > 0))]
        assert (probed["k_receiver_after"] >= 0).all() and (log.loc[~log.index.isin(probed.index), "k_receiver_after"] == -1).all()


def test_writing_the_log_and_probing_change_no_metric(train):
    """The probe samples again after the update from a seed of its own: every metric the job records without
    it is the same, bit for bit, with it."""
    plain, _, _ = train("method=graft", name="plain")
    probed, _, _ = train("method=graft", "train.probe_transfers=true", name="probed")

    def records(job):
        runs = {"job": job.run_id, **{r.data.tags[schema.ROLE]: r.info.run_id
                                      for r in model_runs(job.client, job.run_id).values()}}
        return {who: {k: v for k, v in histories(job.client, run_id).items() if k not in schema.WALL_CLOCK}
                for who, run_id in runs.items()}
    before, after = records(plain), records(probed)
    for who in before:
        extra = set(after[who]) - set(before[who])
        assert extra <= {"transfers/absorbed", "transfers/control_absorbed"}, extra
        assert {k: after[who][k] for k in before[who]} == before[who], who


def test_a_method_that_transfers_on_every_prompt_has_no_controls(train):
    _, _, root = train("method=hacpo", "train.probe_transfers=true")
    rows = prompt_rows(read_log(root / "transfers" / "A")).assign(method="hacpo")
    assert rows["received"].all() and not rows["control"].any()
    rows["measured"], rows["absorbed"] = "probe", rows["k_after"] > 0
    table = rates(rows, ["method"])
    assert table.loc[0, "controls"] == 0 and table.loc[0, "note"].startswith("no controls")


def test_rates_by_hand():
    """Wilson's 95 % interval for 3/4 is [0.3006, 0.9544] and for 1/5 [0.0362, 0.6245] (published tables);
    Newcombe's difference interval for 3/4 - 1/5 combines them: 0.55 - sqrt(0.4494^2 + 0.4245^2) and
    0.55 + sqrt(0.2044^2 + 0.1638^2)."""
    assert wilson(3, 4) == pytest.approx((0.75, 0.3006, 0.9544), abs=1e-4)
    assert wilson(1, 5) == pytest.approx((0.2, 0.0362, 0.6245), abs=1e-4)
    assert newcombe((3, 4), (1, 5)) == pytest.approx((0.55, -0.0682, 0.8119), abs=2e-4)
    rows = pd.DataFrame({"method": "graft", "measured": "probe",
                         "received": [True] * 4 + [False] * 6, "control": [False] * 4 + [True] * 5 + [False],
                         "candidate": [True] * 9 + [False],
                         "absorbed": [True, True, True, False, True, False, False, False, False, True]})
    row = rates(rows, ["method"]).iloc[0]
    assert (row["received"], row["controls"]) == (4, 5)
    assert row["absorbed after transfer"] == 0.75 and row["absorbed on controls"] == 0.2
    assert row["difference"] == pytest.approx(0.55)


def test_prompt_rows_from_a_small_log_by_hand():
    """Two prompts, one source, n = 2: prompt 0 received (one response admitted, log-prob -0.5), prompt 1 a
    control (the receiver failed it, the source solved it once, nothing received)."""
    base = {"step": 1, "receiver": "R", "source": "S", "subject": "add", "replaced_own": False, "weight": 0.0,
            "minibatch": -1, "receiver_tokens": 3, "reward": 1.0}
    log = pd.DataFrame([
        {**base, "prompt_id": "p0", "prompt_index": 0, "sample": 0, "k_source": 2, "k_receiver": 0, "selected": True,
         "admitted": True, "reason": "admitted", "receiver_logp_mean": -0.5, "k_receiver_after": 1},
        {**base, "prompt_id": "p0", "prompt_index": 0, "sample": 1, "k_source": 2, "k_receiver": 0, "selected": True,
         "admitted": False, "reason": "gated", "receiver_logp_mean": -3.0, "k_receiver_after": 1},
        {**base, "prompt_id": "p1", "prompt_index": 1, "sample": 0, "k_source": 1, "k_receiver": 0, "selected": False,
         "admitted": False, "reason": "not selected", "receiver_logp_mean": math.nan, "k_receiver_after": 0},
        {**base, "prompt_id": "p1", "prompt_index": 1, "sample": 1, "k_source": 1, "k_receiver": 0, "selected": False,
         "admitted": False, "reason": "not selected", "receiver_logp_mean": math.nan, "k_receiver_after": 0},
    ])
    rows = prompt_rows(log).set_index("prompt_id")
    assert rows.loc["p0", "received"] and not rows.loc["p0", "control"] and rows.loc["p0", "admitted"] == 1
    assert rows.loc["p0", "logp_mean"] == -0.5 and rows.loc["p0", "source"] == "S"
    assert rows.loc["p1", "control"] and not rows.loc["p1", "received"] and rows.loc["p1", "k_after"] == 0
    assert rows["candidate"].all()


def test_a_received_prompt_the_receiver_had_solved_is_no_candidate():
    """HACPO receives every prompt; only those the receiver failed and its source solved are compared."""
    base = {"step": 1, "receiver": "R", "source": "S", "subject": "add", "replaced_own": False, "weight": 1.0,
            "minibatch": 0, "receiver_tokens": 3, "reward": 1.0, "selected": True, "admitted": True,
            "reason": "admitted", "receiver_logp_mean": -0.5, "sample": 0}
    log = pd.DataFrame([{**base, "prompt_id": "solved", "prompt_index": 0, "k_source": 2, "k_receiver": 3,
                         "k_receiver_after": 4},
                        {**base, "prompt_id": "nothing to learn", "prompt_index": 1, "k_source": 0, "k_receiver": 0,
                         "k_receiver_after": 0},
                        {**base, "prompt_id": "candidate", "prompt_index": 2, "k_source": 1, "k_receiver": 0,
                         "k_receiver_after": 1}])
    rows = prompt_rows(log).assign(method="hacpo", measured="probe")
    rows["absorbed"] = rows["k_after"] > 0
    assert list(rows["candidate"]) == [False, False, True]
    row = rates(rows, ["method"]).iloc[0]
    assert (row["received"], row["absorbed after transfer"]) == (1, 1.0)


def test_the_next_visit_of_a_prompt_is_joined_from_the_receivers_own_successes():
    """Over several epochs a prompt comes back: its k at the receiver's next visit (``prompt_success``) answers
    without the probe; a prompt never seen again has none."""
    from analysis.transfers import next_visits

    prompts = pd.DataFrame({"step": [3, 3, 9], "prompt_id": ["p", "q", "p"]})
    success = pd.DataFrame({"step": [3, 3, 12, 9, 20], "prompt_id": ["p", "q", "p", "p", "p"], "k": [0, 0, 5, 2, 7]})
    first, never, second = next_visits(prompts, success).tolist()
    assert (first, second) == (2.0, 5.0) and math.isnan(never)


def test_the_step_metrics_count_candidates_only():
    """Prompt 0: received, failed before, solved after. Prompt 1: a control (failed; a source solved it once; not
    received), still failed. Prompt 2: received but already solved 3 of 8 times: no candidate."""
    from graft_exp.transfers import transfer_metrics

    rows = {"admitted": [True, False, False, False, False, False], "k_receiver_after": [1, 1, 0, 0, 2, 2],
            "selected": [True, True, False, False, True, True], "prompt_index": [0, 0, 1, 1, 2, 2],
            "k_receiver": [0, 0, 0, 0, 3, 3], "k_source": [2, 2, 1, 0, 1, 1]}
    assert transfer_metrics(rows) == {"transfers/admitted": 1.0, "transfers/absorbed": 1.0,
                                      "transfers/control_absorbed": 0.0}
    assert transfer_metrics({**rows, "k_receiver_after": [-1] * 6}) == {"transfers/admitted": 1.0}
