"""Optional features and the pip extra (pyproject.toml) that installs each one's dependencies.

An entry point checks its feature before doing anything (``require``): a missing dependency stops it with
one line naming the ``pip install`` that fixes it, instead of an import traceback halfway through.
"""

from __future__ import annotations

import importlib.util

#: feature -> (pip extra, the modules it imports)
FEATURES = {
    "python -m graft_exp.prepare": ("prepare", ("datasets", "huggingface_hub")),
    "backend=verl": ("verl", ("verl", "ray", "vllm")),
    "python -m graft_exp.server": ("server", ("psycopg2",)),
}


#: module -> (the oldest release that has what this project imports of it, what that is). A cluster's preinstalled
#: older release would otherwise fail only when the job starts Ray.
MIN_VERSIONS = {
    "ray": ("2.52.0", ("token authentication (ray._raylet.AuthenticationTokenLoader), which "
                       "backends/verl/ray_slurm.py uses to lock each job's Ray")),
}


class MissingExtra(RuntimeError):
    """An optional feature whose dependencies are not installed; the message says what to install."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (verl or vLLM take seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:   # an import hook that refuses it
        return False


def missing_modules(feature: str) -> list[str]:
    _, modules = FEATURES[feature]
    return [m for m in modules if not installed(m)]


def too_old(module: str) -> str | None:
    """Why the installed release of ``module`` is older than ``MIN_VERSIONS`` allows, or None."""
    if module not in MIN_VERSIONS:
        return None
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    oldest, what = MIN_VERSIONS[module]
    try:
        found = version(module)
    except PackageNotFoundError:
        return None
    return f"{module} {found} is older than {oldest}, the first with {what}" if Version(found) < Version(oldest) else None


def require(feature: str) -> None:
    """Raise ``MissingExtra`` naming the install command when a module ``feature`` needs is absent or too old."""
    extra = FEATURES[feature][0]
    install = f"pip install 'graft_exp[{extra}]' (from a clone: pip install -e '.[{extra}]')"
    missing = missing_modules(feature)
    if missing:
        raise MissingExtra(f"{feature} needs {', '.join(missing)}, not installed here: {install}")
    for module in FEATURES[feature][1]:
        old = too_old(module)
        if old:
            raise MissingExtra(f"{feature}: {old}: {install}")
