"""runtime.VerlModel over verl's own CPU-runnable code (tests/support/verl_standins.py says exactly what is stood in
for): checkpoints through verl's FSDPCheckpointManager, any row count at data-parallel sizes 2 and 4 (verl's
split, iterator and micro-batching), per-rank metrics through Metric.aggregate_dp, and the LR schedule
through verl's own scheduler builder; plus the job-scoped Ray environment and socket names, and the replica
rank offset over any rollout replica class verl's registry returns."""

import asyncio
import os
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import ray
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from support.verl_standins import EngineWorkerGroup, aggregate_mini_batch_metrics, gather_by_key
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.metric.utils import Metric
from verl.workers.config import RolloutConfig
from verl.workers.rollout.replica import RolloutReplica
from verl.workers.utils.padding import left_right_2_no_padding

from graft_exp.algorithms import graft_policy_loss, sgt_nll_loss
from graft_exp.backends.verl import batch as vb
from graft_exp.backends.verl import loss as vl
from graft_exp.backends.verl.config import (
    JOB_TOKEN_ENV,
    optimizer_updates_per_step,
    ray_init_kwargs,
    verl_config,
)
from graft_exp.backends.verl.loss import actor_loss
from graft_exp.backends.verl.ray_slurm import start_local_ray
from graft_exp.backends.verl.runtime import VerlModel, offset_replica_class, scoped_job_id, scoped_zmq_handle
from graft_exp.methods import resolve
from graft_exp.methods.objective import LossSpec
from graft_exp.methods.receiver import SELF, ReceiverBatch, Row
from graft_exp.resources import BEST_CONTENTS
from graft_exp.tiny.models import ASSETS

torch.set_num_threads(1)
CONF = str(Path(__file__).resolve().parents[1] / "conf")
MODEL = str(ASSETS / "tiny-char-llama")
PROMPT_LEN, RESPONSE_LEN = 16, 12


def _cfg(method: str, *overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["backend=verl", "pair=pair1", f"method={method}",
                                                       "train.precision=fp32", *overrides])
    GlobalHydra.instance().clear()
    return cfg


def _model(tmp_path, method: str, dp_size: int, *overrides: str, with_ref: bool = False) -> VerlModel:
    """A VerlModel of the tiny char model whose worker group is the in-process stand-in."""
    cfg = _cfg(method, *overrides)
    config = verl_config(cfg, "A", str(tmp_path / "A"))
    model = VerlModel("A", config, resolve(cfg.method).loss)
    wg = EngineWorkerGroup(MODEL, config.actor_rollout_ref, dp_size, with_ref=with_ref)
    model.attach(wg, wg.tokenizer, wg.model.generation_config)
    return model


