"""The cluster tracking server (``python -m graft_exp.server``) seen from a "compute node": a
network namespace joined to this host by a veth pair, with its own /etc/hosts naming the server's
host. The server listens on the host's end of the veth; a real tiny job on the node writes through
it with a user's credentials, and survives the server's restart (PostgreSQL kept) without losing a
step. Unauthenticated, wrongly authenticated and read-only writes are refused and leave nothing
behind, and the launcher's pre-check stops a sweep whose credentials would be refused.

Needs root (network namespaces), iproute2, nsenter/unshare and PostgreSQL; skips saying which is
missing. Everything it starts (namespace, veth, PostgreSQL, mlflow server) is its own and removed.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from mlflow.tracking import MlflowClient
from support.ports import free_port
from support.private_slurm import free_subnet

from graft_exp import server as srv
from graft_exp import tracking

pytestmark = [pytest.mark.service]
HEAD = "graft-head"          # the name jobs use for the server's host (its --name)
WORKERS = 2
STEPS = 8
# A short tiny job: the test is about the path to the server, not about learning.
JOB = ["tracking=server", "pair=tiny", "method=graft", f"train.max_steps={STEPS}", "method.n=2",
       "train.batch_prompts=4", "train.minibatch_prompts=2", "eval.val_every=4", "eval.runs=1",
       "eval.samples=1", "eval.max_problems=4", "backend.progress=false", "train.save_every=4"]
EVERY_STEP = {"cost/gpu_hours", "train/reward_mean", "train/all_fail_frac", "exchange/A_to_B",
              "exchange/B_to_A"}


def why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "nsenter", "unshare", "runuser") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian: iproute2, util-linux)"
    if not any(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        return "PostgreSQL is not installed (CI installs Debian's `postgresql` in .ci/run)"
    return None


@dataclass
class ComputeNode:
    ns: str
    host_if: str         # this host's end of the veth (the server listens on its address)
    head: str            # ... that address
    addr: str            # the node's address
    hosts: Path          # the node's /etc/hosts

    def command(self, *argv: str) -> list[str]:
        # The node's network, and a private mount namespace whose /etc/hosts names the head.
        return ["nsenter", f"--net=/run/netns/{self.ns}", "unshare", "--mount", "sh", "-c",
                f'mount --bind "{self.hosts}" /etc/hosts && exec "$@"', "node", *argv]

    def python(self, code: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(sys.executable, "-c", code), capture_output=True, text=True,
                              timeout=120, check=False, env=env)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    why = why_not_runnable()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    ns, host_if = f"graftcn{tag}", f"graftv{tag}"
    net = free_subnet("10.214.0.0/16", 30)
    head, addr = (str(a) for a in list(net.hosts())[:2])
    hosts = tmp_path_factory.mktemp("node") / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{head} {HEAD}\n")
    hosts.chmod(0o644)
    steps = [["ip", "netns", "add", ns],
             ["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns],
             ["ip", "addr", "add", f"{head}/{net.prefixlen}", "dev", host_if],
             ["ip", "link", "set", host_if, "up"],
             ["ip", "-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0"],
             ["ip", "-n", ns, "link", "set", "eth0", "up"],
             ["ip", "-n", ns, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield ComputeNode(ns, host_if, head, addr, hosts)
    finally:
        # Deleting the namespace deletes its end of the veth, and with it this host's end.
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)


@dataclass
class Server:
    dir: Path
    port: int
    pg_port: int
    start_args: list[str]

    @property
    def url(self) -> str:          # as the compute node names it
        return f"http://{HEAD}:{self.port}"

    def creds(self, user: str) -> tuple[str, str]:
        return srv.read_credentials(srv.Layout(self.dir).credentials(user))

    def cli(self, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "graft_exp.server", *args, "--dir", str(self.dir)],
                              capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def server(node):
    # PostgreSQL runs as `postgres`, which must reach the directory: not under pytest's 0700 tmp.
    where = Path(tempfile.mkdtemp(prefix="graft-server-test-"))
    where.chmod(0o711)
    port, pg_port = free_port(), free_port()
    start_args = ["start", "--host", node.host_if, "--port", str(port), "--pg-port", str(pg_port),
                  "--name", HEAD, "--workers", str(WORKERS)]
    s = Server(where, port, pg_port, start_args)
    try:
        started = s.cli(*start_args)
        assert started.returncode == 0, started.stderr + srv.tail(where / "mlflow.log")
        assert f"MLflow tracking server: http://{HEAD}:{port}" in started.stdout
        for user, flags in (("writer", ()), ("reader", ("--read-only",))):
            added = s.cli("add-user", user, *flags)
            assert added.returncode == 0, added.stderr
        yield s
    finally:
        s.cli("stop", timeout=120)
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def as_user(server, monkeypatch, tmp_path):
    """Make this test process one user of the server (as the jobs' environment would)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))      # no ~/.mlflow/credentials of the machine
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://{server_local(server)}")

    def _as(user: str, password: str | None = None) -> MlflowClient:
        name, real = server.creds(user)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", name)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password or real)
        return MlflowClient(f"http://{server_local(server)}")
    return _as


def server_local(server: Server) -> str:
    return f"{json.loads((server.dir / 'server.json').read_text())['address']}:{server.port}"


def test_secrets_are_private_generated_and_postgres_only_local(server, node):
    layout = srv.Layout(server.dir)
    assert stat.S_IMODE(layout.secrets.stat().st_mode) == 0o700
    for path in [*layout.secrets.iterdir(), *layout.users.iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    admin_password = server.creds("admin")[1]
    db_password = (layout.secrets / "postgres.password").read_text().strip()
    assert len(admin_password) >= 24 and len(db_password) >= 24 and admin_password != db_password
    # No password on any command line (ps shows those to every user of the host).
    for proc in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmdline = proc.read_bytes()
        except OSError:
            continue
        assert admin_password.encode() not in cmdline and db_password.encode() not in cmdline
    probe = node.python(
        "import json, socket, urllib.request\n"
        f"health = urllib.request.urlopen('{server.url}/health', timeout=10).status\n"
        "s = socket.socket(); s.settimeout(5)\n"
        f"pg = s.connect_ex(('{node.head}', {server.pg_port}))\n"
        "print(json.dumps([health, pg]))\n")
    assert probe.returncode == 0, probe.stderr
    health, pg = json.loads(probe.stdout)
    assert health == 200
    assert pg != 0, "PostgreSQL must not be reachable from a compute node"


def test_no_or_wrong_credentials_are_refused_and_store_nothing(server, node, as_user):
    admin = as_user("admin")
    exp = admin.create_experiment("graft/guarded")
    user, password = server.creds("writer")
    probe = node.python(
        "import json, requests\n"
        f"url = '{server.url}/api/2.0/mlflow'\n"
        f"auths = [None, ('{user}', 'wrong-{password}'), ('nobody', '{password}')]\n"
        "out = []\n"
        "for i, auth in enumerate(auths):\n"
        "    out.append(requests.post(url + '/experiments/create', json={'name': f'graft/intruder{i}'},"
        " auth=auth, timeout=30).status_code)\n"
        f"    out.append(requests.post(url + '/runs/create', json={{'experiment_id': '{exp}'}},"
        " auth=auth, timeout=30).status_code)\n"
        # Valid credentials, but a Host header the server was not told about (DNS rebinding).
        f"out.append(requests.get(url.replace('{HEAD}', '{node.head}') + '/users/current',"
        f" auth=('{user}', '{password}'), headers={{'Host': 'elsewhere.example'}}, timeout=30).status_code)\n"
        "print(json.dumps(out))\n")
    assert probe.returncode == 0, probe.stderr
    codes = json.loads(probe.stdout)
    assert codes[:-1] == [401] * 6
    assert codes[-1] == 403
    names = [e.name for e in admin.search_experiments()]
    assert not [n for n in names if "intruder" in n]
    assert admin.search_runs([exp]) == []


def test_read_only_user_cannot_write(server, as_user):
    writer = as_user("writer")
    exp = writer.create_experiment("graft/readonly")
    run = writer.create_run(exp)
    writer.log_metric(run.info.run_id, "m", 1.0, step=1)
    user, password = server.creds("reader")
    base = f"http://{server_local(server)}/api/2.0/mlflow"
    attempts = {
        "create experiment": ("experiments/create", {"name": "graft/readers-own"}),
        "create run": ("runs/create", {"experiment_id": exp}),
        "log metric": ("runs/log-metric", {"run_id": run.info.run_id, "key": "m", "value": 2.0,
                                           "timestamp": 0, "step": 2}),
        "set tag": ("runs/set-tag", {"run_id": run.info.run_id, "key": "k", "value": "v"}),
        "delete run": ("runs/delete", {"run_id": run.info.run_id}),
    }
    codes = {what: requests.post(f"{base}/{path}", json=body, auth=(user, password), timeout=30).status_code
             for what, (path, body) in attempts.items()}
    assert codes == {what: 403 for what in attempts}
    assert requests.get(f"{base}/runs/get", params={"run_id": run.info.run_id}, auth=(user, password),
                        timeout=30).status_code == 200          # it does read
    admin = as_user("admin")
    assert [r.info.run_id for r in admin.search_runs([exp])] == [run.info.run_id]
    got = admin.get_run(run.info.run_id)
    assert got.info.lifecycle_stage == "active" and "k" not in got.data.tags
    assert [(m.step, m.value) for m in admin.get_metric_history(run.info.run_id, "m")] == [(1, 1.0)]
    assert admin.get_experiment_by_name("graft/readers-own") is None

    # The launcher's pre-check says which refusal it is, before anything is submitted.
    as_user("reader")
    with pytest.raises(tracking.TrackingError, match=r"403 Forbidden: its permission is READ"):
        tracking.ensure_store(f"http://{server_local(server)}", "graft/readonly")
    with pytest.raises(tracking.TrackingError, match=r"refused to create experiment .*403 Forbidden"):
        tracking.ensure_store(f"http://{server_local(server)}", "graft/new-study")
    as_user("writer", password="not-the-password")
    with pytest.raises(tracking.TrackingError, match=r"refused user 'writer' \(401 Unauthorized\)"):
        tracking.ensure_store(f"http://{server_local(server)}", "graft/readonly")
    as_user("writer")
    assert tracking.ensure_store(f"http://{server_local(server)}", "graft/readonly") == exp


@pytest.mark.parametrize("who", ["wrong-password", "reader"])
def test_refused_credentials_stop_a_sweep_before_submission(server, as_user, tmp_path, monkeypatch, who):
    monkeypatch.chdir(tmp_path)
    as_user("admin").create_experiment(f"graft/sweep-{who}")
    if who == "reader":
        as_user("reader")
    else:
        as_user("writer", password="not-the-password")
    done = subprocess.run([sys.executable, "-m", "graft_exp", "-m", "method=graft,sgt", "tracking=server",
                           f"study=sweep-{who}", "cluster=submitit_local",
                           f"hydra.sweep.dir={tmp_path / 'multirun'}"],
                          capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert ("401 Unauthorized" if who == "wrong-password" else "403 Forbidden") in out, out[-3000:]
    assert not (tmp_path / "multirun" / ".submitit").exists()      # nothing was submitted


@pytest.mark.slow
def test_job_on_a_compute_node_loses_no_step_across_a_server_restart(server, node, as_user, tmp_path,
                                                                    record_property):
    # The job's credentials come from ~/.mlflow/credentials (0600) on the node, not the environment.
    home = tmp_path / "home"
    srv.write_private(home / ".mlflow" / "credentials",
                      srv.credentials_text(*server.creds("writer")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # MLflow's longest retry window (about ten minutes, docs/tracking.md): beside the suite's other worker the
    # restart has taken over two minutes, close to the default four-minute window.
    env.update(HOME=str(home), MLFLOW_TRACKING_URI=server.url, OMP_NUM_THREADS="1",
               MLFLOW_HTTP_REQUEST_MAX_RETRIES="10")
    with open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen(node.command(sys.executable, "-m", "graft_exp", *JOB, "study=netns",
                                            f"checkpoint_root={tmp_path / 'ckpt'}"),
                               cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    admin = as_user("admin")
    try:
        # Restart once the job has logged its first steps (the server keeps the same PostgreSQL).
        deadline = time.monotonic() + 600
        while max(logged_steps(admin, "graft/netns"), default=0) < 2:
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the job logged no step in 10 min"
            time.sleep(2)
        stopped = server.cli("stop", "--keep-db", timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        restart = time.monotonic()
        restarted = server.cli(*server.start_args)
        assert restarted.returncode == 0, restarted.stderr
        down_s = time.monotonic() - restart
        assert job.poll() is None, "the job ended while the server was down: restart too late to test"
        assert job.wait(timeout=900) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    print(f"\nserver down for {down_s:.1f} s during the job")
    record_property("server_restart_s", round(down_s, 1))

    admin = as_user("admin")
    exp = admin.get_experiment_by_name("graft/netns")
    runs = admin.search_runs([exp.experiment_id])
    assert len(runs) == 3        # the job run and its two model runs
    lost, duplicated = [], []
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.info.artifact_uri.startswith("mlflow-artifacts:")   # proxied: no shared mount
        for key in EVERY_STEP & set(run.data.metrics):
            counts = Counter(m.step for m in admin.get_metric_history(run.info.run_id, key))
            lost += [(key, s) for s in range(1, STEPS + 1) if s not in counts]
            duplicated += [(key, s) for s, c in counts.items() if c > 1]
    assert sum(len(EVERY_STEP & set(r.data.metrics)) for r in runs) >= 3
    assert (lost, duplicated) == ([], [])
    stored = [p for p in (server.dir / "artifacts").rglob("*") if p.is_file()]
    assert stored, "the job's artifacts did not reach the server's artifact store"


def logged_steps(client: MlflowClient, experiment: str) -> list[int]:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return [m.step for run in client.search_runs([exp.experiment_id])
            for m in client.get_metric_history(run.info.run_id, "train/reward_mean")]


def test_removed_user_is_refused_and_its_runs_stay(server, as_user):
    added = server.cli("add-user", "leaver")
    assert added.returncode == 0, added.stderr
    leaver = as_user("leaver")
    exp = leaver.create_experiment("graft/leaver")
    run = leaver.create_run(exp).info.run_id
    name, password = server.creds("leaver")
    removed = server.cli("remove-user", "leaver")
    assert removed.returncode == 0, removed.stderr
    assert not srv.Layout(server.dir).credentials("leaver").exists()
    url = f"http://{server_local(server)}/api/2.0/mlflow"
    # Each worker reuses a successful password check for a while (srv.AUTH_CACHE_TTL_S): a worker
    # that checked the leaver's password moments ago lets it past authentication, but then finds no
    # such user (404) -- refused either way, and nothing is written. Enough requests reach every worker.
    refused = [requests.post(url + "/runs/create", json={"experiment_id": exp}, auth=(name, password),
                             timeout=30).status_code for _ in range(4 * WORKERS)]
    assert set(refused) <= {401, 404}, refused
    admin_client = as_user("admin")
    assert [r.info.run_id for r in admin_client.search_runs([exp])] == [run]
    assert admin_client.get_run(run).info.run_id == run
    again = server.cli("remove-user", "leaver")
    assert again.returncode == 2 and "cannot remove user leaver" in again.stderr
    admin = server.cli("remove-user", "admin")
    assert admin.returncode == 2 and "cannot be removed" in admin.stderr
