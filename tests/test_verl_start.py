"""``VerlModel.start()`` itself in a real local Ray on CPU: verl's ``LLMServerManager`` with the project's
``OffsetReplica`` over the CPU replica (``verl_cpu.cpu_replica_class``, registered for "vllm" in verl's
``RolloutReplicaRegistry``), ``isolate_rollout``, the Ray-actor ``AgentLoopManager`` and the
``CheckpointEngineManager``; then a generation whose rollout samples with the weights the trainer synced."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import torch
from support.verl_cpu import ROLLOUT_DIR_ENV, WORKER_ENV, cpu_replica_class
from test_verl_contract import SMALL, prepared  # noqa: F401 (fixture)
from test_verl_engine import engine_config
from test_verl_runtime import grpo_update
from verl import DataProto
from verl.workers.rollout.replica import RolloutReplicaRegistry

from graft_exp.backends.verl.config import ray_init_kwargs
from graft_exp.backends.verl.ray_slurm import start_local_ray, stop_local_ray
from graft_exp.backends.verl.runtime import VerlModel, start_models
from graft_exp.backends.verl.seeded_agent import SEED_COLUMN, STOP_COLUMN
from graft_exp.methods import resolve

pytestmark = [pytest.mark.verl_engine, pytest.mark.slow]


def test_start_and_rollout_generates_with_the_trained_weights(prepared, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setitem(RolloutReplicaRegistry._registry, "vllm", cpu_replica_class)
    cfg, config = engine_config(prepared, tmp_path, "A")
    kwargs = ray_init_kwargs(config)
    kwargs["runtime_env"]["env_vars"].update(WORKER_ENV)
    (tmp_path / "rollout").mkdir()
    kwargs["runtime_env"]["env_vars"][ROLLOUT_DIR_ENV] = str(tmp_path / "rollout")
    kwargs["num_cpus"] = 16
    # start_local_ray sets this process's Ray token variables; monkeypatch restores them for the next tests
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(key, os.environ.get(key, ""))
        monkeypatch.delenv(key)
    ray_dir = start_local_ray(num_gpus=2, job_dir=tmp_path, init_kwargs=kwargs)
    try:
        model = VerlModel("A", config, resolve(cfg.method).loss)
        start_models([model], with_ref=False)
        assert model.replicas == 2   # data-parallel 2, tensor-parallel 1: one replica per worker
        n = int(config.actor_rollout_ref.rollout.n)
        messages = [[{"role": "user", "content": q}] for q in ("1+1=", "2+2=") for _ in range(n)]

        def generate(step: int) -> DataProto:
            stops = np.empty(len(messages), dtype=object)
            for row in range(len(messages)):
                stops[row] = model.stop_ids
            prompts = DataProto.from_single_dict({"raw_prompt": np.array(messages, dtype=object),
                                                  SEED_COLUMN: np.arange(len(messages), dtype=object) + 100 * step,
                                                  STOP_COLUMN: stops})
            out = model.generate(prompts, step=step)
            assert len(out) == len(messages)
            # the rollout sampled with the trainer's current weights: its log-probs are the trainer's
            mask = out.batch["response_mask"].bool()
            assert mask.any()
            out.batch["old_log_probs"] = model.log_probs(out)
            torch.testing.assert_close(out.batch["rollout_log_probs"][mask], out.batch["old_log_probs"][mask],
                                       atol=1e-4, rtol=0)
            return out

        first = generate(1)
        grpo_update(model, first, torch.linspace(-1, 1, n).repeat(2, 1))
        assert not torch.allclose(model.log_probs(first), first.batch["old_log_probs"], atol=1e-6)   # trained
        generate(2)   # after the update: the rollout has the just-updated weights
    finally:
        stop_local_ray(ray_dir)
