"""Rollout throughput of vLLM with a seed on every request (the verl backend's ``backend.seeded_requests=true``)
against the same requests unseeded, side by side in one vLLM engine (vLLM's CPU build here).

    python benchmarks/seeded_sampling.py                       # 64 prompts x n=8, 48 new tokens, top-p 1.0 and 0.95
    python benchmarks/seeded_sampling.py --prompts 128 --rounds 3

A training step of the paper sends 128 prompts x n=8 requests at temperature 1.0, top-p 1.0; evaluation 8 samples
at 0.6 / 0.95. vLLM samples requests that carry a seed with a generator each (its sampler's per-request path), the
rest batched. The model is the tiny pair's Qwen3-architecture model (graft_exp/tiny/assets/tiny-bpe-qwen3), so the
forward pass is small and the sampler's share of a step is larger than on a real model: the ratio printed is an
upper bound of what seeding costs a CPU engine. What the GPU build adds, FlashInfer's top-p sampler that seeded
requests fall back from, cannot run here. Printed: generated tokens per second of each mode per round and the
ratio unseeded / seeded, rounds alternating the order.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    from graft_exp.seeds import derive_seed
    from graft_exp.tiny.models import ASSETS, model_input
    from graft_exp.tiny.task import SKILLS, train_split

    llm = LLM(model=str(ASSETS / "tiny-bpe-qwen3"), dtype="float32", max_model_len=192, seed=0,
              max_num_seqs=args.prompts * args.n, max_num_batched_tokens=65536)   # no prompt cut across steps:
    # vLLM would rewind a seeded request's generator there, which its CPU build cannot
    problems = train_split(SKILLS, 64, max(args.prompts, 64))[:args.prompts]
    # The backend's layout: every prompt repeated n times, one request per row, each row its own seed.
    rows = [model_input(p.prompt) for p in problems for _ in range(args.n)]
    llm.generate(rows[:8], SamplingParams(max_tokens=4))   # warm-up
    for top_p in (1.0, 0.95):
        def run(seeded: bool, top_p: float = top_p) -> float:
            params = [SamplingParams(temperature=1.0, top_p=top_p, max_tokens=args.max_tokens, ignore_eos=True,
                                     seed=derive_seed(7, i) if seeded else None) for i in range(len(rows))]
            start = time.perf_counter()
            out = llm.generate(rows, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in out)
            return tokens / (time.perf_counter() - start)

        ratios = []
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            speed = {seeded: run(seeded) for seeded in order}
            ratios.append(speed[False] / speed[True])
            print(f"top_p={top_p} round {r}: seeded {speed[True]:,.0f} tok/s, unseeded {speed[False]:,.0f} tok/s, "
                  f"unseeded/seeded {ratios[-1]:.2f}x", flush=True)
        print(f"top_p={top_p}: unseeded/seeded {sum(ratios) / len(ratios):.2f}x (mean of {len(ratios)} rounds, "
              f"{len(rows)} requests of {args.max_tokens} tokens)", flush=True)


if __name__ == "__main__":
    main()
