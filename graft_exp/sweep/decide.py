"""Seeds until decided: the sequential rule of ``python -m graft_exp.sweep SWEEP --until-decided``.

A sweep file's ``decide:`` section names the comparisons of one table (a method against a reference
method, each run on the same seeds) and the rule's settings::

    decide:
      alpha: 0.05          # family-wise error over every comparison of the section and every round
      margin: 1.0          # points: "equivalent" when the adjusted interval lies within +-margin
      max_seeds: 12        # the cap (--max-seeds overrides it); a round adds as many seeds as `runs` lists
      comparisons:
        - [graft, grpo_n8]
        - [sgt, grpo_n8]

The rule is AdaStop (Mathieu, Moulines et al., "AdaStop: adaptive statistical testing for sound
comparisons of Deep RL agents", 2023; package ``adastop``): a group-sequential permutation test over the
family of comparisons, step-down over comparisons, level spent linearly over K = max_seeds // n rounds of
n seeds. Its family-wise error holds under the optional stopping it does itself: after each round it
drops decided comparisons, and only the methods of comparisons still undecided get the next round's
seeds. Measured (``benchmarks/sequential_decisions.py``): ``adastop`` 0.1.3 compares each signed mean
difference with the permutation distribution of the signed maximum but rejects on its absolute value, so
a two-sided test at ``alpha`` rejects a true null about twice as often as ``alpha``; by the symmetry of the
permutation distribution, calling it at ``alpha / 2`` bounds the two-sided family-wise error by ``alpha``.

The adjusted interval of a comparison is the paired (same seed) Student-t interval at level
``1 - alpha / (m K)`` (Bonferroni over the m comparisons and K possible looks), so every interval the
procedure can show covers its true difference simultaneously with probability >= 1 - alpha, whenever it
stops. It decides "equivalent within +-margin" once AdaStop has not found a difference at the cap.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from graft_exp.intervals import paired_interval

RULE = ("AdaStop (Mathieu et al. 2023), adastop==0.1.3, at alpha/2 for a two-sided family-wise error "
        "<= alpha; adjusted intervals: paired Student-t at 1 - alpha/(m K) (Bonferroni over comparisons and looks)")
BETTER, WORSE, EQUIVALENT, UNDECIDED, CONTINUE = "better", "worse", "equivalent", "undecided at the cap", "continue"


class DecideError(ValueError):
    """A ``decide:`` section (or ``--until-decided`` command line) that cannot be run; says what to fix."""


@dataclass(frozen=True)
class Settings:
    comparisons: tuple[tuple[str, str], ...]     # (method, reference)
    alpha: float
    margin: float
    per_round: int                               # seeds a round adds (the file's seed count)
    max_seeds: int
    permutations: int = 10_000                   # AdaStop's B
    seed: int = 0                                # AdaStop's permutation stream: a rerun decides the same

    @property
    def rounds(self) -> int:
        return self.max_seeds // self.per_round

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(m for pair in self.comparisons for m in pair))

    def label(self, pair: tuple[str, str]) -> str:
        return f"{pair[0]} vs {pair[1]}"


def settings(spec: dict, seeds: list[int], max_seeds: int | None, path) -> Settings:
    """The ``decide:`` section of the sweep file ``spec`` (read before anything runs)."""
    section = spec.get("decide")
    if not isinstance(section, dict) or not section.get("comparisons"):
        raise DecideError(f"{path}: --until-decided needs a `decide:` section with `comparisons:` (pairs "
                          "[method, reference], e.g. [graft, grpo_n8]); this file has none")
    comparisons = []
    for pair in section["comparisons"]:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(m, str) for m in pair)) or pair[0] == pair[1]:
            raise DecideError(f"{path}: decide.comparisons entry {pair!r} must be [method, reference] with two "
                              "different methods, e.g. [graft, grpo_n8]")
        comparisons.append((pair[0], pair[1]))
    alpha = float(section.get("alpha", 0.05))
    if not 0 < alpha < 1:
        raise DecideError(f"{path}: decide.alpha={alpha} must be in (0, 1), e.g. 0.05")
    margin = float(section.get("margin", 1.0))
    if not margin > 0:
        raise DecideError(f"{path}: decide.margin={margin} must be > 0 points, e.g. 1.0")
    cap = int(max_seeds if max_seeds is not None else section.get("max_seeds", 12))
    if not seeds:
        raise DecideError(f"{path}: --until-decided needs the file's runs to list seeds (e.g. seed: [0, 1, 2, 3])")
    if cap < 2 * len(seeds):
        raise DecideError(f"--max-seeds={cap} leaves no second round: a round adds {len(seeds)} seeds (the file's "
                          f"seeds), so the cap must be at least {2 * len(seeds)}")
    return Settings(tuple(comparisons), alpha, margin, len(seeds), cap,
                    int(section.get("permutations", 10_000)), int(section.get("seed", 0)))


def adjusted_interval(diffs: np.ndarray, s: Settings) -> tuple[float, float]:
    """The paired Student-t interval of the mean difference at 1 - alpha / (m K)."""
    n = len(diffs)
    if n < 2:
        return (-math.inf, math.inf)
    _, lo, hi = paired_interval(diffs, 1 - s.alpha / (len(s.comparisons) * s.rounds))
    return (lo, hi)


@dataclass
class Round:
    """One look: what was run, AdaStop's decisions after it, and why the next seeds are added."""

    index: int
    seeds: dict[str, list[int]]                  # method -> seeds whose scores this look used
    scores: dict[str, list[float]]               # method -> those seeds' scores (points), in that order
    decisions: dict[str, str]                    # comparison label -> better/worse/equivalent/undecided/continue
    intervals: dict[str, tuple[float, float]]
    mean_diff: dict[str, float]
    next_seeds: list[int] = field(default_factory=list)
    next_reason: dict[str, list[str]] = field(default_factory=dict)   # method -> undecided comparisons needing it

    def as_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, default=float)


