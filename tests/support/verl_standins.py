"""In-process stand-ins for exactly the parts of verl that cannot run on a CPU machine, for tests that drive
``graft_exp.backends.verl.runtime.VerlModel`` (and, through it, the driver) on the tiny models.

``EngineWorkerGroup`` replaces the ``RayWorkerGroup`` of verl's ``ActorRolloutRefWorker`` (Ray actors, one
per GPU, each an ``FSDPEngine``) with the same methods ``VerlModel`` calls: ``set_loss_fn``,
``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``, ``save_checkpoint``, ``load_checkpoint``
(and ``GraftActorWorker``'s ``save_checkpoint_contents`` / ``load_checkpoint_contents``) and ``world_size``. What is stood in for, precisely:

- Ray and the worker processes: the ``dp_size`` data-parallel ranks are simulated one after the other in
  this process on ONE model (one process group of world size 1, gloo). Where verl's ranks communicate,
  the stand-in does the same arithmetic across the simulated ranks: ``batch_num_tokens`` and the
  ``global_token_num`` list (all-reduce SUM / all-gather), the micro-batch count (all-reduce MAX, passed
  to verl's ``prepare_micro_batches`` as ``min_num_micro_batch``), the gradient (each rank backpropagates
  its own loss into the shared parameters, then the sum is divided by ``dp_size``: FSDP's mean
  reduce-scatter), the loss (mean over ranks) and the metrics (the per-rank dicts gathered key by key,
  as ``allgather_dict_into_dict`` does: a key a rank does not emit has fewer entries).
- The FSDP engine's CUDA forward (``FSDPEngineWithLMHead.forward_step``, flash-attention on packed
  sequences): each micro-batch's sequences are run padded, with an attention mask, through the
  tiny HF model; the output is verl's (``log_probs`` of the next token at every position, nested by
  sequence, logits divided by the batch's ``temperature``). fp32, no autocast.
- ``FSDPEngine.optimizer_step``: ``torch.nn.utils.clip_grad_norm_`` then the optimizer step (skipped on a
  non-finite norm, as verl does).

verl's own code runs for everything else: the split of the TensorDict into ranks
(``_split_args_kwargs_data_proto`` -> ``chunk_tensordict``, with its divisibility assertion) and the
concatenation of outputs; ``train_mini_batch``'s ``mini_batch_size % dp`` assertion and ``make_iterator``;
``prepare_micro_batches`` (dynamic or static micro-batching); ``postprocess_batch_func``; ``append_to_dict``
and ``Metric.aggregate_dp``; the optimizer (``build_optimizer``) and LR scheduler
(``FSDPEngine._build_lr_scheduler``) from the actor config, stepped once per ``update_actor`` call like
``train_mini_batch``; the loss set with ``set_loss_fn``; and the checkpoint manager,
``FSDPCheckpointManager``, over the model wrapped by FSDP2 ``fully_shard`` on a one-rank CPU mesh (its
sharded model/optimizer/extra files and its ``huggingface/`` export; world size 1 in the file names).
"""

from __future__ import annotations

import copy
from itertools import chain
from types import SimpleNamespace

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tensordict import NonTensorData, TensorDict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.protocol import BatchData
from verl.single_controller.base.decorator import _split_args_kwargs_data_proto
from verl.utils import tensordict_utils as tu
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.memory_utils import aggressive_empty_cache
from verl.utils.metric.utils import Metric
from verl.utils.py_functional import append_to_dict
from verl.workers.config.optimizer import build_optimizer
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from graft_exp.backends.verl.runtime import checkpoint_contents


def ensure_process_group() -> None:
    """The one-rank gloo group verl's checkpoint manager and FSDP2 need (rank, world size, barriers)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def gather_by_key(per_rank: list[dict]) -> dict[str, list]:
    """What ``allgather_dict_into_dict`` returns on every rank: each key's values, one per rank that has it."""
    gathered: dict[str, list] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            gathered.setdefault(key, []).append(value)
    return gathered


def aggregate_mini_batch_metrics(outputs: list[dict]) -> dict[str, list]:
    """``TrainingWorker.train_mini_batch``'s reduction of its per-mini-batch outputs (verl's code path:
    ``Metric.aggregate_dp`` over ranks for Metric lists, else the flattened lists, then ``append_to_dict``)."""
    metrics: dict[str, list] = {}
    for output in outputs:
        for key, val in output.items():
            if isinstance(val, list):
                output[key] = Metric.aggregate_dp(val) if isinstance(val[0], Metric) else list(chain.from_iterable(val))
        append_to_dict(metrics, output)
    return metrics