def _rows(tokenizer, count: int, seed: int) -> DataProto:
    """``count`` rows of the tiny task's text in verl's padded layout, with old log-probs."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(count):
        prompts.append(tokenizer.encode(f"{i + 3}+{2 * i}=", add_special_tokens=False)[:PROMPT_LEN])
        length = int(torch.randint(1, RESPONSE_LEN + 1, (1,), generator=gen))
        responses.append(tokenizer.encode(f"{3 * i + 3} so \\boxed{{{3 * i + 3}}}", add_special_tokens=False)[:length])
    data = DataProto.from_dict(tensors=vb.pack_rows(prompts, responses, prompt_length=PROMPT_LEN,
                                                    response_length=RESPONSE_LEN, pad_token_id=tokenizer.pad_token_id))
    data.batch["old_log_probs"] = -torch.rand(data.batch["responses"].shape, generator=gen) - 1.0
    return data


def _state(model: VerlModel) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.wg.model.state_dict().items()}


def _shift(model: VerlModel, amount: float) -> None:
    with torch.no_grad():
        for param in model.wg.model.parameters():
            param.add_(amount)


def test_latest_and_best_checkpoints_survive_each_other(tmp_path):
    """save(latest) / save(best) / save(latest) / load(best) / load(latest) through verl's
    FSDPCheckpointManager: each root keeps its newest step; the other root's checkpoint is never deleted.
    With verl's retention (max_ckpt_to_keep=1 on the worker's one manager) the same sequence loses best."""
    model = _model(tmp_path, "graft", 2)
    latest, best = str(tmp_path / "A" / "latest"), str(tmp_path / "A" / "best")
    _shift(model, 0.01)
    model.save(latest, 1)
    _shift(model, 0.01)
    model.wg.lr_scheduler.step()
    at_best = _state(model)
    model.save(best, 2, BEST_CONTENTS)
    _shift(model, 0.01)
    model.wg.lr_scheduler.step()
    at_latest = _state(model)
    model.save(latest, 3)
    assert sorted(p.name for p in Path(latest).iterdir()) == ["global_step_3", "latest_checkpointed_iteration.txt"]
    assert sorted(p.name for p in Path(best).iterdir()) == ["global_step_2", "latest_checkpointed_iteration.txt"]
    # best: the model's shards only; latest: model, optimizer and extra state; neither an hf_model export
    best_files = {p.name for p in (Path(best) / "global_step_2").iterdir()}
    latest_files = {p.name for p in (Path(latest) / "global_step_3").iterdir()}
    assert any(f.startswith("model_world_size_") for f in best_files)
    assert not any(f.startswith(("optim_", "extra_")) for f in best_files)
    assert any(f.startswith("optim_") for f in latest_files) and any(f.startswith("extra_") for f in latest_files)
    for step_dir in (Path(best) / "global_step_2", Path(latest) / "global_step_3"):   # config + tokenizer only
        assert not list((step_dir / "huggingface").glob("*.safetensors"))

    _shift(model, 0.5)
    assert model.load(best, BEST_CONTENTS) == 2
    assert all(torch.equal(v, at_best[k]) for k, v in _state(model).items())
    assert model.wg.lr_scheduler.last_epoch == 2   # a model-only load leaves the scheduler (and optimizer) as they were
    assert model.load(latest) == 3
    assert all(torch.equal(v, at_latest[k]) for k, v in _state(model).items())
    assert model.wg.lr_scheduler.last_epoch == 2
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        model.load(str(tmp_path / "nothing"))

    # the defect this replaces: one manager, max_ckpt_to_keep=1, two paths
    model.wg.save_checkpoint(str(tmp_path / "old" / "latest"), None, 1, max_ckpt_to_keep=1)
    model.wg.save_checkpoint(str(tmp_path / "old" / "best"), None, 1, max_ckpt_to_keep=1)
    assert not (tmp_path / "old" / "latest").exists()


def _direct_log_probs(model: VerlModel, data: DataProto) -> torch.Tensor:
    """Each row's response log-probs by the HF model alone, one unpadded sequence at a time."""
    hf = model.wg.model
    out = torch.zeros(data.batch["responses"].shape)
    for row in range(len(data)):
        prompt, response = vb.row_tokens(data, row)
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = hf(input_ids=ids, use_cache=False).logits[0] / float(model.config.actor_rollout_ref.rollout.temperature)
        log_probs = torch.log_softmax(logits.float(), -1)
        for j, token in enumerate(response):
            out[row, j] = log_probs[len(prompt) + j - 1, token]
    return out


@pytest.mark.parametrize("dp_size", [2, 4])
def test_log_probs_of_any_row_count(tmp_path, dp_size):
    """5 rows at dp 2 and 4 (SGT's NLL pairs, HACPO's reference pass): padded for verl's split, stripped after."""
    model = _model(tmp_path, "hacpo", dp_size, with_ref=True)
    data = _rows(model.tokenizer, 5, seed=dp_size)
    with pytest.raises(AssertionError):       # verl's split refuses 5 rows over dp ranks
        model.wg.compute_log_prob(left_right_2_no_padding(data.to_tensordict()))
    expected = _direct_log_probs(model, data)
    mask = data.batch["response_mask"].bool()
    for reference in (False, True):
        got = model.log_probs(data, reference=reference)
        assert got.shape == (5, RESPONSE_LEN)
        assert torch.allclose(got[mask], expected[mask], atol=1e-5)
    assert model.wg.calls == {"compute_log_prob": 2, "compute_ref_log_prob": 1}   # the refused call, then ours


