"""backend=verl composes with every pair x method; Table 3 lands in verl's config (checked by verl's own
validate_config); verl's GRPO advantages equal ours; validation benchmarks come out of prepared data as
graft_exp.evaluation takes them."""

from pathlib import Path

import numpy as np
import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils.config import validate_config

from graft_exp.algorithms import grpo_advantages
from graft_exp.backends.verl.backend import dataset_problems, gather_groups
from graft_exp.backends.verl.config import minibatch_prompts, placement, verl_config
from graft_exp.config import validate
from graft_exp.evaluation import evaluate
from graft_exp.methods import resolve
from graft_exp.prepare import SOURCES, verl_rows, write_parquet
from graft_exp.prompts import SUFFIX

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
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.28, 3.0)
    # the scheduler counts optimizer steps: 174 training steps x 4 minibatches (unknown until the data is read)
    assert actor.optim.total_training_steps == -1
    assert verl_config(pair1_graft, "B", str(tmp_path), training_steps=174).actor_rollout_ref.actor.optim \
        .total_training_steps == 174 * 4
    assert (rollout.prompt_length, rollout.response_length) == (2048, 4096)
    assert (rollout.temperature, rollout.top_p) == (1.0, 1.0)
    assert actor.loss_agg_mode == "token-mean" and actor.use_kl_loss is False and actor.entropy_coeff == 0
    assert config.algorithm.use_kl_in_reward is False and config.algorithm.adv_estimator == "grpo"
    assert (rollout.val_kwargs.temperature, rollout.val_kwargs.top_p, rollout.val_kwargs.n) == (0.6, 0.95, 8)
    assert actor.fsdp_config.dtype == "bfloat16" and rollout.dtype == "bfloat16"
    assert config.trainer.total_epochs == 3 and config.trainer.test_freq == 5
    assert config.trainer.balance_batch is False            # replaced by our per-minibatch DP layout
    assert config.trainer.n_gpus_per_node == 2 and rollout.tensor_model_parallel_size == 1   # a replica per GPU
    assert data.val_files[-1].endswith("minerva/test.parquet")
    validate_config(config, use_reference_policy=False, use_critic=False)


def test_hacpo_released_configuration(tmp_path):
    cfg = _compose("pair=pair1", "method=hacpo")
    actor = verl_config(cfg, "A", str(tmp_path)).actor_rollout_ref.actor
    assert minibatch_prompts(cfg) == 64 and actor.ppo_mini_batch_size == 64
    assert actor.use_kl_loss is True and actor.kl_loss_coef == 1e-3 and actor.kl_loss_type == "low_var_kl"
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (3e-4, 4e-4)
    spec = resolve(cfg.method).loss
    assert spec.kind == "hacpo" and spec.settings["cross_clip_delta"] == pytest.approx(0.2)
    assert spec.needs_reference_model and spec.sequence_level and "old_log_prob" not in spec.columns
    assert resolve(_compose("pair=pair1", "method=grpo_n8").method).loss.clip_ratio_c == 3.0


def test_verl_overrides_and_placement_errors(tmp_path):
    cfg = _compose("pair=pair1", "method=graft", "backend.verl_overrides=['actor_rollout_ref.rollout.enforce_eager=true']")
    assert verl_config(cfg, "A", str(tmp_path)).actor_rollout_ref.rollout.enforce_eager is True
    with pytest.raises(ValueError, match="needs 6 GPUs"):
        placement(_compose("pair=pair1", "backend.gpus_per_model=3"))
    with pytest.raises(ValueError, match="multiple of backend.rollout_tp"):
        placement(_compose("pair=pair1", "backend.gpus_per_model=1", "backend.rollout_tp=2"))


LOSS_KINDS = {"graft_seq_ratio": "sequence_ratio", "graft_luffy": "luffy", "sgt": "sgt", "sgt_which": "sgt",
              "hacpo": "hacpo", "hacpo_which": "hacpo"}


