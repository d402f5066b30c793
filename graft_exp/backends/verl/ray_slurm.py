"""Ray inside a Slurm allocation, for verl jobs.

One node (the paper's setting, and what ``cluster=slurm`` submits): the job process starts a private Ray
with the allocation's GPUs (``start_local_ray``); nothing else is needed.

Several nodes: ``python -m graft_exp.backends.verl.ray_slurm`` writes (or submits) an sbatch script that
starts a Ray head on the first node and one Ray worker on every other node with ``srun``, waits until every
node has joined with its GPUs, and runs one training job on the head node against that cluster
(``backend.ray_address=auto``, ``backend.nnodes=<nodes>``: each model's resource pool spans every node)::

    python -m graft_exp.backends.verl.ray_slurm --nodes 2 --gpus-per-node 4 --partition gpu \\
        --time 2-00:00:00 --submit -- pair=pair1 method=graft seed=0

Every Ray cluster started here uses Ray's token authentication with a token of its own, generated per job
and kept 0600 in the job's directory (``new_ray_token``): a Ray port on a shared cluster network would
otherwise run any code sent to it. The token reaches the head, the workers and the driver explicitly
(``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH``, ``ray_auth_env``); a token of the caller's
(``~/.ray/auth_token``, ``RAY_AUTH_TOKEN``) is never read, and nothing is written to ``~/.ray``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from graft_exp.resources import RAY_CPUS_PER_GPU

RAY_PORT = 6379
MODULE = "graft_exp.backends.verl.ray_slurm"
#: The job's Ray token, in the job's directory (the run directory; a multi-node job's ``ray_job_dir``).
RAY_TOKEN_FILE = "ray_auth_token"
#: Default parent of the multi-node jobs' directories, relative to the submission directory.
JOBS_DIR = "graft-ray-jobs"


def new_ray_token(directory: str | os.PathLike) -> str:
    """Generate a fresh Ray token (256 random bits) into ``<directory>/ray_auth_token``, readable by its
    owner only (0600, written before it holds the token), replacing an older one; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RAY_TOKEN_FILE)
    staged = f"{path}.{os.getpid()}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.replace(staged, path)
    return path


def ray_auth_env(token_path: str) -> dict[str, str]:
    """The environment that makes Ray (``ray start``, ``ray.init``) authenticate with ``token_path`` only.
    Ray reads ``RAY_AUTH_TOKEN`` before the path: whoever applies this must also drop that variable."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def use_ray_token(token_path: str) -> None:
    """Make this process (and the Ray processes it starts) authenticate with the job's token only, whatever
    the caller's environment or ``~/.ray/auth_token`` hold; Ray's cached settings are refreshed so that a
    process which used Ray before also switches."""
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update(ray_auth_env(token_path))
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@dataclass(frozen=True)
class RayCluster:
    """A Ray cluster over the nodes of one Slurm allocation: the first node is the head."""

    nodes: tuple[str, ...]
    gpus_per_node: int
    cpus_per_node: int
    port: int = RAY_PORT
    head_ip: str | None = None      # the head's address as the other nodes reach it (default: its name)
    temp_dir: str | None = None     # Ray's session files on every node (short: Unix socket paths)

    @property
    def head(self) -> str:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head_ip or self.head}:{self.port}"

    def _node_options(self) -> list[str]:
        temp = [f"--temp-dir={self.temp_dir}"] if self.temp_dir else []
        return [f"--num-gpus={self.gpus_per_node}", f"--num-cpus={self.cpus_per_node}", *temp,
                "--disable-usage-stats", "--block"]

    def head_command(self) -> list[str]:
        ip = [f"--node-ip-address={self.head_ip}"] if self.head_ip else []
        return ["ray", "start", "--head", f"--port={self.port}", *ip, *self._node_options()]

    def worker_command(self) -> list[str]:
        return ["ray", "start", f"--address={self.address}", *self._node_options()]

    def _srun(self, nodes: int) -> list[str]:
        """One task per node holding the node's share of the allocation. Explicit, because since Slurm
        22.05 srun no longer inherits the job's --cpus-per-task, and a step sees no GPU it did not ask for."""
        gpus = [f"--gpus-per-node={self.gpus_per_node}"] if self.gpus_per_node else []
        return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
                f"--cpus-per-task={self.cpus_per_node}", *gpus, "--mem=0"]

    def srun_head(self) -> list[str]:
        return [*self._srun(1), f"--nodelist={self.head}", *self.head_command()]

    def srun_workers(self) -> list[str]:
        """One Ray worker per non-head node (empty for a one-node allocation)."""
        others = len(self.nodes) - 1
        if not others:
            return []
        return [*self._srun(others), f"--exclude={self.head}", *self.worker_command()]

    def wait_command(self, nodes: int | None = None, timeout_s: int = 600) -> list[str]:
        """Block until ``nodes`` (default: all) nodes have joined with their CPUs and GPUs, or fail."""
        nodes = len(self.nodes) if nodes is None else nodes
        return [sys.executable, "-m", MODULE, "--wait-for", self.address, "--nodes", str(nodes),
                "--cpus-per-node", str(self.cpus_per_node), "--gpus-per-node", str(self.gpus_per_node),
                "--timeout", str(timeout_s)]


