"""What a test needs that a plain ``pip install -e .`` lacks: such a test skips, saying why, instead of failing."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

WITHOUT_VERL = ("compares with verl's own implementation, and verl is not installed "
                "(pip install -e '.[dev]' installs it; it runs on CPU)")
#: A module of the verl backend's tests starts with ``pytest.importorskip("verl", reason=VERL_BACKEND)``, above its
#: imports (which import verl).
VERL_BACKEND = "tests the verl backend, and verl is not installed (pip install -e '.[dev]' installs it; it runs on CPU)"
#: A test that starts a Ray calls ``pytest.importorskip("ray", reason=RAY)`` first.
RAY = "starts a Ray, and Ray is not installed (pip install -e '.[dev]' installs it with verl)"


def from_verl(module: str) -> ModuleType:
    """verl's ``module``; the calling test skips where verl itself is absent. A verl that is installed but
    fails to import fails the test: that is a broken environment, not a missing extra."""
    pytest.importorskip("verl", reason=WITHOUT_VERL)
    return importlib.import_module(module)
