"""The counted charge against measurement: each method's counted FLOPs per step (``cost/flops``) beside the
processor time its step takes, as ratios to GRPO n=8's, measured side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/compute_charge.py [--steps 6] [--methods grpo_n8 graft ...] [overrides ...]

Builds one trainer per method on the tiny pair with the same seed (so every method's step t sees the same
prompt batch), runs their steps interleaved (so background load falls on all alike) and measures each step's
process CPU time (``time.process_time``: every thread of this process, so the two models' concurrent work
counts in full, and a neighbour's load does not; reward verification runs in worker processes and counts in
neither charge) and wall time. The first step of each is a warm-up and is not counted. If the count were a
perfect proxy of the work, "counted / measured" would be 1.00 for every method: where it is off by more than
~20 %, the docs (docs/clusters.md, "Counted FLOPs") say what the count leaves out.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

from graft_exp import schema, tracking
from graft_exp.backends.local import LocalBackend
from graft_exp.config import register_schemas, validate
from graft_exp.driver import Driver

CONF = str(Path(__file__).resolve().parents[1] / "conf")
METHODS = ["grpo_n8", "grpo_n16", "grpo_n32", "graft", "sgt", "hacpo"]


def trainer(method: str, store: Path, overrides: list[str]) -> Driver:
    store.mkdir(parents=True)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"method={method}", f"tracking.uri=sqlite:///{store}/mlflow.db", f"checkpoint_root={store}/ckpt",
            "backend.progress=false", "backend.threads=1", *overrides])
    validate(cfg)
    return Driver(cfg, tracking.open_job(cfg), LocalBackend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per method (the first is a warm-up)")
    parser.add_argument("--methods", nargs="+", default=METHODS, help="the first is the reference")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every trainer")
    args = parser.parse_args()
    register_schemas()
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {m: trainer(m, Path(tmp) / m, args.overrides) for m in args.methods}
        cpu = {m: [] for m in args.methods}
        wall = {m: [] for m in args.methods}
        flops = {m: [] for m in args.methods}
        for step in range(1, args.steps + 1):
            for method, job in trainers.items():
                before, started, counted = time.process_time(), time.perf_counter(), job.job_flops
                _, job_metrics = job.co_train_step(step)
                if step > 1:
                    cpu[method].append(time.process_time() - before)
                    wall[method].append(time.perf_counter() - started)
                    flops[method].append(job_metrics[schema.FLOPS] - counted)
            print(f"step {step}/{args.steps} done", flush=True)
        for job in trainers.values():
            job.backend.close()
    reference = args.methods[0]
    mean = statistics.fmean
    table = Table(title=f"counted vs measured cost per step (tiny pair, mean of steps 2-{args.steps}; ratios to "
                        f"{reference})", title_justify="left")
    for column in ("method", "GFLOPs / step (counted)", "CPU s / step", "wall s / step", "counted ratio",
                   "measured ratio (CPU)", "counted / measured", "GFLOPs per CPU s"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for method in args.methods:
        counted = mean(flops[method]) / mean(flops[reference])
        measured = mean(cpu[method]) / mean(cpu[reference])
        table.add_row(method, f"{mean(flops[method]) / 1e9:.1f}", f"{mean(cpu[method]):.2f}",
                      f"{mean(wall[method]):.2f}", f"{counted:.2f}", f"{measured:.2f}", f"{counted / measured:.2f}",
                      f"{mean(flops[method]) / 1e9 / mean(cpu[method]):.1f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
