"""The verl backend (Ray + FSDP + vLLM on GPU nodes): two actor-rollout worker groups, one per model on
split resource pools, driven step by step by graft_exp with the same exchange (``graft_exp.methods.exchange``),
trajectory log (``graft_exp.trajectories``), evaluation protocol (``graft_exp.evaluation``) and MLflow
schema as the local backend.

Modules: ``config`` (our config -> verl's), ``loss`` (the receiver loss inside verl's engine), ``batch``
(the exchange's scorer and receiver batches in verl's layout, minibatches laid out for its dispatch),
``runtime`` (one model's verl stack), ``backend`` (the driver's adapter; ``backend.create`` is the factory
``graft_exp.backends.backend_factory("verl")`` returns), ``ray_slurm`` (Ray in a Slurm job).
"""
