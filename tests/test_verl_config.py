"""backend=verl composes with every pair x method; Table 3 lands in verl's config (checked by verl's own
validate_config); each method's receiver rows come out of graft_exp.algorithms as the paper says."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils.config import validate_config

from graft_exp.algorithms import grpo_advantages
from graft_exp.backends.verl.config import minibatch_prompts, placement, verl_config
from graft_exp.backends.verl.loss import LossSpec
from graft_exp.backends.verl.plan import receiver_rows, select_prompts
from graft_exp.backends.verl.trainer import bench_scores, prompt_order
from graft_exp.config import validate

CONF = str(Path(__file__).resolve().parents[1] / "conf")
METHODS = sorted(p.stem for p in (Path(CONF) / "method").glob("*.yaml"))
PAIRS = ("pair1", "pair2", "pair3")


@pytest.fixture(scope="module", autouse=True)
def hydra_context():
    """One Hydra initialisation for the module: composing is then cheap enough for 66 combinations."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def _compose(*overrides):
    return compose(config_name="config", overrides=["backend=verl", *overrides])


@pytest.fixture(scope="module")
def pair1_graft():
    return _compose("pair=pair1", "method=graft")


def test_table3_defaults_in_verl_config(pair1_graft, tmp_path):
    config = verl_config(pair1_graft, "B", str(tmp_path))
    actor, rollout, data = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout, config.data
    assert config.actor_rollout_ref.model.path == "Qwen/Qwen3-1.7B-Base"
    assert (actor.optim.lr, list(actor.optim.betas), actor.optim.weight_decay, actor.optim.clip_grad) == \
        (1e-6, [0.9, 0.999], 0.01, 1.0)
    assert actor.optim.lr_scheduler_type == "constant" and actor.optim.lr_warmup_steps == 0
    assert data.train_batch_size == 128 and rollout.n == 8 and actor.ppo_mini_batch_size == 32
    assert actor.ppo_epochs == 1 and actor.shuffle is False
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    assert (rollout.prompt_length, rollout.response_length) == (2048, 4096)
    assert (rollout.temperature, rollout.top_p) == (1.0, 1.0)
    assert actor.loss_agg_mode == "token-mean" and actor.use_kl_loss is False and actor.entropy_coeff == 0
    assert config.algorithm.use_kl_in_reward is False and config.algorithm.adv_estimator == "grpo"
    assert (rollout.val_kwargs.temperature, rollout.val_kwargs.top_p, rollout.val_kwargs.n) == (0.6, 0.95, 8)
    assert actor.fsdp_config.dtype == "bfloat16" and rollout.dtype == "bfloat16"
    assert config.trainer.total_epochs == 3 and config.trainer.test_freq == 5
    assert config.trainer.balance_batch is False            # replaced by our per-minibatch DP layout
    assert config.trainer.n_gpus_per_node == 2 and rollout.tensor_model_parallel_size == 2
    assert data.val_files[-1].endswith("minerva/test.parquet")
    validate_config(config, use_reference_policy=False, use_critic=False)


def test_hacpo_released_configuration(tmp_path):
    cfg = _compose("pair=pair1", "method=hacpo")
    actor = verl_config(cfg, "A", str(tmp_path)).actor_rollout_ref.actor
    assert minibatch_prompts(cfg) == 64 and actor.ppo_mini_batch_size == 64
    assert actor.use_kl_loss is True and actor.kl_loss_coef == 1e-3 and actor.kl_loss_type == "low_var_kl"
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (3e-4, 4e-4)
    spec = LossSpec.from_method(cfg.method)
    assert spec.kind == "hacpo" and spec.hacpo_cross_clip_delta == pytest.approx(0.2)


def test_verl_overrides_and_placement_errors(tmp_path):
    cfg = _compose("pair=pair1", "method=graft", "backend.verl_overrides=['actor_rollout_ref.rollout.enforce_eager=true']")
    assert verl_config(cfg, "A", str(tmp_path)).actor_rollout_ref.rollout.enforce_eager is True
    with pytest.raises(ValueError, match="needs 6 GPUs"):
        placement(_compose("pair=pair1", "backend.gpus_per_model=3"))
    with pytest.raises(ValueError, match="multiple of backend.rollout_tp"):
        placement(_compose("pair=pair1", "backend.gpus_per_model=1"))


LOSS_KINDS = {"graft_seq_ratio": "sequence_ratio", "graft_luffy": "luffy", "sgt": "sgt", "sgt_which": "sgt",
              "hacpo": "hacpo", "hacpo_which": "hacpo"}


