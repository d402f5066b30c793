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

``rule: paired`` (``PairedTest``) tests the same comparisons on the per-seed differences instead: the jobs of one
seed share its prompt order, sampling stream and evaluation draws, so a seed effect common to every method cancels
in the difference, where AdaStop, comparing two samples, spends it as noise. At look k (n_k seeds) each live
comparison's two-sided p-value is the exact sign-flip permutation test of the mean difference (Fisher 1935; Good,
"Permutation, Parametric and Bootstrap Tests of Hypotheses", 2005, ch. 3): under the null the differences are
symmetric about 0, so each of the 2^n sign patterns is equally likely (enumerated up to 16 seeds, else a seeded
Monte Carlo sample with the +1 correction of Phipson and Smyth 2010). The level is spent over the looks (a
Bonferroni alpha-spending in the sense of Lan and DeMets 1983, split equally over the looks whose smallest
attainable p-value can reach their share: with 4 seeds a look cannot reject, 2/2^4 > alpha), and within a look over
the m comparisons (Bonferroni, rejecting at alpha_k / m). Every p-value is valid whatever happened at earlier looks,
so the family-wise error of "better"/"worse" claims is at most sum_k alpha_k = alpha under any stopping, including
the rule's own (a union bound; no step-down: with comparisons dropped for equivalence, Holm's thresholds would not
be bounded by alpha_k / m). A comparison also stops, early, as "equivalent" once its adjusted interval (below) lies
within +-margin. Assumed: the differences are independent across seeds and symmetric about their mean under the
null. That fails when methods differ in the shape of their noise, not only its scale (a skewed score distribution
with unequal spreads), and with seeds that are not exchangeable (a seed reused across rounds).

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

_INTERVALS = "adjusted intervals: paired Student-t at 1 - alpha/(m K) (Bonferroni over comparisons and looks)"
#: The rules a ``decide:`` section may name (``rule:``), each as the MLflow record describes it.
RULES = {
    "adastop": "AdaStop (Mathieu et al. 2023), adastop==0.1.3, at alpha/2 for a two-sided family-wise error "
               f"<= alpha; {_INTERVALS}",
    "paired": "paired sign-flip permutation test per look (exact to 16 seeds), alpha spent equally over the looks "
              f"that can reject and split over comparisons (Bonferroni); early equivalence; {_INTERVALS}",
}
RULE = RULES["adastop"]
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
    permutations: int = 10_000                   # AdaStop's B; the paired rule's Monte Carlo sample past 16 seeds
    seed: int = 0                                # the permutation stream: a rerun decides the same
    rule: str = "adastop"                        # a key of RULES

    @property
    def description(self) -> str:
        return RULES[self.rule]

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
    rule = str(section.get("rule", "adastop"))
    if rule not in RULES:
        raise DecideError(f"{path}: decide.rule={rule!r} is not one of {', '.join(RULES)}")
    return Settings(tuple(comparisons), alpha, margin, len(seeds), cap,
                    int(section.get("permutations", 10_000)), int(section.get("seed", 0)), rule)


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


def sign_flip_p(diffs: np.ndarray, permutations: int, rng: np.random.Generator) -> float:
    """Two-sided p-value of the mean of ``diffs`` under sign flips: the share of the 2^n sign patterns whose
    |mean| reaches the observed one (exact to 16 values; beyond, ``permutations`` random patterns, +1 corrected)."""
    n = len(diffs)
    observed = abs(float(diffs.sum())) * (1 - 1e-12)
    if n <= 16:
        signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)
        return float(np.mean(np.abs(signs @ diffs) >= observed))
    signs = rng.choice((-1.0, 1.0), size=(permutations, n))
    return float((1 + np.sum(np.abs(signs @ diffs) >= observed)) / (permutations + 1))


def look_levels(alpha: float, sizes: list[int], comparisons: int) -> list[float]:
    """alpha spent over the looks of ``sizes`` seeds: equally over those whose smallest attainable sign-flip p-value
    (2 / 2^n) can reach their share of alpha / comparisons; 0 for the others."""
    live = list(range(len(sizes)))
    while live and 2.0 ** (1 - sizes[live[0]]) > alpha / (len(live) * comparisons):
        live.pop(0)
    return [alpha / len(live) if k in live else 0.0 for k in range(len(sizes))]


