"""The shared driver (``graft_exp.driver.fit``) on verl's real engine: ``VerlModel.start`` in a real local Ray on
CPU (verl's FSDP1 engine workers at data-parallel size 2, ``LLMServerManager`` with our ``OffsetReplica``
over the CPU replica, the Ray-actor ``AgentLoopManager``, the ``CheckpointEngineManager``), only vLLM
stood in (``verl_cpu``; tests/test_verl_vllm.py runs vLLM's real CPU engine instead), on ``pair=tiny_verl``
(tiny-char-llama and tiny-bpe-qwen3: two tokenizers). A job trains a step, validates and checkpoints, stops as
a preempted job would; a fresh driver of the same MLflow run resumes from verl's checkpoint files, trains the
second step, validates, checkpoints and evaluates the best checkpoint.

Asserted on the way: every training rollout was sampled with the weights the trainer holds at that moment
(the rollout's own log-probs equal the trainer's, first step after the resume included), and the final
evaluation's rollout with the restored best weights; the resumed model scores exactly as the saved one.

The worker groups are started once (each start costs ~20 s on two cores) and handed to the resumed
driver's backend: the resume loads verl's checkpoint into workers whose weights were trained on past it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import ray
import torch
from support.mlflow_records import histories, model_runs
from support.verl_checks import CheckpointCheck, attach_started, train_past_checkpoint, trainer_log_probs
from support.verl_cpu import WORKER_ENV, cpu_replica_class
from test_verl_contract import SMALL, prepared  # noqa: F401 (fixture)
from test_verl_runtime import grpo_update
from verl import DataProto
from verl.utils import hf_tokenizer
from verl.workers.rollout.replica import RolloutReplicaRegistry

from graft_exp import driver, tracking
from graft_exp.backends.verl.backend import VerlBackend, check_verl_loadable
from graft_exp.backends.verl.config import data_files, model_path, ray_init_kwargs
from graft_exp.backends.verl.ray_slurm import start_local_ray
from graft_exp.backends.verl.runtime import start_models

pytestmark = [pytest.mark.verl_engine, pytest.mark.slow]

#: verl settings a CPU needs (not CPU patches: the config a GPU job could choose too): transformers' SDPA
#: attention (verl's model config defaults to flash-attention 2, CUDA only), fp32 FSDP compute so that the
#: rollout's log-probs (an fp32 forward) compare with the trainer's.
CPU_OVERRIDES = "backend.verl_overrides=[{}]".format(",".join(f"'{o}'" for o in (
    "actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    *(f"actor_rollout_ref.actor.fsdp_config.mixed_precision.{k}=fp32"
      for k in ("param_dtype", "reduce_dtype", "buffer_dtype")))))


def assert_rollout_used_trainer_weights(model, out: DataProto, temperature: float) -> None:
    """The rollout's per-token log-probs (what the worker-side rollout computed with the weights verl's sync
    delivered) equal the trainer's on the same tokens at the same temperature: a sync that delivered older
    weights, or none, fails here."""
    mask = out.batch["response_mask"].bool()
    assert mask.any()
    trainer = trainer_log_probs(model, out, temperature)
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], trainer[mask], atol=1e-4, rtol=0)


class CheckedBackend(CheckpointCheck, VerlBackend):
    """The verl backend with the test's checks on its real calls: each rollout against the trainer's weights,
    each checkpoint's scores, each load's scores against the checkpoint's."""

    saved: ClassVar[dict[tuple[str, int], tuple[DataProto, torch.Tensor]]] = {}   # (role, step) -> (rows, log-probs)
    checked: ClassVar[dict[str, int]] = {"rollouts": 0, "evaluations": 0, "loads": 0}

    def _generate(self, role, prompts, n, seed, validate):
        out, texts, finished = super()._generate(role, prompts, n, seed, validate)
        model = self.models[role]
        kwargs = model.config.actor_rollout_ref.rollout
        temperature = float(kwargs.val_kwargs.temperature if validate else kwargs.temperature)
        if temperature > 0:
            assert_rollout_used_trainer_weights(model, out, temperature)
            CheckedBackend.checked["evaluations" if validate else "rollouts"] += 1
        self.last_rollouts = getattr(self, "last_rollouts", {})
        if not validate:
            self.last_rollouts[role] = out
        return out, texts, finished

    def loaded(self, role: str) -> None:
        CheckedBackend.checked["loads"] += 1

    def close(self) -> None:
        """The module's jobs share one Ray and one start of the worker groups (``EngineFactory``): the
        fixture shuts them down after the last job (``VerlBackend.close`` is tested in test_verl_runtime)."""