def wait_for_ray(address: str, nodes: int, cpus_per_node: int, gpus_per_node: int, timeout_s: float) -> None:
    """Return once the Ray cluster at ``address`` has ``nodes`` live nodes, each with its CPUs and GPUs."""
    import ray

    deadline = time.monotonic() + timeout_s
    host, port = address.rsplit(":", 1)
    while True:     # the head's GCS port answers first; ray.init would give up on a head still starting
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the Ray head at {address} did not answer in {timeout_s:.0f} s")
            time.sleep(1)
    ray.init(address=address, log_to_driver=False)
    try:
        while True:
            alive = [n["Resources"] for n in ray.nodes() if n["Alive"]]
            ready = [r for r in alive if r.get("CPU", 0) >= cpus_per_node and r.get("GPU", 0) >= gpus_per_node]
            if len(ready) >= nodes:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the Ray cluster at {address} has {len(ready)} of {nodes} nodes with "
                                 f"{cpus_per_node} CPUs and {gpus_per_node} GPUs after {timeout_s:.0f} s: {alive}")
            time.sleep(2)
    finally:
        ray.shutdown()


def allocation_nodes(nodelist: str) -> tuple[str, ...]:
    """Host names of a Slurm node list (``SLURM_JOB_NODELIST``), expanded by ``scontrol``."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return tuple(line for line in out.stdout.split() if line)


def sbatch_script(cluster_nodes: int, gpus_per_node: int, cpus_per_node: int, overrides: list[str], *,
                  partition: str | None = None, account: str | None = None, time: str = "2-00:00:00",
                  job_name: str = "graft-verl", setup: list[str] | None = None, port: int = RAY_PORT,
                  jobs_dir: str = JOBS_DIR) -> str:
    """An sbatch script that starts Ray across ``cluster_nodes`` nodes and runs one verl training job
    (``python -m graft_exp <overrides> backend=verl backend.ray_address=auto``) on the head node.
    ``jobs_dir`` (relative: to the submission directory) holds each job's directory with its Ray token;
    every node must see it (a shared filesystem, as for the job's log)."""
    if min(cluster_nodes, gpus_per_node, cpus_per_node) < 1:
        raise ValueError(f"a multi-node verl job needs at least 1 node, GPU and CPU per node; got nodes="
                         f"{cluster_nodes}, gpus_per_node={gpus_per_node}, cpus_per_node={cpus_per_node}")
    # --mem=0: all of each node's memory (the job holds its nodes' GPUs; FSDP and vLLM want the host RAM).
    directives = [f"--job-name={job_name}", f"--nodes={cluster_nodes}", "--ntasks-per-node=1",
                  f"--gpus-per-node={gpus_per_node}", f"--cpus-per-task={cpus_per_node}", "--mem=0",
                  f"--time={time}", "--requeue", "--signal=B:USR2@120"]
    if partition:
        directives.append(f"--partition={partition}")
    if account:
        directives.append(f"--account={account}")
    # Every pool spans every node: pair.gpus is what Ray has per node, backend.nnodes how many nodes.
    train = ["python", "-m", "graft_exp", *overrides, "backend=verl", "backend.ray_address=auto",
             f"backend.nnodes={cluster_nodes}", f"pair.gpus={gpus_per_node}"]
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "set -euo pipefail", *(setup or []),
             # The Ray commands of this allocation come from RayCluster (one source for tests and jobs); the
             # job's Ray token is exported to every later step (srun passes the environment on).
             (f'eval "$(python -m {MODULE} --emit-ray-commands --gpus-per-node {gpus_per_node} '
              f'--cpus-per-node {cpus_per_node} --port {port} --jobs-dir {shlex.quote(jobs_dir)})"'),
             'eval "$RAY_HEAD" &', 'eval "$RAY_WAIT_HEAD"',
             'if [ -n "$RAY_WORKERS" ]; then eval "$RAY_WORKERS" & fi',
             'eval "$RAY_WAIT"', 'export RAY_ADDRESS="$RAY_HEAD_ADDRESS"',
             # Slurm sends USR2 two minutes before the limit: requeue; the job resumes from its checkpoint
             # into the same MLflow run (same graft.run_key).
             """trap 'scontrol requeue "$SLURM_JOB_ID"' USR2""", f"{shlex.join(train)} &", "wait $!"]
    return "\n".join(lines) + "\n"


