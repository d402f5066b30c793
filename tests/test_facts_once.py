"""Facts written once: each pattern below is a fact that used to stand in several files and drifted (a clip range,
the experiment filter, the spread behind "±", the rescue rule, a core count, the single-model peer); it may appear
in its one home only, and everything else reads it from there. A new copy of one fails here, naming the file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("graft_exp", "analysis") for p in (ROOT / folder).rglob("*.py"))

#: pattern -> the one file allowed to hold it (relative to the repository)
HOMES = {
    r"\b0\.28\b": "graft_exp/hyperparameters.py",                    # DAPO's clip-high (and every App. B constant)
    r"= (3e-4|4e-4|0\.025)\b": "graft_exp/hyperparameters.py",         # HACPO's released clamps
    r"LIKE '": "graft_exp/schema.py",                                  # the graft/ experiments' filter
    r"f\"graft/\{[a-z_.]*study": "graft_exp/schema.py",              # a study's experiment name
    r"ddof=1": "graft_exp/intervals.py",                              # the sample s.d. behind every "±"
    r"== 0\) & \(": "graft_exp/scores.py",                            # receiver failed all, a source solved
    r"cpu_count\(": "graft_exp/scheduler.py",                         # the cores a process may use
}


@pytest.mark.parametrize("pattern", list(HOMES))
def test_each_fact_stands_in_its_home_only(pattern):
    found = {str(p.relative_to(ROOT)) for p in SOURCES if re.search(pattern, p.read_text())}
    assert found <= {HOMES[pattern]}, f"{pattern!r} written outside {HOMES[pattern]}: {sorted(found)}"


def test_the_analysis_names_the_single_model_peer_by_its_schema_constant():
    quoted = [str(p.relative_to(ROOT)) for p in SOURCES if p.parts[-2] == "analysis" and '"none"' in p.read_text()]
    assert not quoted, f"schema.NO_PEER, not a bare 'none', in {quoted}"
