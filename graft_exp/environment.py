"""The software and hardware a job runs on, recorded as tags of its job run (``graft.env.*``).

Reproductions of RLVR results often differ by library version alone, so every job run carries the
versions of the libraries that compute its numbers, and the GPU, CUDA and driver where there is a GPU;
``python -m analysis tables`` names the difference when one table mixes environments.
"""

from __future__ import annotations

import shutil
import subprocess
from importlib import metadata

from graft_exp.schema import ENV_CUDA, ENV_DRIVER, ENV_GPU, ENV_LIBRARY_TAGS

NOT_INSTALLED = "none"


def library_versions() -> dict[str, str]:
    versions = {}
    for dist, tag in ENV_LIBRARY_TAGS.items():
        try:
            versions[tag] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[tag] = NOT_INSTALLED
    return versions


def gpu_tags() -> dict[str, str]:
    """GPU model and driver (``nvidia-smi``, first GPU; the job's GPUs are one model) and the CUDA
    version torch was built with; empty on a machine without an NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    first = out.strip().splitlines()[:1]
    if not first:
        return {}
    name, _, driver = first[0].partition(",")
    import torch  # only where there is a GPU: its CUDA build

    return {ENV_GPU: name.strip(), ENV_DRIVER: driver.strip(), ENV_CUDA: torch.version.cuda or NOT_INSTALLED}


def tags() -> dict[str, str]:
    """``graft.env.*`` (graft_exp.schema.ENV_TAGS) of this process."""
    return {**library_versions(), **gpu_tags()}
