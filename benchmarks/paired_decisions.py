"""The paired sign-flip rule against AdaStop on the same simulated sweeps: family-wise error under nulls that are not
Gaussian, power at 1, 2 and 4 points, and the seeds each uses.

    python benchmarks/paired_decisions.py [--sims 1000] [--power-sims 400] [--permutations 2000] [--json]

A simulated sweep: two comparisons against one reference (``graft`` and ``sgt`` vs ``grpo_n8``), 4 seeds per round,
a cap of 12, alpha 0.05, margin 1 point, both rules through ``graft_exp.sweep.decide.Decider`` (the code
``--until-decided`` runs). A seed's score of method m is ``40 + seed effect + gain_m + job noise``; the seed effect
is shared by every method of that seed (it fixes prompts and sampling), the job noise is each job's own. Its s.d.
is the tiny study's paired-difference s.d. over sqrt(2) (docs/tiny.md, read as ``benchmarks/sequential_decisions.py``
reads it); the seed effect's is twice that, larger than the job noise as on the tiny study.

Nulls (no method differs): Gaussian; heavy tails (Student t with 3 degrees of freedom, seed effect and noise);
skewed noise (centred log-normal, the same for every method); unequal variances (the compared methods' noise twice
the reference's); skewed noise with unequal spreads (the differences are no longer symmetric: the paired rule's
assumption fails); no seed effect (where pairing gains nothing). The family-wise error is the share of sweeps with a
"better" or "worse" claim, with its 95% Wilson interval. Power: graft gains 1, 2 or 4 points (sgt none), Gaussian
and heavy-tailed; the share of sweeps deciding graft "better", and the mean seeds graft ran.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from sequential_decisions import study_noise

from graft_exp.sweep.decide import BETTER, WORSE, Decider, Settings

METHODS = ("grpo_n8", "graft", "sgt")
PAIRS = (("graft", "grpo_n8"), ("sgt", "grpo_n8"))


def standard(rng, kind: str, size) -> np.ndarray:
    """Draws of unit s.d. and mean 0 of the named shape."""
    if kind == "t3":
        return rng.standard_t(3, size) / math.sqrt(3.0)
    if kind == "lognormal":
        sigma = 0.8
        x = rng.lognormal(0.0, sigma, size)
        return (x - math.exp(sigma ** 2 / 2)) / math.sqrt((math.exp(sigma ** 2) - 1) * math.exp(sigma ** 2))
    return rng.normal(0.0, 1.0, size)


SCENARIOS = {
    # name: (shape, seed effect in units of the job noise, spread of the compared methods' noise)
    "gaussian": ("normal", 2.0, 1.0),
    "heavy tails (t3)": ("t3", 2.0, 1.0),
    "skewed noise": ("lognormal", 2.0, 1.0),
    "unequal variances": ("normal", 2.0, 2.0),
    "skewed, unequal spreads": ("lognormal", 2.0, 2.0),
    "no seed effect": ("normal", 0.0, 1.0),
}


def sweep_scores(rng, scenario: str, noise_sd: float, gain: float, seeds: int) -> dict[str, np.ndarray]:
    shape, effect, spread = SCENARIOS[scenario]
    seed_effect = effect * noise_sd * standard(rng, shape, seeds)
    out = {}
    for m in METHODS:
        scale = noise_sd * (1.0 if m == "grpo_n8" else spread)
        out[m] = 40 + seed_effect + (gain if m == "graft" else 0.0) + scale * standard(rng, shape, seeds)
    return out


def decide(scores: dict[str, np.ndarray], s: Settings) -> dict[str, tuple[str, int]]:
    """Both comparisons' (decision, seeds used) under the rule of ``s``."""
    decider = Decider(s)
    used = {}
    for k in range(s.rounds):
        seeds = list(range(k * s.per_round, (k + 1) * s.per_round))
        live = {m for pair in decider.active() for m in pair} if decider.rounds else set(METHODS)
        record = decider.look(seeds, {m: {x: float(scores[m][x]) for x in seeds} for m in live})
        for pair in PAIRS:
            label = s.label(pair)
            if label not in used and record.decisions[label] != "continue":
                used[label] = (record.decisions[label], len(decider.seeds))
        if decider.finished:
            break
    return used


