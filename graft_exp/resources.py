"""A job's resource plan: GPUs and nodes per model pool, host CPUs and memory, GPU memory per GPU, checkpoint
contents and sizes, peak disk, and the Slurm request, from the composed config and the model sizes of
``conf/catalog/sizes.yaml``. Pure arithmetic: nothing is downloaded, started or created.

``python -m graft_exp.plan`` prints it; launching (``python -m graft_exp``, the multirun callback, the sweep
tool, Slurm submission) runs ``check`` on the same plan before anything is created, and the Slurm request a
job makes is ``Plan.slurm`` (``launching.callbacks``), so the plan shown is the request made.

Sizes are GiB (2**30 bytes), written "GB" as Slurm and nvidia-smi do. Where a number is an estimate rather
than a count, its docstring says what it leaves out. What verl 0.9.1 does that the numbers follow:

- FSDP keeps fp32 master parameters (``fsdp_config.model_dtype: fp32``), fp32 gradients and AdamW's two
  fp32 moments, sharded over the pool's ranks: 16 bytes per parameter, divided by the pool's GPUs. verl frees
  the gradients after each ``train_batch`` (``zero_grad``); what stayed resident after a step on an H200 was
  between parameters + AdamW's moments and the full state (docs/verl.md's table,
  ``benchmarks/fsdp_step_memory.py``). The plan counts the full state while vLLM is awake from the second step on,
  the bound every reading stays under.
- PyTorch's caching allocator reserves more than the peak it allocates: ``ALLOCATOR_HEADROOM`` x the activation
  term above it (the larger reserve of the first reading; docs/verl.md's table has each reading), on top of
  ``GPU_RESERVE_GB`` for what the allocator does not see (the two CUDA contexts per GPU, NCCL's buffers).
- HACPO's KL term (``method.hacpo.kl_coef > 0``) starts a reference model in every pool: a second FSDP engine whose
  fp32 parameters are offloaded to host memory (``ref.fsdp_config.param_offload``), loaded like the actor.
- vLLM takes ``gpu_memory_utilization`` of the *whole* GPU when it wakes (weights, KV cache, activations),
  whatever FSDP already holds on it.
- Placement groups reserve ``ResourcePoolManager.max_colocate_count`` = 3 Ray CPUs with each GPU.
- A model with tied embeddings is loaded in fp32 into host memory by *every* rank
  (``get_init_weight_context_manager(use_meta_tensor=not tie_word_embeddings)``), not by rank 0 only.
- A checkpoint's ``model`` and ``optimizer`` are the ranks' fp32 shards; ``hf_model`` is a bf16 export
  gathered to rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from graft_exp.config import ConfigError, roles, validate_job

SIZES_FILE = Path(__file__).resolve().parents[1] / "conf" / "catalog" / "sizes.yaml"
GB = 2 ** 30

#: What each checkpoint holds (verl's ``checkpoint.save_contents``). ``latest`` resumes a job, so it keeps the
#: optimizer and the extra state (LR scheduler, RNG); ``best`` is only ever loaded as weights for the final
#: evaluation. Nothing reads a ``hf_model`` export.
LATEST_CONTENTS = ("model", "optimizer", "extra")
BEST_CONTENTS = ("model",)
#: Bytes per parameter of each checkpoint part (``extra`` is a few kB).
CONTENT_BYTES = {"model": 4, "optimizer": 8, "extra": 0, "hf_model": 2}

#: verl's Ray CPUs reserved with each GPU of a placement group.
RAY_CPUS_PER_GPU = 3
#: GPU memory neither FSDP nor vLLM's share accounts for and torch's allocator does not see: two CUDA contexts per
#: GPU (the FSDP worker and the vLLM engine) and NCCL buffers.
GPU_RESERVE_GB = 3.0
#: The caching allocator's reserve above the allocated peak of a training step, per GB of the activation term
#: (measured on an H200: docs/verl.md's table).
ALLOCATOR_HEADROOM = 0.92
#: Bytes per (token, vocabulary entry) of each path verl 0.9.1's log-prob pass may take, chosen by
#: ``backend.logprob_path`` (``backends/verl/logprobs.py``), which the job sets on its workers. ``rowwise``
#: (``logprobs_from_logits_v2``): the bf16 log-softmax kept for the backward pass and its bf16 gradient; measured at
#: 16,384 tokens, 10.2 GiB of activations for Qwen3-1.7B against this term's 11.0 (a full fp32 log-softmax took
#: 19-29 GiB). ``chunked``: the same tensors, computed in blocks of rows (benchmarks/logprob_path.py measures its
#: peak beside rowwise's). ``flash_attn_ce`` (flash-attn's Triton cross-entropy, ``inplace_backward=True``): the
#: bf16 logits, whose buffer the backward pass writes the gradient into; derived from the kernel, not measured.
LOGITS_BYTES = {"chunked": 4, "rowwise": 4, "flash_attn_ce": 2}
#: Host memory per GPU for its processes (FSDP worker, vLLM engine core: Python, torch, CUDA runtime).
HOST_PER_GPU_GB = 5.0
#: Host memory per agent-loop worker (tokenizer, reward process) and for the driver process.
HOST_PER_AGENT_WORKER_GB = 1.0
HOST_DRIVER_GB = 4.0
#: The tiny CPU pair on backend=local: one core, a few hundred MB (measured in the tiny study).
LOCAL_CPUS, LOCAL_MEM_GB = 1, 2


@dataclass(frozen=True)
class ModelSize:
    params: int
    layers: int
    hidden: int
    vocab: int
    tied_embeddings: bool


@lru_cache(maxsize=1)
def _sizes() -> dict:
    return OmegaConf.to_container(OmegaConf.load(SIZES_FILE))


def model_size(key: str) -> ModelSize:
    """The catalog size of model ``key`` (``conf/catalog/sizes.yaml``)."""
    if key not in _sizes():
        raise ConfigError(f"model {key!r} has no size in conf/catalog/sizes.yaml: add its params, layers, hidden, "
                          "vocab and tied_embeddings from its config.json")
    return ModelSize(**_sizes()[key])


def gb(n_bytes: float) -> float:
    return round(n_bytes / GB, 1)


@dataclass
class GpuMemory:
    """Per GPU of one pool, GB. ``vllm`` is ``gpu_memory_utilization`` x ``gpu`` (None when the GPU size is not
    given); ``rollout`` = FSDP state + vLLM's share + reserve (vLLM awake; see the module docstring),
    ``train`` = FSDP state + activations + the allocator's headroom + reserve (vLLM asleep)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    headroom: float
    vllm_fraction: float
    vllm: float | None
    rollout: float | None
    train: float
    gpu: float | None


