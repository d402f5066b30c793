"""An in-memory backend (``graft_exp.contract.Backend``) for testing the driver's routing in milliseconds.

No model: each role has a "skill" per problem and a scalar state. ``sample`` answers a problem correctly
with a probability set by the role's skill, drawn from the seed the driver passes (so a resumed job draws
what an uninterrupted one does); ``update`` moves the state by the batch's weighted advantages and records
every call (rows, minibatches, capability ratio; the method's loss spec) for the tests to inspect; ``save``/``load`` write
the state as JSON. Rewards are still verified for real by ``graft_exp.reward`` (the responses are
``\\boxed{...}`` strings).
"""

from __future__ import annotations

import copy
import json
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig

from graft_exp.contract import Generation, Sampled
from graft_exp.methods import Method
from graft_exp.methods.objective import COUNT_METRICS, LossSpec
from graft_exp.methods.receiver import PEER, ReceiverBatch
from graft_exp.rollouts import Rollouts


@dataclass(frozen=True)
class Problem:
    uid: str
    prompt: str
    answer: str


PROBLEMS = [Problem(f"p{i}", f"{i} + {i} =", str(2 * i)) for i in range(32)]
#: The chance of a correct response per role: A is good on even problems, B on odd ones (complementary).
SKILL = {"A": lambda i: 0.8 if i % 2 == 0 else 0.1, "B": lambda i: 0.1 if i % 2 == 0 else 0.8,
         "C": lambda i: 0.6 if i % 3 == 0 else 0.05}


@dataclass
class Update:
    role: str
    spec: LossSpec
    own: Sampled
    batch: ReceiverBatch
    minibatches: list[list[int]]
    source: Rollouts | None
    capability_ratio: float


@dataclass
class MemoryBackend:
    cfg: object
    method: Method
    roles: list[str]
    run_dir: Path | None = None
    concurrent: bool = False
    state: dict[str, float] = field(default_factory=dict)
    best: dict[str, float] = field(default_factory=dict)
    updates: list[Update] = field(default_factory=list)
    gathered: int = 0
    fail_update_at: int | None = None      # raise in update at this call (failure-state tests) ...
    failure: Exception | None = None         # ... this error (a RuntimeError by default)
    peak: float | None = None                # a device's dense peak FLOP/s (perf/mfu); None: a CPU
    # every receiver's scorer waits in its first call for the others' (a pool's scoring overlapping the other's):
    # sequential scoring breaks the barrier after this many seconds, failing the step
    meet_in_scoring_s: float | None = None

    def __post_init__(self):
        self.state = {role: 0.0 for role in self.roles}
        self.meeting = threading.Barrier(len(self.roles), timeout=self.meet_in_scoring_s)
        self.closed = False     # the driver's close() at the end of the job

    def problems(self) -> list[Problem]:
        return PROBLEMS

    def benchmarks(self) -> dict[str, list[Problem]]:
        return {"add": PROBLEMS[:4]}

    def devices(self, role: str) -> int:
        return 1

    def peak_flops(self, role: str) -> float | None:
        return self.peak   # None (a CPU) unless a test gives the backend a GPU's peak

    def model_config(self, role: str):
        """A small Llama shape for the counted charge (a character per token, as ``sample`` counts them)."""
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128)

    def _respond(self, role: str, problem: Problem, rng: random.Random) -> str:
        index = int(problem.uid[1:])
        correct = rng.random() < min(1.0, SKILL[role](index) + 0.01 * self.state[role])
        return f"so \\boxed{{{problem.answer if correct else int(problem.answer) + 1}}}"

    def sample(self, role: str, problems: list, n: int, seed: int, step: int) -> Generation:
        rng = random.Random(seed)
        responses = [[self._respond(role, p, rng) for _ in range(n)] for p in problems]
        tokens = torch.tensor([[len(r) for r in group] for group in responses])
        ids = [[list(range(len(r))) for r in group] for group in responses]
        return Generation(responses=responses, logp_sum=-0.1 * tokens.double(), num_tokens=tokens,
                          finished=torch.ones_like(tokens, dtype=torch.bool), token_ids=ids, data=ids,
                          prompt_tokens=[len(p.prompt) for p in problems])

    def gather(self, role: str, parts: list) -> list:
        self.gathered += 1
        return [data[q] for data, groups in parts for q in groups]

    def scorer(self, role: str, own: Sampled):
        """Receiver-old log-probs: the peer's own mean log-prob shifted by the receiver's taste for the
        response (longer responses are less compatible), so some responses pass the gate and some do not."""
        def score(prompts: list[int], source: Rollouts):
            if self.meet_in_scoring_s is not None:
                self.meeting.wait()
            tokens = source.num_tokens[prompts]
            shift = torch.where(tokens % 2 == 0, 0.0, -0.5)
            return (-0.1 + shift) * tokens.double(), tokens
        return score

    def copy_lengths(self, role: str, source: Rollouts, copies: list[tuple[int, int]]) -> list[int]:
        """A character per token, as ``sample`` counts them."""
        return [len(source.responses[q][i]) for q, i in copies]

    def update(self, role: str, batch: ReceiverBatch, minibatches: list[list[int]], own: Sampled,
               source: Rollouts | None, capability_ratio: float) -> dict[str, float]:
        spec = self.method.loss
        if self.fail_update_at is not None and len(self.updates) == self.fail_update_at:
            raise self.failure or RuntimeError("update failed (test)")
        self.updates.append(Update(role, spec, own, batch, minibatches, source, capability_ratio))
        rows = [r for groups in minibatches for r in batch.rows_in(groups)]
        self.state[role] += sum(r.advantage * r.weight for r in rows)
        kind = "seqs" if spec.sequence_level else "tokens"
        counts = dict.fromkeys(COUNT_METRICS, 0.0)
        counts[f"{kind}_self"] = float(sum(r.origin != PEER for r in rows))
        counts[f"{kind}_peer"] = float(sum(r.origin == PEER for r in rows))
        return {"loss": -self.state[role], **counts}

    def prompting(self, role: str) -> dict[str, str]:
        return {"stop_ids": "0", "rendered_prompt": PROBLEMS[0].prompt}

    def generate(self, role: str, step: int):
        def generate(prompts: list[str], k: int, temperature: float, top_p: float, seed: int) -> list[list[str]]:
            rng = random.Random(seed)
            by_prompt = {p.prompt: p for p in PROBLEMS}
            return [[self._respond(role, by_prompt[q], rng) for _ in range(k)] for q in prompts]
        return generate

    def keep_best(self, role: str, step: int) -> None:
        self.best[role] = self.state[role]

    def restore_best(self, role: str) -> None:
        if role in self.best:
            self.state[role] = self.best[role]

    def save(self, directory: Path, step: int) -> None:
        (directory / "memory.json").write_text(json.dumps({"state": self.state, "best": self.best}))

    def load(self, directory: Path) -> None:
        saved = json.loads((directory / "memory.json").read_text())
        self.state, self.best = saved["state"], saved["best"]

    def close(self) -> None:
        self.closed = True


def factory(created: list[MemoryBackend], **options):
    """A ``BackendFactory`` that keeps every backend it creates in ``created``."""
    def create(cfg, method, roles, run_dir):
        backend = MemoryBackend(cfg, method, list(roles), run_dir, **copy.deepcopy(options))
        created.append(backend)
        return backend
    return create
