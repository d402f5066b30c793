"""One model's verl stack on its own resource pool: the FSDP actor worker group, its vLLM replicas, its
agent loop (which applies the model's own chat template) and its checkpoint engine.

Placement: *split resource pools*. Model A owns GPUs [0, g) and model B [g, 2g) of the node (g = 2 on the
paper's 4-GPU node), each running FSDP training and its vLLM replicas colocated on its own GPUs (verl's
hybrid engine: vLLM sleeps while FSDP trains). Why not both models on all four GPUs (HACPO's layout)?
A 1.7-3B model with its AdamW state and a sleeping vLLM fits two 80-141 GB GPUs; split pools let the two
models generate, score and train *at the same time* (the driver calls both pools concurrently), keep each
model's memory independent of the other's, and need no cross-model offloading. The price is idle time
when one model is faster (Qwen3-1.7B waits for a 3B peer at the synchronisation points of each step).

Both pools live in one Ray cluster, so vLLM servers, which verl names by replica rank, would collide:
model B's replicas are numbered after A's (``start_rank``), and the worker side follows (``GraftActorWorker``).
verl names the trainer -> vLLM weight-transfer sockets ``/tmp/rl-colocate-zmq-<Ray job id>-...``; every job
that starts its own Ray has the same first job id, so the names also carry this job's token
(``config.job_token``) on both sides (``scoped_job_id``).

Batches are padded to a multiple of the data-parallel size before verl splits them across ranks, as verl's
own trainer does (``pad_dataproto_to_divisor`` / ``unpad_dataproto``): log-prob passes strip the padding
rows' outputs; update minibatches carry them with weight 0 (``batch.minibatch_layout``). Every update
goes through our loss (``loss.actor_loss``; single-model GRPO too, where it equals verl's vanilla loss), one
``update_actor`` call per optimizer step, so verl's LR scheduler steps once per optimizer step.

Checkpoints follow verl's trainer layout: ``<root>/global_step_<k>`` and the tracker file
``latest_checkpointed_iteration.txt``, written after the save completes; ``latest`` (model, optimizer, extra
state) and ``best`` (the model only: ``resources.BEST_CONTENTS``) are two roots, each keeping only its newest
step (verl's own retention, ``max_ckpt_to_keep``, counts every save of
the worker's one checkpoint manager and would delete the other root's checkpoint).

vLLM sleeps at level 1 while FSDP trains (its weights wait in host memory), so ``generate`` sends the
trainer's weights only when they changed since the replicas last got them (``weights_version``); ``stop``
kills the model's servers and workers at the end of the job.

Nothing in this module has run on a GPU in this project's CI (no GPU there); ``tests/test_verl_*.py``
cover the CPU-side pieces it calls (config, batches, layout, loss) and drive ``VerlModel`` over an
in-process stand-in of its FSDP worker group (``tests/support/verl_standins.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import ray
import torch
from omegaconf import DictConfig
from verl import DataProto
from verl.checkpoint_engine import CheckpointEngineManager
from verl.experimental.agent_loop import AgentLoopManager
from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager
from verl.utils import tensordict_utils as tu
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path, get_checkpoint_tracker_filename
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.memory_utils import aggressive_empty_cache
from verl.workers.config import HFModelConfig
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.llm_server import LLMServerManager
from verl.workers.rollout.replica import RolloutMode, RolloutReplica
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from graft_exp.backends.verl import batch as vb
from graft_exp.backends.verl import logprobs
from graft_exp.backends.verl.config import JOB_TOKEN_ENV
from graft_exp.backends.verl.loss import actor_loss
from graft_exp.costs import phase
from graft_exp.methods.objective import LossSpec
from graft_exp.resources import LATEST_CONTENTS

log = logging.getLogger(__name__)

#: verl's prefix of the trainer -> vLLM weight-transfer socket (vllm_rollout.py / vllm_rollout/utils.py).
ZMQ_PREFIX = "rl-colocate-zmq-"


def scoped_job_id(job_id: str, token: str) -> str:
    """The Ray job id as both ends of the weight-transfer socket see it: prefixed by the job's token."""
    return f"{token}-{job_id}"


