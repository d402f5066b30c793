"""Ray inside a Slurm allocation, for verl jobs.

One node (the paper's setting, and what ``cluster=slurm`` submits): the job process starts a private Ray
with the allocation's GPUs (``start_local_ray``); nothing else is needed.

Several nodes: ``python -m graft_exp.backends.verl.ray_slurm`` writes (or submits) an sbatch script that
starts a Ray head on the first node and one Ray worker on every other node with ``srun``, waits until all
GPUs have joined, and runs one training job on the head node against that cluster
(``backend.ray_address=auto``)::

    python -m graft_exp.backends.verl.ray_slurm --nodes 2 --gpus-per-node 4 --partition gpu \\
        --time 2-00:00:00 --submit -- pair=pair1 method=graft seed=0
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

RAY_PORT = 6379


@dataclass(frozen=True)
class RayCluster:
    """A Ray cluster over the nodes of one Slurm allocation: the first node is the head."""

    nodes: tuple[str, ...]
    gpus_per_node: int
    cpus_per_node: int
    port: int = RAY_PORT

    @property
    def head(self) -> str:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head}:{self.port}"

    def head_command(self) -> list[str]:
        return ["ray", "start", "--head", f"--port={self.port}",
                f"--num-gpus={self.gpus_per_node}", f"--num-cpus={self.cpus_per_node}", "--disable-usage-stats",
                "--block"]

    def worker_command(self) -> list[str]:
        return ["ray", "start", f"--address={self.address}", f"--num-gpus={self.gpus_per_node}",
                f"--num-cpus={self.cpus_per_node}", "--disable-usage-stats", "--block"]

    def srun_head(self) -> list[str]:
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={self.head}", *self.head_command()]

    def srun_workers(self) -> list[str]:
        """One Ray worker per non-head node (empty for a one-node allocation)."""
        others = len(self.nodes) - 1
        if not others:
            return []
        return ["srun", f"--nodes={others}", f"--ntasks={others}", "--ntasks-per-node=1",
                f"--exclude={self.head}", *self.worker_command()]

    def wait_command(self, timeout_s: int = 600) -> list[str]:
        """Block until the cluster shows every node's GPUs (or fail after ``timeout_s``)."""
        want = self.gpus_per_node * len(self.nodes)
        probe = (f"import ray,time,sys; ray.init(address='{self.address}'); t=time.time()\n"
                 f"while ray.cluster_resources().get('GPU',0)<{want}:\n"
                 f"    time.sleep(2)\n"
                 f"    if time.time()-t>{timeout_s}: sys.exit('Ray cluster never reached {want} GPUs')")
        return [sys.executable, "-c", probe]


def allocation_nodes(nodelist: str) -> tuple[str, ...]:
    """Host names of a Slurm node list (``SLURM_JOB_NODELIST``), expanded by ``scontrol``."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return tuple(line for line in out.stdout.split() if line)


def sbatch_script(cluster_nodes: int, gpus_per_node: int, cpus_per_node: int, overrides: list[str], *,
                  partition: str | None = None, account: str | None = None, time: str = "2-00:00:00",
                  job_name: str = "graft-verl", setup: list[str] | None = None, port: int = RAY_PORT) -> str:
    """An sbatch script that starts Ray across ``cluster_nodes`` nodes and runs one verl training job
    (``python -m graft_exp <overrides> backend=verl backend.ray_address=auto``) on the head node."""
    directives = [f"--job-name={job_name}", f"--nodes={cluster_nodes}", "--ntasks-per-node=1",
                  f"--gpus-per-node={gpus_per_node}", f"--cpus-per-task={cpus_per_node}", f"--time={time}",
                  "--requeue", "--signal=B:USR2@120"]
    if partition:
        directives.append(f"--partition={partition}")
    if account:
        directives.append(f"--account={account}")
    module = "graft_exp.backends.verl.ray_slurm"
    train = ["python", "-m", "graft_exp", *overrides, "backend=verl", "backend.ray_address=auto"]
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "set -euo pipefail", *(setup or []),
             # The Ray commands of this allocation come from RayCluster (one source for tests and jobs).
             (f'eval "$(python -m {module} --emit-ray-commands --gpus-per-node {gpus_per_node} '
              f'--cpus-per-node {cpus_per_node} --port {port})"'),
             'eval "$RAY_HEAD" &', "sleep 10", 'if [ -n "$RAY_WORKERS" ]; then eval "$RAY_WORKERS" & fi',
             'eval "$RAY_WAIT"', 'export RAY_ADDRESS="$RAY_HEAD_ADDRESS"',
             # Slurm sends USR2 two minutes before the limit: requeue; the job resumes from its checkpoint
             # into the same MLflow run (same graft.run_key).
             """trap 'scontrol requeue "$SLURM_JOB_ID"' USR2""", f"{shlex.join(train)} &", "wait $!"]
    return "\n".join(lines) + "\n"


def ray_commands_for_allocation(gpus_per_node: int, cpus_per_node: int, port: int = RAY_PORT) -> str:
    """Shell assignments (RAY_HEAD, RAY_WORKERS, RAY_WAIT, RAY_HEAD_ADDRESS) for the current allocation."""
    cluster = RayCluster(allocation_nodes(os.environ["SLURM_JOB_NODELIST"]), gpus_per_node, cpus_per_node, port)
    values = {"RAY_HEAD": shlex.join(cluster.srun_head()),
              "RAY_WORKERS": shlex.join(cluster.srun_workers()) if cluster.srun_workers() else "",
              "RAY_WAIT": shlex.join(cluster.wait_command()), "RAY_HEAD_ADDRESS": cluster.address}
    return "\n".join(f"{k}={shlex.quote(v)}" for k, v in values.items())


def start_local_ray(num_gpus: int, address: str | None = None) -> None:
    """Connect to Ray for one job: ``address`` ("auto": the allocation's cluster) or a private Ray on
    this node with ``num_gpus`` GPUs. A job spread over several Slurm nodes needs the sbatch script."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
        return
    if int(os.environ.get("SLURM_NNODES", "1")) > 1:
        raise RuntimeError("this Slurm job spans several nodes but backend.ray_address is null: launch "
                           "multi-node verl jobs with `python -m graft_exp.backends.verl.ray_slurm`")
    ray.init(num_gpus=num_gpus, include_dashboard=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graft_exp.backends.verl.ray_slurm", description=__doc__)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--cpus-per-node", type=int, default=32)
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--time", default="2-00:00:00")
    parser.add_argument("--port", type=int, default=RAY_PORT)
    parser.add_argument("--setup", action="append", default=[], help="shell line run first (module load ...)")
    parser.add_argument("--submit", action="store_true", help="sbatch the script instead of printing it")
    parser.add_argument("--emit-ray-commands", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the training job (after --)")
    args = parser.parse_args(argv)
    if args.emit_ray_commands:
        print(ray_commands_for_allocation(args.gpus_per_node, args.cpus_per_node, args.port))
        return 0
    script = sbatch_script(args.nodes, args.gpus_per_node, args.cpus_per_node, args.overrides,
                           partition=args.partition, account=args.account, time=args.time, setup=args.setup,
                           port=args.port)
    if not args.submit:
        print(script, end="")
        return 0
    return subprocess.run(["sbatch"], input=script, text=True, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
