"""Sampling throughput and the default job's wall time, backend.sampler=loop vs static_cache, side by side.

    python benchmarks/tiny_speed.py [--repeats 3] [--jobs 1] [--skip-job]

Part 1 (sampling): both shipped tiny models sample the workloads a tiny job runs: a training batch
(16 prompts x n=8 at temperature 1) and an evaluation pass (the 256 held-out problems x 4 samples at
temperature 0.6, top-p 0.95), each with both samplers and the same seed, interleaved so that background
load hits both alike. Prints generated tokens per CPU-second of this process per sampler (one thread:
on an idle machine, per second; on a shared one the wall clock also counts other processes' turns), the
ratio, and how many samples the two produced identically (same seed: they draw from one distribution with one random stream, so
they differ only where float rounding tips a draw). Both run the models as ``graft_exp.tiny.load`` gives them
(GPT-2's GELU fused), so the ratio is the sampler's alone.

Part 2 (the default job): ``python -m graft_exp`` as README's first command runs it (pair=tiny,
method=graft, 30 steps with validation and the final evaluation), in three set-ups per repeat, alternating
their order, each in a fresh process with a private MLflow store: the old one (``backend.sampler=loop``,
the models taking turns), the static-cache sampler alone, and the new default (static cache, the models at
the same time on a core each, ``backend.concurrent=true``). Prints wall times, the CPU time of the job's
processes (user + system, its reward workers included) and the wall-time ratios to the old set-up.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLERS = ("loop", "static_cache")


def sampling(repeats: int) -> None:
    import torch
    from omegaconf import OmegaConf

    from graft_exp.backends.local_policy import LocalPolicy
    from graft_exp.tiny import models as tiny
    from graft_exp.tiny.task import SKILLS, train_split

    torch.set_num_threads(1)
    cfg = OmegaConf.load(ROOT / "conf" / "config.yaml").train
    train_prompts = [p.prompt for p in train_split(SKILLS, tiny.EVAL_SIZE, 2000)[:16]]
    eval_prompts = [p.prompt for problems in tiny.benchmarks().values() for p in problems]
    workloads = {"train 16x8 T=1": (train_prompts, 8, 1.0, 1.0),
                 "eval 256x4 T=0.6 p=0.95": (eval_prompts, 4, 0.6, 0.95)}
    print(f"{'model':16} {'workload':24} {'loop tok/s':>11} {'static tok/s':>13} {'ratio':>6} {'identical':>11}"
          "   (tokens per CPU-second)")
    all_time = dict.fromkeys(SAMPLERS, 0.0)
    all_tokens = 0
    for key in tiny.RECIPES:
        model, tokenizer = tiny.load(key, progress=False)
        policies = {s: LocalPolicy(key, model, tokenizer, torch.device("cpu"), cfg, 48, s) for s in SAMPLERS}
        for name, (prompts, n, temperature, top_p) in workloads.items():
            ids = [policies["loop"].encode_prompt(tiny.model_input(p)) for p in prompts]
            seconds, tokens, same, total = dict.fromkeys(SAMPLERS, 0.0), 0, 0, 0
            for r in range(repeats):
                out = {}
                for sampler in (SAMPLERS if r % 2 == 0 else SAMPLERS[::-1]):
                    start = time.process_time()
                    out[sampler] = policies[sampler].sample(ids, n, temperature, top_p, 48, seed=r)
                    seconds[sampler] += time.process_time() - start
                tokens += sum(len(t) for t in out["loop"].token_ids)
                same += sum(a == b for a, b in zip(out["loop"].token_ids, out["static_cache"].token_ids))
                total += len(out["loop"].token_ids)
            # Both samplers generate (near-)identical samples, so the loop's token count stands for both.
            rate = {s: tokens / seconds[s] for s in SAMPLERS}
            for s in SAMPLERS:
                all_time[s] += seconds[s]
            all_tokens += tokens
            print(f"{key:16} {name:24} {rate['loop']:11.0f} {rate['static_cache']:13.0f} "
                  f"{rate['static_cache'] / rate['loop']:5.2f}x {same:>5}/{total:<5}")
    print(f"{'all':16} {'':24} {all_tokens / all_time['loop']:11.0f} {all_tokens / all_time['static_cache']:13.0f} "
          f"{all_time['loop'] / all_time['static_cache']:5.2f}x")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


#: The default job's set-ups, old first: (name, overrides).
SETUPS = (("loop, in turn", ["backend.sampler=loop", "backend.concurrent=false"]),
          ("static, in turn", ["backend.sampler=static_cache", "backend.concurrent=false"]),
          ("static, concurrent", ["backend.sampler=static_cache", "backend.concurrent=true"]))


def default_job(repeats: int) -> None:
    wall, cpu = {name: [] for name, _ in SETUPS}, {name: [] for name, _ in SETUPS}
    for r in range(repeats):
        for name, overrides in (SETUPS if r % 2 == 0 else SETUPS[::-1]):
            with tempfile.TemporaryDirectory() as tmp:
                command = [sys.executable, "-m", "graft_exp", *overrides, "backend.progress=false",
                           f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"checkpoint_root={tmp}/ckpt",
                           f"hydra.run.dir={tmp}/hydra"]
                start, start_cpu = time.perf_counter(), children_cpu()
                done = subprocess.run(command, cwd=ROOT, check=False, capture_output=True, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
                seconds, cpu_seconds = time.perf_counter() - start, children_cpu() - start_cpu
            if done.returncode:
                sys.exit(f"the default job failed with {' '.join(overrides)}:\n{done.stderr[-3000:]}")
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
            print(f"default job, {name:18} wall {seconds:6.1f} s, CPU {cpu_seconds:6.1f} s "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
    old = SETUPS[0][0]
    for label, times in (("wall", wall), ("CPU", cpu)):
        mean = {name: sum(v) / len(v) for name, v in times.items()}
        print(f"default job {label} time (mean of {repeats}): " + ", ".join(
            f"{name} {mean[name]:.1f} s ({mean[old] / mean[name]:.2f}x)" for name in mean))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="sampling repeats per workload and sampler")
    parser.add_argument("--jobs", type=int, default=1, help="default-job runs per set-up")
    parser.add_argument("--skip-job", action="store_true", help="sampling only")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    sampling(args.repeats)
    if not args.skip_job:
        default_job(args.jobs)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