def scoped_zmq_handle(handle: str, old_rank: int, offset: int, token: str) -> str:
    """verl's trainer-side socket name with the replica rank shifted by ``offset`` and the job id scoped
    by ``token``, so that it equals what the vLLM worker of that replica computes from the environment
    our server sets (``VERL_REPLICA_RANK``, ``VERL_RAY_JOB_ID`` = ``scoped_job_id``)."""
    if ZMQ_PREFIX not in handle or f"-replica-{old_rank}-" not in handle:
        raise ValueError(f"unexpected weight-transfer socket name {handle!r}: verl's naming changed")
    handle = handle.replace(f"-replica-{old_rank}-", f"-replica-{old_rank + offset}-")
    return handle.replace(ZMQ_PREFIX, f"{ZMQ_PREFIX}{token}-", 1)


@contextmanager
def checkpoint_contents(manager, contents: Sequence[str]):
    """verl's checkpoint ``manager`` saving and loading only ``contents`` (``model``, ``optimizer``, ``extra``)
    for the duration: one worker-side manager serves both the latest checkpoint and the model-only best one."""
    saved, loaded = manager.checkpoint_save_contents, manager.checkpoint_load_contents
    manager.checkpoint_save_contents = manager.checkpoint_load_contents = list(contents)
    try:
        yield manager
    finally:
        manager.checkpoint_save_contents, manager.checkpoint_load_contents = saved, loaded


class GraftActorWorker(ActorRolloutRefWorker):
    """verl's actor-rollout(-ref) worker, plus the log-prob pass the job planned (``logprobs.install``), the
    replica-rank shift of a second pool's rollout, the job-scoped weight-transfer socket and checkpoints of
    chosen contents."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        logprobs.install()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def logprob_function(self) -> str:
        """The name of the log-prob function verl's engine calls in this worker (the tier checks it)."""
        from verl.workers.engine.fsdp import transformer_impl

        return transformer_impl.logprobs_from_logits.__name__

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def isolate_rollout(self, offset: int) -> None:
        old = self.rollout.replica_rank
        self.rollout.replica_rank = old + offset
        self.rollout.zmq_handle = scoped_zmq_handle(self.rollout.zmq_handle, old, offset, os.environ[JOB_TOKEN_ENV])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def release_cached_memory(self) -> None:
        """Hand the trainer's cached, unused GPU blocks back before vLLM wakes on the same GPU. verl empties the
        cache only inside a weight transfer; a wake without one (DAPO's refills, a validation's benchmarks, the
        final evaluation runs) would otherwise meet FSDP's state, the allocator's cache and vLLM's share at once."""
        aggressive_empty_cache(force_sync=True)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint_contents(self, local_path: str, global_step: int, contents: list[str]) -> None:
        with checkpoint_contents(self.actor.engine.checkpoint_manager, contents):
            self.actor.save_checkpoint(local_path, None, global_step, max_ckpt_to_keep=None)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint_contents(self, local_path: str, contents: list[str]) -> None:
        with checkpoint_contents(self.actor.engine.checkpoint_manager, contents):
            self.actor.load_checkpoint(local_path, None, del_local_after_load=False)


def _job_scoped_server(server: type) -> type:
    """The rollout's server actor whose workers name their weight-transfer socket with the scoped job id."""

    class JobScopedServer(server):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)   # sets VERL_RAY_JOB_ID; the engine's workers start later and inherit it
            os.environ["VERL_RAY_JOB_ID"] = scoped_job_id(os.environ["VERL_RAY_JOB_ID"], os.environ[JOB_TOKEN_ENV])

        def _resolve_sleep_level(self) -> int:
            # Level 1 keeps the weights in host memory while the trainer holds the GPU (level 2, verl's
            # default, discards them), so a wake-up without a weight transfer serves the same weights
            # (VerlModel.generate sends them only after they changed).
            return 1

    JobScopedServer.__name__ = f"JobScoped{server.__name__}"
    return JobScopedServer