def _sgt_batch(model: VerlModel, rows: int, nll_rows: list[int]) -> DataProto:
    """A receiver batch of ``rows`` rows in one group per row: own rows, and SGT's NLL rows (weight 0)."""
    data = _rows(model.tokenizer, rows, seed=rows)
    gen = torch.Generator().manual_seed(7)
    advantage = torch.randn(rows, generator=gen)
    advantage[nll_rows] = 0.0
    data.batch["advantages"] = advantage.unsqueeze(1) * data.batch["response_mask"]
    weight = torch.ones(rows)
    weight[nll_rows] = 0.0
    is_nll = torch.zeros(rows)
    is_nll[nll_rows] = 1.0
    data.batch[vl.WEIGHT], data.batch[vl.NLL] = weight, is_nll
    data.batch[vl.IS_PEER] = is_nll.clone()
    data.non_tensor_batch[vb.GROUP] = np.arange(rows)
    return data


def _reference_gradient(model: VerlModel, data: DataProto, spec: LossSpec) -> dict[str, torch.Tensor]:
    """The minibatch objective on the real rows only (no padding, no ranks), differentiated directly."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)   # the weights the update started from
    rows = []
    for row in range(len(data)):
        prompt, response = vb.row_tokens(data, row)
        logits = hf(input_ids=torch.tensor([prompt + response]), use_cache=False).logits[0]
        log_probs = torch.log_softmax(logits.float(), -1)
        rows.append(torch.stack([log_probs[len(prompt) + j - 1, t] for j, t in enumerate(response)]
                                + [torch.zeros(())] * (RESPONSE_LEN - len(response))))
    log_prob = torch.stack(rows)
    mask = data.batch["response_mask"]
    pg, _ = graft_policy_loss(log_prob, data.batch["old_log_probs"], data.batch["advantages"], data.batch[vl.WEIGHT],
                              mask, spec.clip_low, spec.clip_high, clip_ratio_c=spec.clip_ratio_c)
    nll_rows = data.batch[vl.NLL].bool()
    nll, _ = sgt_nll_loss(log_prob[nll_rows], mask[nll_rows], spec.settings["sgt_lambda"])
    (pg + nll).backward()
    return {name: p.grad for name, p in hf.named_parameters()}


@pytest.mark.parametrize("dp_size", [2, 4])
def test_update_of_odd_minibatch_equals_unpadded_objective(tmp_path, dp_size):
    """A 7-row SGT minibatch (2 NLL rows) at dp 2 and 4: laid out with weight-0 padding rows, split by verl,
    micro-batched by verl, its gradient is the objective's on the 7 real rows; the counts verl aggregates
    over ranks (every rank emits every key) are the real rows' tokens."""
    model = _model(tmp_path, "sgt", dp_size, "train.lr=0", "train.grad_clip=1e9", "backend.max_token_len_per_gpu=40")
    data = _sgt_batch(model, 7, nll_rows=[0, 5])
    (minibatch,) = vb.minibatch_layout(data, [list(range(7))], dp_size=dp_size)
    padding = len(minibatch) - 7
    assert len(minibatch) % dp_size == 0 and padding == (-7) % dp_size
    assert int((minibatch.batch[vl.WEIGHT] > 0).sum()) == 5 and int(minibatch.batch[vl.NLL].sum()) == 2
    metrics = model.update_minibatches([minibatch])
    grads = {name: p.grad.full_tensor() for name, p in model.wg.model.named_parameters()}
    reference = _reference_gradient(model, data, model.loss)
    for name, grad in reference.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-7), name
    mask = data.batch["response_mask"].bool()
    nll_rows = data.batch[vl.NLL].bool()
    assert metrics["graft/nll_tokens"] == [pytest.approx(float(mask[nll_rows].sum()))]
    assert metrics["graft/tokens_self"] == [pytest.approx(float(mask[~nll_rows].sum()))]
    assert model.wg.calls == {"update_actor": 1}


