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

Nothing in this module has run on a GPU in this project's CI (no GPU there); ``tests/test_verl_*.py``
cover the CPU-side pieces it calls (config, batches, layout, loss).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import partial

import ray
import torch
from omegaconf import DictConfig
from verl import DataProto
from verl.checkpoint_engine import CheckpointEngineManager
from verl.experimental.agent_loop import AgentLoopManager
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.llm_server import LLMServerManager
from verl.workers.rollout.replica import RolloutMode
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from graft_exp.backends.verl.loss import LossSpec, actor_loss


class GraftActorWorker(ActorRolloutRefWorker):
    """verl's actor-rollout(-ref) worker, plus the replica-rank shift of a second pool's rollout."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shift_rollout_replica_rank(self, offset: int) -> None:
        old = self.rollout.replica_rank
        self.rollout.replica_rank = old + offset
        # The weight-transfer socket name carries the replica rank; keep it unique across pools on a node.
        self.rollout.zmq_handle = self.rollout.zmq_handle.replace(f"-replica-{old}-", f"-replica-{old + offset}-")


def offset_replica_class(base: type, offset: int) -> type:
    """A rollout replica class whose global ``replica_rank`` starts at ``offset`` but which takes its
    workers from its own worker group by the local rank."""

    class OffsetReplica(base):
        async def init_hybrid(self, worker_group: RayWorkerGroup):
            self.rollout_mode = RolloutMode.HYBRID
            local = self.replica_rank - offset
            self.workers = worker_group.workers[self.world_size * local: self.world_size * (local + 1)]
            await self.launch_servers()

    OffsetReplica.__name__ = f"Offset{offset}{base.__name__}"
    return OffsetReplica


@dataclass
class VerlModel:
    """One trained model: role, verl config, tokenizer and its live Ray objects."""

    role: str
    config: DictConfig
    loss: LossSpec | None            # None: verl's own vanilla GRPO loss (single-model methods)
    tokenizer: object = None
    wg: RayWorkerGroup = None
    servers: LLMServerManager = None
    agent_loop: AgentLoopManager = None
    checkpoints: CheckpointEngineManager = None
    replicas: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return int(self.config.trainer.n_gpus_per_node) * int(self.config.trainer.nnodes)

    def start(self, pool, replica_offset: int, with_ref: bool) -> None:
        """Spawn the worker group on ``pool``, build FSDP + vLLM + checkpoint engine, then sleep vLLM."""
        model_config: HFModelConfig = omega_conf_to_dataclass(self.config.actor_rollout_ref.model)
        self.tokenizer = model_config.tokenizer
        role = "actor_rollout_ref" if with_ref else "actor_rollout"
        worker = RayClassWithInitArgs(cls=ray.remote(GraftActorWorker), config=self.config.actor_rollout_ref,
                                      role=role)
        self.wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker, device_name="cuda",
                                 name_prefix=f"graft_{self.role}")
        self.wg.init_model()
        if self.loss is not None:
            actor_cfg = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
            self.wg.set_loss_fn(partial(actor_loss, actor_cfg, self.loss))
        if replica_offset:
            self.wg.shift_rollout_replica_rank(replica_offset)
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

    # --- generation -------------------------------------------------------------------------------
    def generate(self, prompts: DataProto, step: int, validate: bool = False) -> DataProto:
        """Rollouts of ``prompts`` (already repeated n times) with the current weights; vLLM sleeps after."""
        prompts.meta_info.update({"global_steps": step, "validate": validate})
        self.checkpoints.update_weights(step)
        try:
            out = self.agent_loop.generate_sequences(prompts)
        finally:
            self.checkpoints.sleep_replicas()
        out.meta_info.pop("timing", None)
        return out

    # --- scoring ----------------------------------------------------------------------------------
    def log_probs(self, batch: DataProto, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs [B, T] of the batch's responses under the current (old) policy or the
        reference model, computed by the FSDP workers (verl's ``compute_log_prob`` path)."""
        td = left_right_2_no_padding(batch.select(batch_keys=["prompts", "responses", "input_ids", "attention_mask",
                                                              "position_ids", "response_mask"]).to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False,
                             temperature=float(self.config.actor_rollout_ref.rollout.temperature))
        output = self.wg.compute_ref_log_prob(td) if reference else self.wg.compute_log_prob(td)
        return no_padding_2_padding(tu.get(output, "log_probs"), td).float()

    # --- optimisation -----------------------------------------------------------------------------
    def update_minibatches(self, minibatches: list[DataProto]) -> dict[str, list[float]]:
        """One optimizer step per minibatch, in the given order (our layout, so verl must not shuffle)."""
        metrics: dict[str, list[float]] = {}
        for minibatch in minibatches:
            for key, values in self._update(minibatch, len(minibatch)).items():
                metrics.setdefault(key, []).extend(values if isinstance(values, list) else [values])
        return metrics

    def update_grpo(self, batch: DataProto) -> dict[str, list[float]]:
        """verl's standard update: ppo_mini_batch_size prompts x n rows per minibatch, its vanilla loss."""
        rows = int(self.config.actor_rollout_ref.actor.ppo_mini_batch_size) * int(self.config.actor_rollout_ref.rollout.n)
        return self._update(batch, rows)

    def _update(self, batch: DataProto, mini_batch_rows: int) -> dict:
        actor = self.config.actor_rollout_ref.actor
        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=mini_batch_rows,
                             mini_batch_size=mini_batch_rows, epochs=int(actor.ppo_epochs),
                             seed=int(actor.data_loader_seed), dataloader_kwargs={"shuffle": False}, compute_loss=True,
                             temperature=float(self.config.actor_rollout_ref.rollout.temperature))
        output = self.wg.update_actor(td)
        return dict(tu.get(output, "metrics"))

    # --- checkpoints ------------------------------------------------------------------------------
    def save(self, path: str, step: int) -> None:
        self.wg.save_checkpoint(path, None, step, max_ckpt_to_keep=1)

    def load(self, path: str) -> None:
        self.wg.load_checkpoint(path, del_local_after_load=False)


def start_models(models: list[VerlModel], with_ref: bool) -> None:
    """One resource pool per model on the node, then each model's stack (replica ranks kept disjoint)."""
    manager = ResourcePoolManager(resource_pool_spec={f"graft_{m.role}": [m.gpus] for m in models}, mapping={})
    manager.create_resource_pool()
    offset = 0
    for model in models:
        model.start(manager.resource_pool_dict[f"graft_{model.role}"], offset, with_ref)
        offset += model.replicas