def ray_job_dir(jobs_dir: str) -> str:
    """This allocation's own directory under ``jobs_dir``: its Slurm job id (a requeued job reuses it)."""
    return os.path.join(os.path.abspath(jobs_dir), os.environ["SLURM_JOB_ID"])


def ray_commands_for_allocation(gpus_per_node: int, cpus_per_node: int, port: int = RAY_PORT,
                                jobs_dir: str = JOBS_DIR) -> str:
    """Shell assignments (RAY_HEAD, RAY_WAIT_HEAD, RAY_WORKERS, RAY_WAIT, RAY_HEAD_ADDRESS) for the current
    allocation, and the exports that give every later command the job's new Ray token (``ray_auth_env``;
    a caller's ``RAY_AUTH_TOKEN`` unset). Run by the batch script, i.e. on the head node: the head's address
    is its own name resolved there (as the other nodes resolve it), Ray's files go to a short per-job
    directory."""
    nodes = allocation_nodes(os.environ["SLURM_JOB_NODELIST"])
    cluster = RayCluster(nodes, gpus_per_node, cpus_per_node, port, head_ip=socket.gethostbyname(nodes[0]),
                         temp_dir=f"/tmp/graft-ray-{os.environ['SLURM_JOB_ID']}")
    values = {"RAY_HEAD": shlex.join(cluster.srun_head()), "RAY_WAIT_HEAD": shlex.join(cluster.wait_command(1)),
              "RAY_WORKERS": shlex.join(cluster.srun_workers()) if cluster.srun_workers() else "",
              "RAY_WAIT": shlex.join(cluster.wait_command()), "RAY_HEAD_ADDRESS": cluster.address}
    auth = ray_auth_env(new_ray_token(ray_job_dir(jobs_dir)))
    return "\n".join([*(f"{k}={shlex.quote(v)}" for k, v in values.items()), "unset RAY_AUTH_TOKEN",
                      *(f"export {k}={shlex.quote(v)}" for k, v in auth.items())])


def start_local_ray(num_gpus: int, job_dir: str | os.PathLike, address: str | None = None,
                    init_kwargs: dict | None = None, num_cpus: int | None = None) -> str | None:
    """Connect to Ray for one job: ``address`` ("auto": the allocation's cluster) or a private Ray on
    this node with ``num_gpus`` GPUs and ``num_cpus`` CPUs (the cores this process may use; Ray would count the
    whole node's). A job spread over several Slurm nodes needs the sbatch script.
    ``init_kwargs``: ``config.ray_init_kwargs`` (verl's runtime environment; a private Ray's own temp dir).

    A private Ray authenticates with a new token in ``job_dir`` (``new_ray_token``). A cluster joined by
    address is reached with the token its starter gave this process: the ray_slurm script's
    (``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN_PATH``), or, for a cluster of the user's own, the user's.

    Returns the private Ray's own folder (its sessions, logs and sockets), for ``stop_local_ray`` to remove;
    None where this process started no Ray."""
    import ray

    if ray.is_initialized():
        return None
    init_kwargs = dict(init_kwargs or {})
    if address:
        init_kwargs.pop("_temp_dir", None)   # a joined cluster keeps the one `ray start` was given
        ray.init(address=address, **init_kwargs)
        return None
    if int(os.environ.get("SLURM_NNODES", "1")) > 1:
        raise RuntimeError("this Slurm job spans several nodes but backend.ray_address is null: launch "
                           "multi-node verl jobs with `python -m graft_exp.backends.verl.ray_slurm`")
    if num_cpus is not None:
        if num_cpus < RAY_CPUS_PER_GPU * num_gpus:
            # verl's placement groups would wait for the missing CPUs until the job's time limit.
            raise RuntimeError(f"this job may use {num_cpus} CPUs, but verl's placement groups reserve "
                               f"{RAY_CPUS_PER_GPU} per GPU ({RAY_CPUS_PER_GPU * num_gpus} for {num_gpus} GPUs): give "
                               "it more (python -m graft_exp.plan shows what cluster=slurm requests)")
        init_kwargs["num_cpus"] = num_cpus
    use_ray_token(new_ray_token(job_dir))
    ray.init(num_gpus=num_gpus, include_dashboard=False, **init_kwargs)
    return init_kwargs.get("_temp_dir")