@dataclass
class Pool:
    role: str
    model: str
    gpus_per_node: int
    nnodes: int
    rollout_tp: int
    replicas: int
    gpu_mem_gb: GpuMemory
    host_mem_gb: float          # steady host memory of the pool (vLLM's sleeping weights, offloads, processes)
    load_host_mem_gb: float     # transient, while verl loads the model on every rank


@dataclass
class Checkpoint:
    contents: list[str]
    gb: float


@dataclass
class Plan:
    """One job's resources. ``gpus``/``cpus``/``host_mem_gb`` are per node; ``slurm`` is the request."""

    backend: str
    nnodes: int
    gpus: int
    cpus: int
    ray_cpus: int
    host_mem_gb: float
    pools: list[Pool]
    checkpoint: dict[str, Checkpoint]
    peak_disk_gb: float
    slurm: dict
    trained: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_mem_gb(self) -> dict[str, GpuMemory]:
        return {pool.role: pool.gpu_mem_gb for pool in self.pools}

    def to_dict(self) -> dict:
        out = asdict(self)
        out["gpu_mem_gb"] = {role: asdict(memory) for role, memory in self.gpu_mem_gb.items()}
        return out


def fsdp_bytes_per_param(backend: DictConfig) -> dict[str, int]:
    """Bytes per parameter each GPU-resident FSDP state takes over the whole pool (divide by its GPUs):
    fp32 master parameters and gradients (on the host with ``param_offload``), AdamW's two fp32 moments (on
    the host with ``optimizer_offload``)."""
    on_gpu = not backend.param_offload
    return {"params": 4 * on_gpu, "grads": 4 * on_gpu, "optimizer": 8 * (not backend.optimizer_offload)}


