"""Sweep files planned into jobs: grids expanded, jobs composed and keyed, shared single-model
baselines dropped, ``after`` resolved, GPU-hours estimated. Pure: reads no store and starts nothing
(the format is in ``python -m graft_exp.sweep --help``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from graft_exp.config import BUDGET_KEYS, BUDGET_SETTINGS
from graft_exp.launching.jobs import Composer, Job, estimate_cost


class SweepError(ValueError):
    """A sweep file or command line that cannot be planned; the message says what to fix."""


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _override(key: str, value) -> str:
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={value}"


#: Grid keys that are not Hydra overrides: ``after`` (jobs needed first), ``compute_of`` (equal compute) and
#: ``compute_unit`` (the charge that budget is in: gpu_hours, App. D's measured one, the default; or flops, counted).
PLAN_KEYS = ("after", "compute_of", "compute_unit")


def expand(grid: dict) -> list[tuple[str, ...]]:
    """The jobs of one grid (without ``after`` / ``compute_of``), in the order its keys and values are written."""
    keys = [k for k in grid if k not in PLAN_KEYS]
    values = [_as_list(grid[k]) for k in keys]
    return [tuple(_override(k, v) for k, v in zip(keys, combo)) for combo in itertools.product(*values)]


def replace(overrides: tuple[str, ...], changes: dict) -> tuple[str, ...]:
    """``overrides`` with the keys of ``changes`` set to its values (added when absent)."""
    keys = [o.split("=", 1)[0] for o in overrides]
    out = [o for o, k in zip(overrides, keys) if k not in changes]
    return tuple(out + [_override(k, v) for k, v in changes.items()])


@dataclass(eq=False)
class SweepJob:
    """A job of a sweep with its place in the plan."""

    job: Job
    index: int
    roles: tuple[str, ...]                 # models this job trains (a shared GRPO baseline: its first job)
    needs: list[SweepJob] = field(default_factory=list)       # `after`: their models must be finished
    follows: list[SweepJob] = field(default_factory=list)     # shared baseline: run after these started it
    gpu_hours: float = 0.0
    wall_hours: float = 0.0      # App. D's wall time of the job on its GPUs (0: a CPU job, unknown)

    @property
    def key(self) -> str:
        return self.job.key


@dataclass
class Sweep:
    path: Path
    study: str
    jobs: list[SweepJob]
    shared: list[tuple[Job, list[SweepJob]]]   # dropped single-model jobs and the jobs training their models
    uri: str


_FORMAT = "see `python -m graft_exp.sweep --help` or sweeps/main.yaml"


def _scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _check_grid(path: Path, i: int, grid) -> None:
    """One entry of ``runs``: Hydra override keys to a value or a list of values, and an optional
    ``after`` (a mapping of such keys, or a list of them)."""
    where = f"{path}: runs[{i}]"
    if not isinstance(grid, dict) or not grid:
        raise SweepError(f"{where} is {grid!r}, not a grid of overrides ({{key: value or [values]}}); {_FORMAT}")
    for key, value in grid.items():
        if key == "compute_of":
            if not (isinstance(value, dict) and value and all(_scalar(v) for v in value.values())):
                raise SweepError(f"{where}.compute_of={value!r} must map keys to the reference job's values, "
                                 "e.g. compute_of: {method: grpo_n8}")
            budgets = [key for key in BUDGET_KEYS if key in grid]
            if budgets:
                raise SweepError(f"{where} sets both compute_of and {budgets[0]}; keep one of them")
        elif key == "compute_unit":
            if value not in BUDGET_SETTINGS:
                raise SweepError(f"{where}.compute_unit={value!r}: no job records cost/{value}; a budget is in "
                                 f"{' or '.join(BUDGET_SETTINGS)} (cost/gpu_hours measured, cost/flops counted)")
            if not grid.get("compute_of"):
                raise SweepError(f"{where}.compute_unit={value} without compute_of: name the reference job whose "
                                 "cost is the budget, e.g. compute_of: {method: grpo_n8}")
        elif key == "after":
            for change in _as_list(value):
                if not isinstance(change, dict) or not all(_scalar(v) for v in change.values()):
                    raise SweepError(f"{where}.after is {value!r}: name the needed jobs' overrides as a mapping "
                                     f"(after: {{method: grpo_n8}}) or a list of them; {_FORMAT}")
        elif not isinstance(key, str) or not all(_scalar(v) for v in _as_list(value)) or value == []:
            raise SweepError(f"{where}.{key} is {value!r}: a grid key takes a value or a non-empty list of "
                             f"values; {_FORMAT}")


def load(path: Path) -> dict:
    """The sweep file at ``path``, checked: readable YAML, a mapping of ``study`` (a name) and ``runs``
    (a non-empty list of grids). Every problem is a ``SweepError`` naming the file and the fix. Other
    top-level keys are left to the file (sweeps/tiny.yaml keeps a YAML anchor there)."""
    try:
        spec = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SweepError(f"cannot read the sweep file {path} ({err.strerror}); give the path of a sweep file, "
                         "e.g. sweeps/main.yaml") from None
    except UnicodeDecodeError:
        raise SweepError(f"{path} is not a text file; give the path of a sweep file, e.g. sweeps/main.yaml") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise SweepError(f"{path} is not valid YAML ({problem}{at}); fix the file ({_FORMAT})") from None
    if not isinstance(spec, dict) or "study" not in spec or "runs" not in spec:
        raise SweepError(f"{path}: a sweep file needs `study:` and `runs:` (a list of override grids); {_FORMAT}")
    if not _scalar(spec["study"]) or not str(spec["study"] or "").strip():
        raise SweepError(f"{path}: study is {spec['study']!r}; name the MLflow study (experiment graft/<study>)")
    if not isinstance(spec["runs"], list) or not spec["runs"]:
        raise SweepError(f"{path}: runs is {spec['runs']!r}, not a non-empty list of override grids; {_FORMAT}")
    for i, grid in enumerate(spec["runs"]):
        _check_grid(path, i, grid)
    return spec


def selection(path: Path, spec: dict, only: list[str]) -> dict[str, set[str]]:
    """``--only KEY=V1,V2 ...``: the values kept of each key the sweep file sweeps (a pair, a method, seeds)."""
    swept = [k for grid in spec["runs"] for k in grid if k not in PLAN_KEYS]
    chosen: dict[str, set[str]] = {}
    for item in only:
        key, _, values = item.partition("=")
        if key not in swept or not values:
            raise SweepError(f"--only {item}: give KEY=VALUE[,VALUE...] with a key {path} sweeps "
                             f"({', '.join(dict.fromkeys(swept))})")
        chosen.setdefault(key, set()).update(values.split(","))
    return chosen


def plan(path: Path, overrides: list[str], composer: Composer | None = None, spec: dict | None = None,
         only: list[str] = ()) -> Sweep:
    """Compose every job of the sweep file ``path`` (or of ``spec``, a sweep file's content: a round of
    ``--until-decided``) with the command-line ``overrides``; with ``only`` (``--only pair=pair1``), the jobs whose
    swept values are among those given, and the jobs they need (``after``, ``compute_of``)."""
    spec = spec or load(path)
    study = str(spec["study"])
    chosen = selection(path, spec, list(only))
    swept = {"study", *(k for grid in spec["runs"] for k in grid if k not in PLAN_KEYS)}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in swept:
            raise SweepError(f"{path} sets {key}; override other keys only (or --only {key}=..., or copy the "
                             "sweep file)")
    owned = composer is None
    composer = composer or Composer([*overrides, f"study={study}"])
    try:
        by_key: dict[str, Job] = {}
        order: list[str] = []
        after: dict[str, list[str]] = {}

        def add(ovs: tuple[str, ...]) -> str:
            job = Job(ovs, composer.compose(list(ovs)))
            if job.key not in by_key:
                by_key[job.key] = job
                order.append(job.key)
            return job.key

        def selected(ovs: tuple[str, ...]) -> bool:
            values = dict(o.split("=", 1) for o in ovs)
            return all(values.get(key) in kept for key, kept in chosen.items())

        for grid in spec["runs"]:
            for ovs in filter(selected, expand(grid)):
                deps = [add(replace(ovs, change)) for change in _as_list(grid.get("after") or [])]
                if grid.get("compute_of"):
                    # Equal compute: the budget is the reference job's charged cost, known once it has
                    # finished, so the job names the reference's key (its identity) and runs after it.
                    reference = add(replace(ovs, grid["compute_of"]))
                    deps.append(reference)
                    ovs = (*ovs, f"train.{BUDGET_SETTINGS[grid.get('compute_unit', 'gpu_hours')][1]}={reference}")
                key = add(ovs)
                after.setdefault(key, []).extend(d for d in deps if d != key)
        if chosen and not order:
            given = " ".join(f"--only {key}={','.join(sorted(kept))}" for key, kept in chosen.items())
            raise SweepError(f"{given}: no job of {path} has these values")
        uri = composer.base.tracking.uri
    finally:
        if owned:
            composer.close()
    return _order(path, study, [by_key[k] for k in order], after, uri)


def _order(path: Path, study: str, jobs: list[Job], after: dict[str, list[str]], uri: str) -> Sweep:
    """Drop single-model jobs whose models earlier jobs train; order shared baselines; cost."""
    owner: dict[str, SweepJob] = {}
    planned: dict[str, SweepJob] = {}
    shared = []
    for job in jobs:
        roles, follows = [], []
        for role, model_key in job.model_keys.items():
            if job.single_model and model_key in owner:
                follows.append(owner[model_key])
            else:
                roles.append(role)
        if not roles:
            shared.append((job, list(dict.fromkeys(follows))))
            continue
        sj = SweepJob(job, len(planned), tuple(roles), follows=list(dict.fromkeys(follows)))
        cost = estimate_cost(job.cfg, sj.roles)
        sj.gpu_hours, sj.wall_hours = cost.gpu_hours, cost.wall_hours or 0.0
        for role in roles:
            owner.setdefault(job.model_keys[role], sj)
        planned[job.key] = sj
    dropped = {job.key: keepers for job, keepers in shared}
    for sj in planned.values():
        # A needed job's models may be trained by the jobs it follows (shared baselines).
        needs = [[planned[k], *planned[k].follows] if k in planned else dropped[k]
                 for k in after.get(sj.key, [])]
        sj.needs = list(dict.fromkeys(n for group in needs for n in group))
    return Sweep(path, study, list(planned.values()), shared, uri)

