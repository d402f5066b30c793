"""Ray-on-Slurm launch for verl jobs: the commands a multi-node allocation runs, the sbatch script
(checked by bash itself) and the node list expansion by Slurm's own scontrol."""

import shutil
import subprocess
import sys

import pytest

from graft_exp.backends.verl.ray_slurm import RayCluster, sbatch_script

NODES = ("gpu01", "gpu02", "gpu03")


def test_head_and_worker_commands():
    cluster = RayCluster(NODES, gpus_per_node=4, cpus_per_node=32)
    assert cluster.srun_head() == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu01", "ray", "start", "--head",
                                   "--port=6379", "--num-gpus=4", "--num-cpus=32", "--disable-usage-stats", "--block"]
    assert cluster.srun_workers() == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--exclude=gpu01",
                                      "ray", "start", "--address=gpu01:6379", "--num-gpus=4", "--num-cpus=32",
                                      "--disable-usage-stats", "--block"]
    assert RayCluster(NODES[:1], 4, 32).srun_workers() == []


def test_wait_command_counts_all_gpus():
    probe = RayCluster(NODES, gpus_per_node=4, cpus_per_node=8).wait_command(timeout_s=5)
    assert probe[0] == sys.executable and "<12" in probe[2] and "gpu01:6379" in probe[2]
    compile(probe[2], "probe", "exec")


def test_sbatch_script(tmp_path):
    script = sbatch_script(2, 4, 32, ["pair=pair1", "method=graft", "seed=0"], partition="gpu", account="proj",
                           setup=["module load cuda"])
    lines = script.splitlines()
    for directive in ("--nodes=2", "--gpus-per-node=4", "--ntasks-per-node=1", "--partition=gpu",
                      "--account=proj", "--requeue", "--signal=B:USR2@120"):
        assert f"#SBATCH {directive}" in lines
    assert "module load cuda" in lines
    assert lines[-2] == "python -m graft_exp pair=pair1 method=graft seed=0 backend=verl backend.ray_address=auto &"
    assert lines.index('eval "$RAY_WAIT"') < lines.index(lines[-2])
    path = tmp_path / "job.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's scontrol")
def test_emitted_commands_for_an_allocation(tmp_path):
    env_script = tmp_path / "emit.sh"
    env_script.write_text(
        f'eval "$({sys.executable} -m graft_exp.backends.verl.ray_slurm --emit-ray-commands '
        '--gpus-per-node 4 --cpus-per-node 16)"\n'
        'printf "%s\\n" "$RAY_HEAD" "$RAY_WORKERS" "$RAY_HEAD_ADDRESS"\n')
    out = subprocess.run(["bash", str(env_script)], capture_output=True, text=True, check=True,
                         env={"SLURM_JOB_NODELIST": "gpu[01-03]", "PATH": "/usr/bin:/bin"}).stdout.splitlines()
    assert out[0].startswith("srun --nodes=1 --ntasks=1 --nodelist=gpu01 ray start --head")
    assert out[1].startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --exclude=gpu01 ray start "
                             "--address=gpu01:6379")
    assert out[2] == "gpu01:6379"