class EngineFactory:
    """``backend.create`` with the CPU worker environment: the first call starts Ray and the worker groups,
    a later call (a resumed driver, another method's job) builds a fresh backend over the same live workers."""

    def __init__(self, job_dir: Path):
        self.job_dir, self.live, self.backends, self.ray_dir = job_dir, {}, [], None

    def __call__(self, cfg, method, roles, run_dir) -> VerlBackend:
        for role in roles:
            check_verl_loadable(model_path(cfg, role))
        backend = CheckedBackend(cfg, method, roles, run_dir)
        train_file, val_files = data_files(cfg)
        backend.build(train_file, val_files, hf_tokenizer(model_path(cfg, roles[0])))
        if not self.live:
            kwargs = ray_init_kwargs(backend.models[roles[0]].config)
            kwargs["runtime_env"]["env_vars"].update(WORKER_ENV)
            kwargs["num_cpus"] = 16   # verl's pools reserve CPUs per stand-in GPU (ResourcePoolManager's bundles)
            self.ray_dir = kwargs["_temp_dir"]
            start_local_ray(num_gpus=int(cfg.pair.gpus), job_dir=self.job_dir, init_kwargs=kwargs)
            # With the reference model whichever job starts them: hacpo's KL term needs it, the others ignore it.
            start_models(list(backend.models.values()), with_ref=True)
            self.live = backend.models
        else:
            attach_started(backend.models, self.live)
        self.backends.append(backend)
        return backend


@pytest.fixture(scope="module")
def factory(prepared, tmp_path_factory, exclusive_memory):  # noqa: F811
    """One Ray and one pair of worker groups for this module's jobs."""
    job_dir = tmp_path_factory.mktemp("verl_e2e")
    with exclusive_memory(), pytest.MonkeyPatch.context() as patch:
        patch.setitem(RolloutReplicaRegistry._registry, "vllm", cpu_replica_class)
        for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):   # start_local_ray sets them
            patch.setenv(key, os.environ.get(key, ""))
            patch.delenv(key)
        made = EngineFactory(job_dir)
        try:
            yield made
        finally:
            ray.shutdown()
            if made.ray_dir:
                shutil.rmtree(made.ray_dir, ignore_errors=True)


def job_maker(compose_cfg, prepared, tmp_path, method, *overrides):  # noqa: F811
    def make_job():
        # pair=tiny_verl: tiny-char-llama and tiny-bpe-qwen3, two architectures and two tokenizers (verl loads
        # *ForCausalLM models only, ``check_verl_loadable``: not pair=tiny's GPT-2)
        cfg = compose_cfg("backend=verl", "pair=tiny_verl", "pair.data=math",
                          f"backend.data_dir={prepared / 'data'}", f"backend.model_dir={prepared / 'models'}",
                          f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"checkpoint_root={tmp_path}/ckpt",
                          *SMALL, f"method={method}", *overrides, CPU_OVERRIDES)
        return cfg, tracking.open_job(cfg)
    return make_job


