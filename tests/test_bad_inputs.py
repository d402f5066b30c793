"""Every bad input of ``tests/support/bad_inputs.py`` (the table in docs/bad-inputs.md) fails at once, in one
clear message, with a non-zero exit and no traceback, and leaves the store and the checkpoint root as
they were: no run, no experiment, no checkpoint directory. Each case is a process of its own, forked from one
that imported the entry points once (``ForkedCases``); docs/bad-inputs.md's table runs each from a fresh
interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.bad_inputs import CASES, Case, ForkedCases, prepare, seed_store, store_content


@pytest.fixture(scope="module")
def seeded_store(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("seeded")
    seed_store(where)
    return where / "store.db"


@pytest.fixture(scope="module")
def run_case() -> ForkedCases:
    return ForkedCases()


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@pytest.mark.slow   # a process per case
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_fails_early_and_creates_nothing(case: Case, seeded_store, run_case, tmp_path):
    if case.without_gpu:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA GPU: the case is about one that lacks it")
    prepare(case, tmp_path, template=seeded_store)
    before, checkpoints = store_content(tmp_path / "store.db"), files_under(tmp_path / "ckpt")
    done = run_case(case, tmp_path)
    output = done.output
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    assert case.expect in output, output
    assert store_content(tmp_path / "store.db") == before
    assert files_under(tmp_path / "ckpt") == checkpoints
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()
    assert done.seconds < 60, f"took {done.seconds:.0f} s to fail"


def test_the_table_has_the_cases_the_documentation_shows():
    table = (Path(__file__).resolve().parents[1] / "docs" / "bad-inputs.md").read_text()
    assert len(CASES) >= 20
    for case in CASES:
        assert f"| {case.name} |" in table, f"docs/bad-inputs.md lacks {case.name!r}: regenerate it"