class Decider:
    """AdaStop over the family of comparisons, fed one round of seeds at a time.

    ``look(seeds, scores)``: ``scores[method][seed]`` (points) of the round's jobs (earlier rounds' are kept);
    returns the round's record.
    Deterministic: the same scores and ``Settings.seed`` give the same decisions (a restarted sweep replays
    its rounds from MLflow and reaches the same state)."""

    def __init__(self, s: Settings):
        from adastop import MultipleAgentsComparator  # imported here: only --until-decided needs it

        self.s = s
        index = {m: i for i, m in enumerate(s.methods)}
        self.comparator = MultipleAgentsComparator(
            n=s.per_round, K=s.rounds, B=s.permutations, alpha=s.alpha / 2, beta=0, seed=s.seed,
            comparisons=np.array([(index[a], index[b]) for a, b in s.comparisons]))
        self.rounds: list[Round] = []
        self.seeds: list[int] = []
        self.scores: dict[str, dict[int, float]] = {}

    def active(self) -> list[tuple[str, str]]:
        return [pair for pair in self.s.comparisons if self.decision(pair) == CONTINUE]

    def decision(self, pair: tuple[str, str]) -> str:
        return self.rounds[-1].decisions[self.s.label(pair)] if self.rounds else CONTINUE

    def look(self, seeds: list[int], scores: dict[str, dict[int, float]]) -> Round:
        """The next round: ``seeds`` are this round's new seeds (every method still compared has them)."""
        s, k = self.s, len(self.rounds)
        self.seeds += seeds
        for method, by_seed in scores.items():   # a round's sweep reads only its own jobs' scores
            self.scores.setdefault(method, {}).update(by_seed)
        scores = self.scores
        needed = {m for pair in self.active() for m in pair} if self.rounds else set(s.methods)
        # A method no longer compared keeps the values it had; AdaStop reads only those of live comparisons.
        used = {m: [x for x in self.seeds if x in scores.get(m, {})] if m in needed else
                self.rounds[-1].seeds[m] for m in s.methods}
        missing = [f"{m} seed {x}" for m in needed for x in self.seeds if x not in scores.get(m, {})]
        if missing:
            raise DecideError("no score for " + ", ".join(missing) + ": a job failed; fix it and rerun the sweep")
        values = {m: np.array([scores[m][x] for x in used[m]]) for m in s.methods}
        self.comparator.partial_compare(values, verbose=False)
        decisions, intervals, means = {}, {}, {}
        for (a, b), comp in zip(s.comparisons, self.comparator.comparisons):
            label = s.label((a, b))
            if self.rounds and self.rounds[-1].decisions[label] != CONTINUE:
                decisions[label] = self.rounds[-1].decisions[label]
                intervals[label], means[label] = self.rounds[-1].intervals[label], self.rounds[-1].mean_diff[label]
                continue
            common = [x for x in used[a] if x in used[b]]
            diffs = np.array([scores[a][x] - scores[b][x] for x in common])
            intervals[label], means[label] = adjusted_interval(diffs, s), float(np.mean(diffs))
            verdict = self.comparator.decisions[str(comp)]
            if verdict in ("larger", "smaller"):
                decisions[label] = BETTER if verdict == "larger" else WORSE
            elif k == s.rounds - 1:   # the cap: AdaStop found no difference
                lo, hi = intervals[label]
                decisions[label] = EQUIVALENT if -s.margin < lo and hi < s.margin else UNDECIDED
            else:
                decisions[label] = CONTINUE
        record = Round(k, {m: list(used[m]) for m in s.methods}, {m: values[m].tolist() for m in s.methods},
                       decisions, intervals, means)
        self.rounds.append(record)
        if self.active():
            record.next_seeds = list(range(max(self.seeds) + 1, max(self.seeds) + 1 + s.per_round))
            for pair in self.active():
                for m in pair:
                    record.next_reason.setdefault(m, []).append(s.label(pair))
        return record

    @property
    def finished(self) -> bool:
        return bool(self.rounds) and not self.active()
