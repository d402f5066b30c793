"""Training backends. Each exposes ``train(cfg, job)``: train every model of the job into the
job's MLflow run (graft_exp.tracking), resuming from its own checkpoints when the run is resumed."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from omegaconf import DictConfig

from graft_exp.tracking import TrackedRun

BACKEND_MODULES = {"local": "graft_exp.backends.local", "verl": "graft_exp.backends.verl"}


def get_trainer(name: str) -> Callable[[DictConfig, TrackedRun], None]:
    """Import lazily: the verl backend pulls Ray/vLLM, which a local run never needs."""
    return importlib.import_module(BACKEND_MODULES[name]).train
