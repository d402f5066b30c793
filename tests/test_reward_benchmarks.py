"""The reward on the benchmarks' real golds and on real model-written solutions (tests/data/README.md
says where each file comes from).

- Every gold of MATH-500, AIME 2024, AIME 2025, AMC23, Minerva and the MATH training split, turned into
  the ground truth by ``prepare.gold_answer`` as the hub's records would be, scores 1 against itself and
  against rewritings whose equivalence is certain (``\\dfrac`` for ``\\frac``, spacing, Minerva's numbers
  in the other scientific notations).
- Pairs of *different* golds of the same benchmark (a seeded sample) score 0, but for the pairs listed
  in ``EQUIVALENT_GOLDS`` (two golds that are the same answer); each numeric Minerva gold against the
  same number x10, x0.1, x2 and x0.5 scores 0.
- 800 solutions sampled from a Qwen2.5-Math-Instruct model (8 per problem) for 100 MATH test problems, each labelled correct or
  not by the Qwen2.5-Math evaluation (an automatic grader): the reward agrees with every label but those
  of ``LABEL_DISAGREEMENTS``, each inspected: in every one the label is wrong and the reward right.

- ``prepare`` rewrites exactly the six Python-spelled Minerva golds (``PYTHON_GOLDS``: before, after, and a
  LaTeX answer that now scores 1) and no other gold.

All pairs of a test go through one worker pool in one batch. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from decimal import Decimal
from pathlib import Path

import pytest

from graft_exp.prepare import SOURCES, gold_answer, latex_gold, verl_rows
from graft_exp.reward import RewardPool, last_boxed, rewards

DATA = Path(__file__).parent / "data"
RAW_GOLDS = json.loads((DATA / "benchmark_golds.json").read_text())
FIELD = {"math": "solution"}  # the training split's gold field is the worked solution (its last box kept)
PAIR_SAMPLE = {"math500": 600, "aime2024": 100, "aime2025": 100, "amc23": 150, "minerva": 250, "math": 600}
_PLAIN_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

#: Different gold strings of one benchmark that are the same answer: scoring 1 between them is right.
EQUIVALENT_GOLDS: set[frozenset[str]] = set()

#: (problem idx, solution k) -> why the reward and the evaluation's label differ, and who is right.
_TIME_LABEL = ("label wrong: the box is `4:30 \\text{ p.m.}`, the gold `\\text{4:30 p.m.}`; the evaluation "
               "mangled the gold to `4:30p..` and the answer to `4:30`")
LABEL_DISAGREEMENTS: dict[tuple[int, int], str] = {
    **{(3, k): _TIME_LABEL for k in range(8)},
    (72, 7): "label wrong: the box is `10000`, the gold `10{,}000`; the evaluation failed on the braced comma",
}


def golds(benchmark: str) -> list[str]:
    """The ground truths ``prepare`` writes for the benchmark's records (their problems left empty)."""
    source = SOURCES[benchmark]
    frame = verl_rows([{source.question: "", source.answer: raw} for raw in RAW_GOLDS[benchmark]], source)
    return [row["ground_truth"] for row in frame["reward_model"]]


def test_every_gold_is_written_but_the_training_solutions_without_an_answer():
    """Two MATH training solutions box nothing (``$\\boxed{}$``): they cannot be verified, and prepare
    leaves them out; every other gold of every set is written."""
    for benchmark in SOURCES:
        source = SOURCES[benchmark]
        frame = verl_rows([{source.question: "", source.answer: raw} for raw in RAW_GOLDS[benchmark]], source)
        left_out = [] if benchmark != "math" else [5529, 5531]
        assert frame.attrs["unanswered"] == len(left_out)
        assert [row["index"] for row in frame["extra_info"]] == \
            [i for i in range(len(RAW_GOLDS[benchmark])) if i not in left_out]
    assert [RAW_GOLDS["math"][i] for i in (5529, 5531)] == ["\\boxed{}", "\\boxed{}"]


def rewritings(gold: str) -> set[str]:
    """Spellings of ``gold`` a model writes whose equivalence is certain (the gold itself included)."""
    spelled = {gold, gold.replace("\\frac", "\\dfrac"), gold.replace("\\dfrac", "\\frac")}
    # spaces around operators and punctuation carry nothing; nor does one between a number and a letter
    tight = re.sub(r"\s*([-+=,()\[\]^_/<>])\s*", r"\1", gold)
    spelled |= {tight, re.sub(r"(\d)\s+(?=[a-zA-Z])", r"\1", tight)}
    number = _PLAIN_NUMBER.fullmatch(gold)
    if number and number.group(2):
        mantissa, exponent = gold.lower().split("e")
        spelled |= {f"{mantissa}\\times10^{{{int(exponent)}}}", f"{mantissa} \\cdot 10^{{{int(exponent)}}}",
                    f"{mantissa} \\times 10^{{{int(exponent)}}}"}
    return {s for s in spelled if s.strip()}


def boxed(answer: str) -> str:
    return f"So the final answer is $\\boxed{{{answer}}}$."


@pytest.fixture(scope="module")
def pool():
    pool = RewardPool(workers=2)
    yield pool
    pool.close()


@pytest.mark.slow
def test_every_gold_scores_itself_and_its_rewritings(pool):
    pairs = [(benchmark, index, answer, gold) for benchmark in SOURCES
             for index, gold in enumerate(golds(benchmark)) for answer in rewritings(gold)]
    scores = rewards([boxed(a) for _, _, a, _ in pairs], [g for *_, g in pairs], pool=pool)
    failed = {}
    for (benchmark, index, answer, gold), score in zip(pairs, scores):
        if score != 1.0:
            failed.setdefault(benchmark, []).append((index, gold, answer))
    for benchmark in SOURCES:
        total = len(golds(benchmark))
        bad = {index for index, *_ in failed.get(benchmark, [])}
        print(f"{benchmark}: golds scoring themselves and their rewritings {total - len(bad)}/{total} "
              f"({sum(p[0] == benchmark for p in pairs)} pairs)")
    assert failed == {}


