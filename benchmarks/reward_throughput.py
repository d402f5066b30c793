"""Reward throughput: responses verified per second on one core and on all cores, side by side.

    python benchmarks/reward_throughput.py [--prompts 128] [--n 8] [--repeats 2] [--workers N]

The batch is a training step's worth (128 prompts x 8 responses) of MATH-style responses built from the
realistic cases of tests/data/reward_cases.yaml (every benchmark's gold format, right and wrong
answers), each behind ~1,500 characters of reasoning (see ``step_batch``). Every pair is distinct and
sent to the pool as it is, so every response is verified. Measured, in one run:

- pool start-up: the first call of a fresh pool (interpreters, math-verify import, warm-up);
- the batch in the calling thread (``verify_answer`` per response: no timeout, each gold parsed for
  every response), through a 1-worker pool and through an all-cores pool, the pools warm (a worker
  parses a group's gold once per chunk); one-core and all-core passes alternate so that background load hits
  both alike, and the best of ``--repeats`` counts;
- the tiny default run's step (16 prompts x 8 integer answers) in the calling thread and through the pool.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import yaml

from graft_exp.prepare import SOURCES, gold_answer
from graft_exp.reward import WARM_UP, RewardPool, default_workers, last_boxed, verify_answer

CASES = Path(__file__).resolve().parents[1] / "tests" / "data" / "reward_cases.yaml"
REASONING = ("Let me set up the problem carefully. We write the given condition as an equation, "
             "simplify both sides and check the edge cases one at a time before combining them. ") * 9


def step_batch(prompts: int, n: int) -> list[tuple[str, str]]:
    """A step's (boxed answer, gold) pairs: ``prompts`` groups of ``n``, one gold per group, as the
    trainer sends them. Group q takes case q's gold (cycling) and the answers of cases q .. q+n-1:
    its own (right or wrong as the case says) and n-1 others (mostly wrong), every pair distinct."""
    answers, golds = [], []
    for case in yaml.safe_load(CASES.read_text()):
        answer = last_boxed(REASONING + case["response"])
        if answer and answer.strip():
            source = SOURCES[case["source"]]
            answers.append(answer)
            golds.append(gold_answer({source.answer: case["gold"]}, source))
    return [(answers[(q + k) % len(answers)], golds[q % len(golds)]) for q in range(prompts) for k in range(n)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=default_workers(), help="all-cores pool size")
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    pairs = step_batch(args.prompts, args.n)
    tiny = [(str(v), str(v if i % 3 else v + 1)) for i, v in enumerate(range(10, 10 + 128))]
    print(f"{len(pairs)} responses, {os.cpu_count()} cores seen, load average {os.getloadavg()[0]:.1f} "
          "(wall-clock rates need idle cores)")

    one, many = RewardPool(workers=1), RewardPool(workers=args.workers)
    try:
        start_one = timed(lambda: one.score(pairs[:1]))
        start_many = timed(lambda: many.score(pairs[:1]))
        print(f"pool start-up (first call): 1 worker {start_one:.2f} s, {many.size} workers {start_many:.2f} s")
        for answer, gold in WARM_UP:  # the calling thread warms up as the workers did
            verify_answer(answer, gold)
        best = {"thread": float("inf"), "one": float("inf"), "many": float("inf")}
        cpu = float("inf")  # CPU seconds of the calling-thread pass: the per-response cost, load or not
        for _ in range(args.repeats):
            cpu_start = time.process_time()
            best["thread"] = min(best["thread"], timed(lambda: [verify_answer(a, g) for a, g in pairs]))
            cpu = min(cpu, time.process_time() - cpu_start)
            best["one"] = min(best["one"], timed(lambda: one.score(pairs)))
            best["many"] = min(best["many"], timed(lambda: many.score(pairs)))
        rate = {k: len(pairs) / v for k, v in best.items()}
        print(f"calling thread : {rate['thread']:8.1f} responses/s  ({1e3 * best['thread'] / len(pairs):.2f} ms each, "
              f"{1e3 * cpu / len(pairs):.2f} ms CPU)")
        print(f"pool, 1 worker : {rate['one']:8.1f} responses/s  ({1e3 * best['one'] / len(pairs):.2f} ms each)")
        print(f"pool, {many.size} workers: {rate['many']:8.1f} responses/s  ({1e3 * best['many'] / len(pairs):.2f} ms each)")
        print(f"all cores / one core: {rate['many'] / rate['one']:.2f}x "
              f"(pool overhead on one core: {best['one'] / best['thread']:.2f}x the calling thread)")
        tiny_thread = min(timed(lambda: [verify_answer(a, g) for a, g in tiny]) for _ in range(args.repeats))
        tiny_pool = min(timed(lambda: many.score(tiny)) for _ in range(args.repeats))
        print(f"tiny step, 128 integer answers: calling thread {1e3 * tiny_thread:.0f} ms, "
              f"pool {1e3 * tiny_pool:.0f} ms; load average now {os.getloadavg()[0]:.1f}")
    finally:
        one.close()
        many.close()


if __name__ == "__main__":
    main()
