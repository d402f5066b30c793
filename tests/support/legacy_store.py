"""A store written by earlier versions of the project, for the re-key tests: each version's own code, checked out
from this repository's history, trains tiny jobs into one SQLite store as its users would have.

``python tests/support/legacy_store.py <conf dir> <plan>``, the old checkout first on PYTHONPATH, trains the jobs
of the plan (``train_with``) with that checkout's code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Two seconds of training a job, the whole job path: what the old versions write is what matters here.
TINY = ["train.max_steps=2", "train.batch_prompts=8", "train.minibatch_prompts=4", "train.save_every=1",
        "eval.val_every=2", "eval.max_problems=1", "eval.runs=1",
        "eval.samples=1", "backend.progress=false", "backend.threads=1"]


def why_no_history(*commits: str) -> str | None:
    """Why the old versions cannot be checked out here (a source tree without the git history), or None."""
    for commit in commits:
        found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                               capture_output=True, check=False)
        if found.returncode != 0:
            return f"commit {commit} is not in this checkout's git history (a shallow clone or a source archive)"
    return None


def checkout(commit: str, into: Path) -> Path:
    """The project's files at ``commit`` (``git archive``: no worktree is registered in the repository)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True).stdout
    into.mkdir(parents=True)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def train_with(code: Path, store: Path, *jobs: tuple[list[str], int | None]) -> str:
    """Train ``jobs`` (each its overrides and the step after which it stops as a preempted job, or None to finish)
    one after another with the code of ``code`` (its package and conf/), in one process as ``python -m graft_exp``
    would, into ``store``/mlflow.db with checkpoints in ``store``/ckpt; its log."""
    common = [f"tracking.uri=sqlite:///{store / 'mlflow.db'}", f"checkpoint_root={store / 'ckpt'}", *TINY]
    plan = json.dumps([[[*common, *overrides], stop] for overrides, stop in jobs])
    done = subprocess.run([sys.executable, __file__, str(code / "conf"), plan], cwd=store,
                          env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def train_jobs(conf_dir: str, plan: str) -> None:
    """The jobs of ``plan`` with the code on PYTHONPATH: validated, opened and fitted as ``python -m graft_exp``
    does, each stopped after its step when it has one (left RUNNING, checkpointed, as a preempted job)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from graft_exp import driver, tracking
    from graft_exp.backends import local
    from graft_exp.config import register_schemas, validate

    assert Path(driver.__file__).is_relative_to(Path(conf_dir).parent), "the old checkout's code must run"
    register_schemas()
    for overrides, stop_at_step in json.loads(plan):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        validate(cfg)
        driver.fit(cfg, tracking.open_job(cfg), local.LocalBackend, stop_at_step=stop_at_step)


if __name__ == "__main__":
    train_jobs(sys.argv[1], sys.argv[2])
