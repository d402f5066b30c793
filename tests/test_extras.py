"""Optional features without their dependencies, and the options a user is offered.

Each entry point of an optional feature runs in a fresh interpreter whose import system refuses that
feature's modules (a ``sitecustomize`` on ``PYTHONPATH`` installs the refusing finder first): it must stop
with one line naming the ``pip install`` that fixes it, no traceback, nothing created. ``--help`` and tab
completion offer only what a user may choose: the typed schemas stay out of the groups."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.optional import RAY, VERL_BACKEND, WITHOUT_VERL

from graft_exp.extras import FEATURES

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = '''
import os, sys
HIDDEN = set(os.environ["GRAFT_TEST_HIDDEN_MODULES"].split(","))

class Refuse:
    """As if the packages were not installed."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
'''


def run_without(modules: tuple[str, ...], args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "hide").mkdir(exist_ok=True)
    (tmp_path / "hide" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "hide"), str(ROOT)]),
           "GRAFT_TEST_HIDDEN_MODULES": ",".join(modules), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=False,
                          env=env, cwd=tmp_path)


def test_the_blocker_hides_what_it_names(tmp_path):
    done = run_without(("datasets",), ["-c", "import datasets"], tmp_path)
    assert done.returncode == 1 and "ModuleNotFoundError: No module named 'datasets'" in done.stderr


@pytest.mark.slow   # a process per entry point
@pytest.mark.parametrize(("feature", "args", "created"), [
    ("python -m graft_exp.prepare", ["-m", "graft_exp.prepare", "--data-dir", "data", "--model-dir", "models"], ["data", "models"]),
    ("python -m graft_exp.server", ["-m", "graft_exp.server", "start", "--dir", "srv", "--host", "127.0.0.1"], ["srv"]),
    ("backend=verl", ["-m", "graft_exp", "backend=verl", "pair=pair1", "tracking=sqlite",
                      "checkpoint_root=ckpt"], ["ckpt", "mlruns.db"]),
])
def test_a_missing_optional_dependency_stops_with_the_install_line(feature, args, created, tmp_path):
    extra, modules = FEATURES[feature]
    done = run_without(modules, args, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    fix = f"pip install 'graft_exp[{extra}]'"
    (line,) = [x for x in output.splitlines() if fix in x]
    assert f"{feature} needs {', '.join(modules)}, not installed here" in line
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output
    assert not [name for name in created if (tmp_path / name).exists()]


@pytest.mark.slow   # a pytest session in a process of its own
def test_without_verl_what_needs_it_skips_saying_why(tmp_path):
    """The suite in an environment without verl, Ray and vLLM (a plain ``pip install -e .``): a test comparing with
    verl's functions, a file of the verl backend's tests and a test that starts a Ray skip with their reasons
    (tests/support/optional.py); the rest of those files runs."""
    tests = ROOT / "tests"
    done = run_without(("verl", "ray", "vllm"), [
        "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inner'}",
        f"--rootdir={ROOT}", str(tests / "test_algorithms_losses.py"), str(tests / "test_verl_loss.py"),
        f"{tests / 'test_resources.py'}::test_private_ray_without_the_placement_groups_cpus_is_refused",
        f"{tests / 'test_resources.py'}::test_checkpoints_hold_what_resuming_needs"], tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for reason in (WITHOUT_VERL, VERL_BACKEND, RAY):
        assert reason in output, output[-4000:]
    assert "passed" in output.splitlines()[-1] and "error" not in output.splitlines()[-1], output[-4000:]


@pytest.mark.slow   # python -m graft_exp --help and its completion, each a process
def test_help_and_completion_offer_only_choosable_options(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shown = subprocess.run([sys.executable, "-m", "graft_exp", "--help"], capture_output=True, text=True,
                           timeout=300, check=True, env=env, cwd=tmp_path).stdout
    groups = dict(line.split(": ", 1) for line in shown.split("== Config ==")[0].splitlines() if ": " in line)
    assert groups["backend"] == "local, verl"
    assert "graft" in groups["method"].split(", ") and "schema" not in shown
    for word, expected in (("backend=", {"backend=local", "backend=verl"}), ("method=", None)):
        completion = subprocess.run([sys.executable, "-m", "graft_exp", "-sc", "query=bash"], capture_output=True,
                                    text=True, timeout=300, check=True, cwd=tmp_path,
                                    env={**env, "COMP_LINE": f"graft_exp {word}"}).stdout.split()
        assert completion and not [c for c in completion if "schema" in c], completion
        if expected:
            assert set(completion) == expected


@pytest.mark.parametrize("override", ["method=schema", "backend=verl_schema", "backend=local_schema"])
def test_a_schema_is_not_an_option(compose_cfg, override):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException):
        compose_cfg(override)


@pytest.mark.parametrize("override", ["method.gatee=false", "backend.threadz=2"])
def test_the_schemas_still_type_their_groups(compose_cfg, override):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as failed:
        compose_cfg(override)
    key, schema = override.split("=")[0].split(".")[1], "MethodConfig" if "method" in override else "LocalBackendConfig"
    assert f"Key '{key}' not in '{schema}'" in str(failed.value.__cause__)


def test_a_ray_without_token_authentication_is_refused_naming_the_release(monkeypatch):
    """A cluster's preinstalled Ray older than the token authentication backends/verl/ray_slurm.py imports fails
    the launch checks with the release it needs, not at Ray's start."""
    import importlib.metadata

    from graft_exp import extras

    pytest.importorskip("verl", reason=VERL_BACKEND)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.49.2" if name == "ray" else real(name))
    with pytest.raises(extras.MissingExtra, match=r"backend=verl: ray 2.49.2 is older than 2.52.0, the first with "
                                                  r"token authentication .*: pip install 'graft_exp\[verl\]'"):
        extras.require("backend=verl")
    monkeypatch.setattr(importlib.metadata, "version", real)
    extras.require("backend=verl")   # the pinned one passes
    from ray._raylet import AuthenticationTokenLoader  # noqa: F401  (what the floor stands for)


@pytest.mark.slow
def test_a_login_node_without_the_gpu_stack_plans_and_checks_the_paper_sweep_it_submits(tmp_path, monkeypatch):
    """The main sweep as shipped (backend=verl), submitted to Slurm from a machine without verl, Ray or vLLM, the
    paper's models and data prepared there (stand-ins: their real tokenizers, no weights): every job composed,
    validated (config, prepared data, snapshots at the pinned revision, prompt formats against the tokenizers,
    resource plans) and listed; the verl extra is the job's own process's check, on the node."""
    from support.paper_standins import prepare_data, prepare_models

    _, modules = FEATURES["backend=verl"]
    monkeypatch.setenv("GRAFT_DATA_DIR", str(prepare_data(tmp_path / "data")))
    monkeypatch.setenv("GRAFT_MODEL_DIR", str(prepare_models(tmp_path / "models")))
    sweep = ROOT / "sweeps" / "main.yaml"
    done = run_without(modules, ["-m", "graft_exp.sweep", str(sweep), "--only", "pair=pair1", "--dry-run",
                                 "--out", str(tmp_path / "multirun"), "cluster=slurm",
                                 f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "6 jobs: 0 finished" in done.stdout
    # the same machine cannot train it: an in-process job is refused with the install line
    here = run_without(modules, ["-m", "graft_exp", "backend=verl", "pair=pair1", "tracking=sqlite"], tmp_path)
    assert here.returncode == 2 and "pip install 'graft_exp[verl]'" in here.stdout + here.stderr


def test_a_tiny_sweep_is_planned_and_refused_without_torch_or_transformers(tmp_path):
    """The launcher's side of the tiny pair (compose, validate, plan, list, refuse) imports neither torch nor
    transformers, only the jobs that train do: a multirun's parent, a dry run and a bad override answer in
    seconds, and no process that only launches pays for them."""
    hidden = ("torch", "transformers")
    store = f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"
    planned = run_without(hidden, ["-m", "graft_exp.sweep", str(ROOT / "sweeps" / "tiny.yaml"), "--dry-run",
                                   "--out", str(tmp_path / "multirun"), store], tmp_path)
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-3000:]
    assert "65 jobs: 0 finished" in planned.stdout
    refused = run_without(hidden, ["-m", "graft_exp", "-m", "method=graft,sgt", "method.delta=1.5",
                                   "cluster=submitit_local", store, f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "method.delta=1.5 is outside [0, 1]" in refused.stdout + refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "mlflow.db").exists()
