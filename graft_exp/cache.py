"""Where graft_exp keeps what it builds once per machine and reuses: $GRAFT_CACHE, else ~/.cache/graft_exp."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """The cache folder for one kind of artefact (``tiny`` models, ``mlflow`` store templates)."""
    return Path(os.environ.get("GRAFT_CACHE", Path.home() / ".cache" / "graft_exp")) / kind
