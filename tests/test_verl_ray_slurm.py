"""Ray-on-Slurm launch for verl jobs: the commands a multi-node allocation runs, the sbatch script
(checked by bash itself), the node list expansion by Slurm's own scontrol, and the script run for real on
the test session's two-node Slurm cluster (two network namespaces): a Ray head on node 1, a worker on
node 2, and the verl backend's resource pools placed on both, up to where a GPU would be needed."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.optional import RAY, VERL_BACKEND

from graft_exp.backends.verl.ray_slurm import RayCluster, sbatch_script

NODES = ("gpu01", "gpu02", "gpu03")
PROBE = Path(__file__).resolve().parent / "support" / "verl_placement_probe.py"


def test_head_and_worker_commands():
    cluster = RayCluster(NODES, gpus_per_node=4, cpus_per_node=32, head_ip="10.0.0.1", temp_dir="/tmp/r1")
    # srun binds each step explicitly: Slurm >= 22.05 does not hand the job's --cpus-per-task to srun.
    step = ["--ntasks-per-node=1", "--cpus-per-task=32", "--gpus-per-node=4", "--mem=0"]
    ray_node = ["--num-gpus=4", "--num-cpus=32", "--temp-dir=/tmp/r1", "--disable-usage-stats", "--block"]
    assert cluster.srun_head() == ["srun", "--nodes=1", "--ntasks=1", *step, "--nodelist=gpu01", "ray", "start",
                                   "--head", "--port=6379", "--node-ip-address=10.0.0.1", *ray_node]
    assert cluster.srun_workers() == ["srun", "--nodes=2", "--ntasks=2", *step, "--exclude=gpu01", "ray", "start",
                                      "--address=10.0.0.1:6379", *ray_node]
    assert RayCluster(NODES[:1], 4, 32).srun_workers() == []
    assert "--gpus-per-node=0" not in RayCluster(NODES, 0, 8).srun_head()     # a CPU step asks for no GPU


def test_wait_command_waits_for_every_node():
    cluster = RayCluster(NODES, gpus_per_node=4, cpus_per_node=8)
    probe = cluster.wait_command(timeout_s=5)
    assert probe[:4] == [sys.executable, "-m", "graft_exp.backends.verl.ray_slurm", "--wait-for"]
    assert probe[4:] == ["gpu01:6379", "--nodes", "3", "--cpus-per-node", "8", "--gpus-per-node", "4",
                         "--timeout", "5"]
    assert cluster.wait_command(1)[6] == "1"


@pytest.mark.slow   # a process that waits out its timeout
def test_wait_for_a_head_that_never_answers_fails_saying_so():
    pytest.importorskip("ray", reason=RAY)
    done = subprocess.run([sys.executable, "-m", "graft_exp.backends.verl.ray_slurm", "--wait-for", "127.0.0.1:9",
                           "--nodes", "1", "--timeout", "2"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 1 and "the Ray head at 127.0.0.1:9 did not answer in 2 s" in done.stderr


def test_sbatch_script(tmp_path):
    script = sbatch_script(2, 4, 32, ["pair=pair1", "method=graft", "seed=0"], partition="gpu", account="proj",
                           setup=["module load cuda"])
    lines = script.splitlines()
    for directive in ("--nodes=2", "--gpus-per-node=4", "--ntasks-per-node=1", "--cpus-per-task=32", "--mem=0",
                      "--partition=gpu", "--account=proj", "--requeue", "--signal=B:USR2@120"):
        assert f"#SBATCH {directive}" in lines
    assert "module load cuda" in lines
    # The training job's pools span both nodes: backend.nnodes and the GPUs Ray has on each node.
    assert lines[-2] == ("python -m graft_exp pair=pair1 method=graft seed=0 backend=verl backend.ray_address=auto "
                         "backend.nnodes=2 pair.gpus=4 &")
    order = [lines.index(x) for x in ('eval "$RAY_HEAD" &', 'eval "$RAY_WAIT_HEAD"',
                                      'if [ -n "$RAY_WORKERS" ]; then eval "$RAY_WORKERS" & fi', 'eval "$RAY_WAIT"')]
    assert order == sorted(order) and order[-1] < len(lines) - 2
    path = tmp_path / "job.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_script_refuses_an_allocation_without_gpus():
    done = subprocess.run([sys.executable, "-m", "graft_exp.backends.verl.ray_slurm", "--nodes", "2",
                           "--gpus-per-node", "0", "--", "pair=pair1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2 and "needs at least 1 node, GPU and CPU per node" in done.stderr
    assert "#SBATCH" not in done.stdout


def slurm_conf() -> dict[str, str]:
    return {"SLURM_CONF": os.environ["SLURM_CONF"]} if "SLURM_CONF" in os.environ else {}


@pytest.mark.service
def test_emitted_commands_for_an_allocation(slurm, tmp_path):
    """Inside an allocation (its node list expanded by scontrol, which needs a Slurm configuration)."""
    env_script = tmp_path / "emit.sh"
    env_script.write_text(
        f'eval "$({sys.executable} -m graft_exp.backends.verl.ray_slurm --emit-ray-commands '
        '--gpus-per-node 4 --cpus-per-node 16)"\n'
        'printf "%s\\n" "$RAY_HEAD" "$RAY_WORKERS" "$RAY_HEAD_ADDRESS"\n')
    # The head's address is its name resolved on the head (the batch host): here, localhost.
    out = subprocess.run(["bash", str(env_script)], capture_output=True, text=True, check=True,
                         env={"SLURM_JOB_NODELIST": "localhost,gpu[02-03]", "SLURM_JOB_ID": "77",
                              "PATH": "/usr/bin:/bin", **slurm_conf()},
                         ).stdout.splitlines()
    assert re.match(r"srun --nodes=1 --ntasks=1 .* --nodelist=localhost ray start --head --port=6379 "
                    r"--node-ip-address=127\.0\.0\.1 .*--temp-dir=/tmp/graft-ray-77", out[0])
    assert re.match(r"srun --nodes=2 --ntasks=2 .* --exclude=localhost ray start --address=127\.0\.0\.1:6379 ", out[1])
    assert out[2] == "127.0.0.1:6379"


@pytest.mark.service
@pytest.mark.slow
def test_two_node_ray_cluster_places_the_verl_pools_on_both_nodes(own_slurm, tmp_path, record_property,
                                                                 monkeypatch):
    """``sbatch_script(nodes=2, ...)`` on two Slurm nodes that are separate network hosts: the Ray head on node
    1, the worker on node 2, each with the CPUs and GPUs Slurm gave it; then, in place of the training job
    (same overrides), tests/support/verl_placement_probe.py runs the verl backend up to its first GPU need: both
    models' resource pools are placed, across both nodes, on every GPU of the allocation. Submitted by a
    user whose home holds another cluster's token and whose environment disables Ray's authentication:
    head, worker and driver use the job's own token, and that home is left as it was."""
    pytest.importorskip("verl", reason=VERL_BACKEND)
    home, foreign = foreign_home(tmp_path)
    for key, value in {"HOME": str(home), "RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": foreign}.items():
        monkeypatch.setenv(key, value)
    if not own_slurm.multi_host:
        pytest.skip("two Slurm nodes as separate hosts need network namespaces (ip netns), unavailable here")
    gpus, cpus = 2, 6      # per node; verl's bundles ask Ray for 3 CPUs per GPU
    overrides = ["pair=pair1", "method=graft", "backend.gpus_per_model=1", "backend.rollout_tp=1",
                 f"checkpoint_root={tmp_path / 'checkpoints'}"]
    script = sbatch_script(2, gpus, cpus, overrides, time="00:15:00",
                           setup=[f"export PATH={Path(sys.executable).parent}:$PATH"],
                           jobs_dir=str(tmp_path / "jobs")).splitlines()
    train = script[-2]
    assert train.startswith("python -m graft_exp ") and " backend.nnodes=2 pair.gpus=2 " in train
    script[-2] = train.replace("python -m graft_exp", f"python {PROBE}", 1)
    (tmp_path / "job.sh").write_text("\n".join(script) + "\n")
    out = tmp_path / "job.out"
    started = time.monotonic()
    job = own_slurm.run("sbatch", "--parsable", "-o", str(out), str(tmp_path / "job.sh")).stdout.strip()
    try:
        deadline = time.monotonic() + 600
        while own_slurm.run("squeue", "-h", "-j", job, check=False).stdout.strip():
            assert time.monotonic() < deadline, f"the Ray job did not finish in 600 s:\n{out.read_text()[-4000:]}"
            time.sleep(2)
    finally:
        own_slurm.run("scancel", job, check=False)
        shutil.rmtree(f"/tmp/graft-ray-{job}", ignore_errors=True)
    wall = time.monotonic() - started
    log = out.read_text()
    record_property("ray_two_node_job_wall_s", round(wall, 1))
    print(f"\ntwo-node Ray-on-Slurm job up to the verl placement: {wall:.1f} s")
    state = own_slurm.run("scontrol", "show", "job", job).stdout
    assert "JobState=COMPLETED" in state, log[-4000:]
    (line,) = [x for x in log.splitlines() if x.startswith("PLACEMENT ")]
    placement = json.loads(line.removeprefix("PLACEMENT "))

    # Two Ray nodes at the two hosts' addresses, the head on the first, each with its Slurm share.
    nodes = placement["nodes"]
    by_ip = {n["ip"]: n for n in nodes.values()}
    assert set(by_ip) == {m.addr for m in own_slurm.members}
    assert by_ip[own_slurm.members[0].addr]["head"] and not by_ip[own_slurm.members[1].addr]["head"]
    assert all((n["CPU"], n["GPU"]) == (cpus, gpus) for n in nodes.values()), nodes
    assert f"NumCPUs={2 * cpus} " in state and "NumNodes=2 " in state

    # verl's pools (one per model, 1 GPU on each node each): bundles on both nodes, no GPU left idle.
    pools = placement["pools"]
    assert set(pools) == {"graft_A", "graft_B"}
    for groups in pools.values():
        assert len(groups) == 2 and all(len(g) == 1 for g in groups), pools
    used = [node for groups in pools.values() for g in groups for node in g.values()]
    assert set(used) == set(nodes) and len(used) == 2 * gpus
    assert placement["free"].get("GPU", 0) == 0
    # Ray actors get verl's PPO runtime environment and the job's token for its socket names.
    assert placement["actor_env"]["VLLM_DISABLE_COMPILE_CACHE"] == "1" and placement["actor_env"]["GRAFT_JOB_TOKEN"]
    # Ray's authentication: the job's own token (0600 in its directory), never the caller's.
    token_file = tmp_path / "jobs" / job / "ray_auth_token"
    assert placement["driver_auth"] == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file),
                                        "RAY_AUTH_TOKEN": None}
    assert token_file.stat().st_mode & 0o777 == 0o600 and token_file.read_text() != foreign
    assert sorted(p.name for p in (home / ".ray").iterdir()) == ["auth_token"]
    assert (home / ".ray" / "auth_token").read_text() == foreign