def offset_replica_class(base: type, offset: int) -> type:
    """The rollout replica class verl picked for ``rollout.name`` (vLLM in the paper's runs), with its global
    ``replica_rank`` starting at ``offset``, its workers taken from its own worker group by the local rank,
    and its servers (whatever server actor ``base`` launches) scoping the socket names."""
    if not issubclass(base, RolloutReplica):
        raise TypeError(f"graft_exp's verl backend needs a verl rollout replica class; got {base.__name__}")

    class OffsetReplica(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(_job_scoped_server(self.server_class.__ray_actor_class__))

        async def init_hybrid(self, worker_group: RayWorkerGroup):
            self.rollout_mode = RolloutMode.HYBRID
            local = self.replica_rank - offset
            self.workers = worker_group.workers[self.world_size * local: self.world_size * (local + 1)]
            await self.launch_servers()

    OffsetReplica.__name__ = f"Offset{offset}{base.__name__}"
    return OffsetReplica


def save_checkpoint(wg, root: str, step: int, contents: Sequence[str] = LATEST_CONTENTS) -> str:
    """Save the worker group's ``contents`` (model, optimizer, extra state) as ``<root>/global_step_<step>``,
    then point verl's tracker file at it and delete the root's older steps. A crash mid-save leaves the
    previous checkpoint and tracker intact. verl's manager keeps every path (``max_ckpt_to_keep=None``):
    one manager serves both roots, and its retention would delete the other root's checkpoint."""
    path = os.path.join(root, f"global_step_{step}")
    wg.save_checkpoint_contents(path, step, list(contents))
    tracker = get_checkpoint_tracker_filename(root)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(tracker + ".tmp", tracker)
    for old in Path(root).glob("global_step_*"):
        if old.is_dir() and old.name != f"global_step_{step}":
            shutil.rmtree(old)
    return path


def load_checkpoint(wg, root: str, contents: Sequence[str] = LATEST_CONTENTS) -> int:
    """Load ``contents`` of the newest checkpoint of ``root`` (verl's tracker file) into the worker group;
    its step."""
    path = find_latest_ckpt_path(root)
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {root}: {get_checkpoint_tracker_filename(root)} or the step "
                                "directory it names is missing")
    wg.load_checkpoint_contents(path, list(contents))
    return int(Path(path).name.removeprefix("global_step_"))


