"""Checks the verl end-to-end tier (tests/test_verl_vllm.py, vLLM's engine) makes on the backend's real calls: it
subclasses the verl backend with them."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from verl import DataProto


def trainer_log_probs(model, out: DataProto, temperature: float) -> torch.Tensor:
    """The trainer's per-token log-probs of ``out``'s tokens at the temperature the rollout sampled with
    (validation's differs from training's; the worker reads it from the rollout config)."""
    config = model.config.actor_rollout_ref.rollout
    saved = float(config.temperature)
    config.temperature = temperature
    try:
        return model.log_probs(out)
    finally:
        config.temperature = saved


class CheckpointCheck:
    """Mixin of a ``VerlBackend``: every save records each model's log-probs of its last training rollout
    (``self.last_rollouts``), and every load asserts the loaded workers give exactly those, then calls
    ``loaded(role)``. A subclass keeps its own ``saved`` table: (role, step) -> (rows, log-probs)."""

    saved: ClassVar[dict[tuple[str, int], tuple[DataProto, torch.Tensor]]]

    def save(self, directory: Path, step: int) -> None:
        super().save(directory, step)
        for role, model in self.models.items():
            rows = self.last_rollouts[role]
            self.saved[(role, step)] = (rows, model.log_probs(rows))

    def load(self, directory: Path) -> None:
        super().load(directory)
        for role, model in self.models.items():
            rows, expected = self.saved[(role, self.step)]
            assert torch.equal(model.log_probs(rows), expected)    # exactly the saved model
            self.loaded(role)

    def loaded(self, role: str) -> None:
        """Told after each model's load was checked."""


def attach_started(models: dict, started: dict) -> None:
    """A later job of a module reuses the worker groups, vLLM servers, agent loop and checkpoint engine the
    module's first job started (``started``: that job's models by role): starting them takes minutes."""
    for role, model in models.items():
        live = started[role]
        model.attach(live.wg, live.tokenizer)
        model.stop_ids = live.stop_ids
        model.servers, model.agent_loop, model.checkpoints = live.servers, live.agent_loop, live.checkpoints
        model.replicas = live.replicas


def train_past_checkpoint(started: dict, saved: dict, step: int, grpo_update) -> None:
    """One GRPO update of each started model on its rows saved at ``step``, checked to move its log-probs: a
    resume from that checkpoint must then bring the saved weights back (``CheckpointCheck.load``)."""
    for role, model in started.items():
        rows, log_probs = saved[(role, step)]
        rows.batch["old_log_probs"] = log_probs
        n = int(model.config.actor_rollout_ref.rollout.n)
        grpo_update(model, rows, torch.linspace(-1, 1, n).repeat(len(rows) // n, 1))
        assert not torch.equal(model.log_probs(rows), log_probs)