def different_gold_pairs(benchmark: str, count: int) -> list[tuple[str, str]]:
    """A seeded sample of ``count`` (answer, gold) pairs of two different gold strings of ``benchmark``."""
    distinct = sorted(set(golds(benchmark)))
    every = [(a, g) for a in distinct for g in distinct if a != g]
    return random.Random(f"different-{benchmark}").sample(every, min(count, len(every)))


def scaled_numbers(gold: str) -> list[str]:
    """``gold`` (a plain number) x10, x0.1, x2 and x0.5, written as Minerva writes numbers."""
    value = Decimal(gold)
    return [str(value * Decimal(factor)).lower().replace("e+", "e") for factor in ("10", "0.1", "2", "0.5")]


@pytest.mark.slow
def test_different_golds_and_scaled_numbers_score_zero(pool):
    pairs = [(benchmark, answer, gold) for benchmark, count in PAIR_SAMPLE.items()
             for answer, gold in different_gold_pairs(benchmark, count)]
    numeric = [g for g in golds("minerva") if _PLAIN_NUMBER.fullmatch(g) and float(g) != 0]
    pairs += [("minerva x10/x0.1/x2/x0.5", scaled, gold) for gold in numeric for scaled in scaled_numbers(gold)]
    scores = rewards([boxed(a) for _, a, _ in pairs], [g for *_, g in pairs], pool=pool)
    positives = {}
    for (kind, answer, gold), score in zip(pairs, scores):
        if score and frozenset((answer, gold)) not in EQUIVALENT_GOLDS:
            positives.setdefault(kind, []).append((answer, gold))
    for kind in dict.fromkeys(k for k, *_ in pairs):
        total = sum(p[0] == kind for p in pairs)
        equivalent = sum(1 for (k, a, g), s in zip(pairs, scores) if k == kind and s and
                         frozenset((a, g)) in EQUIVALENT_GOLDS)
        print(f"{kind}: false positives {len(positives.get(kind, []))}/{total} "
              f"(+{equivalent} pairs of equivalent golds scored 1)")
    assert positives == {}


def labelled_solutions() -> list[dict]:
    with gzip.open(DATA / "math_labelled_solutions.jsonl.gz", "rt") as lines:
        return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_agreement_with_labelled_model_solutions(pool):
    problems = labelled_solutions()
    solutions = [(p["idx"], k, response, label, gold_answer({"answer": p["answer"]}, SOURCES["math500"]))
                 for p in problems for k, (response, label) in enumerate(zip(p["responses"], p["labels"]))]
    scores = rewards([s[2] for s in solutions], [s[4] for s in solutions], pool=pool)
    disagreements = {(idx, k): (label, score) for (idx, k, _, label, _), score in zip(solutions, scores)
                     if float(label) != score}
    agreed = len(solutions) - len(disagreements)
    print(f"labelled MATH solutions: reward agrees with {agreed}/{len(solutions)} labels")
    for key, (label, score) in sorted(disagreements.items()):
        print(f"  {key}: label {label}, reward {score}: {LABEL_DISAGREEMENTS.get(key, 'UNCLASSIFIED')}")
    assert set(disagreements) == set(LABEL_DISAGREEMENTS)


#: Every gold prepare rewrites (Minerva's Python spellings; no MATH-500 or MATH training gold changes),
#: with an answer a model writes for it in LaTeX.
PYTHON_GOLDS = {
    5: ("np.arcsin(10/13)", "\\arcsin(10/13)", "\\sin^{-1}\\left(\\frac{10}{13}\\right)"),
    38: ("-1./3", "-\\frac{1}{3}", "-\\dfrac{1}{3}"),
    49: ("-3./2", "-\\frac{3}{2}", "-1.5"),
    71: ("\\frac{1}{2a}(\\exp{a*t} - \\exp{-a*t})", "\\frac{1}{2a}(e^{a \\cdot t} - e^{-a \\cdot t})",
         "\\frac{e^{at}-e^{-at}}{2a}"),
    72: ("x_{0} \\cos (\\omega t)+$ $\\dot{x}_{0} \\sin (\\omega t) / \\omega",
         "x_{0} \\cos (\\omega t)+ \\dot{x}_{0} \\sin (\\omega t) / \\omega",
         "x_0\\cos(\\omega t)+\\frac{\\dot{x}_0}{\\omega}\\sin(\\omega t)"),
    95: ("\\frac{1}{2}(\\exp{a*t} + \\exp{-a*t})", "\\frac{1}{2}(e^{a \\cdot t} + e^{-a \\cdot t})", "\\cosh(at)"),
}


def test_prepare_rewrites_exactly_the_python_golds(pool):
    changed = {(benchmark, index): (raw, gold) for benchmark in ("math500", "minerva")
               for index, (raw, gold) in enumerate(zip(RAW_GOLDS[benchmark], golds(benchmark))) if raw.strip() != gold}
    assert changed == {("minerva", i): (raw, gold) for i, (raw, gold, _) in PYTHON_GOLDS.items()}
    training = [box for box in map(last_boxed, RAW_GOLDS["math"]) if box]
    assert [latex_gold(box) for box in training] == [box.strip() for box in training]
    answers = [answer for *_, answer in PYTHON_GOLDS.values()]
    assert rewards([boxed(a) for a in answers], [gold for _, gold, _ in PYTHON_GOLDS.values()], pool=pool) == \
        [1.0] * len(answers)
