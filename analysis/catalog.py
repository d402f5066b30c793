"""Names the analysis needs to know: models, pairs, methods, benchmarks and which sweep file produces what.

Everything here is display or bookkeeping; the runs themselves are identified by their MLflow tags
(``graft.method``, ``graft.model``, ``graft.peer``, ``graft.seed``, ...), never by experiment names.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from omegaconf import OmegaConf

from graft_exp.config import MODELS_FILE, MethodConfig
from graft_exp.methods import METHODS
from graft_exp.schema import NO_PEER

#: The paper's benchmark order (Table 1); benchmarks of other suites follow alphabetically.
BENCH_ORDER = ("math500", "aime2024", "aime2025", "amc23", "minerva")
BENCH_DISPLAY = {
    "math500": "MATH500",
    "aime2024": "AIME2024",
    "aime2025": "AIME2025",
    "amc23": "AMC23",
    "minerva": "Minerva",
}

#: Each catalog model's display name (``display`` in conf/catalog/models.yaml).
MODEL_DISPLAY = {key: entry["display"] for key, entry in OmegaConf.load(MODELS_FILE).items()}
#: One-letter names used by the paper's ablation table (S: SmolLM3-3B, Q: Qwen3-1.7B).
MODEL_SHORT = {
    "smollm3-3b-base": "S",
    "qwen3-1.7b-base": "Q",
    "octothinker-3b-hybrid-base": "O",
}

#: Pair -> (model A, model B). Pairs found in MLflow tags take precedence; these are the fallback that lets a
#: table list what is missing from an empty store.
PAIRS = {
    "pair1": ("smollm3-3b-base", "qwen3-1.7b-base"),
    "pair2": ("octothinker-3b-hybrid-base", "qwen3-1.7b-base"),
    "pair3": ("smollm3-3b-base", "octothinker-3b-hybrid-base"),
    "tiny": ("tiny-char-llama", "tiny-bpe-gpt2"),
}
PAPER_PAIRS = ("pair1", "pair2", "pair3")
#: The pair of the paper's ablation, compute, and clip-dynamics studies.
STUDY_PAIR = "pair1"

#: The paper's default compatibility threshold; a ``graft`` run with another ``method.delta`` is a sweep point.
DEFAULT_DELTA = MethodConfig.delta
DELTA_PARAM = "method.delta"
#: In a group of K > 2 models each receiver learns from all its peers at once; the source rule picks among
#: peers that solved the same prompt, so each rule is its own method key (:func:`all_peers_method`).
SOURCE_RULE_PARAM = "method.source_rule"
#: The reference "best single peer" of the group table: the pair run whose peer gave the higher mean Avg.
BEST_PEER = "best_peer"

SINGLE_MODEL_METHODS = ("grpo_n8", "grpo_n16", "grpo_n32", "grpo_ds")


def peer_of(method: str, peer: str) -> str:
    """The ``graft.peer`` a run of ``method`` with ``peer`` records: ``schema.NO_PEER`` for a model trained alone."""
    return NO_PEER if method in SINGLE_MODEL_METHODS else peer
N8_METHODS = ("grpo_n8", "hacpo", "sgt", "graft")

#: Paper-style names of the methods, from their declarations (graft_exp/methods/__init__.py).
METHOD_DISPLAY = {name: decl.display for name, decl in METHODS.items()}

#: Methods drawn in the validation-curve figure, costed in the compute table and Fig. 3, and in the clip table.
CURVE_METHODS = ("grpo_n8", "grpo_n16", "grpo_n32", "hacpo", "sgt", "graft")
COMPUTE_METHODS = ("grpo_n8", "grpo_n16", "grpo_n32", "grpo_ds", "hacpo", "sgt", "graft", "graft_stored")
CLIP_METHODS = ("graft_peer_first", "graft_peer_uniform", "graft")

ABLATION_COMPONENTS = (
    "graft_no_gate", "graft_no_floor", "graft_no_balance", "graft_seq_ratio",
    "graft_random_prompts", "graft_random_admission", "graft_peer_first", "graft_peer_uniform",
)
ALTERNATIVE_DESIGNS = (
    "graft_pooled", "graft_success_only", "graft_success_only_no_floor",
    "hacpo_which", "sgt_which", "graft_luffy",
)


def delta_method(delta: float) -> str:
    """Method key of a point of the threshold sweep (``method=graft method.delta=<delta>``)."""
    return f"graft {DELTA_PARAM}={delta:g}"


def all_peers_method(method: str, source_rule: str) -> str:
    """Method key of a group run (every other member a peer) with ``method.source_rule=<source_rule>``."""
    return f"{method} all peers {SOURCE_RULE_PARAM}={source_rule}"


def method_display(method: str) -> str:
    """Paper-style name of a method key (the conf name, a delta-sweep point, a group's all-peers run)."""
    if method.startswith(f"graft {DELTA_PARAM}="):
        return f"δ={method.split('=', 1)[1]}"
    if f" all peers {SOURCE_RULE_PARAM}=" in method:
        name, rule = method.split(f" all peers {SOURCE_RULE_PARAM}=")
        return f"{METHOD_DISPLAY.get(name, name)}, all peers ({rule.replace('_', ' ')})"
    if method == BEST_PEER:
        return "best single peer"
    return METHOD_DISPLAY.get(method, method)


def model_display(model: str) -> str:
    return MODEL_DISPLAY.get(model, model)


def bench_display(bench: str) -> str:
    return BENCH_DISPLAY.get(bench, bench)


def order_benches(benches) -> list[str]:
    """Paper order first, then any other benchmark alphabetically (the tiny pair has its own suite)."""
    known = [b for b in BENCH_ORDER if b in benches]
    return known + sorted(set(benches) - set(known))


# The one place that says which sweep file produces which runs (named in "missing" warnings).
#: The repository root (the sweep files' paths are relative to it).
ROOT = Path(__file__).resolve().parents[1]
SWEEP_FILES = {
    "main": "sweeps/main.yaml",
    "ablation": "sweeps/ablation.yaml",
    "alternatives": "sweeps/alternatives.yaml",
    "delta": "sweeps/delta.yaml",
    "stability": "sweeps/stability.yaml",
    "stored": "sweeps/stored.yaml",
    "clip_dynamics": "sweeps/clip_dynamics.yaml",
    "compute": "sweeps/compute.yaml",
    "tiny": "sweeps/tiny.yaml",
    "tiny3": "sweeps/tiny3.yaml",
}


def sweep_for(table: str, method: str, seed: int, model: str | None = None) -> str:
    """The sweep file whose runs fill a cell of ``table`` for ``method`` and ``seed`` (of ``model``)."""
    if table.startswith("group"):
        study = "tiny3"    # the K-model study
    elif model in PAIRS["tiny"]:
        study = "tiny"     # every study of the tiny pair is one sweep file
    elif table == "clipfrac-position":
        study = "clip_dynamics"
    elif table == "training-variance" and seed != 0:
        study = "stability"
    elif method == "grpo_ds":
        study = "compute"
    elif method == "graft_stored":
        study = "stored"
    elif method.startswith(f"graft {DELTA_PARAM}="):
        study = "delta"
    elif method in ABLATION_COMPONENTS:
        study = "ablation"
    elif method in ALTERNATIVE_DESIGNS:
        study = "alternatives"
    elif method in main_sweep_methods():
        study = "main"
    else:
        return "none of sweeps/ (add the method to a sweep file's runs)"
    return SWEEP_FILES[study]


@lru_cache(maxsize=1)
def main_sweep_methods() -> frozenset[str]:
    """The methods sweeps/main.yaml runs (its ``runs``' ``method`` values), read once: ``sweep_for`` asks for every
    missing cell of every table."""
    sweep = OmegaConf.load(ROOT / SWEEP_FILES["main"])
    names = [grid.method for grid in sweep.runs]
    return frozenset(str(m) for name in names for m in (name if OmegaConf.is_list(name) else [name]))
