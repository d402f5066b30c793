"""The resource plan (graft_exp.resources, python -m graft_exp.plan) and the launch checks built on it: the
Slurm request follows from the members a job trains, a plan that cannot fit is refused in one line before
anything is created, and the numbers come from the catalog's sizes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from support.optional import RAY

from graft_exp import resources, scheduler
from graft_exp.backends.verl.ray_slurm import start_local_ray
from graft_exp.config import ConfigError
from graft_exp.launching.callbacks import PlannedJob, check_plans, shared_gpus, slurm_request, trained_roles
from graft_exp.plan import main as plan_main
from graft_exp.tracking import model_run_key

ROOT = Path(__file__).resolve().parents[1]


def _plan(compose_cfg, *overrides, trained=None):
    cfg = compose_cfg("backend=verl", *overrides)
    return cfg, resources.job_plan(cfg, trained)


def test_pair1_and_trio_ask_slurm_for_what_their_members_need(compose_cfg):
    """pair1: two pools of 2 GPUs; trio: three, whose placement groups alone reserve 3 Ray CPUs per GPU = 18
    (the old cluster.resources default asked for 8 CPUs and 64 GB for any pair not listed by name)."""
    _, pair1 = _plan(compose_cfg, "pair=pair1")
    assert pair1.slurm == {"nodes": 1, "gpus_per_node": 4, "cpus_per_task": 29, "mem_gb": 96}
    _, trio = _plan(compose_cfg, "group=trio")
    assert [p.model for p in trio.pools] == ["smollm3-3b-base", "qwen3-1.7b-base", "octothinker-3b-hybrid-base"]
    assert trio.ray_cpus == 18 and trio.slurm["gpus_per_node"] == 6
    assert trio.slurm["cpus_per_task"] >= trio.ray_cpus + 3 * 8     # + one core per agent-loop worker
    assert trio.slurm["mem_gb"] >= trio.host_mem_gb > pair1.host_mem_gb
    jobs = [PlannedJob(0, ["group=trio"], compose_cfg("backend=verl", "group=trio", "cluster=slurm"))]
    plans, problems = check_plans(jobs, set(), OmegaConf.create({}), set())
    assert not problems and slurm_request(plans, set()) == {"gpus_per_node": 6, "cpus_per_task": 43, "mem_gb": 152}


def test_overridden_slurm_request_below_the_plan_is_refused(compose_cfg):
    jobs = [PlannedJob(0, ["group=trio"], compose_cfg("backend=verl", "group=trio", "cluster=slurm"))]
    launcher = OmegaConf.create({"cpus_per_task": 8})
    plans, problems = check_plans(jobs, set(), launcher, {"cpus_per_task"})
    assert len(problems) == 1 and "hydra.launcher.cpus_per_task=8 is below its plan's 43" in problems[0]
    assert slurm_request(plans, {"cpus_per_task"}) == {"gpus_per_node": 6, "mem_gb": 152}   # the user's key stays


def test_job_whose_other_member_finished_asks_for_its_own_pool(compose_cfg):
    """A GRPO baseline job of pair1 whose smollm3 baseline (shared with pair3) is FINISHED trains qwen3 only:
    one pool of backend.gpus_per_model GPUs, not pair.gpus."""
    cfg = compose_cfg("backend=verl", "pair=pair1", "method=grpo_n8")
    finished = {model_run_key(cfg, "A")}
    assert trained_roles(cfg, finished) == ["B"]
    plan = resources.job_plan(cfg, trained_roles(cfg, finished))
    assert plan.slurm["gpus_per_node"] == 2 and [p.model for p in plan.pools] == ["qwen3-1.7b-base"]
    assert trained_roles(cfg, set()) == ["A", "B"]
    co_trained = compose_cfg("backend=verl", "pair=pair1", "method=graft")   # co-trained members need each other
    assert trained_roles(co_trained, {model_run_key(co_trained, "A")}) == ["A", "B"]


def test_checkpoints_hold_what_resuming_needs(compose_cfg):
    """latest: model + optimizer + extra; best: the model only; no hf_model export. For pair1 (4.80 B
    parameters) the peak disk of a job falls from 250 GB (every save with hf_model and optimizer) to 143 GB."""
    _, plan = _plan(compose_cfg, "pair=pair1")
    params = 3075098624 + 1720574976
    assert plan.checkpoint["latest"].contents == ["model", "optimizer", "extra"]
    assert plan.checkpoint["best"].contents == ["model"]
    assert plan.checkpoint["latest"].gb == resources.gb(12 * params) and plan.checkpoint["best"].gb == resources.gb(4 * params)
    before = ("model", "optimizer", "extra", "hf_model")
    assert resources.peak_disk_gb(params, before, before) == 250.0
    assert plan.peak_disk_gb == 143.0


def test_gpu_memory_over_committed_from_step_two_is_refused_with_a_utilization_that_fits(compose_cfg):
    """0.6 of a 48 GB GPU for vLLM next to smollm3's sharded fp32 parameters, gradients and AdamW state (22.9 GB
    per GPU on 2 GPUs) does not fit; the utilization the refusal names does; 80 GB GPUs fit."""
    cfg, plan = _plan(compose_cfg, "pair=pair1", "cluster.gpu_mem_gb=48")
    assert plan.gpu_mem_gb["A"].params + plan.gpu_mem_gb["A"].grads + plan.gpu_mem_gb["A"].optimizer == pytest.approx(22.9)
    with pytest.raises(ConfigError, match=r"lower backend.gpu_memory_utilization to 0\.45") as err:
        resources.check(plan, cfg)
    assert "\n" not in str(err.value)
    cfg, plan = _plan(compose_cfg, "pair=pair1", "cluster.gpu_mem_gb=48", "backend.gpu_memory_utilization=0.45")
    resources.check(plan, cfg)
    cfg, plan = _plan(compose_cfg, "group=trio", "cluster.gpu_mem_gb=80")
    resources.check(plan, cfg)
    cfg, plan = _plan(compose_cfg, "pair=pair1", "cluster.gpu_mem_gb=80", "backend.gpu_memory_utilization=0.04")
    with pytest.raises(ConfigError, match="not enough for smollm3-3b-base's bf16 weights"):
        resources.check(plan, cfg)


def test_each_phase_counts_what_verl_holds_then(compose_cfg):
    """Qwen3-1.7B on one GPU (the measured configuration: peak allocated 35.8 GiB, reserved 45.2, 23.9 after the
    step): training holds fp32 parameters, gradients and AdamW (25.6), the log-prob pass's bf16 logits and their
    gradient plus a bf16 hidden state per layer (11.0), the allocator's headroom over them (0.92 x 11.0) and the
    reserve; the rollout phase the whole state beside vLLM's share (measured after the step: 23.9, between
    parameters + AdamW and the whole state)."""
    _, plan = _plan(compose_cfg, "pair=pair1", "cluster=slurm", "backend.gpus_per_model=1", "backend.rollout_tp=1")
    qwen = plan.gpu_mem_gb["B"]
    assert (qwen.params, qwen.grads, qwen.optimizer, qwen.activations, qwen.headroom) == (6.4, 6.4, 12.8, 11.0, 10.1)
    assert qwen.train == pytest.approx(6.4 + 6.4 + 12.8 + 11.0 + 10.1 + resources.GPU_RESERVE_GB)
    assert qwen.gpu == 140.0 and qwen.vllm == 84.0   # cluster=slurm: the paper's H200s
    assert qwen.rollout == pytest.approx(6.4 + 6.4 + 12.8 + 84.0 + resources.GPU_RESERVE_GB)
    assert 6.4 + 12.8 < 23.9 < 6.4 + 6.4 + 12.8
    assert resources.activations_bytes(resources.model_size("qwen3-1.7b-base"), 16384) == \
        16384 * 151936 * 4 + 16384 * 2048 * 2 * 28


def test_the_activation_term_follows_the_log_prob_path_the_job_sets(compose_cfg, monkeypatch):
    """The plan counts the log-prob path ``backend.logprob_path`` names, and the job sets that path on its Ray
    workers (the worker installs ``GRAFT_LOGPROB_PATH``; verl reads ``VERL_DISABLE_FLASH_ATTN_CE`` per call),
    whatever the submitting machine has installed: chunked by default and row-wise (the log-softmax and its
    gradient: 4 bytes per entry, measured), flash-attn's in-place cross-entropy (the gradient written into the bf16
    logits: 2) where chosen, refused where flash-attn is absent. chunked computes row-wise's values bit for bit
    (tests/test_verl_logprobs.py): both keep the run keys of before the setting; flash-attn's has its own."""
    import importlib.util

    from graft_exp.backends.verl.config import ray_init_kwargs
    from graft_exp.config import ConfigError, node_packages
    from graft_exp.tracking.identity import run_key

    shape = ("pair=pair1", "cluster=slurm", "backend.gpus_per_model=1", "backend.rollout_tp=1")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else find_spec(name, *a))
    _, plan = _plan(compose_cfg, *shape)   # flash-attn installed here: the default path stays chunked
    assert plan.gpu_mem_gb["B"].activations == round((16384 * 151936 * 4 + 16384 * 2048 * 2 * 28) / resources.GB, 1)
    assert not any("cross-entropy" in note for note in plan.notes)
    _, plan = _plan(compose_cfg, *shape, "backend.logprob_path=flash_attn_ce")
    assert plan.gpu_mem_gb["B"].activations == round((16384 * 151936 * 2 + 16384 * 2048 * 2 * 28) / resources.GB, 1)
    assert any("flash-attn's in-place cross-entropy" in note for note in plan.notes)
    paths = ("chunked", "rowwise", "flash_attn_ce")
    env = {path: ray_init_kwargs(OmegaConf.create({}), "t", logprob_path=path)["runtime_env"]["env_vars"]
           for path in paths}
    assert [env[p]["VERL_DISABLE_FLASH_ATTN_CE"] for p in paths] == ["1", "1", "0"]
    assert [env[p]["GRAFT_LOGPROB_PATH"] for p in paths] == list(paths)
    verl = ("backend=verl", *shape)
    keys = {path: run_key(compose_cfg(*verl, f"backend.logprob_path={path}")) for path in paths}
    assert keys["chunked"] == keys["rowwise"] == run_key(compose_cfg(*verl)) != keys["flash_attn_ce"]
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)   # no flash-attn where the job trains (CPU)
    cfg = compose_cfg("pair=tiny_paper_vocab", "backend=verl", "backend.logprob_path=flash_attn_ce")
    with pytest.raises(ConfigError, match="backend.logprob_path=chunked"):
        node_packages(cfg)


