"""The tiny pair's verifiable math task, generated deterministically from a seed (no download).

Four skills with integer answers: ``add`` (two 2-digit numbers), ``sub`` (2-digit minus a smaller
2-digit number), ``mul`` (1-digit times 2-digit) and ``mixed`` (a two-step expression a*b+c or a*b-c
of single digits).
Every problem of a skill is enumerated, shuffled with the data seed and cut into disjoint
evaluation and training parts, so no benchmark problem is ever trained on. Prompts carry the
paper's suffix; the supervised warm-start targets show the steps and end in ``\\boxed{answer}``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from graft_exp.prompts import SUFFIX, format_prompt

__all__ = ["DATA_SEED", "SKILLS", "SUFFIX", "Problem", "benchmark", "every_problem", "format_prompt", "train_split",
           "warmstart_stream"]

SKILLS = ("add", "sub", "mul", "mixed")
#: Default seed of the task data: fixed, so that every run (any training seed) sees the same splits.
DATA_SEED = 20240


@dataclass(frozen=True)
class Problem:
    """One task instance. ``uid`` is stable across runs and identifies the prompt in every record."""

    uid: str
    skill: str
    question: str
    answer: str
    solution: str     # a correct response (the warm-start target), ending in \boxed{answer}

    @property
    def prompt(self) -> str:
        return format_prompt(self.question)


def _boxed(value: int) -> str:
    return f"\\boxed{{{value}}}"


def _add_steps(a: int, b: int) -> str:
    """Column addition, units first: ``47+38`` -> ``7+8=15, 4+3+1=8, so 85``."""
    units = a % 10 + b % 10
    carry = "+1" if units >= 10 else ""
    tens = a // 10 + b // 10 + units // 10
    return f"{a % 10}+{b % 10}={units}, {a // 10}+{b // 10}{carry}={tens}, so {a + b}"


def _sub_steps(a: int, b: int) -> str:
    """Column subtraction with borrowing: ``83-47`` -> ``13-7=6, 8-4-1=3, so 36``."""
    borrow = a % 10 < b % 10
    units = a % 10 + 10 * borrow - b % 10
    tens = a // 10 - b // 10 - borrow
    return f"{a % 10 + 10 * borrow}-{b % 10}={units}, {a // 10}-{b // 10}{'-1' if borrow else ''}={tens}, so {a - b}"


def _mul_steps(a: int, b: int) -> str:
    """One digit times two digits: ``6*54`` -> ``6*4=24, 6*5+2=32, so 324``."""
    units = a * (b % 10)
    carry = f"+{units // 10}" if units >= 10 else ""
    tens = a * (b // 10) + units // 10
    return f"{a}*{b % 10}={units}, {a}*{b // 10}{carry}={tens}, so {a * b}"


def _enumerate(skill: str) -> list[tuple[str, str, str]]:
    """Every (question, answer, solution) of one skill, in a fixed order. Solutions work column by
    column, the way a tiny model can learn quickly, and end with the boxed answer."""
    out = []
    if skill == "add":
        out = [(f"{a}+{b}", a + b, _add_steps(a, b)) for a in range(10, 100) for b in range(10, 100)]
    elif skill == "sub":
        out = [(f"{a}-{b}", a - b, _sub_steps(a, b)) for a in range(10, 100) for b in range(10, a + 1)]
    elif skill == "mul":
        out = [(f"{a}*{b}", a * b, _mul_steps(a, b)) for a in range(2, 10) for b in range(10, 100)]
    elif skill == "mixed":
        for a in range(2, 10):
            for b in range(2, 10):
                for c in range(2, 10):
                    p = a * b
                    out.append((f"{a}*{b}+{c}", p + c, f"{a}*{b}={p}, {p}+{c}={p + c}, so {p + c}"))
                    out.append((f"{a}*{b}-{c}", p - c, f"{a}*{b}={p}, {p}-{c}={p - c}, so {p - c}"))
    else:
        raise ValueError(f"unknown skill {skill!r}; the tiny task has {', '.join(SKILLS)}")
    return [(f"Compute {q}.", str(ans), f"{steps}. {_boxed(ans)}") for q, ans, steps in out]


@lru_cache(maxsize=32)
def _split_skill(skill: str, eval_size: int, seed: int) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    rows = _enumerate(skill)
    random.Random(f"{seed}-{skill}").shuffle(rows)
    if eval_size >= len(rows):
        raise ValueError(f"eval_size={eval_size} leaves no training problems for skill {skill!r} ({len(rows)} in all)")
    problems = [Problem(f"{skill}-{i:05d}", skill, q, a, s) for i, (q, a, s) in enumerate(rows)]
    return tuple(problems[:eval_size]), tuple(problems[eval_size:])


def benchmark(skill: str, eval_size: int, seed: int = DATA_SEED) -> list[Problem]:
    """The evaluation "benchmark" of one skill: ``eval_size`` problems never used for training."""
    return list(_split_skill(skill, eval_size, seed)[0])


def train_split(skills: tuple[str, ...] | list[str], eval_size: int, size: int, seed: int = DATA_SEED) -> list[Problem]:
    """The RL training split: ``size`` problems, an equal share of each skill, interleaved in a fixed
    shuffled order (a run's seed then permutes it)."""
    skills = tuple(skills)
    per_skill = -(-size // len(skills))
    pools = [list(_split_skill(s, eval_size, seed)[1]) for s in skills]
    for skill, pool in zip(skills, pools):
        if len(pool) < per_skill:
            raise ValueError(f"skill {skill!r} has {len(pool)} training problems; {per_skill} requested")
    picked = [p for pool in pools for p in pool[:per_skill]]
    random.Random(f"{seed}-train").shuffle(picked)
    return picked[:size]


def every_problem(eval_size: int, seed: int = DATA_SEED) -> list[Problem]:
    """Every problem of every skill, benchmarks and training parts together (what a model may ever be shown)."""
    return [p for s in SKILLS for part in _split_skill(s, eval_size, seed) for p in part]


def warmstart_stream(mix: dict[str, float], eval_size: int, seed: int, data_seed: int = DATA_SEED):
    """Endless supervised warm-start problems drawn from the training parts with skill weights
    ``mix`` (disjoint from every benchmark). Deterministic in ``seed``."""
    rng = random.Random(seed)
    skills = list(mix)
    weights = [mix[s] for s in skills]
    pools = {s: _split_skill(s, eval_size, data_seed)[1] for s in skills}
    while True:
        skill = rng.choices(skills, weights)[0]
        yield rng.choice(pools[skill])
