"""Run keys survive the project's own changes (docs/design.md, "Run keys").

The keys of a dozen representative jobs are pinned as literals: a change that alters one fails here with the job
and the settings that changed. The way through is a deliberate, documented re-key (tests/support/run_keys.py
--write, README's upgrade notes, ``python -m graft_exp.rekey`` for existing stores), never an edit of a literal
alone. A new setting keeps every key by being declared with ``config.added_setting``."""

from __future__ import annotations

import dataclasses
import json

import pytest
from support.run_keys import CASES, IDENTITIES, MODEL_CASES, compose_case

from graft_exp import config, tracking

JOB_KEYS = {
    "": "0e1811b58516eba0",
    "method=grpo_n8": "ac2eaaafd74f01f9",
    "method=graft seed=3": "36b52c4aa0111aa2",
    "method=graft method.delta=0.9": "e5672220dbab339f",
    "method=graft method.selection=at_least +method.params.min_solved=0.5": "00898da658f3a3dd",
    "method=graft_stored": "d6643645e7df6d60",
    "method=hacpo pair=tiny_ac": "629015e75684cd0d",
    "group=tiny3": "906c1e6f87196aa2",
    "method=grpo_n32 train.max_gpu_hours=0.05": "c421105acc414e77",
    "method=graft train.gpu_hours_of=ac2eaaafd74f01f9": "f48f61094c381b4a",
    "pair=pair1 backend=verl": "c600de0d992ed51d",
    "pair=pair2 backend=verl cluster=slurm method=sgt": "678e2ce8761472d8",
    "pair=pair3 backend=verl method=grpo_ds seed=2": "366ef2c9ea02f916",
    "group=trio backend=verl": "a49e0328a06f6062",
    "pair=tiny_verl backend=verl": "f1b88e60f63705bf",
}
MODEL_KEYS = {
    "pair=pair1 backend=verl method=grpo_n8": "d542bcdc8f1556ca",   # Qwen3's GRPO baseline, shared by the pairs
    "pair=pair2 backend=verl method=grpo_n8": "d542bcdc8f1556ca",
    "method=graft": "70125bcdb00ea7a3",
}


def changed_settings(pinned: dict, now: dict, path: str = "") -> list[str]:
    """The settings whose value differs between two identities, as ``key: before -> after`` lines."""
    lines = []
    for key in sorted(set(pinned) | set(now)):
        where = f"{path}{key}"
        a, b = pinned.get(key, "<absent>"), now.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            lines += changed_settings(a, b, where + ".")
        elif a != b:
            lines.append(f"{where}: {json.dumps(a)} -> {json.dumps(b)}")
    return lines


@pytest.mark.parametrize("overrides", list(CASES))
def test_the_run_key_of_each_representative_job_is_pinned(overrides):
    cfg = compose_case(overrides)
    key = tracking.run_key(cfg)
    if key != JOB_KEYS[overrides]:
        pinned = json.loads(IDENTITIES.read_text())[overrides]
        diff = "\n  ".join(changed_settings(pinned, tracking.identity(cfg)))
        pytest.fail(f"`python -m graft_exp {overrides}` ({CASES[overrides]}) is keyed {key}, pinned "
                    f"{JOB_KEYS[overrides]}: every run of it in a store would be lost. What changed:\n  {diff}\n"
                    "Declare a new setting with config.added_setting(<the value that reproduces the old "
                    "behaviour>); re-key only deliberately (docs/design.md, 'Run keys').")


@pytest.mark.parametrize("overrides", list(MODEL_CASES))
def test_model_run_keys_are_pinned(overrides):
    assert tracking.model_run_key(compose_case(overrides), MODEL_CASES[overrides]) == MODEL_KEYS[overrides]


def test_a_new_catalog_model_or_a_display_name_changes_no_key():
    cfg = tracking.resolved_config(compose_case(""))
    cfg["models"]["some-new-model"] = {"hf_id": "org/new", "display": "New", "max_positions": 4096}
    cfg["models"]["tiny-bpe-gpt2"]["display"] = "renamed"
    assert tracking.run_key(cfg) == JOB_KEYS[""]
    cfg["models"]["tiny-bpe-gpt2"]["hf_id"] = "org/other-weights"   # the job's own model: other weights
    assert tracking.run_key(cfg) != JOB_KEYS[""]


def test_an_undeclared_setting_rekeys_and_a_declared_one_does_not(monkeypatch):
    """The rule at work on a setting added now: plain, it changes every key (this file's golden test fails);
    declared with ``added_setting``, it enters a key only at a value other than the one reproducing the old
    behaviour."""
    resolved = tracking.resolved_config(compose_case(""))
    resolved["train"]["pinned_date"] = None
    assert tracking.run_key(resolved) != JOB_KEYS[""]

    @dataclasses.dataclass
    class TrainWithPin(config.TrainConfig):
        pinned_date: str | None = config.added_setting(None)

    monkeypatch.setattr(config, "TrainConfig", TrainWithPin)
    assert tracking.run_key(resolved) == JOB_KEYS[""]
    resolved["train"]["pinned_date"] = "2026-11-27"
    assert tracking.run_key(resolved) not in JOB_KEYS.values()


def test_keys_ignore_where_and_how_a_job_runs(monkeypatch):
    """Cluster, tracking, study, checkpoint root and rerun say where or how a job runs: one key for all."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    moved = compose_case("pair=pair2 backend=verl cluster=local method=sgt study=other checkpoint_root=/x "
                         "tracking=server rerun=true")
    assert tracking.run_key(moved) == JOB_KEYS["pair=pair2 backend=verl cluster=slurm method=sgt"]


def test_a_logged_config_gives_the_key_of_its_composition():
    """``python -m graft_exp.rekey`` recomputes keys from a run's logged config.yaml: the same key as composed."""
    import yaml
    from omegaconf import OmegaConf

    for overrides in ("", "group=tiny3", "pair=pair1 backend=verl"):
        cfg = compose_case(overrides)
        logged = yaml.safe_load(OmegaConf.to_yaml(cfg, resolve=True))
        assert tracking.run_key(logged) == JOB_KEYS[overrides]


@pytest.mark.parametrize("overrides,before", [("", "2b46ca99c5dc7537"),
                                              ("method=graft method.delta=0.9", "fa7ca91beea51a1f")])
def test_the_old_cut_copy_rule_finds_the_runs_keyed_before_it(overrides, before):
    """The deliberate re-key of the cut-copy rule (README, "Upgrading"): ``method.cut_copies=train`` computes what
    co-trained jobs computed before the setting, and finds their runs under the keys pinned before it."""
    assert tracking.run_key(compose_case(f"{overrides} method.cut_copies=train".strip())) == before