def foreign_home(root: Path) -> tuple[Path, str]:
    """A home whose ``~/.ray/auth_token`` holds someone else's token (what a local ``ray.init`` leaves)."""
    home, token = root / "foreign-home", "f" * 64
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(token)
    return home, token


def ray_client(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A process that joins the Ray cluster at ``address`` and runs one task there. A refused process retries its
    connection for ~20 s (ray/_private/node.py ``_init_gcs_client``: ``NUM_REDIS_GET_RETRIES`` tries, a second
    apart); ``RAY_gcs_server_port_wait_time_s`` sets that number of tries, and two already show the refusal."""
    code = (f"import ray; ray.init(address={address!r}, log_to_driver=False); "
            "print('RAN', ray.get(ray.remote(lambda: 6 * 7).remote()))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          env={**env, "PATH": os.environ["PATH"], "RAY_gcs_server_port_wait_time_s": "2"})


@pytest.mark.slow
def test_a_jobs_ray_admits_only_its_own_token(tmp_path):
    """A one-node job's private Ray (``start_local_ray``) started by a caller whose home and environment
    carry a foreign token and ``RAY_AUTH_MODE=disabled``: the cluster uses the job's own token, 0600 in
    the job's directory; a process without it (no token, or the caller's) is refused, one with it runs a
    task; the caller's ``~/.ray`` is left as it was."""
    pytest.importorskip("ray", reason=RAY)
    home, foreign = foreign_home(tmp_path)
    job_dir, temp = tmp_path / "run", tempfile.mkdtemp(prefix="graft-ray-", dir="/tmp")
    caller = {"HOME": str(home), "RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": foreign,
              "OMP_NUM_THREADS": "1", "PATH": os.environ["PATH"]}
    job_code = ("import sys, ray\n"
                "from graft_exp.backends.verl.ray_slurm import start_local_ray\n"
                f"start_local_ray(0, job_dir={str(job_dir)!r}, init_kwargs={{'_temp_dir': {temp!r}, 'num_cpus': 1}})\n"
                "print('ADDRESS', ray.get_runtime_context().gcs_address, flush=True)\n"
                "sys.stdin.read()\n")
    job = subprocess.Popen([sys.executable, "-c", job_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=caller)
    try:
        line = job.stdout.readline()
        assert line.startswith("ADDRESS "), job.stderr.read() if job.poll() is not None else line
        address = line.split()[1]
        token_file = job_dir / "ray_auth_token"
        assert token_file.stat().st_mode & 0o777 == 0o600 and len(token_file.read_text()) == 64
        assert token_file.read_text() != foreign

        no_token = ray_client(address, {"HOME": str(tmp_path / "empty-home")})
        callers_token = ray_client(address, caller | {"RAY_AUTH_MODE": "token"})
        for refused in (no_token, callers_token):
            assert refused.returncode != 0 and "RAN" not in refused.stdout
            assert "AuthenticationError" in refused.stderr or "Authentication" in refused.stderr, refused.stderr[-2000:]
        admitted = ray_client(address, {"HOME": str(tmp_path / "empty-home"), "RAY_AUTH_MODE": "token",
                                        "RAY_AUTH_TOKEN_PATH": str(token_file)})
        assert admitted.returncode == 0 and "RAN 42" in admitted.stdout, admitted.stderr[-2000:]
    finally:
        job.communicate(input="", timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    assert job.returncode == 0, job.stderr[-2000:]
    assert sorted(p.name for p in (home / ".ray").iterdir()) == ["auth_token"]
    assert (home / ".ray" / "auth_token").read_text() == foreign
    assert not (tmp_path / "empty-home" / ".ray").exists()


@pytest.mark.slow   # three ray_slurm launches, each composing and planning
def test_submission_checks_the_jobs_plan():
    """``--submit`` or not, the multi-node script is written only for a job whose plan fits: the CPUs per node
    must hold verl's placement groups (3 per GPU) and the agent-loop workers; the plan's own refusals (here a
    token budget below one sequence) stop it in one line."""
    base = [sys.executable, "-m", "graft_exp.backends.verl.ray_slurm", "--nodes", "2", "--gpus-per-node", "4"]
    done = subprocess.run([*base, "--cpus-per-node", "8", "--", "pair=pair1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2 and "--cpus-per-node 8 is below the job's plan of 29 CPUs per node" in done.stderr
    assert "#SBATCH" not in done.stdout
    done = subprocess.run([*base, "--", "pair=pair1", "train.max_response_length=16000"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "#SBATCH" not in done.stdout
    assert done.stderr.strip() == done.stderr.strip().splitlines()[0]
    assert "backend.max_token_len_per_gpu=16384 is below one sequence" in done.stderr
    done = subprocess.run([*base, "--", "pair=pair1"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "#SBATCH --cpus-per-task=32" in done.stdout


@pytest.mark.slow   # starts a Ray
def test_shared_paths_are_seen_by_every_node(tmp_path, job_ray_auth):
    """``check_shared_paths`` (a several-node job, before its pools start): a marker written by the driver
    is read back by a task on each node of the job's Ray, none is left behind; a model directory a node does
    not have is named in the one-line refusal."""
    ray = pytest.importorskip("ray", reason=RAY)

    from graft_exp.backends.verl.ray_slurm import check_shared_paths, start_local_ray

    (tmp_path / "models" / "qwen").mkdir(parents=True)
    start_local_ray(0, job_dir=tmp_path, num_cpus=1)   # as a job starts its Ray (its own token)
    try:
        check_shared_paths({"checkpoint_root": str(tmp_path / "run")}, {"model of B": str(tmp_path / "models" / "qwen")})
        with pytest.raises(RuntimeError, match=r"does not see model of A \(.*/smol\): .*one shared filesystem"):
            check_shared_paths({"checkpoint_root": str(tmp_path / "run")}, {"model of A": str(tmp_path / "models" / "smol")})
    finally:
        ray.shutdown()
    assert list((tmp_path / "run").iterdir()) == []
