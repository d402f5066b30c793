"""A store written by earlier versions of the project, carried over by ``python -m graft_exp.rekey``: the old code
itself (checked out from the history) trains into it; the new code then finds every run, skips the finished
jobs, resumes the preempted one into its own run and checkpoint, replays a stored GRPO log and honours a budget's
reference (docs/design.md, "Run keys"; README, "Upgrading")."""

from __future__ import annotations

import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient
from support.legacy_store import TINY, checkout, train_with, why_no_history
from support.mlflow_records import model_runs

from graft_exp import rekey, schema, tracking

#: The last commit before the budget settings (its keys hold the whole catalog), and the last before this rule.
LEGACY, BUDGETED = "9f46777", "3746ae2"
#: The cut-copy rule every run before ``method.cut_copies`` trained with.
OLD_CUT_RULE = "method.cut_copies=train"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """A store and checkpoint root as users of 9f46777 and 3746ae2 left them: GRPO n=8 finished, GRAFT preempted
    after step 1 of 2 (9f46777), and a GRAFT job whose GPU-hour budget is that GRPO job's cost (3746ae2)."""
    reason = why_no_history(LEGACY, BUDGETED)
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("legacy")
    store = tmp / "store"
    store.mkdir()
    oldest, older = checkout(LEGACY, tmp / LEGACY), checkout(BUDGETED, tmp / BUDGETED)
    train_with(oldest, store, (["method=grpo_n8"], None), (["method=graft"], 1))
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    grpo = job_runs(client)["grpo_n8"][0]
    train_with(older, store, (["method=graft", "seed=1", f"train.gpu_hours_of={grpo.data.tags[schema.RUN_KEY]}"], None))
    return store


def job_runs(client: MlflowClient) -> dict[str, list]:
    """The job runs of the store by method (seed 1: ``<method>/budget``), oldest first."""
    exps = [e.experiment_id for e in client.search_experiments()]
    found = {}
    for run in client.search_runs(exps, order_by=["attributes.start_time ASC"]):
        if tracking.PARENT_TAG not in run.data.tags:
            tags = run.data.tags
            found.setdefault(tags[schema.METHOD] + ("/budget" if tags[schema.SEED] == "1" else ""), []).append(run)
    return found


def test_an_old_store_is_rekeyed_then_skipped_resumed_and_replayed(legacy, compose_cfg):
    store, uri = legacy, f"sqlite:///{legacy / 'mlflow.db'}"
    client = MlflowClient(uri)
    composed = lambda *o: compose_cfg(f"tracking.uri={uri}", f"checkpoint_root={store / 'ckpt'}", *TINY, *o)
    before = {m: runs[0] for m, runs in job_runs(client).items()}
    assert set(before) == {"grpo_n8", "graft", "graft/budget"}
    assert before["graft"].info.status == "RUNNING"
    # What an upgrade without re-keying meets: today's keys find none of the old runs, and a launch over the store
    # says so in one line naming the command, before anything trains.
    for cfg in (composed("method=grpo_n8"), composed("method=graft")):
        assert tracking.find_run(client, tracking.run_key(cfg)) is None
    runs_before = len(client.search_runs([before["graft"].info.experiment_id]))
    refused = subprocess.run([sys.executable, "-m", "graft_exp", "-m", "method=grpo_n8,graft", f"tracking.uri={uri}",
                              f"checkpoint_root={store / 'ckpt'}", f"hydra.sweep.dir={store / 'multirun'}", *TINY],
                             cwd=store, capture_output=True, text=True, timeout=300, check=False)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 2 and "Traceback" not in said, said[-3000:]
    assert f"holds this job's run {before['grpo_n8'].info.run_id} under key" in said, said[-3000:]
    assert f"python -m graft_exp.rekey --tracking-uri {uri}" in said and "nothing was trained" in said
    assert len(client.search_runs([before["graft"].info.experiment_id])) == runs_before

    dry = rekey.rekey_store(uri, dry_run=True)
    assert {r.info.run_id: r.data.tags[schema.RUN_KEY] for r in client.search_runs([before["graft"].info.experiment_id])} \
        == {e.run_id: e.before for e in dry}, "a dry run changed a key"
    cli = subprocess.run([sys.executable, "-m", "graft_exp.rekey", "--tracking-uri", uri], cwd=store,
                         capture_output=True, text=True, check=True).stdout
    assert f"{len(dry)} of {len(dry)} runs re-keyed" in cli, cli   # every job and model run of the old rule
    again = subprocess.run([sys.executable, "-m", "graft_exp.rekey", "--tracking-uri", uri], cwd=store,
                           capture_output=True, text=True, check=True).stdout
    assert f"0 of {len(dry)} runs re-keyed" in again, again

    # The old code trained peer copies cut at the response limit (method.cut_copies=train): its co-trained runs keep
    # that rule's key, which today's default (drop) does not share (README, "Upgrading").
    grpo_key = tracking.run_key(composed("method=grpo_n8"))
    graft_key = tracking.run_key(composed("method=graft", OLD_CUT_RULE))
    budget_key = tracking.run_key(composed("method=graft", "seed=1", f"train.gpu_hours_of={grpo_key}", OLD_CUT_RULE))
    for method, key in (("grpo_n8", grpo_key), ("graft", graft_key), ("graft/budget", budget_key)):
        run = client.get_run(before[method].info.run_id)
        assert run.data.tags[schema.RUN_KEY] == key, method
        assert run.data.tags[schema.RUN_KEY_BEFORE] == before[method].data.tags[schema.RUN_KEY], method
    for role, run in model_runs(client, before["graft"].info.run_id).items():
        assert run.data.tags[schema.RUN_KEY] == tracking.model_run_key(composed("method=graft", OLD_CUT_RULE), role)
    # The preempted job's checkpoints moved with its key.
    assert (store / "ckpt" / graft_key / "ckpt-1").is_dir()
    assert not (store / "ckpt" / before["graft"].data.tags[schema.RUN_KEY]).exists()

    # The new code's sweep over the store: GRPO n=8 skipped, GRAFT resumed into its own run, graft_stored replays
    # the old GRPO log; the budgeted job found FINISHED under its new key.
    done = subprocess.run([sys.executable, "-m", "graft_exp", "-m", "method=grpo_n8,graft,graft_stored",
                           f"tracking.uri={uri}", f"checkpoint_root={store / 'ckpt'}",
                           f"hydra.sweep.dir={store / 'multirun'}", "cluster.poll_s=2", OLD_CUT_RULE, *TINY],
                          cwd=store, capture_output=True, text=True, timeout=900, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    after = job_runs(client)
    assert [r.info.run_id for r in after["grpo_n8"]] == [before["grpo_n8"].info.run_id], output[-4000:]
    assert f"a FINISHED run with graft.run_key={grpo_key} exists" in output, output[-4000:]
    assert [r.info.run_id for r in after["graft"]] == [before["graft"].info.run_id], "the resumed job made a run"
    assert after["graft"][0].info.status == "FINISHED"
    for role, run in model_runs(client, before["graft"].info.run_id).items():
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/reward_mean")]
        assert sorted(steps) == [1, 2], (role, steps)   # step 1 from the old code, step 2 resumed: once each
    stored = after["graft_stored"]
    assert len(stored) == 1 and stored[0].info.status == "FINISHED"
    assert all(float(r.data.metrics["train/peer_groups"]) >= 0 for r in model_runs(client, stored[0].info.run_id).values())
    budgeted = tracking.find_run(client, budget_key)
    assert budgeted is not None and budgeted.info.status == "FINISHED"
    assert budgeted.info.run_id == before["graft/budget"].info.run_id