def wilson(hits: int, n: int) -> tuple[float, float]:
    interval = stats.binomtest(hits, n).proportion_ci(confidence_level=0.95, method="wilson")
    return float(interval.low), float(interval.high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sims", type=int, default=1000, help="simulated sweeps per null")
    parser.add_argument("--power-sims", type=int, default=400, help="simulated sweeps per true gain")
    parser.add_argument("--permutations", type=int, default=2000,
                        help="AdaStop's B (the sweep's default is 10000; 2000 keeps the benchmark within minutes)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    noise = study_noise(ROOT / "docs" / "tiny.md")
    noise_sd = noise["paired_diff_sd"] / math.sqrt(2)
    base = Settings(PAIRS, alpha=0.05, margin=1.0, per_round=4, max_seeds=12, permutations=args.permutations)
    rules = {"paired": replace(base, rule="paired"), "adastop": replace(base, rule="adastop")}
    runs = [(name, 0.0, args.sims) for name in SCENARIOS]
    runs += [(name, gain, args.power_sims) for name in ("gaussian", "heavy tails (t3)") for gain in (1.0, 2.0, 4.0)]
    out = {"noise_sd_points": noise_sd, "seed_effect_sd_points": 2 * noise_sd, "alpha": 0.05, "rows": []}
    with Progress(disable=args.json, transient=True) as bar:
        for scenario, gain, sims in runs:
            task = bar.add_task(f"{scenario} gain {gain}", total=sims)
            rng = np.random.default_rng([int(gain * 10), len(scenario), 57])
            tally = {rule: {"claims": 0, "better": 0, "seeds": []} for rule in rules}
            for i in range(sims):
                scores = sweep_scores(rng, scenario, noise_sd, gain, 12)
                for rule, s in rules.items():
                    found = decide(scores, replace(s, seed=i))
                    verdicts = {label: v for label, (v, _) in found.items()}
                    t = tally[rule]
                    if gain == 0:
                        t["claims"] += any(v in (BETTER, WORSE) for v in verdicts.values())
                    else:
                        t["better"] += verdicts["graft vs grpo_n8"] == BETTER
                        t["claims"] += verdicts["sgt vs grpo_n8"] in (BETTER, WORSE)
                    t["seeds"].append(found["graft vs grpo_n8"][1])
                bar.advance(task)
            for rule, t in tally.items():
                row = {"scenario": scenario, "gain": gain, "rule": rule, "sims": sims,
                       "mean_seeds_graft": float(np.mean(t["seeds"]))}
                if gain == 0:
                    row["fwer"], row["fwer_ci"] = t["claims"] / sims, wilson(t["claims"], sims)
                else:
                    row["power"], row["power_ci"] = t["better"] / sims, wilson(t["better"], sims)
                out["rows"].append(row)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    console = Console(width=140)
    console.print(f"job noise s.d. {noise_sd:.2f} points, seed effect s.d. {2 * noise_sd:.2f} (docs/tiny.md); "
                  "2 comparisons vs one reference, 4 seeds a round, cap 12, alpha 0.05")
    table = Table(title="family-wise error with no true difference (95% Wilson interval)")
    for column in ("null", "paired", "AdaStop", "seeds (paired / AdaStop)"):
        table.add_column(column)
    rows = {(r["scenario"], r["gain"], r["rule"]): r for r in out["rows"]}
    for scenario in SCENARIOS:
        p, a = rows[scenario, 0.0, "paired"], rows[scenario, 0.0, "adastop"]
        table.add_row(scenario, f"{p['fwer']:.3f} [{p['fwer_ci'][0]:.3f}, {p['fwer_ci'][1]:.3f}]",
                      f"{a['fwer']:.3f} [{a['fwer_ci'][0]:.3f}, {a['fwer_ci'][1]:.3f}]",
                      f"{p['mean_seeds_graft']:.1f} / {a['mean_seeds_graft']:.1f}")
    console.print(table)
    table = Table(title="power: graft decided better (95% Wilson interval), seeds graft ran")
    for column in ("noise", "gain", "paired", "AdaStop", "ratio", "seeds (paired / AdaStop)"):
        table.add_column(column)
    for scenario in ("gaussian", "heavy tails (t3)"):
        for gain in (1.0, 2.0, 4.0):
            p, a = rows[scenario, gain, "paired"], rows[scenario, gain, "adastop"]
            ratio = p["power"] / a["power"] if a["power"] else math.inf
            table.add_row(scenario, f"{gain:.0f}", f"{p['power']:.3f} [{p['power_ci'][0]:.3f}, {p['power_ci'][1]:.3f}]",
                          f"{a['power']:.3f} [{a['power_ci'][0]:.3f}, {a['power_ci'][1]:.3f}]", f"{ratio:.2f}x",
                          f"{p['mean_seeds_graft']:.1f} / {a['mean_seeds_graft']:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