def test_hacpo_counts_its_reference_models_and_pools_load_together(compose_cfg):
    """HACPO's KL term starts a reference model per pool, its fp32 parameters offloaded to host memory; every
    pool loads at the same time, so their load spikes add up."""
    _, graft = _plan(compose_cfg, "pair=pair1", "cluster=slurm")
    _, hacpo = _plan(compose_cfg, "pair=pair1", "cluster=slurm", "method=hacpo")
    params = {p.role: resources.model_size(p.model).params for p in graft.pools}
    for g, h in zip(graft.pools, hacpo.pools):
        assert h.host_mem_gb == pytest.approx(g.host_mem_gb + 4 * params[g.role] / resources.GB, abs=0.1)
    assert hacpo.slurm["mem_gb"] > graft.slurm["mem_gb"]
    loads = sum(p.load_host_mem_gb for p in graft.pools)
    assert graft.host_mem_gb == pytest.approx(sum(p.host_mem_gb for p in graft.pools) + loads
                                              + resources.HOST_PER_AGENT_WORKER_GB * 8 * 2 + resources.HOST_DRIVER_GB,
                                              abs=0.1)


def test_the_node_checks_the_plan_against_its_own_gpus(compose_cfg):
    """A job submitted for 140 GB GPUs that lands on 48 GB ones stops before Ray starts, with the numbers."""
    cfg, plan = _plan(compose_cfg, "pair=pair1", "cluster=slurm")
    resources.check(plan, cfg)
    resources.check_on_node(cfg, ["A", "B"], 140.4)
    resources.check_on_node(cfg, ["A", "B"], None)   # no CUDA GPU here: nothing to check against
    resources.check_on_node(cfg, ["A", "B"], 79.6)   # an 80 GB H100 holds pair 1 too
    with pytest.raises(ConfigError, match=r"this node's GPUs have 47\.5 GB \(cluster.gpu_mem_gb=140\): "
                                          r"backend.gpu_memory_utilization=0.6 of a 47.5 GB GPU"):
        resources.check_on_node(cfg, ["A", "B"], 47.5)


