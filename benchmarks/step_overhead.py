"""GRAFT's co-training step time over the sum of the two models' GRPO n=8 step times, same prompts.

    python benchmarks/step_overhead.py [--steps 8] [--threads 1] [overrides ...]

Builds one GRAFT trainer and one GRPO n=8 trainer of the tiny pair with the same seed (so every step
sees the same prompt batch), runs their steps interleaved (so background load hits both alike), and
prints the per-step times and the ratio of the sums; the first step of each is a warm-up and is not
counted. GRAFT adds no rollouts (paper App. B): its extra cost is the receiver-side scoring of the
transferred responses, so the ratio should stay close to 1 (target <= 1.10).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from graft_exp import tracking
from graft_exp.backends.local import LocalBackend
from graft_exp.config import register_schemas, validate
from graft_exp.driver import Driver

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def trainer(method: str, store: Path, threads: int, overrides: list[str]) -> Driver:
    store.mkdir(parents=True)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"method={method}", f"tracking.uri=sqlite:///{store}/mlflow.db", f"checkpoint_root={store}/ckpt",
            "backend.progress=false", f"backend.threads={threads}", *overrides])
    validate(cfg)
    return Driver(cfg, tracking.open_job(cfg), LocalBackend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both trainers, e.g. seed=1")
    args = parser.parse_args()
    register_schemas()
    with tempfile.TemporaryDirectory() as tmp:
        graft = trainer("graft", Path(tmp) / "graft", args.threads, args.overrides)
        grpo = trainer("grpo_n8", Path(tmp) / "grpo", args.threads, args.overrides)
        totals = {"graft": 0.0, "grpo_n8": 0.0}
        print(f"{'step':>4} {'graft s':>8} {'grpo_n8 s':>9} {'ratio':>6} {'A->B':>5} {'B->A':>5}")
        for step in range(1, args.steps + 1):
            times = {}
            for name, t in (("graft", graft), ("grpo_n8", grpo)):
                start = time.perf_counter()
                _, job_metrics = t.co_train_step(step)
                times[name] = time.perf_counter() - start
                if name == "graft":
                    exchanged = job_metrics["exchange/A_to_B"], job_metrics["exchange/B_to_A"]
            if step > 1:
                for name in totals:
                    totals[name] += times[name]
            print(f"{step:>4} {times['graft']:>8.2f} {times['grpo_n8']:>9.2f} "
                  f"{times['graft'] / times['grpo_n8']:>6.3f} {exchanged[0]:>5.0f} {exchanged[1]:>5.0f}"
                  + ("   (warm-up, not counted)" if step == 1 else ""))
        ratio = totals["graft"] / totals["grpo_n8"]
        print(f"GRAFT step / (GRPO n=8 step of A + of B), steps 2..{args.steps}: "
              f"{totals['graft']:.1f} s / {totals['grpo_n8']:.1f} s = {ratio:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