def test_every_rank_emits_every_metric_key(tmp_path):
    """Two simulated ranks, one holding SGT's NLL rows and one not: through verl's postprocessing and
    Metric.aggregate_dp the counts sum over ranks; a key only one rank emits would not aggregate."""
    from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

    model = _model(tmp_path, "sgt", 2)
    data = _sgt_batch(model, 8, nll_rows=[1, 2])     # rows 0-3 go to rank 0, rows 4-7 to rank 1
    data.batch[vl.DENOMINATOR] = torch.full((8,), 10.0)
    data.batch[vl.NLL_DENOMINATOR] = torch.full((8,), 4.0)
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, dp_size=2, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, batch_num_tokens=1)
    loss_fn = partial(actor_loss, None, model.loss)
    per_rank = []
    for rank in tu.chunk_tensordict(td, 2):
        micros, indices = prepare_micro_batches(rank, dp_group=None)
        results = []
        for micro in micros:
            log_probs = torch.nested.nested_tensor_from_jagged(-torch.ones(micro["input_ids"].values().shape),
                                                               offsets=micro["input_ids"].offsets())
            _, metrics = loss_fn(model_output={"log_probs": log_probs}, data=micro)
            results.append({"metrics": metrics})
        per_rank.append(postprocess_batch_func(results, indices, rank)["metrics"])
    assert per_rank[0].keys() == per_rank[1].keys()
    (aggregated,) = [aggregate_mini_batch_metrics([gather_by_key(per_rank)])]
    mask = data.batch["response_mask"].bool()
    assert aggregated["graft/nll_tokens"] == [pytest.approx(float(mask[[1, 2]].sum()))]
    two = Metric("sum", 1.0)
    two.append(2.0)
    with pytest.raises(ValueError, match="same number of values"):   # what a key emitted by some micro-batches does
        Metric.aggregate_dp([Metric("sum", 1.0), two])


def grpo_update(model: VerlModel, own: DataProto, advantages: torch.Tensor) -> dict[str, list[float]]:
    """Single-model GRPO the way the driver trains it: the own-rows receiver batch (weight 1, one group per
    prompt), consecutive minibatches of ``ppo_mini_batch_size`` prompts (the last may be smaller)."""
    prompts, n = advantages.shape
    plan = ReceiverBatch([Row(q, SELF, q, i, float(advantages[q, i]), 1.0) for q in range(prompts) for i in range(n)],
                         torch.zeros(prompts, dtype=torch.bool))
    size = int(model.config.actor_rollout_ref.actor.ppo_mini_batch_size)
    groups = [list(range(start, min(start + size, prompts))) for start in range(0, prompts, size)]
    return model.update_minibatches(vb.minibatch_layout(vb.receiver_batch(own, n, None, plan), groups,
                                                        dp_size=model.dp_size))


def test_lr_warmup_counts_optimizer_steps(tmp_path):
    """train.lr_warmup_steps=4 through verl's own scheduler builder: two training steps of two minibatches
    each are four update_actor calls, four scheduler steps, the warm-up's end (HF's schedule: the first
    update runs at lr 0); the scheduler's horizon is max_steps x optimizer steps per training step."""
    model = _model(tmp_path, "grpo_n8", 2, "train.lr=1e-3", "train.lr_warmup_steps=4", "train.max_steps=10",
                   "method.n=2", "train.minibatch_prompts=2")
    optim = model.config.actor_rollout_ref.actor.optim
    cfg = _cfg("grpo_n8", "train.max_steps=10")
    assert optimizer_updates_per_step(cfg) == 4 and optimizer_updates_per_step(_cfg("hacpo")) == 4
    assert optim.total_training_steps == 10 * optimizer_updates_per_step(
        _cfg("grpo_n8", "train.max_steps=10", "train.minibatch_prompts=2")) and optim.lr_warmup_steps == 4
    assert model.wg.optimizer.param_groups[0]["lr"] == 0.0
    lrs = []
    for step in range(2):
        own = _rows(model.tokenizer, 8, seed=step)                     # 4 prompts x n = 2
        advantages = torch.tensor([[1.0, -1.0], [0.5, -0.5], [0.0, 0.0], [-1.0, 1.0]])
        lrs += grpo_update(model, own, advantages)["lr"]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert model.wg.calls == {"update_actor": 4}


