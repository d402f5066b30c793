"""The verl backend (Ray + FSDP + vLLM on GPU nodes): two actor-rollout worker groups, one per model on
split resource pools, driven step by step by graft_exp with the same exchange (``graft_exp.exchange``),
trajectory log (``graft_exp.trajectories``), evaluation protocol (``graft_exp.evaluation``) and MLflow
schema as the local backend.

Modules: ``config`` (our config -> verl's), ``loss`` (the receiver loss inside verl's engine), ``batch``
(the exchange's scorer and receiver batches in verl's layout, minibatches laid out for its dispatch),
``runtime`` (one model's verl stack), ``backend`` (the driver's adapter), ``ray_slurm`` (Ray in a Slurm job).
"""

from __future__ import annotations

from omegaconf import DictConfig

from graft_exp import driver, tracking


def train(cfg: DictConfig, job: tracking.TrackedRun) -> dict[str, dict[str, float]]:
    """Train every model of the job (co-trained, or each alone for single-model methods) into its MLflow
    model run through ``graft_exp.driver``, resuming from ``<checkpoint_root>/<run_key>`` when the job was
    requeued. Ray and the models start only when there is a model left to train."""
    from graft_exp.backends.verl.backend import create

    return driver.fit(cfg, job, create)