def test_token_budget_below_one_sequence_is_refused(compose_cfg):
    cfg, plan = _plan(compose_cfg, "pair=pair1", "train.max_response_length=16000")
    with pytest.raises(ConfigError, match="backend.max_token_len_per_gpu=16384 is below one sequence .* 18048"):
        resources.check(plan, cfg)
    cfg, plan = _plan(compose_cfg, "pair=pair1", "train.max_response_length=16000", "backend.max_token_len_per_gpu=18048")
    resources.check(plan, cfg)


def test_several_nodes_state_the_shared_filesystem(compose_cfg):
    _, plan = _plan(compose_cfg, "pair=pair1", "backend.nnodes=2")
    assert any("shared filesystem" in note and "checkpoint_root" in note and "model_dir" in note for note in plan.notes)
    assert not _plan(compose_cfg, "pair=pair1")[1].notes


@pytest.mark.slow   # composes and plans a verl multirun's jobs
def test_verl_multirun_on_this_machine_does_not_share_gpus(compose_cfg):
    verl = [PlannedJob(i, [f"seed={i}"], compose_cfg("backend=verl", "pair=pair1", f"seed={i}")) for i in range(2)]
    tiny = [PlannedJob(i, [f"seed={i}"], compose_cfg(f"seed={i}")) for i in range(2)]
    assert "2 backend=verl jobs" in shared_gpus("local", verl)
    assert "2 backend=verl jobs" in shared_gpus("submitit_local", verl)
    assert shared_gpus("slurm", verl) is None and shared_gpus("local", tiny) is None
    assert shared_gpus("local", verl[:1]) is None