@pytest.mark.parametrize("dp_size", [2, 4])
def test_partial_dapo_batch_trains_at_any_dp(tmp_path, dp_size):
    """DAPO's batch after its last refill: 3 prompts x n = 2 with minibatches of 2 prompts -> 4 and 2 real
    rows, each padded to the dp size with weight 0; the token counts are the real rows'."""
    model = _model(tmp_path, "grpo_ds", dp_size, "method.n=2", "train.minibatch_prompts=2")
    own = _rows(model.tokenizer, 6, seed=3)
    metrics = grpo_update(model, own, torch.tensor([[1.0, -1.0], [0.5, -0.5], [-1.0, 1.0]]))
    assert sum(metrics["graft/tokens_self"]) == pytest.approx(float(own.batch["response_mask"].sum()))
    assert model.wg.calls == {"update_actor": 2}


def test_ray_environment_and_socket_names_are_per_job(monkeypatch):
    """verl's PPO runtime environment reaches the job's Ray; each job has its own temp dir and its own
    weight-transfer socket names, and both ends of a socket agree on the name."""
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    cfg = _cfg("graft")
    config = verl_config(cfg, "A", "/ckpt/A")
    first, second = ray_init_kwargs(config), ray_init_kwargs(config)
    env = first["runtime_env"]["env_vars"]
    assert env["VLLM_DISABLE_COMPILE_CACHE"] == "1" and env["TOKENIZERS_PARALLELISM"] == "true"
    assert env[JOB_TOKEN_ENV] != second["runtime_env"]["env_vars"][JOB_TOKEN_ENV]
    assert first["_temp_dir"] != second["_temp_dir"] and len(first["_temp_dir"]) < 60

    token_a, token_b = (kw["runtime_env"]["env_vars"][JOB_TOKEN_ENV] for kw in (first, second))
    # verl's trainer side names the socket from the Ray job id, which is the same in every private Ray
    # (vllm_rollout.py); its vLLM worker side from VERL_RAY_JOB_ID / VERL_REPLICA_RANK (vllm_rollout/utils.py)
    job, old_rank, offset = "01000000", 0, 2
    trainer_side = f"ipc:///tmp/rl-colocate-zmq-{job}-replica-{old_rank}-rank-1.sock"
    ours = scoped_zmq_handle(trainer_side, old_rank, offset, token_a)
    worker_side = f"ipc:///tmp/rl-colocate-zmq-{scoped_job_id(job, token_a)}-replica-{old_rank + offset}-rank-1.sock"
    assert ours == worker_side
    assert ours != scoped_zmq_handle(trainer_side, old_rank, offset, token_b)
    with pytest.raises(ValueError, match="naming changed"):
        scoped_zmq_handle("ipc:///tmp/other.sock", 0, 0, token_a)


class _RecordingServer:
    """A rollout server actor class as a replica launches it; records the job id its workers would see."""

    def __init__(self):
        os.environ["VERL_RAY_JOB_ID"] = "01000000"
        self.job_id_seen = os.environ["VERL_RAY_JOB_ID"]


