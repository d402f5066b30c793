"""The seeds-until-decided rule on synthetic paired data with the tiny study's noise, against "add seeds
and look again".

    python benchmarks/sequential_decisions.py [--sims 2000] [--power-sims 1000] [--json]

Noise, read from docs/tiny.md's seed-study tables (the tiny study, seeds 0-4, "Both models" rows): the s.d. of a
method's pair average over seeds (the "Avg. (± s.d. over seeds)" column) and the s.d. of its paired
difference to GRPO n=8, recovered from each 95% Student-t interval (half-width x sqrt(5) / t(0.975, 4));
the medians over the table's rows. A synthetic seed gives the reference method
``seed_effect + noise`` and the compared method ``seed_effect + delta + noise'``, the seed effect (shared
by both, as the same seed fixes prompts and sampling) and the noises split so that each method's s.d. and
the paired difference's s.d. are that page's.

The rule (``graft_exp.sweep.decide.Decider``, the one ``--until-decided`` runs): 4 seeds per round, a cap
of 12 (3 looks), alpha 0.05, AdaStop's permutation test at alpha/2 per side. The naive procedure: a
paired t-test at 0.05 after 4, 8 and 12 seeds, stopping at the first p < 0.05. Also shown: AdaStop called
at alpha itself (``type1_adastop_at_alpha``), the reason for the alpha/2. Reports the false-decision
rate with no true difference (type 1), the rate of "better" decisions at 1 and 2 points of true
difference (power), and the mean seeds used per method.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.progress import Progress
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graft_exp.sweep.decide import BETTER, WORSE, Decider, Settings

ROW = re.compile(r"^\| (?P<method>[^|]+?) \|(?:[^|]*\|){4} (?P<avg>[\d.]+) ± (?P<sd>[\d.]+) \| 5/5 \| "
                 r"(?P<delta>[^|]+)\|")
CI = re.compile(r"\[(?P<lo>[+-][\d.]+), (?P<hi>[+-][\d.]+)\]")


def study_noise(page: Path) -> dict:
    """The two s.d.s of the tiny study (points of the pair average), from docs/tiny.md's "Both models" rows."""
    rows, both = {}, False
    t = stats.t.ppf(0.975, 4)
    for line in page.read_text().splitlines():
        match = ROW.match(line)
        if match is None and line.startswith("| *"):   # a section of a table ("*Both models ...*") or a band
            both = line.startswith("| *Both models")
        elif match is not None and both:   # a method appears in several tables: count it once
            rows[match["method"].strip("*")] = match
    method_sd = [float(m["sd"]) for m in rows.values()]
    diff_sd = [(float(ci["hi"]) - float(ci["lo"])) / 2 * math.sqrt(5) / t
               for ci in (CI.search(m["delta"]) for m in rows.values()) if ci]
    if not diff_sd:
        raise SystemExit(f"{page}: no seed-study table with 'Both models' rows and 95% intervals to read")
    return {"method_sd": float(statistics.median(method_sd)), "paired_diff_sd": float(statistics.median(diff_sd)),
            "methods": len(method_sd), "intervals": len(diff_sd)}


