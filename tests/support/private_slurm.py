"""A Slurm cluster private to one test session, started and stopped by the tests (as root, with Debian's
``slurm-wlm`` and ``munge``). It never touches a Slurm that was already on the machine:

- its own ``slurm.conf`` in a directory the session owns, reached through ``SLURM_CONF`` (the environment
  of the tests and of every job), with its own ClusterName, ports, state, spool and log files;
- its own ``munged`` on its own socket and key (``AuthInfo=socket=...``): a site's munge and the site's
  cluster cannot decode this cluster's credentials, nor the other way round;
- its nodes are "hosts" of their own: each ``slurmd`` runs in a network namespace with its own address on
  a private bridge, its own host name (UTS namespace) and its own ``/etc/hosts`` (a bind mount in a mount
  namespace), so a job on node 2 reaches node 1 by name over the network, as on a cluster.
  Where namespaces cannot be made, the cluster falls back to one node in the host's network.

Nodes declare more CPUs than the machine has (``SlurmdParameters=config_overrides``; no CPU binding, so
this only changes bookkeeping): verl's placement asks Ray for 3 CPUs per GPU bundle, and each node offers
``gpus`` count-only GPUs (``Gres=gpu:N``, no device files) so that ``--gpus-per-node`` and Ray's GPU
resources can be exercised on a machine without GPUs. ``CR_LLN`` puts each job on the least loaded node.

Manual use (e.g. for ``benchmarks/launch_figures.py``)::

    python tests/support/private_slurm.py start DIR     # prints `export SLURM_CONF=DIR/slurm.conf`
    python tests/support/private_slurm.py stop DIR
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if not __package__:   # run by path: tests/ on the path, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.ports import free_ports

# Debian packages: slurm-wlm, munge, iproute2 (ip) and util-linux (nsenter, unshare).
REQUIRED = ("munged", "slurmctld", "slurmd", "sbatch", "ip", "nsenter", "unshare")


def why_not_startable() -> str | None:
    """Why this machine cannot start a private cluster, or None when it can."""
    if os.geteuid() != 0:
        return "starting a private Slurm cluster needs root (slurmd runs jobs as their users)"
    missing = [c for c in REQUIRED if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]
    if missing:
        return (f"{', '.join(missing)} not found: `apt-get install slurm-wlm munge iproute2` "
                "(.ci/run does this in CI)")
    return None


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def free_subnet(within: str, prefix: int) -> ipaddress.IPv4Network:
    """A random /``prefix`` inside ``within`` that no interface or route of this machine overlaps (test
    networks of their own: the Slurm nodes' bridge, the server tests' compute node)."""
    shown = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    shown += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    used = []
    for token in shown.split():
        try:
            used.append(ipaddress.ip_network(token, strict=False))
        except ValueError:
            continue
    candidates = list(ipaddress.ip_network(within).subnets(new_prefix=prefix))
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError(f"no free /{prefix} in {within} for a test network")


class PortTaken(RuntimeError):
    """A daemon of the cluster could not bind its port: another process took it first."""


@dataclass
class Node:
    name: str
    addr: str
    netns: str | None = None


@dataclass
class PrivateSlurm:
    """One Slurm cluster in ``root``. ``start()`` brings it up, ``stop()`` removes everything it made."""

    root: Path
    nodes: int = 2
    cpus: int = 8
    gpus: int = 2
    mem_mb: int = 8192
    netns: bool = True
    tag: str = field(default_factory=lambda: f"g{os.getpid() % 100000}{random.randrange(100)}")
    # Filled by start():
    run_dir: str = ""               # short path for Unix sockets (munge, slurmd spool): at most 108 bytes
    cluster: str = ""
    ctld_addr: str = "127.0.0.1"
    bridge: str | None = None
    members: list[Node] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def multi_host(self) -> bool:
        """True when the nodes are separate network hosts (namespaces), not one host's processes."""
        return self.bridge is not None

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, squeue, scontrol, ...) against this cluster."""
        return subprocess.run(list(command), capture_output=True, text=True, check=check, env=self.env,
                              timeout=60)

    # --- bring-up --------------------------------------------------------------------------------
    def start(self, attempts: int = 3) -> PrivateSlurm:
        """Bring the cluster up; a daemon that lost its port to another process between the choice of ports and
        its bind (``ports.free_ports``) is started again, on other ports, up to ``attempts`` times."""
        for attempt in range(1, attempts):
            try:
                return self._bring_up()
            except PortTaken as err:
                print(f"private Slurm: {err}; again on other ports", file=sys.stderr)
                for log in (self.root / "log").glob("slurm*.log"):
                    log.rename(log.with_name(f"{log.name}.attempt{attempt}"))
        return self._bring_up()

    def _bring_up(self) -> PrivateSlurm:
        self.root = Path(self.root).resolve()
        for sub in ("munge", "ctld", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.run_dir = tempfile.mkdtemp(prefix="gslurm", dir="/tmp")
        self.cluster = f"graft{self.tag}".lower()
        try:
            if self.netns:
                try:
                    self._make_network()
                except subprocess.CalledProcessError as err:
                    # No namespaces here (e.g. an unprivileged container): one node in the host's network.
                    print(f"private Slurm: no network namespaces ({err.stderr.strip()}); one local node",
                          file=sys.stderr)
                    self._remove_network()
            if not self.members:
                self.members = [Node(f"{self.tag}n1", "127.0.0.1")]
            self._save()
            self._start_munge()
            self._write_config()
            subprocess.run([_sbin("slurmctld"), "-f", str(self.conf), "-c", "-i"], check=True, env=self.env,
                           capture_output=True, text=True)
            for node in self.members:
                self._start_slurmd(node)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _make_network(self) -> None:
        net = free_subnet("10.213.0.0/16", 24)
        hosts = list(net.hosts())
        self.bridge = f"{self.tag}br"
        self.ctld_addr = str(hosts[0])
        self._save()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.ctld_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.members = [Node(f"{self.tag}n{i}", str(hosts[i]), f"{self.tag}n{i}") for i in range(1, self.nodes + 1)]
        self._save()
        (self.root / "hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in self.members))
        for node in self.members:
            _ip("netns", "add", node.netns)
            _ip("link", "add", f"{node.netns}v", "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            _ip("link", "set", f"{node.netns}v", "master", self.bridge, "up")
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        # --force: the socket's directory is the session's private (0700) temp dir, reachable by root only,
        # which is everyone who talks to this cluster (tests and jobs run as root).
        subprocess.run([_sbin("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                        f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                        f"--log-file={self.root / 'log' / 'munged.log'}",
                        f"--seed-file={self.root / 'munge' / 'munged.seed'}"],
                       check=True, capture_output=True, text=True)

    @property
    def munge_socket(self) -> Path:
        return Path(self.run_dir) / "munge.socket"

    def _write_config(self) -> None:
        root, host = self.root, socket.gethostname().split(".")[0]
        # Distinct ports: one for the controller, one per node (nodes in namespaces are hosts of their own and
        # share theirs). Seen in CI: a node drawn its controller's port answers sinfo "Invalid argument".
        ctld_port, *node_ports = free_ports(1 + len(self.members))
        lines = [
            f"ClusterName={self.cluster}",
            # slurmctld only runs on a host whose name is listed; the address is where slurmd reach it.
            f"SlurmctldHost={host}({self.ctld_addr})",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={root / 'ctld'}",
            f"SlurmdSpoolDir={self.run_dir}/%n",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core,CR_LLN",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            # Every finished job is written here: the record of what ran on this cluster.
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={root / 'log' / 'jobcomp.txt'}",
            "GresTypes=gpu",
            "ReturnToService=2",
            # Short waits keep tests fast: kill 5 s after SIGTERM, look at the queue every 2 s.
            "KillWait=5",
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "MinJobAge=600",
            "MpiDefault=none",
        ]
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        for node, port in zip(self.members, node_ports):
            lines.append(f"NodeName={node.name} NodeAddr={node.addr} Port={node_ports[0] if node.netns else port} "
                         f"CPUs={self.cpus} RealMemory={self.mem_mb}{gres} State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # Stand-in GPU devices (character devices with /dev/null's numbers; no task plugin constrains
        # devices): Slurm drops a GPU without a File=, and with one it schedules it as on a GPU node.
        gpu_dir = self.root / "gpu"
        gpu_dir.mkdir(exist_ok=True)
        for i in range(self.gpus):
            if not (gpu_dir / f"nvidia{i}").exists():
                os.mknod(gpu_dir / f"nvidia{i}", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        files = f"File={gpu_dir}/nvidia[0-{self.gpus - 1}]"
        (self.root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={n.name} Name=gpu {files}\n" for n in self.members) if self.gpus else "")

    def _start_slurmd(self, node: Node) -> None:
        command = [_sbin("slurmd"), "-f", str(self.conf), "-N", node.name]
        (Path(self.run_dir) / node.name).mkdir(exist_ok=True)
        if node.netns:
            # Its own network (the namespace), host name (UTS) and /etc/hosts (a private mount namespace),
            # like a separate machine. nsenter rather than `ip netns exec`, which remounts /sys without the
            # cgroup hierarchy slurmd needs.
            command = ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", "--mount", "sh", "-c",
                       f'mount --bind {self.root / "hosts"} /etc/hosts && hostname {node.name} && exec "$@"',
                       "slurmd", *command]
        subprocess.run(command, check=True, env=self.env, capture_output=True, text=True)

    def _wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            self._raise_on_fatal()
            done = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
            states = done.stdout + done.stderr
            node_states = [line.split()[-1] for line in done.stdout.splitlines()]
            if done.returncode == 0 and node_states.count("idle") == len(self.members):
                return
            if any(s.startswith(("inval", "drain")) for s in node_states):
                reasons = self.run("sinfo", "-h", "-R", check=False).stdout
                raise RuntimeError(f"private Slurm: a node was refused: {reasons.strip()}")
            time.sleep(0.5)
        raise RuntimeError(f"private Slurm did not come up in {timeout} s: {states.strip()!r}; "
                           f"logs in {self.root / 'log'}")

    def _raise_on_fatal(self) -> None:
        """A daemon that died on start says why in its log (``fatal: ...``); waiting on it is in vain, and a
        port taken meanwhile is worth another try (``start``)."""
        for log in (self.root / "log").glob("slurm*.log"):
            fatal = _fatal(log)
            if fatal and "Address already in use" in fatal:
                raise PortTaken(f"{log.name}: {fatal}")
            if fatal:
                raise RuntimeError(f"private Slurm: {log.name}: {fatal}; logs in {self.root / 'log'}")

    # --- tear-down -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel this cluster's jobs, stop its daemons, remove its namespaces, bridge and socket directory."""
        # A controller that died (or is dying) on start would keep scancel trying to reach it for 18 s.
        if (self.conf.exists() and _alive(self.root / "slurmctld.pid")
                and not _fatal(self.root / "log" / "slurmctld.log")):
            self.run("scancel", "--full", "--user=root", check=False)
        for node in self.members:
            _kill_pidfile(self.root / f"slurmd-{node.name}.pid")
        _kill_pidfile(self.root / "slurmctld.pid")
        self._remove_network()
        _kill_pidfile(self.root / "munge" / "munged.pid")
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _remove_network(self) -> None:
        for node in self.members:
            if not node.netns:
                continue
            # Whatever still runs on the "host" (job steps, Ray) goes with it.
            pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True,
                                  check=False).stdout.split()
            for pid in pids:
                _signal(int(pid), 9)
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True, check=False)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        # The nodes go with their network: a later bring-up (the host-network fallback, a retry) starts afresh.
        self.members, self.bridge, self.ctld_addr = [], None, "127.0.0.1"

    # --- state for the command line (stop in another process) ------------------------------------
    def _save(self) -> None:
        state = {k: v for k, v in asdict(self).items() if k != "root"}
        (self.root / "cluster.json").write_text(json.dumps(state))

    @classmethod
    def load(cls, root: Path) -> PrivateSlurm:
        state = json.loads((Path(root) / "cluster.json").read_text())
        state["members"] = [Node(**n) for n in state["members"]]
        return cls(root=Path(root).resolve(), **state)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _fatal(log: Path) -> str | None:
    """The last ``fatal:`` message of a Slurm daemon's log, or None."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    fatal = [line.split("fatal:", 1)[1].strip() for line in lines if "fatal:" in line]
    return fatal[-1] if fatal else None


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(path: Path) -> bool:
    """Whether the daemon whose pid ``path`` holds still runs."""
    pid = _pid(path)
    return pid is not None and _signal(pid, 0)


def _kill_pidfile(path: Path, timeout: float = 20) -> None:
    """SIGTERM the daemon whose pid ``path`` holds (it is ours: the file is in our directory), wait for it."""
    pid = _pid(path)
    if pid is None or not _signal(pid, 15):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _signal(pid, 0):
            return
        time.sleep(0.1)
    _signal(pid, 9)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "stop":
        PrivateSlurm.load(Path(argv[1])).stop()
        return 0
    reason = why_not_startable()
    if reason:
        print(f"private Slurm: {reason}", file=sys.stderr)
        return 1
    cluster = PrivateSlurm(Path(argv[1])).start()
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