def test_private_ray_without_the_placement_groups_cpus_is_refused(tmp_path):
    """verl reserves 3 CPUs per GPU: a job with fewer would wait in pg.ready() until its time limit."""
    pytest.importorskip("ray", reason=RAY)
    with pytest.raises(RuntimeError, match="reserve 3 per GPU .12 for 4 GPUs."):
        start_local_ray(num_gpus=4, job_dir=tmp_path, num_cpus=8)
    assert not (tmp_path / "ray_auth_token").exists()   # refused before anything was started or written


@pytest.mark.slow   # python -m graft_exp.plan launches
def test_plan_command_json_and_refusal(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plan_main(["--json", "backend=verl", "pair=pair1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {"gpus", "cpus", "host_mem_gb", "slurm", "pools", "checkpoint", "peak_disk_gb", "gpu_mem_gb"} <= set(plan)
    assert plan["checkpoint"]["best"] == {"contents": ["model"], "gb": 17.9}
    assert set(plan["gpu_mem_gb"]) == {"A", "B"} and plan["gpu_mem_gb"]["A"]["optimizer"] == 11.5
    assert list(tmp_path.iterdir()) == []   # nothing created (no store, no checkpoint root)
    assert plan_main(["backend=verl", "pair=pair1", "seed=0,1"]) == 2   # one job: Hydra's first line, no traceback
    assert capsys.readouterr().err == ("plan: Ambiguous value for argument 'seed=0,1' (the overrides of one job, "
                                       "as for python -m graft_exp)\n")
    done = subprocess.run([sys.executable, "-m", "graft_exp.plan", "backend=verl", "pair=pair1",
                           "cluster.gpu_mem_gb=40"], check=False, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]   # one line
    assert done.stderr.startswith("plan refused: backend.gpu_memory_utilization=0.6 of a 40 GB GPU")
    assert "slurm request: --nodes=1 --gpus-per-node=4 --cpus-per-task=29 --mem=96G --time=2-00:00:00" in done.stdout


def test_the_plan_states_each_job_s_cost_wall_time_and_time_limit(compose_cfg):
    """App. D's figures (43.3 GPU-h for GRAFT on pair 1, 174 steps on 4 GPUs: both pools for the whole run; a
    GRPO baseline's models each on its own pool of 2), the Slurm time limit of the pair, and what a job longer
    than the limit does."""
    from graft_exp.launching.jobs import estimate_cost, time_limit
    from graft_exp.plan import cost_line, limit_notes

    graft = compose_cfg("pair=pair1", "backend=verl", "method=graft")
    cost = estimate_cost(graft)
    assert (cost.gpu_hours, cost.wall_hours) == (43.3, pytest.approx(43.3 / 4))
    assert cost_line(cost, graft) == "cost: ~43.3 GPU-h, ~10.8 h wall (174 steps; App. D)"
    limit = time_limit(graft)   # cluster=local composes none: cluster=slurm's default
    assert (limit.minutes, limit.slurm, limit.requeues_allowed) == (2880, "2-00:00:00", 3)
    assert limit_notes(cost, limit) == []
    n32 = estimate_cost(compose_cfg("pair=pair1", "backend=verl", "method=grpo_n32"))
    assert n32.gpu_hours == pytest.approx(99.5 + 45.6) and n32.wall_hours == pytest.approx(99.5 / 2)  # SmolLM3's pool
    (note,) = limit_notes(n32, limit)
    assert "~49.8 h exceed the 48 h limit (--time)" in note and "requeued, 1 time" in note
    short = time_limit(compose_cfg("pair=pair1", "backend=verl", "cluster=slurm",
                                   "+cluster.resources.pair1.timeout_min=600"))
    assert short.slurm == "0-10:00:00" and short.requeues(n32.wall_hours) == 4
    assert "more than hydra.launcher.max_num_timeout=3 allows" in limit_notes(n32, short)[0]
    tiny = estimate_cost(compose_cfg("method=graft"))
    assert tiny.gpu_hours == 0.0 and tiny.wall_hours is None and "wall time unknown" in cost_line(tiny, graft)


def test_launch_callback_sets_the_slurm_request_from_the_plans(tmp_path):
    """The multirun callback (cluster=slurm, before submission): the array's request is the jobs' plan; the
    tiny pair's is 1 CPU, 2 GB and no GPU; a key the user set stays as set."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict, read_write

    from graft_exp.launching.callbacks import LaunchCallback

    def launched(*overrides):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", return_hydra_config=True,
                          overrides=["cluster=slurm", f"tracking.uri=sqlite:///{tmp_path}/store.db",
                                     f"checkpoint_root={tmp_path}/ckpt", *overrides])
            with read_write(cfg.hydra), open_dict(cfg.hydra):
                cfg.hydra.sweeper.params = {"seed": "0,1"}
                cfg.hydra.overrides.hydra = [o for o in overrides if o.startswith("hydra.")]
            callback = LaunchCallback()
            callback.on_multirun_start(cfg)
            callback.on_multirun_end(cfg)
        launcher = cfg.hydra.launcher
        return launcher.gpus_per_node, launcher.cpus_per_task, launcher.mem_gb

    assert launched() == (0, 1, 2)
    assert launched("hydra.launcher.mem_gb=4") == (0, 1, 4)


@pytest.mark.parametrize("cluster", ["submitit_local", "local"])
def test_launch_callback_gives_each_local_job_its_share_of_the_cores(cluster, tmp_path, monkeypatch):
    """On this machine the jobs of a multirun divide its cores (their reward workers, their models side by side):
    submitit_local starts all of them at once, a share each; the joblib launcher one per core, one core each."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict, read_write

    from graft_exp.launching.callbacks import LaunchCallback

    monkeypatch.setenv(scheduler.JOB_CORES_ENV, "8")   # the machine these jobs share, whatever this one has
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True,
                      overrides=[f"cluster={cluster}", f"tracking.uri=sqlite:///{tmp_path}/store.db",
                                 f"checkpoint_root={tmp_path}/ckpt"])
        with read_write(cfg.hydra), open_dict(cfg.hydra):
            cfg.hydra.sweeper.params = {"seed": "0,1,2"}
        callback = LaunchCallback()
        callback.on_multirun_start(cfg)
        callback.on_multirun_end(cfg)
    assert scheduler.job_cores() == {"submitit_local": 8 // 3, "local": 1}[cluster]
