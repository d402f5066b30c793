"""Jobs as the sweep tool sees them: override lists composed into configs, keys, costs, ordering.

``Composer`` composes the project's config exactly as ``python -m graft_exp`` does, but fast
enough to list a sweep of hundreds of jobs in seconds: each group choice (``pair=pair2``,
``method=sgt``) is composed once and grafted onto the base config, and value overrides
(``seed=1``, ``method.delta=0.7``) are applied with OmegaConf. A group option that writes
outside its own node, and any override that is not a plain group choice or value, falls back to
a full Hydra compose; ``tests/test_sweep.py`` checks both paths give every sweep job the same
``graft.run_key``. Compositions are cached on disk until a config file changes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from graft_exp import methods, tracking
from graft_exp.config import register_schemas, roles

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# GPU-hours of the paper's complete 3-epoch (174-step) runs on 4 GPUs (Table "Score and training
# cost on Pair 1", App. D). Single-model runs are charged per model; OctoThinker-3B, absent from
# that table, is charged like SmolLM3-3B (same size).
GRPO_GPU_HOURS = {
    "smollm3-3b-base": {"grpo_n8": 17.4, "grpo_n16": 34.8, "grpo_n32": 99.5, "grpo_ds": 40.5},
    "qwen3-1.7b-base": {"grpo_n8": 12.5, "grpo_n16": 22.5, "grpo_n32": 45.6, "grpo_ds": 27.4},
    "octothinker-3b-hybrid-base": {"grpo_n8": 17.4, "grpo_n16": 34.8, "grpo_n32": 99.5, "grpo_ds": 40.5},
}
# Joint runs on pair 1 (both models); a variant costs what the method it modifies costs.
CO_TRAIN_GPU_HOURS = {"hacpo": 47.1, "sgt": 53.1, "graft": 43.3, "graft_stored": 33.3}
PAPER_PAIR = ("smollm3-3b-base", "qwen3-1.7b-base")
PAPER_STEPS = 174


@dataclass
class Job:
    """One Hydra job of a sweep: its own overrides and what they compose to."""

    overrides: tuple[str, ...]
    cfg: DictConfig = field(repr=False, compare=False)
    after: tuple[Job, ...] = field(default=(), repr=False, compare=False)

    @cached_property
    def key(self) -> str:
        return tracking.run_key(self.cfg)

    @cached_property
    def model_keys(self) -> dict[str, str]:
        """Model run key of each role this job trains."""
        return {role: tracking.model_run_key(self.cfg, role) for role in roles(self.cfg.pair)}

    @property
    def single_model(self) -> bool:
        return not methods.co_trains(self.cfg.method)

    @property
    def label(self) -> str:
        return " ".join(self.overrides)


def conf_fingerprint(common: list[str]) -> str:
    """Hash of everything a composition depends on: the config tree, the method schema, Hydra's
    version and the common overrides (environment variables are resolved later, at use)."""
    import hydra

    h = hashlib.sha256(f"{hydra.__version__}\0{common}".encode())
    for path in sorted(CONF_DIR.rglob("*.yaml")) + [Path(__file__).resolve().parents[1] / "config.py"]:
        h.update(str(path.relative_to(CONF_DIR.parent)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:20]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "graft_exp" / "compose"


class Composer:
    """Compose job configs for override lists on top of ``common`` overrides (e.g. ``cluster=slurm``).

    Compositions are cached on disk (unresolved, keyed by ``conf_fingerprint``), so listing a
    sweep again composes nothing until a config file changes.
    """

    def __init__(self, common: list[str] = (), cache_dir: Path | None = None):
        self.common = [o for o in common if not o.startswith("hydra.")]
        fingerprint = conf_fingerprint(self.common)
        self.cache_file = (cache_dir or default_cache_dir()) / f"{fingerprint}.json"
        try:
            self.cache: dict[str, dict] = json.loads(self.cache_file.read_text())
        except (OSError, ValueError):
            self.cache = {}
        self._dirty = False
        self._init = None
        self._parts: dict[str, DictConfig | None] = {}
        self._base: DictConfig | None = None

    def _hydra(self) -> None:
        if self._init is None:
            register_schemas()
            GlobalHydra.instance().clear()
            self._init = initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
            self._init.__enter__()
            self.parser = OverridesParser.create()

    def close(self) -> None:
        if self._init is not None:
            self._init.__exit__(None, None, None)
            GlobalHydra.instance().clear()
            self._init = None
        if self._dirty:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.cache))
            tmp.replace(self.cache_file)
            self._dirty = False

    @property
    def base(self) -> DictConfig:
        """The config of the common overrides alone."""
        return self.compose([])

    def _full(self, overrides: list[str]) -> DictConfig:
        self._hydra()
        return compose(config_name="config", overrides=[*self.common, *overrides])

    def _base_cfg(self) -> DictConfig:
        if self._base is None:
            self._base = self._full([])
        return self._base

    def _is_group(self, key: str) -> bool:
        return GlobalHydra.instance().hydra.config_loader.repository.group_exists(key)

    def _part(self, override: str, key: str) -> DictConfig | None:
        """The node ``key`` composed with ``override``, or None if that option writes elsewhere."""
        if override not in self._parts:
            full, base = self._full([override]), self._base_cfg()
            outside = {k for k in set(full) | set(base) if k != key and full.get(k) != base.get(k)}
            self._parts[override] = None if outside else full[key]
        return self._parts[override]

    def compose(self, overrides: list[str]) -> DictConfig:
        """The job config of ``overrides``, as ``python -m graft_exp <common> <overrides>`` has it."""
        cache_key = "\x1f".join(overrides)
        if cache_key not in self.cache:
            self.cache[cache_key] = OmegaConf.to_container(self._compose(list(overrides)), resolve=False)
            self._dirty = True
        return OmegaConf.create(copy.deepcopy(self.cache[cache_key]))

    def _compose(self, overrides: list[str]) -> DictConfig:
        self._hydra()
        parsed = self.parser.parse_overrides(overrides)
        groups, values = [], []
        for text, ov in zip(overrides, parsed):
            simple = not (ov.is_delete() or ov.is_add() or ov.is_force_add() or ov.package)
            if not simple or ov.is_sweep_override() or "/" in ov.key_or_group:
                return self._full(overrides)
            (groups if self._is_group(ov.key_or_group) else values).append((text, ov))
        cfg = copy.deepcopy(self._base_cfg())
        for text, ov in groups:
            part = self._part(text, ov.key_or_group)
            if part is None:
                return self._full(overrides)
            with open_dict(cfg):
                cfg[ov.key_or_group] = copy.deepcopy(part)
        for _, ov in values:
            if OmegaConf.select(cfg, ov.key_or_group, default=KeyError) is KeyError:
                return self._full(overrides)   # let Hydra report the unknown key
            OmegaConf.update(cfg, ov.key_or_group, ov.value(), merge=False)
        return cfg


def _grpo_hours(model: str, method: str) -> float:
    table = GRPO_GPU_HOURS.get(model, GRPO_GPU_HOURS["smollm3-3b-base"])
    return table.get(method, table["grpo_n8"])


@dataclass(frozen=True)
class Projection:
    """What a complete job is expected to cost: GPU-hours (App. D's charge), wall hours, and whose figures."""

    gpu_hours: float
    wall_hours: float | None     # None where nothing times the job's hardware (a CPU pair before a preflight)
    source: str


def estimate_cost(cfg: DictConfig, trained: Sequence[str] = ()) -> Projection:
    """Expected GPU-hours and wall time of a complete job from the paper's measured costs, scaled by the pair's
    models (relative to pair 1), by ``train.max_steps`` against 174 steps and by ``pair.gpus`` against 4. A
    single-model job is charged for the roles it trains (``trained``, default all: a shared baseline is paid once),
    each on its own pool at the same time, so its wall time is its slowest pool's hours over that pool's GPUs; a
    co-trained group of K models is charged the sum of its members' GRPO costs, as a pair, and holds all its GPUs
    for the whole run. CPU pairs cost 0, in unknown time."""
    if int(cfg.pair.gpus) == 0:
        return Projection(0.0, None, "App. D (a CPU pair: no GPU-hours)")
    method, steps = cfg.method.name, cfg.train.max_steps or PAPER_STEPS
    family = methods.declaration(method).cost_family
    scale = steps / PAPER_STEPS * int(cfg.pair.gpus) / 4
    pool_gpus = int(cfg.backend.get("gpus_per_model", 1)) * int(cfg.backend.get("nnodes", 1))
    if not methods.co_trains(cfg.method):
        hours = {role: _grpo_hours(cfg.pair[role], family) * scale for role in trained or roles(cfg.pair)}
        return Projection(sum(hours.values()), max(hours.values()) / pool_gpus, "App. D")
    pair_cost = sum(_grpo_hours(cfg.pair[role], "grpo_n8") for role in roles(cfg.pair))
    hours = CO_TRAIN_GPU_HOURS[family] * pair_cost / sum(_grpo_hours(m, "grpo_n8") for m in PAPER_PAIR) * scale
    return Projection(hours, hours / (pool_gpus * len(roles(cfg.pair))), "App. D")


def estimate_gpu_hours(cfg: DictConfig, trained: Sequence[str] = ()) -> float:
    """``estimate_cost``'s GPU-hours."""
    return estimate_cost(cfg, trained).gpu_hours


@dataclass(frozen=True)
class TimeLimit:
    """The time limit a job asks Slurm for under ``cluster=slurm`` and how many times a job that reaches it is
    requeued (``hydra.launcher.timeout_min`` from ``cluster.resources``, ``max_num_timeout``)."""

    minutes: int
    requeues_allowed: int

    @property
    def slurm(self) -> str:
        """Slurm's ``--time`` form, days-hours:minutes:seconds."""
        days, minutes = divmod(self.minutes, 24 * 60)
        return f"{days}-{minutes // 60:02d}:{minutes % 60:02d}:00"

    def requeues(self, wall_hours: float) -> int:
        """How many times a job of ``wall_hours`` reaches the limit and is requeued to go on (each start also
        re-starts the job and reloads its checkpoint: not counted here)."""
        return max(math.ceil(wall_hours * 60 / self.minutes) - 1, 0)


def time_limit(cfg: DictConfig) -> TimeLimit:
    """``cfg``'s Slurm time limit: its cluster's ``resources`` entry for its pair (else ``default``), or, for a job
    composed with another cluster, what ``cluster=slurm`` would ask (conf/cluster/slurm.yaml); the requeues the
    launcher allows as that file sets them (a ``hydra.launcher.max_num_timeout`` override is not seen here)."""
    slurm = OmegaConf.load(CONF_DIR / "cluster" / "slurm.yaml")
    resources = cfg.cluster.get("resources") or slurm.cluster.resources
    entry = resources.get(str(cfg.pair.name)) or resources.default
    return TimeLimit(int(entry.timeout_min), int(slurm.hydra.launcher.max_num_timeout))
