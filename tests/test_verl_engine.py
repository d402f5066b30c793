"""verl 0.9.1's real engine workers on CPU: the project's ``GraftActorWorker`` worker group in a real local
Ray (started by ``ray_slurm.start_local_ray`` with ``config.ray_init_kwargs``, as a job starts it), built
as ``VerlModel.start`` builds it (``resource_pools``, ``RayClassWithInitArgs``, ``init_model``), at
data-parallel size 2, FSDP1 (the paper's strategy) and FSDP2; then ``VerlModel``'s log-probs, one GRPO
update through our loss (pickled to the workers by ``set_loss_fn``), verl's sharded checkpoint with its
Hugging Face export, and an exact load. The CPU-only patches, and the worker-side rollout standing in
for vLLM's, are ``verl_cpu``'s.
"""

from __future__ import annotations

import os

import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import ray
import torch
from conftest import CONF_DIR
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from support.verl_cpu import ROLLOUT_DIR_ENV, WORKER_ENV
from test_verl_contract import SMALL, prepared  # noqa: F401 (fixture)
from test_verl_runtime import grpo_update
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

from graft_exp.backends.verl.config import ray_init_kwargs, verl_config
from graft_exp.backends.verl.ray_slurm import start_local_ray, stop_local_ray
from graft_exp.backends.verl.runtime import GraftActorWorker, VerlModel, resource_pools
from graft_exp.methods import resolve

pytestmark = [pytest.mark.verl_engine, pytest.mark.slow]
STRATEGIES = {"A": "fsdp", "B": "fsdp2"}   # one worker group each, on its own pool of 2 stand-in GPUs
MODEL = "tiny-char-llama"


