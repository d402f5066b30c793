"""Run identity: ``graft.run_key`` (a hash of the resolved config without where/how-it-runs keys), each
model run's key (a GRPO baseline of one (model, n, seed) is shared by every pair holding the model), the
flattened config as params, and the code version (git commit, MLflow source tags)."""

from __future__ import annotations

import copy
import getpass
import hashlib
import json
import subprocess
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from graft_exp import methods, prompts, scheduler
from graft_exp.config import MEMBER_KEYS, key_neutral_settings

# Config sections that say where or how a job runs, not what it computes.
NON_IDENTITY_KEYS = ("cluster", "tracking", "checkpoint_root", "rerun", "study", "hydra", "compare_to", "preflight")
#: The catalog field (conf/catalog/models.yaml) that says which weights a model starts from; the others describe
#: it (display name, sizes, positions) for tables, checks and plans.
CATALOG_IDENTITY_FIELDS = ("hf_id",)


def catalog_identity(entry: dict) -> dict:
    """What one catalog model contributes to a run key: its weights (``hf_id``), and for a hub model the snapshot's
    pinned ``revision`` (where set) and its prompt format's content (``prompts.PromptFormat.digest``), which the
    project chose and a researcher may change. A model the project builds itself keys by ``hf_id`` alone (null):
    its tokenizer and template are part of its content-hashed build, and runs keyed before formats existed keep
    their keys."""
    ident = {f: entry.get(f) for f in CATALOG_IDENTITY_FIELDS}
    if entry.get("hf_id"):
        if entry.get("revision"):
            ident["revision"] = entry["revision"]
        if entry.get("prompt_format"):
            ident["prompt_format"] = prompts.prompt_format(entry["prompt_format"]).digest
    return ident


def stable_hash(obj) -> str:
    """16 hex digits of the SHA-256 of ``obj`` as canonical JSON (sorted keys): the same on every
    machine and Python version, so run keys found in the store match the ones computed now."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resolved_config(cfg: DictConfig | dict) -> dict:
    """``cfg`` as plain containers, interpolations resolved (a dict, e.g. a run's logged config.yaml, as it is)."""
    return cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)


def keyed_method(method: dict) -> dict:
    """The method as run keys have named it since the first runs: ``co_train`` and ``dynamic_sampling`` were YAML
    flags before the components said them (the selection and the peer loss, ``method.sampling``). A key writes them
    as it did, so no run is re-keyed; a config logged before the change holds them already."""
    if "sampling" not in method:
        return method
    keyed = {k: v for k, v in method.items() if k != "sampling"}
    keyed["co_train"] = methods.co_trains(OmegaConf.create(method))
    keyed["dynamic_sampling"] = methods.SAMPLINGS.build(method).own_prompts
    return keyed


def co_trained(cfg: DictConfig | dict) -> bool:
    """Whether a job's (or a logged config's) method trains its members together."""
    return bool(keyed_method(resolved_config(cfg)["method"])["co_train"])


def identity(cfg: DictConfig | dict, models: list[str] | None = None) -> dict:
    """What a job computes, the rule of docs/design.md ("Run keys"): the resolved config without the keys that
    say where or how it runs (``NON_IDENTITY_KEYS``), the catalog entries of its own models only (``models``,
    default the pair's or group's members), and without every setting declared with
    ``config.added_setting`` whose value is the one that reproduces the behaviour from before it existed.
    ``cfg`` is a composed config or a resolved one (a run's logged config.yaml)."""
    resolved = resolved_config(cfg)
    ident = copy.deepcopy({k: v for k, v in resolved.items() if k not in NON_IDENTITY_KEYS})
    ident["method"] = keyed_method(ident["method"])
    for path, neutral in key_neutral_settings(resolved).items():
        *parents, name = path
        node = ident
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and name in node and node[name] in neutral:
            del node[name]
    members = models if models is not None else [resolved["pair"][r] for r in MEMBER_KEYS if resolved["pair"].get(r)]
    catalog = resolved.get("models") or {}
    ident["models"] = {key: catalog_identity(catalog.get(key, {})) for key in members}
    return ident


def run_key(cfg: DictConfig | dict) -> str:
    """``graft.run_key`` of a job: stable hash of its identity."""
    return stable_hash(identity(cfg))


def model_run_key(cfg: DictConfig | dict, role: str) -> str:
    """Identity of one trained model. Single-model methods leave out the pair, the peer and their catalog
    entries, so a GRPO baseline of (model, method, seed) is one run whichever pair launches it."""
    resolved = resolved_config(cfg)
    if co_trained(resolved):
        return stable_hash({"job": identity(resolved), "role": role})
    model = resolved["pair"][role]
    ident = identity(resolved, models=[model])
    ident.pop("pair")
    ident["model"] = model
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
