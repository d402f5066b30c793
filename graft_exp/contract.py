"""The backend contract: what the driver (``graft_exp.driver``) needs from a backend, and what it hands back.

A backend does only what depends on the hardware: generate, score, update with the method's loss
(``graft_exp.objective``), evaluate, save and load. ``backends/local.py`` and ``backends/verl/``
implement ``Backend``; ``graft_exp.backends.backend_factory`` picks one by ``cfg.backend.name``. This
module imports no backend and no driver, so both sides depend on it and not on each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import DictConfig

from graft_exp.evaluation import Generate
from graft_exp.exchange import ReceiverBatch, Scorer
from graft_exp.objective import LossSpec
from graft_exp.rollouts import Rollouts


@dataclass
class Generation:
    """What a backend's ``sample`` returns: n responses per prompt, prompt-major."""

    responses: list[list[str]]                # [P][n] decoded strings
    logp_sum: torch.Tensor                    # [P, n] float64 generation log-prob sums
    num_tokens: torch.Tensor                  # [P, n] generated tokens
    finished: torch.Tensor                    # [P, n] bool: ended with a stop token
    token_ids: list[list[list[int]]]          # [P][n] generated ids, for the trajectory log
    data: object                              # the backend's token-level data for its update


@dataclass
class Sampled:
    """One model's rollouts of a step: as the exchange sees them, the problems, and the backend's own
    token-level data (ids, behaviour log-probs; opaque here) that its update and log need."""

    rollouts: Rollouts
    problems: list
    data: object
    token_ids: list[list[list[int]]]          # [P][n] generated ids, for the trajectory log


class Backend(Protocol):
    """What the driver needs from a backend; one instance per job, holding the models of ``roles``."""

    roles: list[str]
    concurrent: bool        # the models sit on disjoint devices (GPU pools, CPU cores): their phases may run at once

    def problems(self) -> list:
        """The training problems (``.uid``, ``.prompt``, ``.answer``), in a fixed order."""

    def benchmarks(self) -> dict[str, list]:
        """Validation/test problems per benchmark key (``.prompt``, ``.answer``)."""

    def devices(self, role: str) -> int:
        """The devices (GPUs; a CPU counts as one) model ``role`` holds while it works."""

    def sample(self, role: str, problems: list, n: int, seed: int, step: int) -> Generation:
        """n responses per problem at the training temperature (``step``: the weights' version)."""

    def gather(self, role: str, parts: list[tuple[object, list[int]]]) -> object:
        """The backend data of the chosen groups of several draws, in order (DAPO refills)."""

    def scorer(self, role: str, own: Sampled) -> Scorer:
        """Receiver-old log-probs of re-tokenized peer responses (eq. 8), cached for ``update``."""

    def update(self, role: str, spec: LossSpec, batch: ReceiverBatch, minibatches: list[list[int]], own: Sampled,
               source: Rollouts | None, capability_ratio: float) -> dict[str, float]:
        """One optimizer step per minibatch, in order, with ``spec``'s loss: the mean minibatch ``loss`` and
        the summed counts of ``graft_exp.objective`` (``tokens_self``, ``clipped_tokens_peer``, ``seqs_*``, ...)."""

    def generate(self, role: str, step: int) -> Generate:
        """``graft_exp.evaluation``'s generate function for model ``role`` at its current weights."""

    def keep_best(self, role: str, step: int) -> None:
        """Remember the current weights of ``role`` as its best checkpoint."""

    def restore_best(self, role: str) -> None:
        """Load the best checkpoint of ``role`` for the final evaluation."""

    def save(self, directory: Path, step: int) -> None:
        """Every model's weights and optimiser (and best weights, if kept in memory) into ``directory``."""

    def load(self, directory: Path) -> None:
        """The state ``save`` wrote."""

    def close(self) -> None:
        """Release the job's devices and processes (the driver calls it when the job ends, however it ends)."""


#: ``factory(cfg, roles, run_dir) -> Backend``: the models of ``roles`` loaded; ``run_dir`` is the job's
#: directory (``driver.run_directory``), where a backend may keep files beside the driver's checkpoints.
BackendFactory = Callable[[DictConfig, list[str], Path], Backend]
