"""The shipped tiny models' pass@1 per skill on the held-out problems, backend.sampler=loop vs static_cache.

    python benchmarks/sampler_pass_at_1.py [--samples 8]

Both samplers draw ``--samples`` responses per held-out problem (64 per skill) at the evaluation
settings (temperature 0.6, top-p 0.95), from independent seeds, so the two columns are two independent
measurements of one distribution if the samplers agree. Per skill: pass@1 of each, their difference and
its standard error (paired over problems: the per-problem mean correctness of each sampler), and
z = difference / SE; |z| < 2 everywhere is agreement within sampling noise.
"""

from __future__ import annotations

import argparse
import math

import torch
from omegaconf import OmegaConf

from graft_exp.backends.local_policy import LocalPolicy
from graft_exp.reward import rewards
from graft_exp.tiny import models as tiny

SAMPLERS = ("loop", "static_cache")
SEEDS = {"loop": 1000, "static_cache": 2000}


def per_problem_correct(policy: LocalPolicy, problems, samples: int, seed: int) -> list[float]:
    ids = [policy.encode_prompt(tiny.model_input(p.prompt)) for p in problems]
    out = policy.sample(ids, samples, 0.6, 0.95, 48, seed)
    flat = rewards(out.texts, [p.answer for p in problems for _ in range(samples)])
    return [sum(flat[i * samples:(i + 1) * samples]) / samples for i in range(len(problems))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8, help="responses per problem and sampler")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = OmegaConf.create({"temperature": 1.0, "grad_clip": 1.0, "lr": 1e-6, "betas": [0.9, 0.999],
                            "weight_decay": 0.0})
    print(f"{'model':16} {'skill':6} {'loop':>6} {'static':>7} {'diff':>6} {'SE':>5} {'z':>5}")
    worst = 0.0
    for key in tiny.RECIPES:
        model, tokenizer = tiny.load(key, progress=False)
        for skill, problems in tiny.benchmarks().items():
            scores = {s: per_problem_correct(LocalPolicy(key, model, tokenizer, torch.device("cpu"), cfg, 48, s),
                                             problems, args.samples, SEEDS[s]) for s in SAMPLERS}
            diffs = [b - a for a, b in zip(scores["loop"], scores["static_cache"])]
            mean = sum(diffs) / len(diffs)
            se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
            z = mean / se if se > 0 else 0.0
            worst = max(worst, abs(z))
            p = {s: 100 * sum(v) / len(v) for s, v in scores.items()}
            print(f"{key:16} {skill:6} {p['loop']:6.1f} {p['static_cache']:7.1f} {100 * mean:+6.1f} "
                  f"{100 * se:5.1f} {z:+5.2f}")
    print(f"largest |z| over the {2 * len(tiny.benchmarks())} (model, skill) cells: {worst:.2f}")


if __name__ == "__main__":
    main()
