"""``python -m graft_exp.tiny build``: rebuild the shipped tiny models from their recipes.

Writes ``graft_exp/tiny/assets/<key>/`` (weights, tokenizer, recipe hash) for every recipe, or only
the keys given. The build is deterministic on a given machine (seeded init, seeded data stream).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from graft_exp.config import folder_problem
from graft_exp.tiny.models import ASSETS, build
from graft_exp.tiny.recipes import all_recipes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m graft_exp.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build"])
    recipes = all_recipes()
    parser.add_argument("keys", nargs="*", default=list(recipes), help="models to build (default: all)")
    parser.add_argument("--out", type=Path, default=ASSETS, help="directory for <key>/ (default: the shipped assets)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the shipped weights used 1)")
    args = parser.parse_args(argv)
    unknown = [key for key in args.keys if key not in recipes]
    if unknown:
        parser.error(f"unknown tiny model(s) {', '.join(unknown)}; choose from {', '.join(recipes)}")
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: need at least 1")
    problem = folder_problem(args.out)
    if problem:   # before minutes of training
        parser.error(f"--out {args.out}: {problem}; give a folder you can write")
    torch.set_num_threads(args.threads)
    for key in args.keys:
        build(recipes[key], args.out / key)


if __name__ == "__main__":
    main()
