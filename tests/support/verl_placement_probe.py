"""A multi-node verl job up to the point where it needs a GPU, run by tests/test_verl_ray_slurm.py in place
of ``python -m graft_exp <overrides>`` in the ray_slurm sbatch script, with the same overrides.

It composes the job's config, joins the allocation's Ray cluster as the verl backend does
(``start_local_ray`` with ``ray_init_kwargs``: verl's runtime environment), builds every member's verl config and their resource pools
(``runtime.resource_pools``) and places the pools' placement groups. The backend's next step,
``VerlModel.start``, spawns the FSDP workers, which need CUDA. Prints one line ``PLACEMENT <json>``:
the live Ray nodes with their resources, the node of every bundle of every pool, and what is left free.
"""

import json
import os
import sys
import time
from pathlib import Path

import ray
from hydra import compose, initialize_config_dir

from graft_exp.backends.verl.config import JOB_TOKEN_ENV, ray_init_kwargs, verl_config
from graft_exp.backends.verl.ray_slurm import start_local_ray
from graft_exp.backends.verl.runtime import VerlModel, resource_pools
from graft_exp.config import register_schemas, roles
from graft_exp.methods import resolve

register_schemas()
with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
    cfg = compose(config_name="config", overrides=sys.argv[1:])
models = [VerlModel(role, verl_config(cfg, role, str(Path(cfg.checkpoint_root) / role)),
                    resolve(cfg.method).loss) for role in roles(cfg.pair)]
# As backends/verl/backend.create starts it: verl's runtime environment and this job's token on every actor.
start_local_ray(num_gpus=int(cfg.pair.gpus), job_dir=cfg.checkpoint_root, address=cfg.backend.ray_address,
                init_kwargs=ray_init_kwargs(models[0].config))


@ray.remote(num_cpus=0)
def actor_env() -> dict:
    return {key: os.environ.get(key) for key in ("VLLM_DISABLE_COMPILE_CACHE", JOB_TOKEN_ENV)}


placed = {}
for name, pool in resource_pools(models).resource_pool_dict.items():
    groups = pool.get_placement_groups(device_name="cuda")
    placed[name] = [ray.util.placement_group_table(pg)["bundles_to_node_id"] for pg in groups]
nodes = {n["NodeID"]: {"ip": n["NodeManagerAddress"], "CPU": n["Resources"].get("CPU", 0),
                       "GPU": n["Resources"].get("GPU", 0), "head": "node:__internal_head__" in n["Resources"]}
         for n in ray.nodes() if n["Alive"]}
auth = {key: os.environ.get(key) for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
# The head's view of free resources follows each raylet's reports, a moment after a placement group is ready.
deadline = time.monotonic() + 30
while ray.available_resources().get("GPU", 0) and time.monotonic() < deadline:
    time.sleep(0.2)
print("PLACEMENT " + json.dumps({"nodes": nodes, "pools": placed, "free": ray.available_resources(),
                                 "actor_env": ray.get(actor_env.remote()), "driver_auth": auth}), flush=True)