@dataclass
class VerlModel:
    """One trained model: role, verl config, tokenizer and its live Ray objects."""

    role: str
    config: DictConfig
    loss: LossSpec                   # the job method's (Method.loss), single-model GRPO included
    tokenizer: object = None
    stop_ids: list[int] = field(default_factory=list)   # batch.stop_token_ids of the model
    wg: RayWorkerGroup = None
    servers: LLMServerManager = None
    agent_loop: AgentLoopManager = None
    checkpoints: CheckpointEngineManager = None
    replicas: int = 0
    extra: dict = field(default_factory=dict)
    weights_version: int = 0         # bumped by every change of the trainer's weights (update, load)
    served_version: int | None = None   # the version the vLLM replicas hold (None: never sent)

    @property
    def gpus(self) -> int:
        return int(self.config.trainer.n_gpus_per_node) * int(self.config.trainer.nnodes)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the FSDP worker group (no sequence parallelism)."""
        return self.wg.world_size

    def start(self, pool, replica_offset: int, with_ref: bool) -> None:
        """Spawn the worker group on ``pool``, build FSDP + vLLM + checkpoint engine, then sleep vLLM."""
        model_config: HFModelConfig = omega_conf_to_dataclass(self.config.actor_rollout_ref.model)
        role = "actor_rollout_ref" if with_ref else "actor_rollout"
        worker = RayClassWithInitArgs(cls=ray.remote(GraftActorWorker), config=self.config.actor_rollout_ref,
                                      role=role)
        wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker, device_name="cuda",
                            name_prefix=f"graft_{self.role}")
        wg.init_model()
        self.attach(wg, model_config.tokenizer, model_config.generation_config)
        wg.isolate_rollout(replica_offset)
        manager = LLMServerManager(config=self.config, worker_group=self.wg, rollout_resource_pool=pool,
                                   start_rank=replica_offset)
        manager.rollout_replica_class = offset_replica_class(manager.rollout_replica_class, replica_offset)
        asyncio.run(manager._initialize_llm_servers())
        asyncio.run(manager._init_global_load_balancer())
        self.servers = manager
        self.agent_loop = AgentLoopManager.create(config=self.config, llm_client=manager.get_client())
        engine_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine)
        self.checkpoints = CheckpointEngineManager(config=engine_config, actor_wg=self.wg,
                                                   replicas=manager.get_replicas())
        self.replicas = len(manager.get_replicas())
        self.checkpoints.sleep_replicas()

    def attach(self, wg, tokenizer, generation_config=None) -> None:
        """Train and score through ``wg`` (verl's FSDP worker group, or an in-process stand-in with the
        same methods in tests) with this model's loss; ``tokenizer`` and ``generation_config`` (the HF
        model's) give its stop tokens."""
        self.wg, self.tokenizer = wg, tokenizer
        self.stop_ids = vb.stop_token_ids(tokenizer, generation_config)
        actor_cfg = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        wg.set_loss_fn(partial(actor_loss, actor_cfg, self.loss))

    # --- generation -------------------------------------------------------------------------------
    def generate(self, prompts: DataProto, step: int, validate: bool = False) -> DataProto:
        """Rollouts of ``prompts`` (already repeated n times) with the current weights; vLLM sleeps after.
        verl's agent loop splits the batch evenly over its workers (``DataProto.chunk`` asserts otherwise):
        it is padded to a multiple of ``rollout.agent.num_workers`` and the padding's rollouts dropped, as
        verl's own trainer does for validation."""
        prompts.meta_info.update({"global_steps": step, "validate": validate})
        workers = int(self.config.actor_rollout_ref.rollout.agent.num_workers)
        padded, pad_size = pad_dataproto_to_divisor(prompts, workers)
        with phase("sync"):   # the step's timeline: the engine woken with the trainer's weights, and put to sleep
            if self.served_version == self.weights_version:   # DAPO's refills, validation, evaluation runs
                self.wg.release_cached_memory()
                self.checkpoints.wake_up_replicas()
            else:
                self.checkpoints.update_weights(step)
                self.served_version = self.weights_version
        try:
            out = self.agent_loop.generate_sequences(padded)
        finally:
            with phase("sync"):
                self.checkpoints.sleep_replicas()
        out = unpad_dataproto(out, pad_size)
        out.meta_info.pop("timing", None)
        return out

    # --- scoring ----------------------------------------------------------------------------------
    def log_probs(self, batch: DataProto, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs [B, T] of the batch's responses under the current (old) policy or the
        reference model, computed by the FSDP workers (verl's ``compute_log_prob`` path). Any B: the batch
        is padded to a multiple of the data-parallel size for verl's split and the padding is stripped."""
        selected = batch.select(batch_keys=["prompts", "responses", "input_ids", "attention_mask", "position_ids",
                                            "response_mask"])
        padded, pad_size = pad_dataproto_to_divisor(selected, self.dp_size)
        td = left_right_2_no_padding(padded.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False,
                             temperature=float(self.config.actor_rollout_ref.rollout.temperature))
        output = self.wg.compute_ref_log_prob(td) if reference else self.wg.compute_log_prob(td)
        log_probs = no_padding_2_padding(tu.get(output, "log_probs"), td).float()
        return log_probs[:len(log_probs) - pad_size]

    # --- optimisation -----------------------------------------------------------------------------
    def update_minibatches(self, minibatches: list[DataProto]) -> dict[str, list[float]]:
        """``ppo_epochs`` passes over the minibatches (``batch.minibatch_layout``: padded to the
        data-parallel size, weight-0 padding), in the given order (our layout, so verl must not shuffle),
        one optimizer step and one LR-scheduler step per minibatch."""
        metrics: dict[str, list[float]] = {}
        for _ in range(int(self.config.actor_rollout_ref.actor.ppo_epochs)):
            for minibatch in minibatches:
                for key, values in self._update(minibatch).items():
                    metrics.setdefault(key, []).extend(values if isinstance(values, list) else [values])
        return metrics

    def _update(self, minibatch: DataProto) -> dict:
        """One ``update_actor`` call = one optimizer step over the whole minibatch."""
        rows = len(minibatch)
        if rows % self.dp_size:
            raise ValueError(f"a minibatch of {rows} rows does not split over {self.dp_size} data-parallel ranks; "
                             "lay it out with batch.minibatch_layout")
        actor = self.config.actor_rollout_ref.actor
        td = left_right_2_no_padding(minibatch.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=rows, mini_batch_size=rows, epochs=1,
                             seed=int(actor.data_loader_seed), dataloader_kwargs={"shuffle": False}, compute_loss=True,
                             temperature=float(self.config.actor_rollout_ref.rollout.temperature))
        output = self.wg.update_actor(td)
        self.weights_version += 1
        return dict(tu.get(output, "metrics"))

    # --- checkpoints ------------------------------------------------------------------------------
    def save(self, root: str, step: int, contents: Sequence[str] = LATEST_CONTENTS) -> str:
        """Checkpoint ``contents`` under ``root`` (e.g. ``<run>/A/latest``, or ``<run>/A/best`` with
        ``BEST_CONTENTS``); see ``save_checkpoint``."""
        return save_checkpoint(self.wg, root, step, contents)

    def load(self, root: str, contents: Sequence[str] = LATEST_CONTENTS) -> int:
        """Restore ``contents`` of the newest checkpoint under ``root``; returns its step."""
        step = load_checkpoint(self.wg, root, contents)
        self.weights_version += 1
        return step

    def stop(self) -> None:
        """Kill this model's vLLM servers and FSDP workers: their GPU memory is freed now, also on a Ray cluster
        that outlives the job."""
        if self.servers is None:   # not started here (attached to a worker group of the caller's)
            return
        for replica in self.servers.get_replicas():
            for server in replica.servers:
                shut_down_engine(server)
                ray.kill(server)
        for worker in self.wg.workers:
            ray.kill(worker)
        self.servers = self.wg = self.agent_loop = self.checkpoints = None


def _shut_down(server) -> None:
    server.engine.shutdown()


def shut_down_engine(server: ray.actor.ActorHandle, timeout_s: float = 60) -> None:
    """Stop the vLLM engine a server actor of verl holds (its ``AsyncLLM``) before the actor is killed: the engine
    core and its workers then exit on their own and unlink the shared memory they made (their message queues'
    ``psm_*`` segments, the multiprocessing lock of their progress bars, ``sem.*``). Killed with their actor, they
    leave those files in /dev/shm until the node restarts. An engine already gone is no error."""
    try:
        ray.get(server.__ray_call__.remote(_shut_down), timeout=timeout_s)
    except ray.exceptions.RayError as err:
        log.warning("the vLLM engine of %s did not shut down (%s); killing its server", server, err)


def resource_pools(models: list[VerlModel]) -> ResourcePoolManager:
    """One resource pool per model with its GPUs on every node of the job (verl's spec: GPUs per node)."""
    spec = {f"graft_{m.role}": [int(m.config.trainer.n_gpus_per_node)] * int(m.config.trainer.nnodes)
            for m in models}
    manager = ResourcePoolManager(resource_pool_spec=spec, mapping={})
    manager.create_resource_pool()
    return manager


def start_models(models: list[VerlModel], with_ref: bool) -> None:
    """Each model's pool (``resource_pools``), then every model's stack at once: a start mostly waits on its own
    processes (the workers' spawn and weight load, the rollout engine's start: minutes per model at the paper's
    sizes). Replica ranks stay disjoint: a model's start after the GPUs of the pools before it (a replica holds
    at least one GPU)."""
    manager = resource_pools(models)
    pools = [manager.resource_pool_dict[f"graft_{model.role}"] for model in models]
    offsets = [0, *itertools.accumulate(pool.world_size for pool in pools[:-1])]
    with ThreadPoolExecutor(len(models)) as starts:
        for started in [starts.submit(model.start, pool, offset, with_ref)
                        for model, pool, offset in zip(models, pools, offsets, strict=True)]:
            started.result()
