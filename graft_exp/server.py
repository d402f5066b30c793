"""The cluster tracking server: ``mlflow server`` with MLflow's basic-auth app on a private
PostgreSQL, everything under one directory.

    python -m graft_exp.server start --dir /shared/mlflow --host eth0 --port 5000
    python -m graft_exp.server add-user alice [--read-only] --dir /shared/mlflow
    python -m graft_exp.server remove-user alice --dir /shared/mlflow
    python -m graft_exp.server status|stop --dir /shared/mlflow

What ``start`` sets up (and reuses on later starts; every step is skipped when already done):
  * PostgreSQL in DIR/pg/data, listening on 127.0.0.1 only (no Unix socket), password
    (scram-sha-256) authentication; run as the ``postgres`` user when started by root;
  * secrets in DIR/secrets (0700, files 0600), generated once: the database password, the Flask
    secret key and the MLflow admin password. There is no default password anywhere;
  * ``mlflow server --app-name basic-auth`` on the given interface: runs and the auth app's users
    in PostgreSQL, artifacts proxied by the server into DIR/artifacts (jobs need no shared
    mount), ``--allowed-hosts`` limited to the names jobs use for this host;
  * a role that lets the users made by ``add-user`` (without ``--read-only``) write every
    experiment; everyone else only reads (``default_permission = READ``).
The compute nodes need TCP access to the server's port and nothing else.
"""

from __future__ import annotations

import argparse
import configparser
import fcntl
import ipaddress
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from graft_exp.config import folder_problem
from graft_exp.extras import MissingExtra, require

ADMIN = "admin"
DB_USER = "mlflow"
DATABASES = ("mlflow", "mlflow_auth")   # runs; the auth app's users and permissions
WRITERS_ROLE = "graft-writers"
HEALTH_TIMEOUT_S = 180
AUTH_CACHE_TTL_S = 60   # how long a worker reuses a successful password check (see remove_user)
SIOCGIFADDR = 0x8915   # Linux ioctl: an interface's IPv4 address


class ServerError(RuntimeError):
    """The server cannot be started or managed; the message says what to fix."""


@dataclass(frozen=True)
class Layout:
    """Where everything of one server lives under ``--dir``."""

    root: Path

    @property
    def pg(self) -> Path:
        return self.root / "pg"

    @property
    def pg_data(self) -> Path:
        return self.pg / "data"

    @property
    def secrets(self) -> Path:
        return self.root / "secrets"

    @property
    def users(self) -> Path:
        return self.root / "users"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def state(self) -> Path:
        """Settings of the last start (address, port, names), read by stop/status/add-user."""
        return self.root / "server.json"

    @property
    def pid(self) -> Path:
        return self.root / "mlflow.pid"

    @property
    def log(self) -> Path:
        return self.root / "mlflow.log"

    def credentials(self, user: str) -> Path:
        return (self.secrets if user == ADMIN else self.users) / f"{user}.credentials"


# --- small helpers -------------------------------------------------------------------------------

