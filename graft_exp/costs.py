"""GPU-hours (paper App. D; docs/design.md "GPU-hours"): the devices a job is charged for, each role's busy
time in a step, and how a step's wall time becomes each model's and the job's device-seconds."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import contextmanager

from omegaconf import DictConfig


def accounted_gpus(cfg: DictConfig) -> int:
    """N_GPU of ``cost/gpu_hours`` (paper App. D: N_GPU x summed per-step training wall time).

    The GPUs Slurm allocated to this job (``SLURM_GPUS_ON_NODE`` x nodes) when it runs under Slurm
    with GPUs, else what the pair asks for (``pair.gpus``: 4 for pair1..3, as in the paper). A
    CPU-only job (the tiny pair) is charged as one device so that its compute curves keep a scale.
    """
    on_node = os.environ.get("SLURM_GPUS_ON_NODE")
    if on_node and on_node.isdigit() and int(on_node) > 0:
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1
        return int(on_node) * int(nodes)
    return max(int(cfg.pair.gpus), 1)


class Timer:
    """Busy seconds per role; ``shared`` work (reward checks, the exchange's bookkeeping) is split evenly."""

    def __init__(self, roles: Sequence[str]):
        self.seconds = {role: 0.0 for role in roles}

    @contextmanager
    def __call__(self, *roles: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            share = (time.perf_counter() - started) / len(roles)
            for role in roles:
                self.seconds[role] += share


def step_costs(busy: dict[str, float], wall: float, devices: dict[str, int], co_train: bool,
               concurrent: bool) -> tuple[dict[str, float], float]:
    """Device-seconds of one training step: (each model's, the job's). Paper App. D, docs/design.md "GPU-hours".

    Independent models pay their own busy time on their own devices; the job is their sum. A co-trained
    pair pays the step's wall time on every device it holds (both pools when they are disjoint, the one
    shared device otherwise), split between the models in proportion to their busy time, so the shares
    add up to the joint cost."""
    if not co_train:
        own = {role: busy[role] * devices[role] for role in busy}
        return own, sum(own.values())
    joint = wall * (sum(devices.values()) if concurrent else max(devices.values()))
    total_busy = sum(busy.values())
    shares = {role: joint * (busy[role] / total_busy if total_busy > 0 else 1 / len(busy)) for role in busy}
    return shares, joint
