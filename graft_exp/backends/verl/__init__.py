"""The verl backend (Ray + FSDP + vLLM on GPU nodes): two actor-rollout worker groups, one per model,
driven step by step by graft_exp with the same algorithms, MLflow schema and trajectory log as the local
backend. Modules: ``config`` (our config -> verl's), ``loss`` (the receiver loss inside verl's engine),
``batch`` (receiver batches and minibatch layout)."""
