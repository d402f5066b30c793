"""Figure smoke test: every figure is written as a readable PNG of sensible size and a PDF."""

from __future__ import annotations

import matplotlib.image as mpimg
import pytest
from test_analysis_tables import golden_jobs

from analysis import __main__ as cli
from analysis.synthetic import write_jobs

FIGURES = ("val-curves", "rescue-fraction", "pair-budget", "stored-vs-online", "compute-conservative")


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory, new_store):
    root = tmp_path_factory.mktemp("figures")
    uri = new_store(root)
    write_jobs(uri, golden_jobs(), root / "artifacts")
    return uri


def test_every_figure_is_written(store_uri, tmp_path):
    assert cli.main(["figures", "--tracking-uri", store_uri, "--out", str(tmp_path)]) == 0
    for name in FIGURES:
        image = mpimg.imread(tmp_path / f"{name}.png")
        height, width = image.shape[:2]
        assert width >= 400 and height >= 300, name
        assert image.std() > 0, f"{name} is blank"
        assert (tmp_path / f"{name}.pdf").read_bytes()[:4] == b"%PDF"