def activations_bytes(size: ModelSize, tokens: int, path: str = "chunked") -> int:
    """Training activations of one micro-batch of ``tokens`` (``max_token_len_per_gpu``), an estimate: the
    log-prob pass's logits (``LOGITS_BYTES[path]`` per token and vocabulary entry) and, with gradient
    checkpointing, one bf16 hidden state per layer. A layer's own recomputed activations are left out (small
    beside these)."""
    return tokens * size.vocab * LOGITS_BYTES[path] + tokens * size.hidden * 2 * size.layers


def checkpoint_gb(params: int, contents: Sequence[str]) -> float:
    return gb(params * sum(CONTENT_BYTES[c] for c in contents))


def needs_reference_model(cfg: DictConfig) -> bool:
    """Whether the job's loss has a KL term to a reference model (HACPO's), which verl runs as a second engine."""
    from graft_exp.methods import resolve

    return resolve(cfg.method).loss.needs_reference_model


def _pool(cfg: DictConfig, role: str, gpu_size: float | None) -> Pool:
    backend = cfg.backend
    key = cfg.pair[role]
    size = model_size(key)
    world = int(backend.gpus_per_model) * int(backend.nnodes)
    per_param = fsdp_bytes_per_param(backend)
    states = {name: gb(size.params * b / world) for name, b in per_param.items()}
    if backend.logprob_path not in LOGITS_BYTES:
        raise ConfigError(f"backend.logprob_path={backend.logprob_path!r} is not one of {', '.join(LOGITS_BYTES)}")
    activations = gb(activations_bytes(size, int(backend.max_token_len_per_gpu), str(backend.logprob_path)))
    headroom = round(ALLOCATOR_HEADROOM * activations, 1)
    fraction = float(backend.gpu_memory_utilization)
    vllm = None if gpu_size is None else round(fraction * gpu_size, 1)
    resident = sum(states.values()) + GPU_RESERVE_GB
    memory = GpuMemory(**states, activations=activations, headroom=headroom, vllm_fraction=fraction, vllm=vllm,
                       rollout=None if vllm is None else round(resident + vllm, 1),
                       train=round(resident + activations + headroom, 1), gpu=gpu_size)
    tp = int(backend.rollout_tp)
    replicas = world // tp
    # vLLM sleeps at level 1 (its weights wait in host memory, bf16: a full copy per replica); offloaded
    # FSDP state lives on the host too; each node holds its share of the pool.
    offloaded = size.params * (8 * bool(backend.param_offload) + 8 * bool(backend.optimizer_offload)
                               + 4 * needs_reference_model(cfg))   # the reference model's fp32 parameters
    nnodes = int(backend.nnodes)
    steady = (2 * size.params * replicas + offloaded) / nnodes + HOST_PER_GPU_GB * GB * int(backend.gpus_per_model)
    load = 4 * size.params * (int(backend.gpus_per_model) if size.tied_embeddings else 1)
    return Pool(role=role, model=key, gpus_per_node=int(backend.gpus_per_model), nnodes=nnodes, rollout_tp=tp,
                replicas=replicas, gpu_mem_gb=memory, host_mem_gb=gb(steady), load_host_mem_gb=gb(load))


def round_up(value: float, step: int) -> int:
    return int(math.ceil(value / step) * step)


