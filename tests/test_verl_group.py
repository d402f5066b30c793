"""A group of three models on verl: one resource pool per member (``backend.gpus_per_model`` GPUs each),
placed by verl's own ResourcePoolManager in a local Ray that declares 8 stand-in GPUs (Ray's bookkeeping
only: placing needs no device), as on one 8-GPU node. The two-node placement across Slurm nodes is
tests/test_verl_ray_slurm.py's, for a pair."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import ray
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from graft_exp.backends.verl.config import placement, ray_init_kwargs, verl_config
from graft_exp.backends.verl.ray_slurm import start_local_ray, stop_local_ray
from graft_exp.backends.verl.runtime import VerlModel, resource_pools
from graft_exp.config import roles
from graft_exp.methods import resolve

CONF = str(Path(__file__).resolve().parents[1] / "conf")


@pytest.mark.slow
def test_three_members_get_three_disjoint_pools_on_one_eight_gpu_node(tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["group=trio", "backend=verl", "method=graft",
                                                       f"checkpoint_root={tmp_path / 'checkpoints'}"])
    GlobalHydra.instance().clear()
    placement(cfg)   # 3 members x 2 GPUs fit the group's 6
    models = [VerlModel(role, verl_config(cfg, role, str(tmp_path / role)), resolve(cfg.method).loss)
              for role in roles(cfg.pair)]
    kwargs = ray_init_kwargs(models[0].config)
    kwargs["num_cpus"] = 32    # verl's bundles reserve CPUs per GPU
    auth = {key: os.environ.get(key) for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    ray_dir = start_local_ray(num_gpus=8, job_dir=tmp_path, init_kwargs=kwargs)
    try:
        pools = resource_pools(models).resource_pool_dict
        assert set(pools) == {"graft_A", "graft_B", "graft_C"}
        bundles = []
        for pool in pools.values():
            groups = pool.get_placement_groups(device_name="cuda")
            ray.get([pg.ready() for pg in groups], timeout=120)
            for pg in groups:
                assert [b.get("GPU") for b in pg.bundle_specs] == [1.0, 1.0]   # gpus_per_model, one node
                bundles.append(ray.util.placement_group_table(pg)["bundles_to_node_id"])
        assert len(bundles) == 3 and ray.available_resources().get("GPU") == 2.0   # 6 of the 8 GPUs held
    finally:
        stop_local_ray(ray_dir)
        for key, value in auth.items():   # start_local_ray set this job's token; later tests start their own
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