def next_token_log_probs(model, micro: TensorDict) -> torch.Tensor:
    """verl's model output for a no-padding micro-batch: for every token of every sequence, the log-prob
    of the token after it (the last position's value is never read), nested like ``input_ids``."""
    ids = micro["input_ids"]
    positions = micro["position_ids"]
    lengths = ids.offsets().diff().tolist()
    rows, width = len(lengths), max(lengths)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    position_ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    for row, (seq, pos) in enumerate(zip(ids.unbind(), positions.unbind())):
        input_ids[row, :len(seq)], position_ids[row, :len(seq)], attention[row, :len(seq)] = seq, pos, 1
    temperature = tu.get(micro, "temperature", default=1.0)
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False).logits
    log_probs = torch.log_softmax(logits.float() / float(temperature), dim=-1)
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    token_log_probs = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    values = torch.cat([token_log_probs[row, :length] for row, length in enumerate(lengths)])
    return torch.nested.nested_tensor_from_jagged(values, offsets=ids.offsets())


class EngineWorkerGroup:
    """The worker group of one model (see the module docstring for what is verl's and what is not).

    ``actor_rollout_ref``: the model's ``verl_config(...).actor_rollout_ref``; ``model_path``: an HF model
    directory (a tiny model of ``graft_exp.tiny``)."""

    def __init__(self, model_path: str, actor_rollout_ref: DictConfig, dp_size: int, *, with_ref: bool = False):
        ensure_process_group()
        torch.manual_seed(0)
        self.world_size = dp_size
        actor = actor_rollout_ref.actor
        self.actor_config = omega_conf_to_dataclass(actor)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.ref = copy.deepcopy(self.model).eval() if with_ref else None
        fully_shard(self.model, mesh=init_device_mesh("cpu", (1,)))
        self.optimizer = build_optimizer(self.model.parameters(), self.actor_config.optim)
        engine = SimpleNamespace(optimizer_config=self.actor_config.optim, rank=dist.get_rank())
        self.lr_scheduler = FSDPEngine._build_lr_scheduler(engine, self.optimizer)
        self.checkpoints = FSDPCheckpointManager(model=self.model, optimizer=self.optimizer,
                                                 lr_scheduler=self.lr_scheduler, processing_class=self.tokenizer,
                                                 checkpoint_config=self.actor_config.checkpoint)
        rollout = actor_rollout_ref.rollout
        self.train_defaults = {"use_remove_padding": True, "use_dynamic_bsz": bool(actor.use_dynamic_bsz),
                               "max_token_len_per_gpu": actor.ppo_max_token_len_per_gpu,
                               "micro_batch_size_per_gpu": actor.ppo_micro_batch_size_per_gpu}
        self.infer_defaults = {"use_remove_padding": True, "use_dynamic_bsz": bool(rollout.log_prob_use_dynamic_bsz),
                               "max_token_len_per_gpu": rollout.log_prob_max_token_len_per_gpu,
                               "micro_batch_size_per_gpu": rollout.log_prob_micro_batch_size_per_gpu}
        self.loss_fn = None
        self.calls: dict[str, int] = {}      # how often each method ran (tests read it)

    # --- the worker group's methods ---------------------------------------------------------------
    def set_loss_fn(self, loss_fn) -> None:
        self.loss_fn = loss_fn

    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        return self._infer(data, self.model, "compute_log_prob")

    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        if self.ref is None:
            raise RuntimeError("this worker group has no reference model (role actor_rollout)")
        return self._infer(data, self.ref, "compute_ref_log_prob")

    def update_actor(self, data: TensorDict) -> TensorDict:
        """``ActorRolloutRefWorker.update_actor`` -> ``TrainingWorker.train_mini_batch`` on every rank."""
        self._count("update_actor")
        ranks = self._split(data)
        options = [{key: tu.pop(rank, key=key, default=default) for key, default in
                    (("mini_batch_size", None), ("epochs", 1), ("seed", 42), ("dataloader_kwargs", {}))}
                   for rank in ranks]
        for rank in ranks:
            tu.pop(rank, key="disable_auto_offload", default=False)
        mini_batch_size = options[0]["mini_batch_size"]
        assert mini_batch_size % self.world_size == 0, f"Got {mini_batch_size=} and dp size {self.world_size}"
        per_rank = mini_batch_size // self.world_size
        iterators = [tu.make_iterator(rank, mini_batch_size=per_rank, epochs=option["epochs"],
                                      seed=option["seed"] + index, dataloader_kwargs=option["dataloader_kwargs"])
                     for index, (rank, option) in enumerate(zip(ranks, options))]
        total = ranks[0].shape[0] // per_rank * options[0]["epochs"]
        outputs = []
        for batch_idx, minis in enumerate(zip(*iterators)):
            global_token_num = [n for mini in minis for n in mini["input_ids"].offsets().diff().tolist()]
            for mini in minis:
                tu.assign_non_tensor(mini, global_token_num=NonTensorData(global_token_num),
                                     update_lr_scheduler=batch_idx == total - 1, disable_auto_offload=True)
            outputs.append(self._train_batch(list(minis)))
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": aggregate_mini_batch_metrics(outputs)})

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None) -> None:
        self._count("save_checkpoint")
        self.checkpoints.save_checkpoint(local_path=local_path, hdfs_path=hdfs_path, global_step=global_step,
                                         max_ckpt_to_keep=max_ckpt_to_keep)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False) -> None:
        self._count("load_checkpoint")
        self.checkpoints.load_checkpoint(local_path=local_path, hdfs_path=hdfs_path,
                                         del_local_after_load=del_local_after_load)

    def release_cached_memory(self) -> None:
        """``GraftActorWorker.release_cached_memory``: verl's own cache release (nothing to release on CPU)."""
        self._count("release_cached_memory")
        aggressive_empty_cache(force_sync=True)

    def save_checkpoint_contents(self, local_path, global_step, contents) -> None:
        """``GraftActorWorker.save_checkpoint_contents``: the manager saving ``contents`` only."""
        self._count("save_checkpoint")
        with checkpoint_contents(self.checkpoints, contents):
            self.checkpoints.save_checkpoint(local_path=local_path, global_step=global_step, max_ckpt_to_keep=None)

    def load_checkpoint_contents(self, local_path, contents) -> None:
        self._count("load_checkpoint")
        with checkpoint_contents(self.checkpoints, contents):
            self.checkpoints.load_checkpoint(local_path=local_path, del_local_after_load=False)

    # --- the ranks --------------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _split(self, data: TensorDict) -> list[TensorDict]:
        (chunks,), _ = _split_args_kwargs_data_proto(self.world_size, data)
        # verl's chunks are consolidated (locked); each worker receives its own deserialized, writable copy.
        return [chunk.clone().unlock_() for chunk in chunks]

    def _micro_batches(self, ranks: list[TensorDict]) -> list[tuple[list[TensorDict], list | None]]:
        """verl's micro-batches of every rank, with the count made equal across ranks (all-reduce MAX)."""
        counts = [len(prepare_micro_batches(rank, dp_group=None)[0]) for rank in ranks]
        return [prepare_micro_batches(rank, dp_group=None, min_num_micro_batch=max(counts)) for rank in ranks]

    def _with_defaults(self, ranks: list[TensorDict], defaults: dict) -> None:
        for rank in ranks:
            for key, value in defaults.items():
                if key not in rank.keys():  # noqa: SIM118 (TensorDict's `in` does not look up keys)
                    tu.assign_non_tensor(rank, **{key: value})
            tu.assign_non_tensor(rank, sp_size=1, dp_size=self.world_size)

    def _infer(self, data: TensorDict, model, name: str) -> TensorDict:
        self._count(name)
        ranks = self._split(data)
        self._with_defaults(ranks, self.infer_defaults)
        compute_loss = tu.get(ranks[0], "compute_loss", default=True)
        loss_fn = self.loss_fn if compute_loss else None
        batch_tokens = sum(int(rank["loss_mask"].sum()) for rank in ranks)
        outputs = []
        with torch.no_grad():
            for rank, (micros, indices) in zip(ranks, self._micro_batches(ranks)):
                tu.assign_non_tensor(rank, batch_num_tokens=batch_tokens)
                results = []
                for micro in micros:
                    model_output = {"log_probs": next_token_log_probs(model, micro)}
                    metrics = {} if loss_fn is None else loss_fn(model_output=model_output, data=micro,
                                                                 dp_group=None)[1]
                    results.append({"model_output": model_output, "loss": 1.0, "metrics": metrics})
                processed = postprocess_batch_func(output_lst=results, indices=indices, data=rank)
                outputs.append(tu.get_tensordict(tensor_dict=processed["model_output"], non_tensor_dict={}))
        return BatchData(outputs).concat()

    def _train_batch(self, minis: list[TensorDict]) -> dict:
        """``TrainingWorker.train_batch`` + ``FSDPEngine.train_batch`` for one mini-batch on every rank;
        returns what rank 0's ``_postprocess_output`` returns (its metrics)."""
        if self.loss_fn is None:
            raise RuntimeError("loss function can't be None when calling train_batch")
        self._with_defaults(minis, self.train_defaults)
        batch_tokens = sum(int(mini["loss_mask"].sum()) for mini in minis)
        self.optimizer.zero_grad()
        per_rank = []
        for mini, (micros, indices) in zip(minis, self._micro_batches(minis)):
            tu.assign_non_tensor(mini, batch_num_tokens=batch_tokens)
            results = []
            for micro in micros:
                model_output = {"log_probs": next_token_log_probs(self.model, micro)}
                loss, metrics = self.loss_fn(model_output=model_output, data=micro, dp_group=None)
                loss.backward()
                results.append({"loss": loss.detach().item(), "metrics": metrics})
            per_rank.append(postprocess_batch_func(output_lst=results, indices=indices, data=mini))
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.div_(self.world_size)       # FSDP averages gradients over data-parallel ranks
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=self.actor_config.optim.clip_grad)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad()
        lr = None
        if tu.get(minis[0], "update_lr_scheduler", default=False):
            self.lr_scheduler.step()
            lr = self.lr_scheduler.get_last_lr()[0]
        metrics = gather_by_key([output["metrics"] for output in per_rank])
        metrics["loss"] = sum(sum(output["loss"]) for output in per_rank) / len(per_rank)
        metrics["grad_norm"] = float(grad_norm)
        if lr is not None:
            metrics["lr"] = lr
        return metrics
