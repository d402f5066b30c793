"""The verl backend (Ray + FSDP + vLLM on GPU nodes): two actor-rollout worker groups, one per model on
split resource pools, driven step by step by graft_exp with the same exchange (``graft_exp.exchange``),
trajectory log (``graft_exp.trajectories``), evaluation protocol (``graft_exp.evaluation``) and MLflow
schema as the local backend.

Modules: ``config`` (our config -> verl's), ``loss`` (the receiver loss inside verl's engine), ``batch``
(the exchange's scorer and receiver batches in verl's layout, minibatches laid out for its dispatch),
``runtime`` (one model's verl stack), ``trainer`` (the step loop), ``ray_slurm`` (Ray in a Slurm job).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from graft_exp import tracking


def train(cfg: DictConfig, job: tracking.TrackedRun) -> None:
    """Train every model of the job (co-trained, or each alone for single-model methods) into its MLflow
    model run, resuming from ``<checkpoint_root>/<run_key>`` when the job was requeued."""
    from graft_exp.backends.verl.ray_slurm import start_local_ray
    from graft_exp.backends.verl.trainer import Trainer

    trainer = Trainer(cfg, job, Path(cfg.checkpoint_root) / tracking.run_key(cfg))
    if not trainer.runs:
        return   # every model run of this job is FINISHED already (e.g. a shared GRPO baseline)
    start_local_ray(num_gpus=int(cfg.pair.gpus), address=cfg.backend.ray_address)
    trainer.start()
    trainer.fit()
