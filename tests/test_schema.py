"""The MLflow schema is the contract between training and analysis: ``analysis/`` reads only names
``graft_exp.schema`` lists (the backends' side is checked on real runs in test_local_training.py and
test_verl_contract.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from graft_exp import schema

ANALYSIS = Path(__file__).resolve().parents[1] / "analysis"
PREFIXES = ("train/", "val/", "test/", "cost/", "exchange/", "graft.")


def names_read_by_analysis() -> set[str]:
    """Every string constant (or the literal head of an f-string) in analysis/ that looks like a metric
    or graft tag name."""
    found = set()
    for path in ANALYSIS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                text = str(node.values[0].value) + "<bench>"
            else:
                continue
            if text.startswith(PREFIXES) and " " not in text:
                found.add(text)
    return found


def test_analysis_reads_only_schema_names():
    names = names_read_by_analysis()
    assert {"val/avg", "test/avg", "cost/gpu_hours", "graft.best_step"} <= names   # the scan sees them
    unknown = []
    for name in names:
        if name.startswith("graft."):
            ok = name == "graft." or schema.known_tag(name)
        elif name.endswith("<bench>") or name in ("val/", "test/", "train/"):
            ok = name.split("/")[0] in ("val", "test", "train")
        else:
            ok = schema.known_metric(name, "model") or schema.known_metric(name, "job")
        if not ok:
            unknown.append(name)
    assert not unknown, f"analysis/ reads names that are not in graft_exp/schema.py: {sorted(unknown)}"


def test_schema_checks_names():
    assert schema.known_metric("val/math500", "model") and schema.known_metric("test/avg", "model")
    assert schema.known_metric("exchange/A_to_B", "job") and not schema.known_metric("exchange/A_to_B", "model")
    assert not schema.known_metric("train/clip_frac", "model") and not schema.known_tag("graft.bestep")