def job_plan(cfg: DictConfig, trained: Sequence[str] | None = None) -> Plan:
    """The plan of the job ``cfg`` training the roles ``trained`` (default: all; a single-model job whose
    other member's shared GRPO baseline already finished trains only the rest, and asks only for their
    GPUs). ``cluster.gpu_mem_gb`` (the GPUs' memory, when given) enables the GPU-memory check."""
    trained = list(trained if trained is not None else roles(cfg.pair))
    if cfg.backend.name != "verl":
        slurm = {"nodes": 1, "gpus_per_node": 0, "cpus_per_task": LOCAL_CPUS, "mem_gb": LOCAL_MEM_GB}
        return Plan(backend=cfg.backend.name, nnodes=1, gpus=0, cpus=LOCAL_CPUS, ray_cpus=0, host_mem_gb=LOCAL_MEM_GB,
                    pools=[], checkpoint={}, peak_disk_gb=0.0, slurm=slurm, trained=trained,
                    notes=["backend=local: the tiny CPU models, checkpoints of a few MB"])
    backend = cfg.backend
    gpu_size = cfg.cluster.get("gpu_mem_gb")
    gpu_size = None if gpu_size is None else float(gpu_size)
    pools = [_pool(cfg, role, gpu_size) for role in trained]
    nnodes = int(backend.nnodes)
    gpus = len(pools) * int(backend.gpus_per_model)
    ray_cpus = RAY_CPUS_PER_GPU * gpus
    # Each agent-loop worker tokenizes and scores on a core of its own; one more for the driver process.
    cpus = ray_cpus + int(backend.agent_workers) * len(pools) + 1
    # start_models loads every pool at the same time: their load spikes add up.
    host = (sum(p.host_mem_gb for p in pools) + sum(p.load_host_mem_gb for p in pools) / nnodes
            + HOST_PER_AGENT_WORKER_GB * int(backend.agent_workers) * len(pools) + HOST_DRIVER_GB)
    params = sum(model_size(p.model).params for p in pools)
    checkpoint = {"latest": Checkpoint(list(LATEST_CONTENTS), checkpoint_gb(params, LATEST_CONTENTS)),
                  "best": Checkpoint(list(BEST_CONTENTS), checkpoint_gb(params, BEST_CONTENTS))}
    slurm = {"nodes": nnodes, "gpus_per_node": gpus, "cpus_per_task": cpus, "mem_gb": round_up(host, 8)}
    notes = []
    if backend.logprob_path == "flash_attn_ce":
        notes.append("activations follow flash-attn's in-place cross-entropy (backend.logprob_path=flash_attn_ce): "
                     "half the row-wise logits term, derived, not measured (chunked, the default, and rowwise are measured)")
    if nnodes > 1:
        notes.append(f"{nnodes} nodes: every pool spans every node; checkpoint_root ({cfg.checkpoint_root}) and "
                     f"backend.model_dir ({backend.model_dir}) must be one shared filesystem that every node "
                     "sees (each rank writes its checkpoint shard and reads the model there)")
    return Plan(backend="verl", nnodes=nnodes, gpus=gpus, cpus=cpus, ray_cpus=ray_cpus, host_mem_gb=round(host, 1),
                pools=pools, checkpoint=checkpoint, peak_disk_gb=peak_disk_gb(params), slurm=slurm,
                trained=trained, notes=notes)


def peak_disk_gb(params: int, latest: Sequence[str] = LATEST_CONTENTS, best: Sequence[str] = BEST_CONTENTS) -> float:
    """Peak disk of a job's checkpoints (``driver.save_checkpoint``): the previous checkpoint stays until the
    new one is renamed into place (two ``latest``), and when the best step moved, the previous checkpoint's
    best (hard links) and the newly staged one are both on disk (two ``best``)."""
    return round(2 * checkpoint_gb(params, latest) + 2 * checkpoint_gb(params, best), 1)


