"""What ``train.probe_transfers`` costs: a GRAFT step's wall time with the probe over without, side by side.

    OMP_NUM_THREADS=1 python benchmarks/probe_cost.py [--steps 8] [overrides ...]

Builds two GRAFT trainers of the tiny pair with the same seed (so both see the same prompts and, the probe
drawing nothing the training uses, train identically), one with the probe, and runs their steps interleaved
(background load falls on both alike). The first step of each is a warm-up. Prints each step's times, the
prompts probed, and the ratio of the sums. The probe samples n responses on each prompt the receivers got a
group on and on their controls: about as much sampling again as those prompts took.
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


def trainer(store: Path, probe: bool, overrides: list[str]) -> Driver:
    store.mkdir(parents=True)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "method=graft", f"tracking.uri=sqlite:///{store}/mlflow.db", f"checkpoint_root={store}/ckpt",
            "backend.progress=false", "backend.threads=1", f"train.probe_transfers={str(probe).lower()}", *overrides])
    validate(cfg)
    return Driver(cfg, tracking.open_job(cfg), LocalBackend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    register_schemas()
    with tempfile.TemporaryDirectory() as tmp:
        plain, probed = trainer(Path(tmp) / "plain", False, args.overrides), trainer(Path(tmp) / "probe", True,
                                                                                      args.overrides)
        times = {"without": [], "with": []}
        for step in range(1, args.steps + 1):
            for name, job in (("without", plain), ("with", probed)):
                started = time.perf_counter()
                metrics, _ = job.co_train_step(step)
                if step > 1:
                    times[name].append(time.perf_counter() - started)
            shown = {role: m.get("transfers/admitted", 0) for role, m in metrics.items()}
            print(f"step {step}: without {times['without'][-1] if step > 1 else float('nan'):.2f} s, with "
                  f"{times['with'][-1] if step > 1 else float('nan'):.2f} s; peer responses admitted {shown}",
                  flush=True)
        for job in (plain, probed):
            job.backend.close()
    ratio = sum(times["with"]) / sum(times["without"])
    print(f"probe cost: {sum(times['with']):.1f} s with / {sum(times['without']):.1f} s without over "
          f"{args.steps - 1} steps = {ratio:.2f}x the step time")


if __name__ == "__main__":
    main()