def engine_config(prepared, root, role: str):  # noqa: F811
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "backend=verl", "pair=tiny", "pair.data=math", f"backend.data_dir={prepared / 'data'}",
            f"backend.model_dir={prepared / 'models'}", f"checkpoint_root={root}", "method=grpo_n8", *SMALL])
    GlobalHydra.instance().clear()
    config = verl_config(cfg, role, str(root / role), training_steps=2)
    model = config.actor_rollout_ref.model
    model.path = str(prepared / "models" / MODEL)
    # transformers' default attention is flash-attention 2 in verl's model config (HFModelConfig), CUDA only
    model.override_config = {"attn_implementation": "sdpa"}
    config.actor_rollout_ref.actor.strategy = STRATEGIES[role]
    # fp32 compute (verl's FSDP default computes in bf16), so that log-probs compare with a plain forward
    config.actor_rollout_ref.actor.fsdp_config.mixed_precision = {"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                                   "buffer_dtype": "fp32"}
    return cfg, config


@pytest.fixture(scope="module")
def engines(prepared, tmp_path_factory):  # noqa: F811
    """Both worker groups in one local Ray, shared by the tests of this module (each start costs ~15 s)."""
    root = tmp_path_factory.mktemp("verl_engine")
    configs = {role: engine_config(prepared, root, role) for role in STRATEGIES}
    kwargs = ray_init_kwargs(configs["A"][1])
    kwargs["runtime_env"]["env_vars"].update(WORKER_ENV)
    (root / "rollout").mkdir()
    kwargs["runtime_env"]["env_vars"][ROLLOUT_DIR_ENV] = str(root / "rollout")
    kwargs["num_cpus"] = 16   # verl's pools reserve CPUs per stand-in GPU (ResourcePoolManager's bundles)
    auth = {key: os.environ.get(key) for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    ray_dir = start_local_ray(num_gpus=4, job_dir=root, init_kwargs=kwargs)   # sets this process's Ray token variables
    try:
        models = [VerlModel(role, config, resolve(cfg.method).loss) for role, (cfg, config) in configs.items()]
        pools = resource_pools(models)
        for model in models:
            worker = RayClassWithInitArgs(cls=ray.remote(GraftActorWorker), config=model.config.actor_rollout_ref,
                                          role="actor_rollout")
            wg = RayWorkerGroup(resource_pool=pools.resource_pool_dict[f"graft_{model.role}"],
                                ray_cls_with_init=worker, device_name="cpu", name_prefix=f"graft_{model.role}")
            wg.init_model()
            tokenizer = AutoTokenizer.from_pretrained(model.config.actor_rollout_ref.model.path)
            model.attach(wg, tokenizer)
        yield {model.role: model for model in models}, root
    finally:
        stop_local_ray(ray_dir)
        for key, value in auth.items():   # the tests after these start Ray with their own tokens
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rollouts(tokenizer, prompts: list[str], responses: list[list[str]]) -> DataProto:
    """Rows in the agent loop's layout (left-padded prompts, right-padded responses, prompt-major)."""
    rows = [(tokenizer(p)["input_ids"], tokenizer(r)["input_ids"] + [tokenizer.eos_token_id])
            for p, group in zip(prompts, responses) for r in group]
    width_p, width_r = max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_ids = torch.full((len(rows), width_p), pad)
    response_ids = torch.full((len(rows), width_r), pad)
    prompt_mask, response_mask = torch.zeros_like(prompt_ids), torch.zeros_like(response_ids)
    for i, (p, r) in enumerate(rows):
        prompt_ids[i, width_p - len(p):], prompt_mask[i, width_p - len(p):] = torch.tensor(p), 1
        response_ids[i, :len(r)], response_mask[i, :len(r)] = torch.tensor(r), 1
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    return DataProto.from_dict({"prompts": prompt_ids, "responses": response_ids,
                                "input_ids": torch.cat([prompt_ids, response_ids], dim=1), "attention_mask": attention,
                                "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0),
                                "response_mask": response_mask})


def plain_log_probs(path: str, batch: DataProto, weights: dict | None = None) -> torch.Tensor:
    """The responses' token log-probs under a plain Hugging Face forward of the model at ``path`` (with
    ``weights`` instead of its own, if given)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)   # tied embeddings
    with torch.no_grad():
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                       position_ids=batch.batch["position_ids"]).logits.float()
    width = batch.batch["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -width - 1:-1], dim=-1)
    return log_probs.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1) * batch.batch["response_mask"]


PROMPTS = ["Compute 2+3.", "Compute 7-4.", "Compute 6*3.", "Compute 9+9."]


@pytest.mark.parametrize("role", list(STRATEGIES))
def test_engine_workers_score_train_save_and_load(engines, role):
    models, root = engines
    model = models[role]
    assert model.dp_size == 2
    # every worker's engine takes the log-prob pass the job planned (backend.logprob_path's default)
    assert model.wg.logprob_function() == ["chunked_logprobs"] * 2
    n = int(model.config.actor_rollout_ref.rollout.n)
    responses = [[f"{'The answer is ' * (i % 3)}\\boxed{{{q + i}}}" for i in range(n)] for q in range(len(PROMPTS))]
    batch = rollouts(model.tokenizer, PROMPTS, responses)[torch.arange(len(PROMPTS) * n - 1)]   # odd: dp padding
    before = model.log_probs(batch) * batch.batch["response_mask"]
    expected = plain_log_probs(model.config.actor_rollout_ref.model.path, batch)
    assert torch.allclose(before, expected, atol=1e-4), (before - expected).abs().max()

    full = rollouts(model.tokenizer, PROMPTS, responses)
    full.batch["old_log_probs"] = model.log_probs(full)
    advantages = torch.linspace(-1, 1, n).repeat(len(PROMPTS), 1)
    metrics = grpo_update(model, full, advantages)
    assert metrics["actor/pg_loss"] and all(torch.isfinite(torch.tensor(metrics["actor/pg_loss"])))
    trained = model.log_probs(batch) * batch.batch["response_mask"]
    assert not torch.allclose(trained, before, atol=1e-6)   # the update reached the weights

    step_root = root / role / "latest"
    model.save(str(step_root), 1)
    files = {p.name for p in (step_root / "global_step_1").iterdir()}
    assert {f"model_world_size_2_rank_{r}.pt" for r in (0, 1)} <= files           # verl's sharded checkpoint
    assert {f"optim_world_size_2_rank_{r}.pt" for r in (0, 1)} <= files
    assert not list((step_root / "global_step_1" / "huggingface").glob("*.safetensors"))   # no hf_model export

    # verl's colocated weight sync (update_weights, the naive backend CheckpointEngineManager drives) hands
    # the trained weights to the worker-side rollout: a model with them scores as the trainer does.
    received = root / "rollout" / "weights.pt"
    received.unlink(missing_ok=True)
    ray.get(model.wg.update_weights(global_steps=1))
    synced = plain_log_probs(model.config.actor_rollout_ref.model.path, batch, torch.load(received))
    assert torch.allclose(synced, trained, atol=1e-4)
    assert not torch.allclose(synced, before, atol=1e-3)    # what a sync that sent nothing would leave

    grpo_update(model, full, -advantages)                                           # trained on past the save
    assert not torch.equal(model.log_probs(batch) * batch.batch["response_mask"], trained)
    assert model.load(str(step_root)) == 1
    assert torch.equal(model.log_probs(batch) * batch.batch["response_mask"], trained)   # exactly the saved model
