"""The paper's evaluation protocol (App. B "Evaluation"), backend-agnostic.

- pass@1 of a benchmark = correctness averaged over the k responses of each problem, then over
  problems; the aggregate ``avg`` is the unweighted mean over benchmarks.
- Validation every K steps on that aggregate; the best-scoring checkpoint is the one reported
  (``BestCheckpoint``: strictly better replaces, so ties keep the earlier step).
- Final evaluation of the best checkpoint: R independent runs of k samples each (temperature 0.6,
  top-p 0.95), one ``test/*`` value per run.

A backend supplies ``generate(prompts, k, temperature, top_p, seed) -> [[response] * k] per prompt``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from graft_exp.reward import rewards as verify_rewards

AVG = "avg"


class Task(Protocol):
    prompt: str
    answer: str


Generate = Callable[[list[str], int, float, float, int], list[list[str]]]


def pass_at_1(correct: Sequence[Sequence[float]]) -> float:
    """Mean over problems of the mean correctness of each problem's responses."""
    if not correct:
        raise ValueError("pass@1 of an empty benchmark is undefined")
    return sum(sum(row) / len(row) for row in correct) / len(correct)


def evaluate(generate: Generate, benchmarks: Mapping[str, Sequence[Task]], samples: int, temperature: float,
             top_p: float, seed: int) -> dict[str, float]:
    """pass@1 of every benchmark with ``samples`` responses per problem, plus their average ``avg``.

    All benchmarks are generated in one call (the backend batches them); the result is deterministic
    in ``seed``.
    """
    names = list(benchmarks)
    problems = [p for name in names for p in benchmarks[name]]
    responses = generate([p.prompt for p in problems], samples, temperature, top_p, seed)
    # One reward call for everything, so that verification uses every core of the reward pool.
    flat = verify_rewards([r for row in responses for r in row], [p.answer for p, row in zip(problems, responses)
                                                                  for _ in row])
    correct, start = [], 0
    for row in responses:
        correct.append(flat[start:start + len(row)])
        start += len(row)
    scores, start = {}, 0
    for name in names:
        scores[name] = pass_at_1(correct[start:start + len(benchmarks[name])])
        start += len(benchmarks[name])
    scores[AVG] = sum(scores[name] for name in names) / len(names)
    return scores


def final_evaluation(generate: Generate, benchmarks: Mapping[str, Sequence[Task]], runs: int, samples: int,
                     temperature: float, top_p: float, seed: int) -> list[dict[str, float]]:
    """R independent evaluation runs of the selected checkpoint (run r seeded with ``seed + r``)."""
    return [evaluate(generate, benchmarks, samples, temperature, top_p, seed + r) for r in range(runs)]


def is_validation_step(step: int, every: int, last_step: int) -> bool:
    """Validate before training (step 0), every ``every`` steps, and at the last step."""
    return step == 0 or step == last_step or (every > 0 and step % every == 0)


@dataclass
class BestCheckpoint:
    """The highest validation average so far and its step (ties keep the earlier step)."""

    step: int = -1
    score: float = float("-inf")

    def update(self, step: int, score: float) -> bool:
        """Record a validation result; True if it is the new best."""
        if score > self.score:
            self.step, self.score = step, score
            return True
        return False
