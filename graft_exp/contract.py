"""The backend contract: what the driver (``graft_exp.driver``) needs from a backend, and what it hands back.

A backend does only what depends on the hardware: generate, score, update with the method's loss
(``graft_exp.methods.objective``), evaluate, save and load. It is built for one job with the job's resolved method
(``methods.Method``: its loss spec is ``method.loss``).

The order of one training step, for every model (the driver keeps it; a backend may rely on it):
``sample`` (or several, then ``gather``), ``scorer``, every call of that scorer (the exchange's), then
``update``. ``update`` may read what this step's scorer computed (the local backend reuses the per-token
log-probs of the re-tokenized peer responses instead of recomputing them); a scorer from an earlier step
is never called again. ``backends/local.py`` and ``backends/verl/``
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
from graft_exp.methods import Method
from graft_exp.methods.receiver import ReceiverBatch, Scorer
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
    prompt_tokens: list[int]                  # [P] each prompt's length in the model's tokens, as prefilled
    # The largest mean per-token |rollout engine - trainer| log-prob gap of a response (verl: vLLM's log-probs
    # against the FSDP workers' of the same tokens); None where one engine samples and scores (local).
    logprob_gap: float | None = None


@dataclass
class Sampled:
    """One model's rollouts of a step: as the exchange sees them, the problems, and the backend's own
    token-level data (ids, behaviour log-probs; opaque here) that its update and log need."""

    rollouts: Rollouts
    problems: list
    data: object
    token_ids: list[list[list[int]]]          # [P][n] generated ids, for the trajectory log
    prompt_tokens: list[int]                  # [P] each prompt's length in the model's tokens
    logprob_gap: float | None = None          # Generation.logprob_gap (the largest of a refilled batch's draws)


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

    def peak_flops(self, role: str) -> float | None:
        """The dense bf16 peak FLOP/s of one device of model ``role``, from which the driver counts its ``perf/mfu``
        (``costs.dense_peak``); None on a CPU, on a GPU of unknown peak, or where ``update`` reports its trainer's
        own utilisation (``step_record.UPDATE_MFU``: verl)."""

    def model_config(self, role: str):
        """Model ``role``'s transformers config (its architecture and sizes: what ``costs.ModelFlops`` counts)."""

    def prompting(self, role: str) -> dict[str, str]:
        """How model ``role`` is prompted and stopped, recorded on its run when the job starts: ``stop_ids``
        (comma-separated, the order the model stops on them) and ``rendered_prompt`` (the first training problem
        as the model receives it: chat template, pinned date, suffix)."""

    def sample(self, role: str, problems: list, n: int, seed: int, step: int) -> Generation:
        """n responses per problem at the training temperature (``step``: the weights' version)."""

    def gather(self, role: str, parts: list[tuple[object, list[int]]]) -> object:
        """The backend data of the chosen groups of several draws, in order (DAPO refills)."""

    def scorer(self, role: str, own: Sampled) -> Scorer:
        """Receiver-old log-probs of re-tokenized peer responses (eq. 8) for this step; what it computes may
        serve this step's ``update`` (the step order above)."""

    def copy_lengths(self, role: str, source: Rollouts, copies: list[tuple[int, int]]) -> list[int]:
        """The length of each source response ``copies`` = [(prompt, sample)] in receiver ``role``'s tokens, as the
        scorer and the update re-tokenize it, its stop token included where the source finished, before the cut
        at ``train.max_response_length``."""

    def update(self, role: str, batch: ReceiverBatch, minibatches: list[list[int]], own: Sampled,
               source: Rollouts | None, capability_ratio: float) -> dict[str, float]:
        """One optimizer step per minibatch, in order, with the method's loss (``method.loss``): the mean
        minibatch ``loss`` and the summed counts of ``graft_exp.methods.objective`` (``tokens_self``,
        ``clipped_tokens_peer``, ``seqs_*``, ...). Called after this step's ``scorer`` and its calls."""

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


#: ``factory(cfg, method, roles, run_dir) -> Backend``: the models of ``roles`` loaded for the job's resolved
#: ``method``; ``run_dir`` is the job's directory (``driver.run_directory``), where a backend may keep files
#: beside the driver's checkpoints.
BackendFactory = Callable[[DictConfig, Method, list[str], Path], Backend]