@pytest.mark.slow   # composes every pair x method into a verl config
def test_every_pair_and_method_composes_with_verl(tmp_path):
    """All 3 x 22 jobs compose and validate with backend=verl; verl configs are built for every method
    (pair1) and for both roles of every pair (their models are what differs between pairs)."""
    for pair in PAIRS:
        for method in METHODS:
            cfg = _compose(f"pair={pair}", f"method={method}")
            validate(cfg)
            if resolve(cfg.method).co_train:   # a peer loss that names no objective of its own trains GRAFT's
                resolved = resolve(cfg.method)
                assert resolved.loss.kind == LOSS_KINDS.get(method, resolved.peer_loss.objective or "graft"), method
            roles = ("A", "B") if method == "graft" else ("A",) if pair == "pair1" else ()
            for role in roles:
                config = verl_config(cfg, role, str(tmp_path / role))
                assert config.actor_rollout_ref.rollout.n == cfg.method.n
                assert config.actor_rollout_ref.model.path == cfg.models[cfg.pair[role]].hf_id


def test_grpo_advantages_match_verl():
    rewards = torch.tensor([[1.0, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]])
    mask = torch.ones(12, 3)
    token_rewards = torch.zeros(12, 3)
    token_rewards[:, -1] = rewards.flatten()
    index = np.repeat(np.arange(3), 4)
    theirs, _ = compute_grpo_outcome_advantage(token_rewards, mask, index, epsilon=1e-6)
    assert torch.allclose(theirs[:, 0].view(3, 4), grpo_advantages(rewards), atol=1e-6)