def draw(rng: np.random.Generator, seeds: int, delta: float, noise: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-seed scores of (method, reference) with the tiny study's s.d.s."""
    own = noise["paired_diff_sd"] / math.sqrt(2)
    shared = math.sqrt(max(noise["method_sd"] ** 2 - own ** 2, 0.0))
    seed_effect = rng.normal(0, shared, seeds)
    return seed_effect + delta + rng.normal(0, own, seeds), seed_effect + rng.normal(0, own, seeds)


def rule(method: np.ndarray, reference: np.ndarray, s: Settings) -> tuple[str, int]:
    """The Decider on one comparison: (decision, seeds used)."""
    decider = Decider(s)
    for k in range(s.rounds):
        seeds = list(range(k * s.per_round, (k + 1) * s.per_round))
        n = (k + 1) * s.per_round
        record = decider.look(seeds, {"m": dict(enumerate(method[:n])), "ref": dict(enumerate(reference[:n]))})
        if decider.finished:
            return record.decisions["m vs ref"], n
    raise AssertionError("the rule decides at the cap")


def naive(method: np.ndarray, reference: np.ndarray, s: Settings) -> tuple[str, int]:
    """Paired t-test after each round at alpha, stop at the first significant one."""
    for k in range(s.rounds):
        n = (k + 1) * s.per_round
        d = method[:n] - reference[:n]
        if stats.ttest_1samp(d, 0.0).pvalue < s.alpha:
            return (BETTER if d.mean() > 0 else WORSE), n
    return "not significant", s.max_seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sims", type=int, default=2000, help="simulated comparisons with no true difference")
    parser.add_argument("--power-sims", type=int, default=1000, help="simulated comparisons per true difference")
    parser.add_argument("--permutations", type=int, default=2000,
                        help="AdaStop's B, its Monte Carlo sample of the permutation distribution (the sweep's "
                             "default is 10000; 2000 keeps 6,000 simulated procedures within minutes on 2 cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    noise = study_noise(ROOT / "docs" / "tiny.md")
    s = Settings((("m", "ref"),), alpha=0.05, margin=1.0, per_round=4, max_seeds=12, permutations=args.permutations)
    at_alpha = replace(s, alpha=2 * s.alpha)   # Decider halves alpha: this calls AdaStop at 0.05 itself
    rng = np.random.default_rng(20231)
    runs = {"null": (0.0, args.sims), "1": (1.0, args.power_sims), "2": (2.0, args.power_sims)}
    out = {"rule": "AdaStop (adastop 0.1.3) at alpha/2 per side, 4 seeds per round, cap 12",
           "naive": "paired t-test at alpha after 4, 8, 12 seeds, stop at the first p < alpha",
           "alpha": s.alpha, "sims": args.sims, "power_sims": args.power_sims, "noise_from_tiny_study": noise,
           "permutations": args.permutations}
    results = {}
    with Progress(disable=args.json, transient=True) as bar:
        for name, (delta, sims) in runs.items():
            task = bar.add_task(f"delta {delta}", total=sims)
            rows = []
            for i in range(sims):
                m, r = draw(rng, s.max_seeds, delta, noise)
                ours, used = rule(m, r, replace(s, seed=i))
                rows.append((ours, used, *naive(m, r, s),
                             rule(m, r, replace(at_alpha, seed=i))[0] if name == "null" else ""))
                bar.advance(task)
            results[name] = rows
    null = results["null"]
    out["type1"] = sum(r[0] in (BETTER, WORSE) for r in null) / len(null)
    out["type1_naive"] = sum(r[2] in (BETTER, WORSE) for r in null) / len(null)
    out["type1_adastop_at_alpha"] = sum(r[4] in (BETTER, WORSE) for r in null) / len(null)
    out["equivalent_under_null"] = sum(r[0] == "equivalent" for r in null) / len(null)
    out["power"] = {name: sum(r[0] == BETTER for r in results[name]) / len(results[name]) for name in ("1", "2")}
    out["power_naive"] = {name: sum(r[2] == BETTER for r in results[name]) / len(results[name]) for name in ("1", "2")}
    out["mean_seeds"] = {name: float(np.mean([r[1] for r in rows])) for name, rows in results.items()}
    out["mean_seeds_naive"] = {name: float(np.mean([r[3] for r in rows])) for name, rows in results.items()}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"noise from docs/tiny.md: method s.d. {noise['method_sd']:.2f}, paired-difference s.d. "
          f"{noise['paired_diff_sd']:.2f} points ({noise['methods']} methods)")
    print(f"no true difference, {args.sims} comparisons: false decisions {out['type1']:.3f} (rule), "
          f"{out['type1_naive']:.3f} (naive), {out['type1_adastop_at_alpha']:.3f} (AdaStop at alpha)")
    for name in ("1", "2"):
        print(f"true difference {name} point(s): 'better' {out['power'][name]:.3f} (rule), "
              f"{out['power_naive'][name]:.3f} (naive); mean seeds {out['mean_seeds'][name]:.1f} vs "
              f"{out['mean_seeds_naive'][name]:.1f}")


if __name__ == "__main__":
    main()