class _NonVllmReplica(RolloutReplica):
    """A rollout replica class of another engine: the offset seam must not depend on vLLM's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(_RecordingServer)
        self.launched = False

    def get_ray_class_with_init_args(self):
        raise NotImplementedError("hybrid replicas reuse the trainer's workers")

    async def launch_servers(self):
        self.launched = True


def test_offset_replica_works_for_any_registered_rollout(monkeypatch):
    from graft_exp.backends.verl.config import JOB_TOKEN_ENV

    monkeypatch.setenv(JOB_TOKEN_ENV, "tok")
    monkeypatch.setenv("VERL_RAY_JOB_ID", "unset")
    offset, tp = 2, 2
    replica_class = offset_replica_class(_NonVllmReplica, offset)
    config = RolloutConfig(name="vllm", tensor_model_parallel_size=tp)
    replica = replica_class(replica_rank=offset + 1, config=config, model_config=None, gpus_per_node=4)
    workers = SimpleNamespace(workers=list("abcdef"))
    asyncio.run(replica.init_hybrid(workers))
    assert replica.launched and replica.workers == ["c", "d"]        # local replica 1 of TP 2 -> workers 2, 3
    server = replica.server_class.__ray_actor_class__()
    assert server.job_id_seen == "01000000" and os.environ["VERL_RAY_JOB_ID"] == scoped_job_id("01000000", "tok")
    with pytest.raises(TypeError, match="rollout replica class"):
        offset_replica_class(_RecordingServer, offset)


class RolloutRecorder:
    """What ``VerlModel.generate`` drives besides the worker group, recording the calls: verl's
    ``CheckpointEngineManager`` (weight transfer to the vLLM replicas, their sleep and wake-up) and the agent
    loop (whose rollouts need vLLM, which this machine does not run): it returns the prompts as they came."""

    def __init__(self):
        self.calls: list[str] = []

    def update_weights(self, step):
        self.calls.append("update_weights")

    def wake_up_replicas(self):
        self.calls.append("wake_up")

    def sleep_replicas(self):
        self.calls.append("sleep")

    def generate_sequences(self, prompts):
        return prompts


def test_weights_reach_vllm_only_after_they_changed(tmp_path):
    """verl's CheckpointEngineManager.update_weights sends every parameter to the replicas; DAPO's refill
    draws, the benchmarks of one validation and the final evaluation runs generate with unchanged weights:
    those only wake the replicas (sleeping at level 1, their weights kept in host memory). An update or a
    load changes the weights and the next generate sends them."""
    model = _model(tmp_path, "grpo_ds", 2, "method.n=2", "train.minibatch_prompts=2")
    recorder = RolloutRecorder()
    model.checkpoints = model.agent_loop = recorder
    prompts = _rows(model.tokenizer, 8, seed=0)

    def generate():
        recorder.calls.clear()
        model.generate(prompts, step=1)
        return recorder.calls

    assert generate() == ["update_weights", "sleep"]
    assert generate() == ["wake_up", "sleep"]          # a refill draw or the next benchmark: nothing re-sent
    grpo_update(model, _rows(model.tokenizer, 8, seed=1), torch.tensor([[1.0, -1.0], [0.5, -0.5], [0.0, 0.0],
                                                                        [-1.0, 1.0]]))
    assert generate() == ["update_weights", "sleep"]
    model.save(str(tmp_path / "latest"), 1)
    assert generate() == ["wake_up", "sleep"]          # saving changes nothing
    model.load(str(tmp_path / "latest"))
    assert generate() == ["update_weights", "sleep"]


@pytest.mark.slow   # starts a Ray
def test_backend_close_leaves_ray_for_the_next_job(tmp_path, compose_cfg, job_ray_auth):
    """The end of a job shuts its Ray down: the next job of the same process (a multirun on cluster=local runs
    them one after another in this process) starts a Ray of its own instead of joining this one, with its
    placement groups."""
    from graft_exp.backends.verl.backend import VerlBackend

    backend = VerlBackend(cfg := compose_cfg("backend=verl", "pair=pair1"), resolve(cfg.method), ["A", "B"], tmp_path)
    start_local_ray(0, job_dir=tmp_path, num_cpus=1)   # as a job starts its Ray (its own token)
    try:
        backend.close()
        assert not ray.is_initialized()
    finally:
        ray.shutdown()
