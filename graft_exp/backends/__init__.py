"""Training backends, the driver's adapters (``graft_exp.contract.Backend``): ``local`` trains the tiny
models in this process, ``verl`` the paper's on GPU nodes. ``python -m graft_exp`` runs
``driver.fit(cfg, job, backend_factory(cfg.backend.name))``."""

from __future__ import annotations

import importlib

from graft_exp.contract import BackendFactory

#: backend name -> (module, factory attribute); imported lazily: verl pulls Ray/vLLM, which a local run never needs.
BACKENDS = {"local": ("graft_exp.backends.local", "LocalBackend"), "verl": ("graft_exp.backends.verl.backend", "create")}


def backend_factory(name: str) -> BackendFactory:
    """The factory of backend ``name`` (``cfg.backend.name``)."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {', '.join(BACKENDS)}")
    module, attribute = BACKENDS[name]
    return getattr(importlib.import_module(module), attribute)