def check_job(cfg: DictConfig) -> None:
    """What every launch path refuses before anything is created, in one line: the config (``validate_job``:
    values, this machine's extras, data and checkpoint root), then its plan (``check``: GPU memory, token budget,
    what ``python -m graft_exp.plan`` prints)."""
    validate_job(cfg)
    check(job_plan(cfg), cfg)


def check(plan: Plan, cfg: DictConfig) -> None:
    """Refuse a plan that cannot run, in one line that says what to change."""
    if plan.backend != "verl":
        return
    train, backend = cfg.train, cfg.backend
    sequence = int(train.max_prompt_length) + int(train.max_response_length)
    if int(backend.max_token_len_per_gpu) < sequence:
        # verl's dynamic micro-batching asserts on the first sequence longer than its token budget.
        raise ConfigError(f"backend.max_token_len_per_gpu={backend.max_token_len_per_gpu} is below one sequence of "
                          f"train.max_prompt_length + train.max_response_length = {sequence} tokens: raise "
                          f"backend.max_token_len_per_gpu to at least {sequence}")
    for pool in plan.pools:
        memory = pool.gpu_mem_gb
        if memory.gpu is None:
            continue
        fsdp = memory.params + memory.grads + memory.optimizer
        if memory.rollout > memory.gpu:
            fits = math.floor((memory.gpu - fsdp - GPU_RESERVE_GB) / memory.gpu * 20) / 20
            advice = (f"lower backend.gpu_memory_utilization to {fits:.2f}" if fits >= 0.1 else
                      "set backend.optimizer_offload=true")
            raise ConfigError(
                f"backend.gpu_memory_utilization={memory.vllm_fraction} of a {memory.gpu:g} GB GPU ({memory.vllm} GB "
                f"for vLLM) plus {pool.model}'s FSDP state from step 2 ({fsdp:.1f} GB per GPU: parameters, gradients, "
                f"AdamW) and {GPU_RESERVE_GB:g} GB reserve is {memory.rollout} GB > {memory.gpu:g} GB: {advice}, or "
                "raise backend.gpus_per_model")
        weights = gb(2 * model_size(pool.model).params / pool.rollout_tp)
        if memory.vllm < weights + 1:
            raise ConfigError(
                f"backend.gpu_memory_utilization={memory.vllm_fraction} gives vLLM {memory.vllm} GB per GPU, not "
                f"enough for {pool.model}'s bf16 weights ({weights} GB per GPU at rollout_tp={pool.rollout_tp}) and a "
                "KV cache: raise backend.gpu_memory_utilization or backend.rollout_tp")
        if memory.train > memory.gpu:
            raise ConfigError(
                f"{pool.model} needs {memory.train} GB per GPU to train (FSDP state {fsdp:.1f} GB, activations of "
                f"backend.max_token_len_per_gpu={cfg.backend.max_token_len_per_gpu} tokens {memory.activations} GB, "
                f"the allocator's headroom {memory.headroom} GB) > "
                f"{memory.gpu:g} GB: lower backend.max_token_len_per_gpu or raise backend.gpus_per_model")


def device_memory_gb() -> float | None:
    """The memory of this node's first CUDA GPU in GB, or None without one."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GB if torch.cuda.is_available() else None


def check_on_node(cfg: DictConfig, trained: Sequence[str], measured_gb: float | None) -> None:
    """The plan checked again where the job runs, before Ray starts: against the GPUs this node has
    (``measured_gb``, ``device_memory_gb``), whatever ``cluster.gpu_mem_gb`` said at submission."""
    if measured_gb is None or cfg.cluster.get("gpu_mem_gb") is None:
        return
    node = OmegaConf.merge(cfg, {"cluster": {"gpu_mem_gb": math.floor(measured_gb * 10) / 10}})
    try:
        check(job_plan(node, trained), node)
    except ConfigError as err:
        raise ConfigError(f"this node's GPUs have {measured_gb:.1f} GB (cluster.gpu_mem_gb={cfg.cluster.gpu_mem_gb}): "
                          f"{err}") from None
