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


def require(feature: str) -> None:
    """Raise ``MissingExtra`` naming the install command when a module ``feature`` needs is absent."""
    missing = missing_modules(feature)
    if missing:
        extra = FEATURES[feature][0]
        raise MissingExtra(f"{feature} needs {', '.join(missing)}, not installed here: "
                           f"pip install 'graft_exp[{extra}]' (from a clone: pip install -e '.[{extra}]')")