class AdaStopTest:
    """AdaStop's verdicts over the whole family after each look (it keeps its own state across looks)."""

    early_equivalence = False   # AdaStop decides "no difference" only at the cap

    def __init__(self, s: Settings):
        from adastop import MultipleAgentsComparator  # imported here: only --until-decided needs it

        index = {m: i for i, m in enumerate(s.methods)}
        self.comparator = MultipleAgentsComparator(
            n=s.per_round, K=s.rounds, B=s.permutations, alpha=s.alpha / 2, beta=0, seed=s.seed,
            comparisons=np.array([(index[a], index[b]) for a, b in s.comparisons]))

    def verdicts(self, values: dict[str, np.ndarray], diffs: dict[int, np.ndarray], look: int) -> dict[int, str | None]:
        self.comparator.partial_compare(values, verbose=False)
        found = [self.comparator.decisions[str(comp)] for comp in self.comparator.comparisons]
        return {j: found[j] if found[j] in ("larger", "smaller") else None for j in diffs}


class PairedTest:
    """The paired sign-flip rule (module docstring): each live comparison's per-seed differences at this look."""

    early_equivalence = True

    def __init__(self, s: Settings):
        self.s = s
        self.levels = look_levels(s.alpha, [(k + 1) * s.per_round for k in range(s.rounds)], len(s.comparisons))
        self.rng = np.random.default_rng(s.seed)

    def verdicts(self, values: dict[str, np.ndarray], diffs: dict[int, np.ndarray], look: int) -> dict[int, str | None]:
        level = self.levels[look] / len(self.s.comparisons)
        out = {}
        for j, d in diffs.items():
            significant = level > 0 and sign_flip_p(d, self.s.permutations, self.rng) <= level
            out[j] = ("larger" if d.mean() > 0 else "smaller") if significant else None
        return out


TESTS = {"adastop": AdaStopTest, "paired": PairedTest}


class Decider:
    """The sweep file's rule (``Settings.rule``: AdaStop, or the paired test) over the family of comparisons, fed
    one round of seeds at a time.

    ``look(seeds, scores)``: ``scores[method][seed]`` (points) of the round's jobs (earlier rounds' are kept);
    returns the round's record.
    Deterministic: the same scores and ``Settings.seed`` give the same decisions (a restarted sweep replays
    its rounds from MLflow and reaches the same state)."""

    def __init__(self, s: Settings):
        self.s = s
        self.test = TESTS[s.rule](s)
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
        # A method no longer compared keeps the values it had; the rule reads only those of live comparisons.
        used = {m: [x for x in self.seeds if x in scores.get(m, {})] if m in needed else
                self.rounds[-1].seeds[m] for m in s.methods}
        missing = [f"{m} seed {x}" for m in needed for x in self.seeds if x not in scores.get(m, {})]
        if missing:
            raise DecideError("no score for " + ", ".join(missing) + ": a job failed; fix it and rerun the sweep")
        values = {m: np.array([scores[m][x] for x in used[m]]) for m in s.methods}
        live = {j: pair for j, pair in enumerate(s.comparisons) if self.decision(pair) == CONTINUE}
        diffs = {j: np.array([scores[a][x] - scores[b][x] for x in used[a] if x in used[b]])
                 for j, (a, b) in live.items()}
        verdicts = self.test.verdicts(values, diffs, k)
        decisions, intervals, means = {}, {}, {}
        for j, (a, b) in enumerate(s.comparisons):
            label = s.label((a, b))
            if j not in live:
                decisions[label] = self.rounds[-1].decisions[label]
                intervals[label], means[label] = self.rounds[-1].intervals[label], self.rounds[-1].mean_diff[label]
                continue
            intervals[label], means[label] = adjusted_interval(diffs[j], s), float(np.mean(diffs[j]))
            lo, hi = intervals[label]
            within = -s.margin < lo and hi < s.margin
            if verdicts[j] is not None:
                decisions[label] = BETTER if verdicts[j] == "larger" else WORSE
            elif within and (self.test.early_equivalence or k == s.rounds - 1):
                decisions[label] = EQUIVALENT
            elif k == s.rounds - 1:   # the cap: no difference found, none excluded
                decisions[label] = UNDECIDED
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
