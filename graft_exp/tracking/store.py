"""The tracking store: experiment names, the checks before anything is launched (an unwritable SQLite
file, a dead server, missing credentials: errors that say what to fix), store creation, UI links."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sqlite3
import uuid
from contextlib import closing
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from graft_exp import schema
from graft_exp.cache import cache_dir

# MLflow 3.x records an experiment's kind in this tag; the UI's experiment-kind selector writes it.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


class TrackingError(RuntimeError):
    """The tracking store cannot be used; the message says what to check."""


def use_installed_postgresql_driver() -> None:
    """Let ``postgresql://`` URIs (as PostgreSQL writes them) use the driver the ``server`` extra installs.
    SQLAlchemy 2.1 reads a driverless ``postgresql://`` as psycopg 3; the extra installs psycopg2, which
    SQLAlchemy then uses only when the URI says ``postgresql+psycopg2://``. Where psycopg 3 is installed,
    SQLAlchemy's own default stays."""
    if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
        from sqlalchemy.dialects import registry

        registry.register("postgresql", "sqlalchemy.dialects.postgresql.psycopg2", "PGDialect_psycopg2")


use_installed_postgresql_driver()


def _check_sqlite_is_mlflow(uri: str, db: Path) -> None:
    """An existing, non-empty file at a ``sqlite:///`` URI must be an MLflow store: MLflow would otherwise
    add its tables to someone else's database, or fail on a file that is no database at all."""
    if not db.is_file() or db.stat().st_size == 0:
        return
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as err:
        raise TrackingError(f"tracking.uri={uri}: {db} is not an MLflow store ({err}); point tracking.uri at "
                            "an MLflow store, or at a new file to create one") from None
    if tables and not {"experiments", "runs", "alembic_version"} <= tables:
        raise TrackingError(f"tracking.uri={uri}: {db} is an SQLite database without MLflow's tables "
                            f"({', '.join(sorted(tables)[:5])}...); point tracking.uri at an MLflow store, or at "
                            "a new file to create one")