def test_graft_through_the_driver_on_the_real_engine(compose_cfg, prepared, store_template, tmp_path,  # noqa: F811
                                                     factory, monkeypatch):
    shutil.copy(store_template, tmp_path / "mlflow.db")
    CheckedBackend.saved.clear()
    CheckedBackend.checked.update(rollouts=0, evaluations=0, loads=0)
    make_job = job_maker(compose_cfg, prepared, tmp_path, "graft")
    cfg, job = make_job()
    assert driver.fit(cfg, job, factory, stop_at_step=1) == {}
    job.finish("KILLED")
    run_dir = driver.run_directory(cfg)
    for role in ("A", "B"):
        files = {p.name for p in (run_dir / "ckpt-1" / role / "global_step_1").iterdir()}
        assert {f"model_world_size_2_rank_{r}.pt" for r in (0, 1)} <= files   # verl's sharded FSDP1 files
    # trained on past the checkpoint: the resume must bring the saved weights back
    train_past_checkpoint(factory.live, CheckedBackend.saved, 1, grpo_update)

    cfg, resumed = make_job()
    assert resumed.resumed and resumed.run_id == job.run_id
    scores = driver.fit(cfg, resumed, factory)
    assert resumed.status == "FINISHED" and set(scores) == {"A", "B"}
    assert CheckedBackend.checked["loads"] == 2
    assert CheckedBackend.checked["rollouts"] >= 4          # two steps, two models
    assert CheckedBackend.checked["evaluations"] >= 6       # validations 0..2 and the final runs, per model
    assert all(m.wg.world_size == 2 for m in factory.live.values())
    runs = model_runs(resumed.client, job.run_id)
    for role, run in runs.items():
        assert run.info.status == "FINISHED"
        metrics = histories(resumed.client, run.info.run_id)
        assert [s for s, _ in metrics["train/reward_mean"]] == [1, 2]
        assert [s for s, _ in metrics["val/avg"]] == [0, 1, 2]
        assert [s for s, _ in metrics["test/avg"]] == [0, 1]
        assert all(np.isfinite(v) for _, v in metrics["train/loss"])
        assert int(run.data.tags["graft.best_step"]) in (1, 2)

    # A weight sync that stops delivering fails the check: the trainer moves on, the rollout keeps the
    # weights of the last sync.
    backend, model = factory.backends[-1], factory.live["A"]
    rows, _ = CheckedBackend.saved[("A", 2)]
    rows.batch["old_log_probs"] = model.log_probs(rows)
    n = int(model.config.actor_rollout_ref.rollout.n)
    grpo_update(model, rows, torch.linspace(-1, 1, n).repeat(len(rows) // n, 1))
    monkeypatch.setattr(model.checkpoints, "update_weights", lambda global_steps=None: None)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        backend.sample("A", backend.problems()[:2], n, seed=1, step=3)


@pytest.mark.parametrize("method", ["sgt", "hacpo", "grpo_ds"])
def test_method_through_the_driver_on_the_real_engine(compose_cfg, prepared, store_template, tmp_path,  # noqa: F811
                                                      factory, method, monkeypatch):
    """A step, validations, a checkpoint and the final evaluation of the best checkpoint on the workers the graft
    job started; every rollout checked against the trainer's weights. (The graft test trains two steps, stops
    and resumes: what a second step adds is the same for every method.)"""
    shutil.copy(store_template, tmp_path / "mlflow.db")
    # The untrained tiny models fail most groups, so dynamic sampling would draw DAPO's cap of 10 batches per
    # step; 3 draws exercise the same refilling path.
    monkeypatch.setattr(driver, "MAX_GEN_BATCHES", 3)
    CheckedBackend.checked.update(rollouts=0, evaluations=0, loads=0)
    batch = ["train.batch_prompts=4", "train.minibatch_prompts=2"] if method == "grpo_ds" else []
    cfg, job = job_maker(compose_cfg, prepared, tmp_path, method, *batch, "train.max_steps=1")()
    scores = driver.fit(cfg, job, factory)
    assert job.status == "FINISHED" and set(scores) == {"A", "B"}
    assert CheckedBackend.checked["rollouts"] >= 2 and CheckedBackend.checked["evaluations"] >= 4
    assert sorted(p.name for p in driver.run_directory(cfg).glob("ckpt-*")) == ["ckpt-1"]
    for run in model_runs(job.client, job.run_id).values():
        assert run.info.status == "FINISHED"
        metrics = histories(job.client, run.info.run_id)
        assert [s for s, _ in metrics["train/loss"]] == [1]
        assert all(np.isfinite(v) for _, v in metrics["train/loss"])
        assert [s for s, _ in metrics["val/avg"]] == [0, 1]