def stop_local_ray(temp_dir: str | None) -> None:
    """Leave Ray and remove ``temp_dir``, the folder of the private Ray ``start_local_ray`` started (None: a
    joined cluster's, which stays): nothing of the job left in the node's /tmp."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)


def check_shared_paths(written: dict[str, str], read: dict[str, str]) -> None:
    """Every node of the job's Ray cluster sees the directories this process sees: a marker written into each
    of ``written`` (what -> directory) is read back on each node, and each of ``read`` (what -> directory, only
    read, e.g. the model snapshots) exists there. Each rank writes its checkpoint shard under the run directory
    and reads the model from ``backend.model_dir``, so several nodes need one shared filesystem."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    markers = {}
    for what, directory in written.items():
        os.makedirs(directory, exist_ok=True)
        markers[what] = os.path.join(directory, f".graft-shared-{token}")
        with open(markers[what], "w") as f:
            f.write(token)

    @ray.remote(num_cpus=0)
    def unseen() -> tuple[str, list[str]]:
        def reads(path: str) -> bool:
            try:
                with open(path) as f:
                    return f.read() == token
            except OSError:
                return False
        return socket.gethostname(), ([what for what, path in markers.items() if not reads(path)]
                                      + [what for what, path in read.items() if not os.path.isdir(path)])

    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        found = ray.get([unseen.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                         for node in nodes])
    finally:
        for path in markers.values():
            os.remove(path)
    places = {**written, **read}
    missing = [f"{host} does not see {', '.join(f'{w} ({places[w]})' for w in whats)}" for host, whats in found if whats]
    if missing:
        raise RuntimeError(f"{'; '.join(missing)}: the job's nodes need one shared filesystem for checkpoint_root "
                           "and backend.model_dir (each rank writes its checkpoint shard and reads the model there)")


def planned(overrides: list[str]) -> dict:
    """The training job's resource plan (``python -m graft_exp.plan --json``), refused as launching refuses it."""
    done = subprocess.run([sys.executable, "-m", "graft_exp.plan", "--json", *overrides], capture_output=True,
                          text=True, check=False)
    if done.returncode:
        print(done.stderr.strip(), file=sys.stderr)
        raise SystemExit(2)
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graft_exp.backends.verl.ray_slurm", description=__doc__)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--cpus-per-node", type=int, default=32)
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--time", default="2-00:00:00")
    parser.add_argument("--port", type=int, default=RAY_PORT)
    parser.add_argument("--jobs-dir", default=JOBS_DIR,
                        help="where each job keeps its Ray token, in a directory named by its Slurm job id "
                             "(relative: to the submission directory; must be on a filesystem every node sees)")
    parser.add_argument("--setup", action="append", default=[], help="shell line run first (module load ...)")
    parser.add_argument("--submit", action="store_true", help="sbatch the script instead of printing it")
    parser.add_argument("--emit-ray-commands", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--wait-for", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the training job (after --)")
    args = parser.parse_args(argv)
    if args.wait_for:
        wait_for_ray(args.wait_for, args.nodes, args.cpus_per_node, args.gpus_per_node, args.timeout)
        return 0
    if args.emit_ray_commands:
        print(ray_commands_for_allocation(args.gpus_per_node, args.cpus_per_node, args.port, args.jobs_dir))
        return 0
    try:
        script = sbatch_script(args.nodes, args.gpus_per_node, args.cpus_per_node, args.overrides,
                               partition=args.partition, account=args.account, time=args.time, setup=args.setup,
                               port=args.port, jobs_dir=args.jobs_dir)
    except ValueError as err:
        parser.error(str(err))
    plan = planned([*args.overrides, "backend=verl", f"backend.nnodes={args.nodes}", f"pair.gpus={args.gpus_per_node}"])
    if plan["cpus"] > args.cpus_per_node:
        parser.error(f"--cpus-per-node {args.cpus_per_node} is below the job's plan of {plan['cpus']} CPUs per node "
                     f"(verl's placement groups alone take {plan['ray_cpus']}): raise --cpus-per-node")
    if not args.submit:
        print(script, end="")
        return 0
    return subprocess.run(["sbatch"], input=script, text=True, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
