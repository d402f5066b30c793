"""Our composed config (pair x method x train/eval) -> one verl config per trained model.

verl 0.9.1 ships its whole PPO trainer config flattened in ``trainer/config/_generated_ppo_trainer.yaml``
(verl's CI keeps it equal to the Hydra-composed ``ppo_trainer.yaml``); we load it and set every field the
paper fixes (Table 3, App. B) from ``train.*``, ``eval.*`` and ``method.*``, and the placement from
``backend.*``. Nothing here starts Ray or touches a GPU.
"""

from __future__ import annotations

import copy
import math
import os
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import verl
from omegaconf import DictConfig, OmegaConf

from graft_exp.backends.verl.logprobs import LOGPROB_PATH_ENV
from graft_exp.config import minibatch_prompts, verl_overrides
from graft_exp.methods import resolve
from graft_exp.prompts import prompt_format
from graft_exp.resources import LATEST_CONTENTS, RAY_CPUS_PER_GPU

GENERATED_CONFIG = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"

#: graft_exp's entries of verl's agent-loop registry, read by verl's agent-loop workers, and the name of
#: the one every generation runs (``seeded_agent.SeededSingleTurnAgentLoop``).
AGENT_LOOPS = Path(__file__).with_name("agent_loops.yaml")
AGENT_NAME = "graft_seeded_single_turn"

#: Where ``python -m graft_exp.prepare`` writes each data set (relative to ``backend.data_dir``).
TRAIN_FILE = "math/train.parquet"


def benchmark_file(bench: str) -> str:
    return f"{bench}/test.parquet"


@dataclass(frozen=True)
class Placement:
    """Which GPUs of each node a model's worker group owns (split resource pools)."""

    gpus: int              # GPUs of this model's pool on each node (FSDP world size: gpus x nnodes)
    rollout_tp: int        # vLLM tensor parallelism
    nnodes: int = 1


def placement(cfg: DictConfig) -> Placement:
    """Split each node's GPUs (``pair.gpus``) into one pool per model (both models run, co-trained or
    independently); with ``backend.nnodes`` > 1 every pool spans every node of the job's Ray cluster."""
    per_model = int(cfg.backend.gpus_per_model)
    if 2 * per_model > int(cfg.pair.gpus):
        raise ValueError(
            f"backend.gpus_per_model={per_model} needs {2 * per_model} GPUs but pair.gpus={cfg.pair.gpus}"
        )
    tp = int(cfg.backend.rollout_tp)
    if per_model % tp:
        raise ValueError(f"backend.gpus_per_model={per_model} is not a multiple of backend.rollout_tp={tp}")
    nnodes = int(cfg.backend.nnodes)
    if nnodes < 1:
        raise ValueError(f"backend.nnodes={nnodes}: a job runs on at least one node")
    return Placement(gpus=per_model, rollout_tp=tp, nnodes=nnodes)


def model_path(cfg: DictConfig, role: str) -> str:
    """The prepared local snapshot of the role's model if there is one, else its hub id."""
    key = cfg.pair[role]
    local = Path(cfg.backend.model_dir) / key
    if local.is_dir():
        return str(local.resolve())
    hf_id = cfg.models[key].hf_id
    if not hf_id:
        raise ValueError(f"model {key!r} has no hf_id: it is a CPU test-bed model, use backend=local")
    return hf_id


def data_files(cfg: DictConfig) -> tuple[str, list[str]]:
    """(training Parquet, one Parquet per benchmark) under ``backend.data_dir``."""
    root = Path(cfg.backend.data_dir)
    if cfg.pair.data != "math":
        raise ValueError(f"backend=verl trains on MATH; pair.data={cfg.pair.data!r} has no verl Parquet")
    return str(root / TRAIN_FILE), [str(root / benchmark_file(b)) for b in cfg.pair.benchmarks]


def optimizer_updates_per_step(cfg: DictConfig) -> int:
    """Optimizer steps per training step on a full batch: ppo_epochs x minibatches (Table 3: 128 / 32 = 4;
    HACPO: its own and its peer's groups, 2 x 128 / 64 = 4). A step whose gate removed a whole minibatch
    takes one fewer. The runtime calls ``update_actor`` once per optimizer step and verl's LR scheduler
    steps once per call, so these are also the scheduler's steps."""
    groups = resolve(cfg.method).peer_loss.receiver_groups(int(cfg.train.batch_prompts))
    return int(cfg.train.ppo_epochs) * math.ceil(groups / minibatch_prompts(cfg))


#: Environment variable carrying this job's token to every Ray actor (``ray_init_kwargs``).
JOB_TOKEN_ENV = "GRAFT_JOB_TOKEN"


def job_token() -> str:
    """A token naming this job's node-local files (Slurm job id when there is one, plus randomness)."""
    return f"{os.environ.get('SLURM_JOB_ID', 'local')}-{uuid.uuid4().hex[:8]}"