def write_private(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 from the start (never briefly world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def secret(layout: Layout, name: str) -> str:
    """A generated secret stored in DIR/secrets/NAME, created on first use."""
    path = layout.secrets / name
    if not path.exists():
        write_private(path, secrets.token_urlsafe(24))
    return path.read_text().strip()


def credentials_text(user: str, password: str) -> str:
    """The format of ``~/.mlflow/credentials``, which MLflow's client reads in every process."""
    return f"[mlflow]\nmlflow_tracking_username = {user}\nmlflow_tracking_password = {password}\n"


def read_credentials(path: Path) -> tuple[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(path)
    return cfg["mlflow"]["mlflow_tracking_username"], cfg["mlflow"]["mlflow_tracking_password"]


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError as err:
            raise ServerError(f"interface {name} has no IPv4 address ({err})") from err
    return socket.inet_ntoa(packed[20:24])


def bind_address(host: str) -> str:
    """``--host`` as an address: an interface name, an IP address, or a resolvable host name."""
    if Path("/sys/class/net", host).exists():
        return interface_address(host)
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError as err:
        raise ServerError(f"--host {host}: neither an interface, an IP address nor a host name that "
                          f"resolves ({err})") from err


def local_url(state: dict) -> str:
    """How this host's own commands (add-user, status) reach the server."""
    address = "127.0.0.1" if state["address"] in ("0.0.0.0", "::") else state["address"]
    return f"http://{address}:{state['port']}"


def allowed_hosts(names: list[str], address: str, port: int) -> list[str]:
    """Host headers the server accepts: the names jobs use, the bound address, and the loopback
    names when it listens on every interface; each bare and with the port."""
    hosts = [*names, address]
    if address in ("0.0.0.0", "::"):
        hosts += ["127.0.0.1", "localhost"]
    hosts = list(dict.fromkeys(hosts))
    return [h for host in hosts for h in (host, f"{host}:{port}")]


# --- PostgreSQL ----------------------------------------------------------------------------------

def pg_bin() -> Path:
    """PostgreSQL's server programs: Debian keeps them in /usr/lib/postgresql/<version>/bin."""
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if debian:
        return debian[-1].parent
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise ServerError("PostgreSQL's server programs (initdb, pg_ctl) are not installed; install them "
                      "(Debian/Ubuntu: apt-get install postgresql) and start again")


def pg_owner() -> pwd.struct_passwd | None:
    """The account PostgreSQL runs as: None = the caller; root hands it to ``postgres`` (PostgreSQL
    refuses to run as root)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise ServerError("started as root, PostgreSQL must run as an unprivileged user, and there is "
                          "no `postgres` user (Debian's postgresql package creates it); start as an "
                          "ordinary user instead") from None


def as_pg(owner, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    if owner is not None:
        cmd = ["runuser", "-u", owner.pw_name, "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


def pg_running(layout: Layout) -> bool:
    return layout.pg_data.exists() and as_pg(
        pg_owner(), [str(pg_bin() / "pg_ctl"), "status", "-D", str(layout.pg_data)]).returncode == 0


def pg_port(layout: Layout) -> int | None:
    """The port of the running PostgreSQL (4th line of postmaster.pid)."""
    try:
        return int((layout.pg_data / "postmaster.pid").read_text().splitlines()[3])
    except (OSError, IndexError, ValueError):
        return None


def start_postgres(layout: Layout, port: int) -> None:
    owner = pg_owner()
    bindir = pg_bin()
    layout.pg.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        os.chown(layout.pg, owner.pw_uid, owner.pw_gid)
        if as_pg(owner, ["test", "-w", str(layout.pg)]).returncode != 0:
            raise ServerError(f"PostgreSQL runs as `{owner.pw_name}`, which cannot reach {layout.pg} "
                              "(a parent directory is not traversable); choose a --dir it can reach")
    password = secret(layout, "postgres.password")
    if not (layout.pg_data / "PG_VERSION").exists():
        # initdb reads the superuser's password from a file its own user can read; removed after.
        pwfile = layout.pg / "initdb.pw"
        write_private(pwfile, password + "\n")
        if owner is not None:
            os.chown(pwfile, owner.pw_uid, owner.pw_gid)
        try:
            done = as_pg(owner, [str(bindir / "initdb"), "-D", str(layout.pg_data), "-U", DB_USER,
                                 f"--pwfile={pwfile}", "--auth=scram-sha-256", "--encoding=UTF8",
                                 "--no-locale"])
        finally:
            pwfile.unlink()
        if done.returncode != 0:
            raise ServerError(f"initdb failed:\n{done.stdout}{done.stderr}")
        # TCP on loopback only, no Unix socket: the password is the only way in, and only from here.
        with open(layout.pg_data / "postgresql.conf", "a") as conf:
            conf.write("\n# graft_exp.server\nlisten_addresses = '127.0.0.1'\n"
                       "unix_socket_directories = ''\nmax_connections = 200\n")
    if pg_running(layout):
        if pg_port(layout) != port:
            raise ServerError(f"the PostgreSQL of {layout.root} runs on port {pg_port(layout)}, not "
                              f"{port}; stop the server first (python -m graft_exp.server stop --dir "
                              f"{layout.root}) or pass --pg-port {pg_port(layout)}")
    else:
        done = as_pg(owner, [str(bindir / "pg_ctl"), "-D", str(layout.pg_data), "-l",
                             str(layout.pg / "postgres.log"), "-w", "-t", "120", "-o", f"-p {port}",
                             "start"])
        if done.returncode != 0:
            log = (layout.pg / "postgres.log").read_text()[-2000:] if (layout.pg / "postgres.log").exists() else ""
            raise ServerError(f"PostgreSQL did not start on 127.0.0.1:{port} (port taken?):\n"
                              f"{done.stdout}{done.stderr}{log}")
    create_databases(password, port)


def create_databases(password: str, port: int) -> None:
    import psycopg2

    conn = psycopg2.connect(host="127.0.0.1", port=port, user=DB_USER, password=password,
                            dbname="postgres")
    conn.autocommit = True   # CREATE DATABASE cannot run inside a transaction
    try:
        with conn.cursor() as cur:
            for db in DATABASES:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{db}"')
    finally:
        conn.close()


def stop_postgres(layout: Layout) -> None:
    if pg_running(layout):
        done = as_pg(pg_owner(), [str(pg_bin() / "pg_ctl"), "-D", str(layout.pg_data), "-m", "fast",
                                  "-w", "stop"])
        if done.returncode != 0:
            raise ServerError(f"PostgreSQL did not stop:\n{done.stdout}{done.stderr}")


# --- mlflow server -------------------------------------------------------------------------------

def mlflow_pid(layout: Layout) -> int | None:
    """The pid of this directory's running ``mlflow server`` (None when it is not running; a
    stale pid file of a recycled pid is not mistaken for it)."""
    try:
        pid = int(layout.pid.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if b"mlflow" in cmdline and str(layout.artifacts).encode() in cmdline else None


def healthy(url: str, timeout_s: float = 15.0) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=timeout_s).ok
    except requests.RequestException:
        return False


def write_auth_config(layout: Layout, port: int) -> Path:
    """The auth app's settings: users in PostgreSQL; every user reads everything (the default
    workspace's ``default_permission``), and creating or writing experiments needs the writers
    role (``add-user`` without ``--read-only``). Workspaces are on (``--enable-workspaces``) because
    only there can a user be kept from creating experiments of their own."""
    path = layout.secrets / "basic_auth.ini"
    write_private(path, "[mlflow]\ndefault_permission = READ\n"
                        f"database_uri = postgresql+psycopg2://{DB_USER}@127.0.0.1:{port}/mlflow_auth\n"
                        f"admin_username = {ADMIN}\n"
                        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                        "grant_default_workspace_access = true\n"
                        # Checking a password (PBKDF2) on every request of every job costs more than
                        # the request itself; a successful check is reused per worker for a while.
                        f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}\n")
    return path


def start_mlflow(layout: Layout, address: str, port: int, pg: int, names: list[str], workers: int) -> None:
    admin_password = secret(layout, "admin.password")
    write_private(layout.credentials(ADMIN), credentials_text(ADMIN, admin_password))
    # libpq reads the database password from this file, so it appears in no command line.
    write_private(layout.secrets / "pgpass",
                  f"127.0.0.1:{pg}:*:{DB_USER}:{secret(layout, 'postgres.password')}\n")
    env = {**os.environ,
           "PGPASSFILE": str(layout.secrets / "pgpass"),
           "MLFLOW_AUTH_CONFIG_PATH": str(write_auth_config(layout, pg)),
           # Used only the first time, to create the admin user in an empty user store.
           "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
           "MLFLOW_FLASK_SERVER_SECRET_KEY": secret(layout, "flask.secret"),
           # MLflow's job executor (GenAI scorers, prompt optimisation) is nothing a tracking server of
           # training runs uses: without it, ten fewer processes (~2.5 GB) start, and no queue folder is left
           # in /dev/shm after a stop.
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)
    layout.artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
           "--backend-store-uri", f"postgresql+psycopg2://{DB_USER}@127.0.0.1:{pg}/mlflow",
           "--serve-artifacts", "--artifacts-destination", str(layout.artifacts),
           "--host", address, "--port", str(port), "--workers", str(workers), "--enable-workspaces",
           "--allowed-hosts", ",".join(allowed_hosts(names, address, port))]
    with open(layout.log, "ab") as log:
        # Its own session: stop signals the whole group (the server and its workers).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, cwd=layout.root)
    layout.pid.write_text(str(proc.pid))
    url = local_url({"address": address, "port": port})
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while not healthy(url):
        if proc.poll() is not None:
            raise ServerError(f"mlflow server exited (code {proc.returncode}); its log, {layout.log}, "
                              f"ends with:\n{tail(layout.log)}")
        if time.monotonic() > deadline:
            raise ServerError(f"mlflow server gave no answer on {url} in {HEALTH_TIMEOUT_S} s; see {layout.log}")
        time.sleep(1)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def stop_mlflow(layout: Layout) -> None:
    pid = mlflow_pid(layout)
    if pid is not None:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while mlflow_pid(layout) is not None and time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:   # our own child (tests): reap it
                    break
            except ChildProcessError:
                pass
            time.sleep(0.2)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    layout.pid.unlink(missing_ok=True)


# --- users (through the auth app's REST API, as admin) -------------------------------------------

class Admin:
    """MLflow's AuthServiceClient acting as this server's admin."""

    def __init__(self, layout: Layout, state: dict):
        from mlflow.server.auth.client import AuthServiceClient

        # The client takes its credentials from the environment; this process acts as admin.
        user, password = read_credentials(layout.credentials(ADMIN))
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = user, password
        self.client = AuthServiceClient(local_url(state))

    def writers_role(self):
        from mlflow.utils.workspace_utils import DEFAULT_WORKSPACE_NAME

        for role in self.client.list_roles(DEFAULT_WORKSPACE_NAME):
            if role.name == WRITERS_ROLE:
                return role
        role = self.client.create_role(DEFAULT_WORKSPACE_NAME, WRITERS_ROLE,
                                       "create runs and log to every experiment (graft_exp.server add-user)")
        # USE on the workspace: may create experiments; EDIT on every experiment: may create runs
        # and log into experiments others created (deleting stays with each experiment's creator).
        self.client.add_role_permission(role.id, "workspace", "*", "USE")
        self.client.add_role_permission(role.id, "experiment", "*", "EDIT")
        return role


def load_state(layout: Layout) -> dict:
    if not layout.state.exists():
        raise ServerError(f"no server was started in {layout.root} (no {layout.state.name}); "
                          f"python -m graft_exp.server start --dir {layout.root} --host ... first")
    return json.loads(layout.state.read_text())


def add_user(layout: Layout, name: str, read_only: bool) -> Path:
    from mlflow.exceptions import RestException

    state = load_state(layout)
    if not healthy(local_url(state)):
        raise ServerError(f"the server of {layout.root} is not running; start it first")
    if name == ADMIN or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ServerError(f"user name {name!r}: use letters, digits, '-', '_' or '.', and not {ADMIN!r}")
    admin = Admin(layout, state)
    password = secrets.token_urlsafe(24)
    try:
        admin.client.create_user(name, password)
    except RestException as err:
        raise ServerError(f"cannot create user {name}: {err}") from err
    if not read_only:
        admin.client.assign_role(name, admin.writers_role().id)
    path = layout.credentials(name)
    write_private(path, credentials_text(name, password))
    return path


def remove_user(layout: Layout, name: str) -> None:
    """Delete a user from the auth app (its runs stay) and its credentials file: the server refuses
    that user's requests from now on -- 401, or, for up to AUTH_CACHE_TTL_S on a worker that checked
    the password just before, 404 (no such user); nothing that user sends is written either way."""
    from mlflow.exceptions import RestException

    state = load_state(layout)
    if not healthy(local_url(state)):
        raise ServerError(f"the server of {layout.root} is not running; start it first")
    if name == ADMIN:
        raise ServerError(f"{ADMIN!r} is the server's own administrator and cannot be removed")
    admin = Admin(layout, state)
    try:
        admin.client.delete_user(name)
    except RestException as err:
        raise ServerError(f"cannot remove user {name}: {err}") from err
    layout.credentials(name).unlink(missing_ok=True)


# --- commands ------------------------------------------------------------------------------------

def start(layout: Layout, host: str, port: int, pg: int, names: list[str], workers: int) -> str:
    address = bind_address(host)
    names = list(dict.fromkeys(names or [socket.gethostname(), socket.getfqdn()]))
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.secrets.mkdir(mode=0o700, exist_ok=True)
    os.chmod(layout.secrets, 0o700)
    start_postgres(layout, pg)
    state = {"address": address, "port": port, "pg_port": pg, "names": names}
    if mlflow_pid(layout) is not None:
        running = json.loads(layout.state.read_text()) if layout.state.exists() else {}
        if {k: running.get(k) for k in state} != state:
            raise ServerError(f"the mlflow server of {layout.root} already runs with {running}; stop it "
                              "first to change its settings")
        if not healthy(local_url(state)):
            raise ServerError(f"the mlflow server of {layout.root} runs (pid {layout.pid.read_text()}) "
                              f"but does not answer; see {layout.log}, or stop and start it")
    else:
        start_mlflow(layout, address, port, pg, names, workers)
    layout.state.write_text(json.dumps(state, indent=1))
    Admin(layout, state).writers_role()
    return f"http://{names[0]}:{port}"


def status(layout: Layout) -> bool:
    state = load_state(layout)
    pg_ok, ml_ok = pg_running(layout), mlflow_pid(layout) is not None and healthy(local_url(state))
    print(f"PostgreSQL (127.0.0.1:{state['pg_port']}, {layout.pg_data}): {'running' if pg_ok else 'stopped'}")
    print(f"mlflow server ({state['address']}:{state['port']}): {'running' if ml_ok else 'stopped'}")
    print(f"tracking URI: http://{state['names'][0]}:{state['port']}")
    return pg_ok and ml_ok


def usage(layout: Layout, uri: str, port: int) -> str:
    return (f"MLflow tracking server: {uri}  (basic auth; PostgreSQL on 127.0.0.1 only)\n"
            f"Firewall: open TCP {port} on this host to the compute nodes; nothing else.\n"
            f"Admin credentials: {layout.credentials(ADMIN)} (0600).\n"
            f"Jobs: export MLFLOW_TRACKING_URI={uri} and give them a user's credentials, made with\n"
            f"  python -m graft_exp.server add-user NAME --dir {layout.root}\n"
            "  as ~/.mlflow/credentials (mode 0600, read by MLflow in every process) or as\n"
            "  MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD in the jobs' environment.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graft_exp.server", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmds = {name: sub.add_parser(name, help=text) for name, text in [
        ("start", "start (or initialize and start) PostgreSQL and the mlflow server"),
        ("stop", "stop the mlflow server and PostgreSQL"),
        ("status", "say what runs; exit 1 unless both run"),
        ("add-user", "create a user for jobs (writes every experiment unless --read-only)"),
        ("remove-user", "delete a user: its credentials are refused from then on (its runs stay)")]}
    for p in cmds.values():
        p.add_argument("--dir", required=True, type=Path, help="the server's directory (data, secrets, logs)")
    cmds["start"].add_argument("--host", required=True,
                               help="interface name, address or host name to listen on (0.0.0.0: all)")
    cmds["start"].add_argument("--port", type=int, default=5000, help="the server's TCP port (default 5000)")
    cmds["start"].add_argument("--pg-port", type=int, default=55432,
                               help="PostgreSQL's port on 127.0.0.1 (default 55432)")
    cmds["start"].add_argument("--name", action="append", default=[], dest="names",
                               help="a host name jobs use for this server (repeatable; the first is the "
                                    "printed URI; default: this host's name and FQDN)")
    cmds["start"].add_argument("--workers", type=int, default=4, help="server worker processes (default 4)")
    cmds["stop"].add_argument("--keep-db", action="store_true",
                              help="stop only the mlflow server; PostgreSQL keeps running")
    cmds["add-user"].add_argument("name")
    cmds["remove-user"].add_argument("name")
    cmds["add-user"].add_argument("--read-only", action="store_true",
                                  help="may read every experiment but write none")
    args = parser.parse_args(argv)
    layout = Layout(args.dir.resolve())
    try:
        problem = folder_problem(args.dir) if args.command == "start" or args.dir.exists() else None
        if problem:
            raise ServerError(f"--dir {args.dir}: {problem}; give the server's folder (start creates it)")
        if args.command in ("start", "add-user"):   # both talk to PostgreSQL
            require("python -m graft_exp.server")
        if args.command == "start":
            for flag, value in (("--port", args.port), ("--pg-port", args.pg_port)):
                if not 0 < value < 65536:
                    raise ServerError(f"{flag} {value}: not a TCP port")
            if args.workers < 1:
                raise ServerError(f"--workers {args.workers}: need at least 1")
            uri = start(layout, args.host, args.port, args.pg_port, args.names, args.workers)
            print(usage(layout, uri, args.port))
        elif args.command == "stop":
            stop_mlflow(layout)
            if not args.keep_db:
                stop_postgres(layout)
        elif args.command == "status":
            return 0 if status(layout) else 1
        elif args.command == "remove-user":
            remove_user(layout, args.name)
            print(f"user {args.name} removed: the server refuses its credentials; its runs stay")
        else:
            path = add_user(layout, args.name, args.read_only)
            print(f"user {args.name} ({'read-only' if args.read_only else 'writes every experiment'}): "
                  f"credentials in {path} (0600). For jobs: install -D -m 600 {path} ~/.mlflow/credentials")
    except ServerError as err:
        print(f"graft_exp.server: {err}", file=sys.stderr)
        return 2
    except MissingExtra as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
