"""Run identity: ``graft.run_key`` (a hash of the resolved config without where/how-it-runs keys), each
model run's key (a GRPO baseline of one (model, n, seed) is shared by every pair holding the model), the
flattened config as params, and the code version (git commit, MLflow source tags)."""

from __future__ import annotations

import getpass
import hashlib
import json
import subprocess
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from graft_exp import scheduler

# Config sections that say where or how a job runs, not what it computes.
NON_IDENTITY_KEYS = ("cluster", "tracking", "checkpoint_root", "rerun", "study", "hydra")
#: The catalog fields (conf/catalog/models.yaml) that say which model is trained; the others describe it
#: (sizes, positions) for checks and plans, and adding one must not change every run key.
CATALOG_IDENTITY_FIELDS = ("hf_id", "display")


def stable_hash(obj) -> str:
    """16 hex digits of the SHA-256 of ``obj`` as canonical JSON (sorted keys): the same on every
    machine and Python version, so run keys found in the store match the ones computed now."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity(cfg: DictConfig) -> dict:
    """The resolved config minus the keys that do not change what a job computes."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    ident = {k: v for k, v in resolved.items() if k not in NON_IDENTITY_KEYS}
    if not ident.get("method", {}).get("params", True):
        # A method without rule parameters keeps the key it had before ``method.params`` existed, so the
        # runs already in a store stay findable (resumption, replayed logs, equal-compute references).
        ident["method"] = {k: v for k, v in ident["method"].items() if k != "params"}
    if "models" in ident:
        ident["models"] = {key: {f: entry[f] for f in CATALOG_IDENTITY_FIELDS if f in entry}
                           for key, entry in ident["models"].items()}
    return ident


def run_key(cfg: DictConfig) -> str:
    """``graft.run_key`` of a job: stable hash of its identity config."""
    return stable_hash(identity(cfg))


def model_run_key(cfg: DictConfig, role: str) -> str:
    """Identity of one trained model. Single-model methods leave out the pair and the peer, so a
    GRPO baseline of (model, method, seed) is one run whichever pair launches it."""
    ident = identity(cfg)
    if cfg.method.co_train:
        return stable_hash({"job": ident, "role": role})
    ident.pop("pair")
    ident["model"] = cfg.pair[role]
    return stable_hash(ident)


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list) else str(v)
    return out


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def git_sha() -> str:
    return _git("rev-parse", "HEAD") or "unknown"


def source_tags(entry_point: str) -> dict[str, str]:
    """MLflow's own source tags, which fill the UI's Source and User columns: the entry point, the
    git commit (and remote, which the UI links to) of this checkout, local process or scheduler job."""
    tags = {"mlflow.source.name": entry_point,
            "mlflow.source.type": "JOB" if scheduler.slurm_job_id() else "LOCAL",
            "mlflow.user": getpass.getuser()}
    for key, args in (("commit", ("rev-parse", "HEAD")), ("repoURL", ("config", "--get", "remote.origin.url"))):
        value = _git(*args)
        if value:
            tags[f"mlflow.source.git.{key}"] = value
    return tags