def test_validation_benchmarks_from_prepared_data_scored_by_evaluation(tmp_path):
    """The validation Parquet files (prepare.py) read by verl's RLHFDataset become graft_exp.evaluation's
    benchmarks: one per data source, each problem's prompt text and gold answer; pass@1 and the average
    follow from responses by prompt text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from verl.utils.dataset.rl_dataset import RLHFDataset

    files = [write_parquet(verl_rows(records, SOURCES[key]), SOURCES[key], tmp_path, check_rows=False)
             for key, records in (("aime2024", [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}]),
                                  ("amc23", [{"question": "3*3?", "answer": "9"}]))]
    tok = Tokenizer(models.WordLevel({"<eos>": 0, "<unk>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>",
                                        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 2048, "filter_overlong_prompts": False,
                               "return_raw_chat": True, "cache_dir": str(tmp_path / "cache")})
    dataset = RLHFDataset(data_files=[str(f) for f in files], tokenizer=tokenizer, config=config)
    benchmarks = {}
    for source, problem in dataset_problems(dataset):
        benchmarks.setdefault(source, []).append(problem)
    assert {k: [(p.prompt, p.answer, p.row) for p in v] for k, v in benchmarks.items()} == {
        "aime2024": [(f"1+1? {SUFFIX}", "2", 0), (f"2+2? {SUFFIX}", "4", 1)], "amc23": [(f"3*3? {SUFFIX}", "9", 2)]}
    answers = {f"1+1? {SUFFIX}": ["\\boxed{2}", "\\boxed{3}"], f"2+2? {SUFFIX}": ["\\boxed{4}"] * 2,
               f"3*3? {SUFFIX}": ["9"] * 2}
    scores = evaluate(lambda prompts, k, *_: [answers[p] for p in prompts], benchmarks, 2, 0.6, 0.95, 0)
    assert scores == {"aime2024": 0.75, "amc23": 0.0, "avg": 0.375}


def test_dynamic_sampling_takes_kept_groups_of_several_draws():
    """DAPO's kept groups of two draws become one step's rollouts: verl rows and exchange view agree."""
    from verl import DataProto

    from graft_exp.backends.verl import batch as vb
    from graft_exp.rollouts import Rollouts

    def draw(first_id: int) -> tuple[DataProto, Rollouts]:
        ids = [[first_id + row] for row in range(6)]    # 3 prompts x n = 2, one token per response
        out = DataProto.from_dict(tensors=vb.pack_rows([[1]] * 6, ids, prompt_length=2, response_length=2,
                                                       pad_token_id=0))
        rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
        rollouts = Rollouts(model="m", prompt_ids=[f"{first_id}-{q}" for q in range(3)],
                            responses=[[str(first_id + 2 * q), str(first_id + 2 * q + 1)] for q in range(3)],
                            rewards=rewards, advantages=grpo_advantages(rewards),
                            logp_sum=-torch.arange(6, dtype=torch.float64).view(3, 2) - first_id,
                            num_tokens=torch.ones(3, 2, dtype=torch.long), finished=torch.ones(3, 2, dtype=torch.bool))
        return out, rollouts

    draws = [(draw(10), [0, 2]), (draw(20), []), (draw(30), [2])]
    rows = gather_groups([(out, groups) for (out, _), groups in draws], n=2)
    taken = Rollouts.concat_groups([(rollouts, groups) for (_, rollouts), groups in draws])
    assert taken.prompt_ids == ["10-0", "10-2", "30-2"]
    assert taken.responses == [["10", "11"], ["14", "15"], ["34", "35"]]
    assert [vb.row_tokens(rows, row)[1] for row in range(6)] == [[10], [11], [14], [15], [34], [35]]
    assert taken.logp_sum[:, 0].tolist() == [-10, -14, -34] and taken.k.tolist() == [1, 1, 1]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_precision_reaches_fsdp_mixed_precision_and_vllm_alike(precision, tmp_path):
    """verl's FSDP engine computes in ``fsdp_config.mixed_precision.param_dtype`` (bf16 when it is unset; it
    never reads ``fsdp_config.dtype``) while vLLM samples in ``rollout.dtype``: both carry train.precision."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.torch_dtypes import PrecisionType

    config = verl_config(_compose("pair=pair1", f"train.precision={precision}"), "A", str(tmp_path))
    engine = omega_conf_to_dataclass(config.actor_rollout_ref.actor.fsdp_config)
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    assert PrecisionType.to_dtype(engine.mixed_precision["param_dtype"]) == expected
    assert PrecisionType.to_dtype(config.actor_rollout_ref.rollout.dtype) == expected
    assert (engine.mixed_precision["reduce_dtype"], engine.model_dtype) == ("fp32", "fp32")   # fp32 master weights
    assert PrecisionType.to_dtype(config.actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype) == expected


def test_checkpoints_carry_no_hf_model_export(pair1_graft, tmp_path):
    """verl 0.9.1's FSDPCheckpointManager exports hf_model (the full model gathered to rank 0) on every save
    whose save_contents lists it; nothing reads it. Latest holds what resuming needs."""
    checkpoint = verl_config(pair1_graft, "A", str(tmp_path)).actor_rollout_ref.actor.checkpoint
    assert list(checkpoint.save_contents) == ["model", "optimizer", "extra"]
    assert list(checkpoint.load_contents) == ["model", "optimizer", "extra"]


@pytest.mark.parametrize("method", ["grpo_n8", "grpo_ds", "graft"])
@pytest.mark.parametrize("key", ["kl_coef", "entropy_coef"])
def test_kl_and_entropy_coefficients_refused_before_any_run(method, key):
    """Every verl update goes through graft_exp's loss, which has no KL or entropy term: a coefficient would
    be silently ignored by the single-model methods too. ``validate`` (run before the MLflow run opens)
    refuses it in one line."""
    from graft_exp.config import ConfigError

    cfg = _compose("pair=pair1", f"method={method}", f"train.{key}=0.01")
    with pytest.raises(ConfigError, match=f"train.{key}=0.01 is not supported by backend=verl.*set train.{key}=0"):
        validate(cfg)
