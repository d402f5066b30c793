"""sweeps/tiny.yaml: the tiny study's jobs are the tables' cells (every method of the main, stored and
ablation tables on seeds 0-4, one budget), and the stored-trajectory jobs wait for their GRPO n=8 logs."""

from pathlib import Path

from analysis.tables import COMPUTE_METHODS, SEED_TABLES
from graft_exp.sweep import plan

SWEEP = Path(__file__).resolve().parents[1] / "sweeps" / "tiny.yaml"


def test_tiny_study_fills_the_seed_tables():
    sweep = plan(SWEEP, [])
    assert sweep.study == "tiny" and len(sweep.jobs) == 13 * 5
    cells = {(sj.job.cfg.method.name, sj.job.cfg.seed) for sj in sweep.jobs}
    methods = {m for _, ms, _ in SEED_TABLES.values() for m in ms} | set(COMPUTE_METHODS)
    assert cells == {(m, s) for m in methods for s in range(5)}
    for sj in sweep.jobs:
        cfg = sj.job.cfg
        assert cfg.pair.name == "tiny" and cfg.train.max_steps == 20 and cfg.eval.max_problems is None
        assert (cfg.eval.runs, cfg.eval.samples, cfg.eval.val_every) == (2, 4, 5)
        if cfg.method.name == "graft_stored":
            assert [(n.job.cfg.method.name, n.job.cfg.seed) for n in sj.needs] == [("grpo_n8", cfg.seed)]
        else:
            assert sj.needs == []