def _check_database(uri: str, timeout_s: float) -> None:
    """A database URI MLflow would open itself (``postgresql://...``, ``mysql://...``): its SQLAlchemy
    driver is installed and the database answers."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

    try:
        url = make_url(uri)
        shown = url.render_as_string(hide_password=True)
        engine = create_engine(url, connect_args={"connect_timeout": int(timeout_s)} if
                               url.get_backend_name() == "postgresql" else {})
    except ModuleNotFoundError as err:
        raise TrackingError(f"tracking.uri={uri.split('://')[0]}://...: SQLAlchemy's driver for it, {err.name}, is "
                            "not installed: install it (for PostgreSQL: pip install -e '.[server]', psycopg2), or "
                            "name an installed driver in the URI (postgresql+psycopg2://...)") from None
    except (ArgumentError, NoSuchModuleError) as err:
        raise TrackingError(f"tracking.uri is not a database URI MLflow can open ({err}); use sqlite:///FILE, "
                            "http://HOST:PORT (a tracking server) or postgresql://USER@HOST:PORT/DB") from None
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as err:
        first = str(getattr(err, "orig", err)).strip().splitlines()[0]
        raise TrackingError(f"the tracking database {shown} does not answer ({first}): start it, or fix "
                            "tracking.uri (or MLFLOW_TRACKING_URI), then launch again") from None
    finally:
        engine.dispose()


def experiment_name(cfg: DictConfig) -> str:
    """The job's experiment (``schema.experiment_name``): ``graft/<study>``, a preflight's outside it."""
    return schema.experiment_name(str(cfg.study), bool(cfg.get("preflight")))


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def check_store(uri: str, timeout_s: float = 10.0, writing: bool = True) -> None:
    """Fail fast, with the fix in the message, when ``uri`` cannot take runs: a SQLite file in a
    missing or read-only place or one that is not an MLflow store, a database whose driver is missing or
    that does not answer, or a tracking server that does not answer its health check. ``writing=False``
    (analysis) leaves out the write access."""
    db = sqlite_file(uri)
    if db is not None:
        place = db if db.exists() else db.parent
        if writing and (not place.exists() or not os.access(place, os.W_OK)):
            raise TrackingError(f"cannot write the MLflow store {uri}: {place} is missing or not "
                                "writable; set tracking.uri to a writable location")
        _check_sqlite_is_mlflow(uri, db)
    elif "://" in uri and not uri.startswith(("http://", "https://", "file://", "databricks")):
        _check_database(uri, timeout_s)
    elif uri.startswith(("http://", "https://")):
        import requests

        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
        except requests.RequestException as err:
            raise TrackingError(
                f"the MLflow tracking server {uri} does not answer ({type(err).__name__}: {err}). "
                "Start it (python -m graft_exp.server start --dir ... --host ...) or fix "
                "MLFLOW_TRACKING_URI, then launch again."
            ) from err


def check_credentials(uri: str, experiment: str, timeout_s: float = 10.0) -> None:
    """Fail before submission when a tracking server with authentication (MLflow's basic-auth
    app) would refuse the jobs: their credentials, as MLflow reads them (MLFLOW_TRACKING_USERNAME /
    MLFLOW_TRACKING_PASSWORD, else ~/.mlflow/credentials), are refused (401), the server refuses
    the request itself (403, e.g. a host name outside its --allowed-hosts), or the user may not
    write the existing experiment (403). A server without authentication passes."""
    import requests
    from mlflow.utils.credentials import read_mlflow_creds

    creds = read_mlflow_creds()
    auth = (creds.username, creds.password) if creds.username and creds.password else None
    who = f"user {creds.username!r}" if auth else "no credentials"
    base = uri.rstrip("/")
    fix = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or ~/.mlflow/credentials "
           "(mode 0600), to a user of the server (python -m graft_exp.server add-user NAME)")
    try:
        me = requests.get(f"{base}/api/2.0/mlflow/users/current", auth=auth, timeout=timeout_s)
        if me.status_code == 404:   # no authentication app: nothing to check
            return
        if me.status_code == 401:
            raise TrackingError(f"the MLflow tracking server {uri} refused {who} (401 Unauthorized): "
                                f"{fix}, then launch again")
        if me.status_code == 403:
            raise TrackingError(f"the MLflow tracking server {uri} refused the request (403 Forbidden: "
                                f"{me.text.strip()[:200]}); if it names the Host header, start the "
                                "server with this host name (graft_exp.server start --name)")
        me.raise_for_status()
        if me.json()["user"]["is_admin"]:
            return
        exp = requests.get(f"{base}/api/2.0/mlflow/experiments/get-by-name", auth=auth,
                           params={"experiment_name": experiment}, timeout=timeout_s)
        if exp.status_code == 404:   # a new experiment: creating it (ensure_store) is the check
            return
        exp.raise_for_status()
        perm = requests.get(f"{base}/api/3.0/mlflow/users/permissions/get", auth=auth, timeout=timeout_s,
                            params={"username": creds.username, "resource_type": "experiment",
                                    "resource_id": exp.json()["experiment"]["experiment_id"]})
        perm.raise_for_status()
    except requests.RequestException as err:
        raise TrackingError(f"cannot check the credentials on the MLflow tracking server {uri} "
                            f"({type(err).__name__}: {err})") from err
    if perm.json()["permission"] not in ("EDIT", "MANAGE"):
        raise TrackingError(f"{who} may not write experiment {experiment!r} on the MLflow tracking "
                            f"server {uri} (403 Forbidden: its permission is {perm.json()['permission']}); use the "
                            "credentials of a user that writes (graft_exp.server add-user without "
                            "--read-only) or have EDIT granted on the experiment")


def empty_store_template(folder: Path | None = None) -> Path:
    """An empty SQLite store with MLflow's whole schema, built once per MLflow version into ``folder``
    (default: the graft_exp cache) and copied for every new store: MLflow creates a store by running
    each of its schema migrations, several seconds per store. The template holds no experiment, so a
    copy creates its Default experiment when it is first opened, its artifact root where MLflow would
    have put it then (./mlruns of that process)."""
    folder = Path(folder or cache_dir("mlflow"))
    template = folder / f"empty-{mlflow.__version__}.db"
    if not template.exists():
        folder.mkdir(parents=True, exist_ok=True)
        building = folder / f".building-{os.getpid()}-{uuid.uuid4().hex[:8]}.db"
        try:
            MlflowClient(f"sqlite:///{building}").search_experiments()
            with closing(sqlite3.connect(building)) as db, db:
                db.execute("DELETE FROM experiments")
            os.replace(building, template)   # atomic: concurrent builders each publish a whole file
        finally:
            building.unlink(missing_ok=True)
    return template


def create_sqlite_store(db: Path) -> None:
    """A new SQLite store at ``db``, copied from ``empty_store_template``; never replaces an existing
    file (a store another launcher created meanwhile is kept). Where the template cannot be built
    (an unwritable cache), MLflow creates the store itself on first use, and reports what fails there."""
    try:
        template = empty_store_template()
    except Exception:  # noqa: BLE001  (only a shortcut: MLflow's own creation is the real check)
        return
    copy = db.parent / f".{db.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"   # a file of the umask's mode
    try:
        shutil.copyfile(template, copy)
        os.link(copy, db)     # fails if db exists: no store is ever overwritten
    except OSError:           # db appeared meanwhile, or no hard links here: MLflow's own creation
        pass
    finally:
        copy.unlink(missing_ok=True)


def ensure_store(uri: str, experiment: str) -> str:
    """Create (or migrate) the store and the experiment, from the launching process; return the
    experiment id.

    Concurrent first-time SQLite schema creation crashes jobs, so this runs once before any job
    starts. An unreachable server or unwritable store fails here, before anything is launched.
    """
    check_store(uri)
    db = sqlite_file(uri)
    if db is not None and not db.exists():
        create_sqlite_store(db)
    elif uri.startswith(("http://", "https://")):
        check_credentials(uri, experiment)
    try:
        client = MlflowClient(uri)   # a database store is created, or its missing tables migrated, here
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return client.create_experiment(experiment, tags=EXPERIMENT_TAGS)
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        for key, value in EXPERIMENT_TAGS.items():   # experiments made before the kind was recorded
            if key not in exp.tags:
                client.set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id
    except Exception as err:  # MLflow raises many kinds; all mean the same thing to the user
        if getattr(err, "error_code", None) == "PERMISSION_DENIED":
            raise TrackingError(f"MLflow tracking server {uri} refused to create experiment "
                                f"{experiment!r} (403 Forbidden): the user has read-only access; use "
                                "credentials of a user that writes") from err
        raise TrackingError(
            f"MLflow tracking store {uri} is not usable ({type(err).__name__}: {err}). "
            "Start the server / fix tracking.uri (or MLFLOW_TRACKING_URI) and launch again."
        ) from err


def ui_link(experiment_id: str, server: str = "http://127.0.0.1:5000") -> str:
    """The experiment's runs table in the MLflow UI. MLflow 3.17's UI opens every experiment on its
    GenAI overview unless the workflow type is ``machine_learning`` (its sidebar toggle "Model
    training", remembered per browser, or this URL parameter); the experiment-kind tag does not
    change that."""
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def compare_hint(uri: str, experiment_id: str) -> str:
    """One line telling where to compare the runs of ``experiment_id``."""
    if uri.startswith(("http://", "https://")):
        return f"compare the runs in the MLflow UI: {ui_link(experiment_id, uri)}"
    return f"compare the runs in the MLflow UI: mlflow ui --backend-store-uri {uri}, then open {ui_link(experiment_id)}"
