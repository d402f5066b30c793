"""Reward throughput: responses verified per second on one core and on all cores, side by side.

    python benchmarks/reward_throughput.py [--prompts 128] [--n 8] [--repeats 2] [--workers N]

The batch is a training step's worth (128 prompts x 8 responses) of real model-written solutions of
1,000 to 2,000 characters: those a Qwen2.5-Math-Instruct model wrote for 100 MATH test problems
(tests/data/math_labelled_solutions.jsonl.gz; see ``step_batch``). Measured, in one run:

- pool start-up: the first call of a fresh pool (interpreters, math-verify import, warm-up);
- the batch in the calling thread (``last_boxed`` and ``verify_answer`` per response: no timeout, each
  gold parsed for every response), through ``rewards`` with a 1-worker pool and with an all-cores pool,
  the pools warm (a worker parses a group's gold once per chunk); one-core and all-core passes
  alternate so that background load hits both alike, and the best of ``--repeats`` counts;
- the tiny default run's step (16 prompts x 8 integer answers) in the calling thread and through the pool.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import time
from pathlib import Path

from graft_exp.prepare import SOURCES, gold_answer
from graft_exp.reward import WARM_UP, RewardPool, default_workers, last_boxed, rewards, verify_answer

SOLUTIONS = Path(__file__).resolve().parents[1] / "tests" / "data" / "math_labelled_solutions.jsonl.gz"


def step_batch(prompts: int, n: int) -> list[tuple[str, str]]:
    """A step's (response, gold) pairs: ``prompts`` groups of ``n`` solutions of 1-2k characters, one
    gold per group, as the trainer scores them. Each solution stands for its final boxed answer (one
    solution per distinct answer), so that the answers cycle through every distinct one and math-verify's
    small parse cache does not turn repeated answers into free ones; the golds cycle through the
    problems' golds."""
    with gzip.open(SOLUTIONS, "rt") as lines:
        problems = [json.loads(line) for line in lines]
    source = SOURCES["math500"]
    golds = list(dict.fromkeys(gold_answer({source.answer: p["answer"]}, source) for p in problems))
    by_answer = {}
    for problem in problems:
        for response in problem["responses"]:
            if 1000 <= len(response) <= 2000 and last_boxed(response):
                by_answer.setdefault(last_boxed(response), response)
    responses = list(by_answer.values())
    return [(responses[(q * n + k) % len(responses)], golds[q % len(golds)]) for q in range(prompts) for k in range(n)]


def verify_in_thread(pairs: list[tuple[str, str]]) -> list[float]:
    """The reward of each pair computed in the calling thread: no pool, no timeout."""
    return [verify_answer(answer, gold) if (answer := last_boxed(response)) else 0.0 for response, gold in pairs]


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
    responses, golds = [r for r, _ in pairs], [g for _, g in pairs]
    distinct = len({(last_boxed(r), g) for r, g in pairs})
    print(f"{len(pairs)} responses of {min(map(len, responses))}-{max(map(len, responses))} characters "
          f"({distinct} distinct answer-gold pairs), {os.cpu_count()} cores seen, load average {os.getloadavg()[0]:.1f} "
          "(wall-clock rates need idle cores)")

    one, many = RewardPool(workers=1), RewardPool(workers=args.workers)
    try:
        start_one = timed(lambda: one.score([("1", "1")]))
        start_many = timed(lambda: many.score([("1", "1")]))
        print(f"pool start-up (first call): 1 worker {start_one:.2f} s, {many.size} workers {start_many:.2f} s")
        for answer, gold in WARM_UP:  # the calling thread warms up as the workers did
            verify_answer(answer, gold)
        best = {"thread": float("inf"), "one": float("inf"), "many": float("inf")}
        cpu = float("inf")  # CPU seconds of the calling-thread pass: the per-response cost, load or not
        for _ in range(args.repeats):
            cpu_start = time.process_time()
            best["thread"] = min(best["thread"], timed(lambda: verify_in_thread(pairs)))
            cpu = min(cpu, time.process_time() - cpu_start)
            best["one"] = min(best["one"], timed(lambda: rewards(responses, golds, pool=one)))
            best["many"] = min(best["many"], timed(lambda: rewards(responses, golds, pool=many)))
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
