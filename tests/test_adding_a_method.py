"""docs/adding-a-method.md's worked examples, ``graft_top_half`` (a selection) and ``graft_peer_half`` (a peer
loss), are the ones the project ships, word for word: each code block of the page stands in the file its first line
names; the rule and the loss checked by hand, the parameter checks' messages as the page quotes them, and each
method trained for two steps on the tiny pair through the local backend."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from support.mlflow_records import histories, model_runs

from graft_exp import driver, methods, tracking
from graft_exp.algorithms import balanced_exchange
from graft_exp.backends import local
from graft_exp.config import ConfigError, validate
from graft_exp.methods.objective import receiver_loss

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "adding-a-method.md"


def test_the_page_s_code_is_the_shipped_code():
    """A block opens with a comment naming its file (``# graft_exp/methods/__init__.py: ...``); each of its code lines
    stands in that file, in the block's order."""
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    assert len(blocks) == 6
    for block in blocks:
        header, *code = block.splitlines()
        path = header.removeprefix("# ").split(":")[0].split(" (")[0]
        shipped, at = (ROOT / path).read_text().splitlines(), 0
        for line in code:
            if line.strip() and not line.startswith("#"):
                assert line in shipped[at:], f"{path} lacks, after line {at}, the page's line {line!r}"
                at = shipped.index(line, at) + 1


@pytest.fixture
def top_half():
    return ["method=graft_top_half"]


def test_the_worked_example_selects_the_peers_top_fraction_balanced(top_half, compose_cfg):
    method = methods.resolve(compose_cfg(*top_half, "method.params.top_fraction=0.25").method)
    # By hand, n = 4 over 8 prompts. C_{A->B} = {2, 3, 5} (B failed, A solved 3, 1, 2 of 4; prompt 1: A solved
    # all), A's top quarter by k = {1, 2}: {2}. C_{B->A} = {0, 4, 6}, B's top quarter = {0, 6}: {0, 6}. Balanced to
    # m = 1: A->B {2}, B->A the larger k_B, {6}. GRAFT alone would exchange all three each way.
    k_a, k_b = torch.tensor([0, 4, 3, 1, 0, 2, 0, 0]), torch.tensor([2, 0, 0, 0, 1, 0, 3, 0])
    a_to_b, b_to_a = method.selection.rule(k_a, k_b, 4, torch.Generator())
    assert torch.nonzero(a_to_b).flatten().tolist() == [2] and torch.nonzero(b_to_a).flatten().tolist() == [6]
    assert [int(m.sum()) for m in balanced_exchange(k_a, k_b, 4)] == [3, 3]
    assert not method.selection.one_direction_ok


def test_the_worked_example_s_parameter_checks_say_what_the_page_quotes(top_half, compose_cfg, tmp_path):
    store = f"tracking.uri=sqlite:///{tmp_path}/m.db"
    with pytest.raises(ConfigError, match="method.params.top_fracton is read by none of graft_top_half's rules; "
                                          "they read: top_fraction"):
        validate(compose_cfg(*top_half, store, "+method.params.top_fracton=0.5"))
    for value in ("1.5", "abc", "null"):
        with pytest.raises(ConfigError, match=rf"method.params.top_fraction={value}: method.selection=top_fraction "
                                              r"needs a number in \[0, 1\]"):
            validate(compose_cfg(*top_half, store, f"method.params.top_fraction={value}"))


def test_the_peer_loss_example_scales_the_peer_rows_weights(compose_cfg):
    """By hand, at ratio 1 (no clipping) the loss is -(sum of w A |o| over rows) / (tokens of rows with w > 0). An own
    row (A = 1, 2 tokens), a peer row (w = 0.8, A = 1, 1 token) and a peer row of A = -0.5 and 2 tokens, w = 0.5;
    lambda = 0.5: -(2 + 0.5 * 0.8 * 1 - 0.5 * 0.5 * 0.5 * 2) / 5 = -0.43, and at lambda = 0 the peer tokens still
    count: -2 / 5. At lambda = 1 it is GRAFT's loss."""
    log_prob, mask = torch.full((3, 2), -0.7), torch.tensor([[1, 1], [1, 0], [1, 1]])
    advantages, weights, is_peer = torch.tensor([1.0, 1.0, -0.5]), torch.tensor([1.0, 0.8, 0.5]), torch.tensor(
        [False, True, True])

    def loss(*overrides):
        spec = methods.resolve(compose_cfg("method=graft_peer_half", *overrides).method).loss
        return float(receiver_loss(spec, log_prob, mask, advantages, weights, is_peer, old_log_prob=log_prob)[0])
    assert loss() == pytest.approx(-0.43)
    assert loss("method.params.peer_scale=0") == pytest.approx(-0.4)
    graft = methods.resolve(compose_cfg("method=graft").method).loss
    assert loss("method.params.peer_scale=1") == float(
        receiver_loss(graft, log_prob, mask, advantages, weights, is_peer, old_log_prob=log_prob)[0])


def test_the_peer_loss_example_s_parameter_check_says_what_the_page_quotes(compose_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"method.params.peer_scale=1.5: method.peer_loss=scaled needs a number "
                                          r"in \[0, 1\]"):
        validate(compose_cfg("method=graft_peer_half", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                             "method.params.peer_scale=1.5"))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["graft_top_half", "graft_peer_half"])
def test_the_worked_example_trains_on_the_tiny_pair(method, compose_cfg, store_template, tmp_path):
    shutil.copy(store_template, tmp_path / "mlflow.db")
    cfg = compose_cfg(f"method={method}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                      f"checkpoint_root={tmp_path}/ckpt", "train.batch_prompts=8", "train.minibatch_prompts=4",
                      "train.max_steps=2", "eval.max_problems=2", "eval.runs=1", "eval.samples=1",
                      "backend.progress=false")
    validate(cfg)
    job = tracking.open_job(cfg)
    assert set(driver.fit(cfg, job, local.LocalBackend)) == {"A", "B"}
    assert job.status == "FINISHED"
    for run in model_runs(job.client, job.run_id).values():
        assert [s for s, _ in histories(job.client, run.info.run_id)["train/peer_groups"]] == [1, 2]