def test_every_pair_and_method_composes_with_verl(tmp_path):
    """All 3 x 22 jobs compose and validate with backend=verl; verl configs are built for every method
    (pair1) and for both roles of every pair (their models are what differs between pairs)."""
    for pair in PAIRS:
        for method in METHODS:
            cfg = _compose(f"pair={pair}", f"method={method}")
            validate(cfg)
            if cfg.method.co_train:
                assert LossSpec.from_method(cfg.method).kind == LOSS_KINDS.get(method, "graft"), method
            roles = ("A", "B") if method == "graft" else ("A",) if pair == "pair1" else ()
            for role in roles:
                config = verl_config(cfg, role, str(tmp_path / role))
                assert config.actor_rollout_ref.rollout.n == cfg.method.n
                assert config.actor_rollout_ref.model.path == cfg.models[cfg.pair[role]].hf_id


@pytest.mark.parametrize("method", [m for m in METHODS if not m.startswith("grpo")])
def test_every_exchange_method_plans_receiver_rows(method):
    cfg = _compose("pair=pair1", f"method={method}")
    n, gen = cfg.method.n, torch.Generator().manual_seed(0)
    rewards_a = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [0] * 8, [1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]])
    rewards_b = torch.tensor([[0] * 8, [0] * 8, [1, 0, 0, 0, 0, 0, 0, 0], [0] * 8, [1, 1, 1, 1, 1, 1, 1, 0]])
    k_a, k_b = rewards_a.sum(1), rewards_b.sum(1)
    a_to_b, _ = select_prompts(cfg.method, k_a, k_b, n, gen)
    scores = torch.linspace(0.5, 1.2, int(a_to_b.sum()) * n).view(-1, n)
    plan = receiver_rows(cfg.method, own_rewards=rewards_b.float(), own_advantages=grpo_advantages(rewards_b.float()),
                         peer_rewards=rewards_a.float(), peer_advantages=grpo_advantages(rewards_a.float()),
                         selected=a_to_b, scores=scores, generator=gen)
    rows = plan.rows
    assert len(rows.peer) == len(rows.peer_weight) == len(rows.peer_advantage) == len(rows.peer_sft)
    assert bool((rows.peer_weight >= 0).all()) and bool((rows.peer_weight <= 1).all())
    assert plan.stats["train/peer_groups"] == float(a_to_b.sum())
    if method in ("graft", "graft_stored"):
        # C_{A->B} = prompts 0, 1 (B failed all, 1 <= k_A < n), C_{B->A} = prompt 2: m = 1 keeps the
        # candidate with the larger k_A (prompt 1); stored replay is one-way and unbalanced
        expected = [True, True, False, False, False] if method == "graft_stored" else [False, True, False, False, False]
        assert a_to_b.tolist() == expected


def test_graft_rows_replace_groups_with_gated_source_responses():
    cfg = _compose("pair=pair1", "method=graft_no_balance")
    gen = torch.Generator().manual_seed(0)
    rewards_a = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0], [0] * 8]).float()
    rewards_b = torch.tensor([[0] * 8, [1, 1, 0, 0, 0, 0, 0, 0]]).float()
    a_to_b, _ = select_prompts(cfg.method, rewards_a.sum(1).long(), rewards_b.sum(1).long(), 8, gen)
    assert a_to_b.tolist() == [True, False]
    scores = torch.tensor([[0.9, 0.7, 1.3, 0.85, 0.8, 0.95, 0.5, 1.0]])
    adv_a = grpo_advantages(rewards_a)
    plan = receiver_rows(cfg.method, own_rewards=rewards_b, own_advantages=grpo_advantages(rewards_b),
                         peer_rewards=rewards_a, peer_advantages=adv_a, selected=a_to_b, scores=scores, generator=gen)
    assert plan.rows.own.tolist() == list(range(8, 16))                   # prompt 0's own group is replaced
    assert plan.rows.peer_weight.tolist() == pytest.approx([0.9, 0, 1.0, 0.85, 0, 0.95, 0, 1.0])
    assert torch.allclose(plan.rows.peer_advantage, adv_a[0])             # source advantages, not re-normalised
    assert plan.stats["train/peer_admitted"] == 5


def test_grpo_advantages_match_verl():
    rewards = torch.tensor([[1.0, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]])
    mask = torch.ones(12, 3)
    token_rewards = torch.zeros(12, 3)
    token_rewards[:, -1] = rewards.flatten()
    index = np.repeat(np.arange(3), 4)
    theirs, _ = compute_grpo_outcome_advantage(token_rewards, mask, index, epsilon=1e-6)
    assert torch.allclose(theirs[:, 0].view(3, 4), grpo_advantages(rewards), atol=1e-6)


def test_bench_scores_and_prompt_order():
    scores = bench_scores(np.array([1, 0, 1, 1, 0, 0]), np.array(["aime2024"] * 4 + ["amc23"] * 2),
                          np.array([0, 0, 1, 1, 2, 2]))
    assert scores == {"aime2024": 0.75, "amc23": 0.0, "avg": 0.375}
    assert torch.equal(prompt_order(10, 0, 1), prompt_order(10, 0, 1))
    assert not torch.equal(prompt_order(10, 0, 0), prompt_order(10, 0, 1))