def ray_init_kwargs(config: DictConfig, token: str | None = None, logprob_path: str = "chunked") -> dict:
    """``ray.init`` arguments for a job: verl's PPO runtime environment (``get_ppo_ray_runtime_env``:
    ``VLLM_DISABLE_COMPILE_CACHE``, NCCL / vLLM log levels, ... as ``verl.trainer.main_ppo`` passes them)
    plus this job's token for its socket names (``runtime.scoped_zmq_handle``), and, for the private Ray
    a one-node job starts, a temp dir of its own (Ray's sessions and sockets; a cluster joined by
    address keeps the one ``ray start`` was given), the log-prob path of ``backend.logprob_path`` on every
    worker (``logprobs.LOGPROB_PATH_ENV``, which the worker installs, and ``VERL_DISABLE_FLASH_ATTN_CE``, which
    verl reads per call) and the OpenMP threads of each Ray process.

    ``config`` is the verl config of one of the job's models (``verl_config``)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    token = token or job_token()
    runtime_env = get_ppo_ray_runtime_env(config)
    runtime_env.setdefault("env_vars", {})[JOB_TOKEN_ENV] = token
    # The log-prob path the plan counted (backend.logprob_path), whatever the node's shell says.
    runtime_env["env_vars"]["VERL_DISABLE_FLASH_ATTN_CE"] = "0" if logprob_path == "flash_attn_ce" else "1"
    runtime_env["env_vars"][LOGPROB_PATH_ENV] = logprob_path
    # Ray gives a process as many OpenMP threads as CPUs it reserved only where OMP_NUM_THREADS is unset; a Slurm
    # job's is its whole allocation (cluster=slurm), which ~40 Ray processes (FSDP workers, vLLM servers and
    # engines, agent-loop workers) would each inherit. Each gets the CPUs the plan reserves per GPU.
    runtime_env["env_vars"]["OMP_NUM_THREADS"] = str(RAY_CPUS_PER_GPU)
    # Ray's Unix socket paths must stay under ~107 bytes: a short directory in the node's /tmp (not the job's
    # temporary folder, which is longer), removed by the backend when the job ends (``VerlBackend.close``).
    return {"runtime_env": runtime_env, "_temp_dir": f"/tmp/graft-ray-{token}"}


@lru_cache(maxsize=1)
def _generated() -> DictConfig:
    return OmegaConf.load(GENERATED_CONFIG)


def verl_config(cfg: DictConfig, role: str, checkpoint_dir: str, training_steps: int | None = None) -> DictConfig:
    """The full verl config of the model playing ``role`` (a member letter: A, B, ...) in this job.

    The model's own worker group, vLLM replicas, tokenizer (its chat template comes with it) and
    checkpoints all follow from this config; the co-training driver holds one per model.

    Learning-rate schedule: verl's scheduler steps once per ``update_actor`` call, which the runtime makes
    once per optimizer step, so ``train.lr_warmup_steps`` counts *optimizer steps* (minibatches; 4 per
    training step under Table 3), the unit of torch's and verl's schedulers; the scheduler's
    ``total_training_steps`` is the run's optimizer steps, ``training_steps`` (default ``train.max_steps``;
    the driver passes the number it computed from the data) x ``optimizer_updates_per_step``.
    """
    train, evaluation, method, backend = cfg.train, cfg.eval, cfg.method, cfg.backend
    place = placement(cfg)
    train_file, val_files = data_files(cfg)
    resolved = resolve(method)
    clip_low, clip_high = resolved.peer_loss.clip_range(method)
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[train.precision]
    optimizer = {"adamw": "AdamW"}[str(train.optimizer).lower()]
    # Every update goes through graft_exp's loss, whose only KL term is HACPO's (config.validate refuses
    # train.kl_coef / train.entropy_coef > 0 on verl before any run exists).
    kl_coef = resolved.loss.kl_coef

    steps = training_steps if training_steps is not None else train.max_steps
    total_updates = -1 if steps is None else int(steps) * optimizer_updates_per_step(cfg)   # -1: verl's "unknown"

    base = copy.deepcopy(_generated())
    ours = {
        "data": {
            "train_files": train_file,
            "val_files": val_files,
            "prompt_key": "prompt",
            "train_batch_size": int(train.batch_prompts),
            "max_prompt_length": int(train.max_prompt_length),
            "max_response_length": int(train.max_response_length),
            "return_raw_chat": True,
            "shuffle": True,
            "seed": int(cfg.seed),
            # MATH prompts are far below 2,048 tokens for every model; filtering would depend on the tokenizer
            # and could give the two models different prompt sets, so an overlong prompt is an error instead.
            "filter_overlong_prompts": False,
            "truncation": "error",
            "validation_shuffle": False,
        },
        "actor_rollout_ref": {
            "hybrid_engine": True,
            "model": {
                "path": model_path(cfg, role),
                "use_remove_padding": True,
                "enable_gradient_checkpointing": bool(backend.gradient_checkpointing),
            },
            "actor": {
                # FSDP2 (per-parameter DTensor sharding), the engine the plan's memory terms were measured on
                # (benchmarks/fsdp_step_memory.py); verl 0.9.1's "fsdp" builds FSDP1, which reserved 3-7 GB more
                # per GPU for the 3B models on an H200 (docs/verl.md, "Defaults on a GPU cluster").
                "strategy": "fsdp2",
                "ppo_mini_batch_size": minibatch_prompts(cfg),
                "ppo_epochs": int(train.ppo_epochs),
                "shuffle": False,
                "use_dynamic_bsz": True,
                "ppo_max_token_len_per_gpu": int(backend.max_token_len_per_gpu),
                "clip_ratio": float(method.clip_low),
                "clip_ratio_low": clip_low,
                "clip_ratio_high": clip_high,
                "clip_ratio_c": float(method.clip_ratio_c),
                "loss_agg_mode": "token-mean",
                "entropy_coeff": float(train.entropy_coef),
                "use_kl_loss": kl_coef > 0,
                "kl_loss_coef": kl_coef,
                "kl_loss_type": "low_var_kl",
                "optim": {
                    "optimizer": optimizer,
                    "lr": float(train.lr),
                    "betas": [float(b) for b in train.betas],
                    "weight_decay": float(train.weight_decay),
                    "clip_grad": float(train.grad_clip),
                    "lr_scheduler_type": "constant",
                    "lr_warmup_steps": int(train.lr_warmup_steps),
                    "lr_warmup_steps_ratio": 0.0,
                    "total_training_steps": total_updates,
                },
                "fsdp_config": {
                    "param_offload": bool(backend.param_offload),
                    "optimizer_offload": bool(backend.optimizer_offload),
                    # The FSDP engine computes in mixed_precision.param_dtype (bf16 when unset) over fp32 master
                    # weights; it never reads fsdp_config.dtype. Gradients reduce and buffers stay in fp32.
                    "mixed_precision": {"param_dtype": train.precision, "reduce_dtype": "fp32",
                                        "buffer_dtype": "fp32"},
                    "dtype": dtype,
                },
                # What resuming needs; no hf_model export (nothing reads it, and verl gathers the full model
                # to rank 0 for it). The best checkpoint holds the model only (resources.BEST_CONTENTS).
                "checkpoint": {"save_contents": list(LATEST_CONTENTS)},
            },
            "ref": {"fsdp_config": {"param_offload": True, "mixed_precision": {"param_dtype": train.precision,
                                                                                "reduce_dtype": "fp32",
                                                                                "buffer_dtype": "fp32"}}},
            "rollout": {
                "name": "vllm",
                "mode": "async",
                "n": int(method.n),
                "temperature": float(train.temperature),
                "top_p": float(train.top_p),
                "top_k": -1,
                "dtype": dtype,
                "tensor_model_parallel_size": place.rollout_tp,
                "gpu_memory_utilization": float(backend.gpu_memory_utilization),
                "calculate_log_probs": True,
                "free_cache_engine": True,
                "checkpoint_engine": {"backend": "naive"},
                # per-sample vLLM seeds from the run seed and step (seeded_agent.py)
                "agent": {"num_workers": int(backend.agent_workers), "default_agent_loop": AGENT_NAME,
                          "agent_loop_config_path": str(AGENT_LOOPS)},
                "val_kwargs": {
                    "temperature": float(evaluation.temperature),
                    "top_p": float(evaluation.top_p),
                    "top_k": -1,
                    "n": int(evaluation.samples),
                    "do_sample": True,
                },
            },
        },
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False},
        "trainer": {
            "project_name": f"graft-{cfg.study}",
            "experiment_name": f"{cfg.pair.name}-{method.name}-s{cfg.seed}-{role}",
            "logger": [],
            "nnodes": place.nnodes,
            "n_gpus_per_node": place.gpus,
            "total_epochs": int(train.total_epochs),
            "total_training_steps": None if train.max_steps is None else int(train.max_steps),
            "test_freq": int(evaluation.val_every),
            "save_freq": int(cfg.train.save_every),
            "default_local_dir": checkpoint_dir,
            "resume_mode": "auto",
            "val_before_train": False,
            "device": "cuda",
            # Minibatch order and DP balance are set by graft_exp (peer-last); see batch.minibatch_layout.
            "balance_batch": False,
        },
    }
    fmt = cfg.models[cfg.pair[role]].get("prompt_format")
    if fmt is not None:   # this model's pinned format, whatever template its snapshot carries (prompts.check_format)
        ours["actor_rollout_ref"]["model"]["custom_chat_template"] = prompt_format(fmt).text
    return OmegaConf.merge(base, OmegaConf.create(ours), verl_overrides(backend))
