"""The shipped tiny models' row of docs/tiny.md's table: tokenizer size, parameters, pass@1 per skill at T=1.

    python benchmarks/tiny_models.py [--problems 32] [--samples 8] [--seed 7] [--models KEY ...]

Each model samples ``--samples`` responses per held-out problem (the first ``--problems`` of each skill)
at temperature 1.0 / top-p 1.0, the RL sampling settings; pass@1 is the share of correct responses.
"""

from __future__ import annotations

import argparse

import torch
from omegaconf import OmegaConf

from graft_exp.backends.local_policy import LocalPolicy
from graft_exp.reward import rewards
from graft_exp.tiny import models as tiny

TRAIN = OmegaConf.create({"temperature": 1.0, "grad_clip": 1.0, "lr": 1e-6, "betas": [0.9, 0.999],
                          "weight_decay": 0.0, "lr_warmup_steps": 0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--models", nargs="*", default=list(tiny.RECIPES), choices=list(tiny.RECIPES),
                        help="the models to measure (default: every shipped one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    benchmarks = tiny.benchmarks()
    print(f"| model | tokens | params | pass@1 at T=1 ({' / '.join(benchmarks)}) |")
    for key in args.models:
        model, tokenizer = tiny.load(key, progress=False)
        policy = LocalPolicy(key, model, tokenizer, torch.device("cpu"), TRAIN, 48)
        cells = []
        for problems in benchmarks.values():
            problems = problems[:args.problems]
            ids = [policy.encode_prompt(tiny.model_input(p.prompt)) for p in problems]
            out = policy.sample(ids, args.samples, 1.0, 1.0, 48, seed=args.seed)
            scores = rewards(out.texts, [p.answer for p in problems for _ in range(args.samples)])
            cells.append(f"{100 * sum(scores) / len(scores):.0f}")
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"| {key} | {len(tokenizer)} | {params:.2f} M | {' / '.join(cells)} % |")


if __name__ == "__main__":
    main()
