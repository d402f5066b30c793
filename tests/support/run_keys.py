"""The golden run keys of tests/test_run_keys.py: a dozen representative jobs, and each one's identity (the
document its key hashes) in tests/data/run_keys.json, so that a changed key shows which settings changed.

    python tests/support/run_keys.py            # print the keys this code computes, as the test's literals
    python tests/support/run_keys.py --write    # a deliberate re-key: also rewrite tests/data/run_keys.json

Re-keying is deliberate only: it needs a note in README's upgrade notes and `python -m graft_exp.rekey` to
carry existing stores over (docs/design.md, "Run keys")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from graft_exp import tracking
from graft_exp.config import register_schemas

ROOT = Path(__file__).resolve().parents[2]
IDENTITIES = ROOT / "tests" / "data" / "run_keys.json"
#: The budget reference of the budgeted case: the default GRPO n=8 job's key.
REFERENCE = "ac2eaaafd74f01f9"
#: Each case: its overrides (as on the command line) -> what it stands for.
CASES = {
    "": "the embedded default (tiny pair, GRAFT, local)",
    "method=grpo_n8": "a single-model baseline",
    "method=graft seed=3": "another seed",
    "method=graft method.delta=0.9": "a method setting (the threshold sweep)",
    "method=graft method.selection=at_least +method.params.min_solved=0.5": "a rule with parameters",
    "method=graft_stored": "a stored-log replay",
    "method=hacpo pair=tiny_ac": "HACPO on the other tiny pair",
    "group=tiny3": "a group of three",
    "method=grpo_n32 train.max_gpu_hours=0.05": "a GPU-hour budget",
    f"method=graft train.gpu_hours_of={REFERENCE}": "a budget by reference (a sweep's compute_of)",
    "pair=pair1 backend=verl": "pair 1 on verl",
    "pair=pair2 backend=verl cluster=slurm method=sgt": "pair 2 on Slurm",
    "pair=pair3 backend=verl method=grpo_ds seed=2": "pair 3, DAPO",
    "group=trio backend=verl": "the paper models' group",
    "pair=tiny_verl backend=verl": "the tiny pair on verl",
}
#: Model runs whose keys others find: a shared GRPO baseline (pair -> its key for role B, Qwen3 in both).
MODEL_CASES = {"pair=pair1 backend=verl method=grpo_n8": "B", "pair=pair2 backend=verl method=grpo_n8": "B",
               "method=graft": "A"}


def compose_case(overrides: str):
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides.split())


def computed() -> tuple[dict[str, str], dict[str, str], dict[str, dict]]:
    """(job keys, model keys, identities) of every case, as this code computes them."""
    keys, identities = {}, {}
    for overrides in CASES:
        cfg = compose_case(overrides)
        keys[overrides], identities[overrides] = tracking.run_key(cfg), tracking.identity(cfg)
    model_keys = {o: tracking.model_run_key(compose_case(o), role) for o, role in MODEL_CASES.items()}
    return keys, model_keys, identities


if __name__ == "__main__":
    keys, model_keys, identities = computed()
    print("JOB_KEYS = " + json.dumps(keys, indent=4))
    print("MODEL_KEYS = " + json.dumps(model_keys, indent=4))
    if "--write" in sys.argv:
        IDENTITIES.write_text(json.dumps(identities, indent=1, sort_keys=True) + "\n")
        print(f"wrote {IDENTITIES}")
