"""The driver's bookkeeping that no backend can check by itself: GPU-hours by the paper's rules
(App. D; docs/design.md "GPU-hours") with known step timings, and the per-role timer."""

from __future__ import annotations

import time

import pytest

from graft_exp import driver
from graft_exp.costs import Timer, step_costs


def test_independent_models_pay_their_own_busy_time_on_their_own_gpus():
    # GRPO on verl: A busy 10 s on 2 GPUs, B busy 20 s on 2 GPUs, both at the same time (wall 20 s).
    own, job = step_costs({"A": 10.0, "B": 20.0}, wall=20.0, devices={"A": 2, "B": 2}, co_train=False,
                          concurrent=True)
    assert own == {"A": 20.0, "B": 40.0} and job == 60.0        # not 2 x 20 s x 2 GPUs each
    own, job = step_costs({"A": 3.0, "B": 5.0}, wall=8.0, devices={"A": 1, "B": 1}, co_train=False,
                          concurrent=False)
    assert own == {"A": 3.0, "B": 5.0} and job == 8.0


def test_a_co_trained_pair_pays_the_joint_run_and_the_shares_add_up():
    # Split pools (verl): the step holds all 4 GPUs for its wall time; shares follow each model's busy time.
    shares, joint = step_costs({"A": 10.0, "B": 15.0}, wall=25.0, devices={"A": 2, "B": 2}, co_train=True,
                               concurrent=True)
    assert joint == 100.0 and shares == {"A": 40.0, "B": 60.0}
    # One shared device (local): the wall time once.
    shares, joint = step_costs({"A": 6.0, "B": 2.0}, wall=9.0, devices={"A": 1, "B": 1}, co_train=True,
                               concurrent=False)
    assert joint == 9.0 and shares == pytest.approx({"A": 6.75, "B": 2.25})
    assert sum(shares.values()) == pytest.approx(joint)


def test_timer_splits_shared_work_evenly():
    timer = Timer(["A", "B"])
    with timer("A"):
        time.sleep(0.02)
    with timer("A", "B"):
        time.sleep(0.02)
    assert timer.seconds["A"] > timer.seconds["B"] > 0.009
    assert timer.seconds["A"] - timer.seconds["B"] == pytest.approx(0.02, abs=0.015)


def test_paper_step_count_drops_the_last_partial_batch_of_each_epoch(compose_cfg):
    cfg = compose_cfg("pair=pair1", "backend=verl")
    assert driver.total_steps(cfg, 7500) == 174   # 3 epochs x floor(7500 / 128)


def test_batches_never_cross_an_epoch_boundary():
    problems = list(range(10))
    stream = driver.PromptStream(problems, seed=3)
    batches = [stream.next(4) for _ in range(6)]   # 2 whole batches per epoch; 2 problems dropped
    for epoch in range(3):
        first, second = batches[2 * epoch], batches[2 * epoch + 1]
        assert len(set(first + second)) == 8
        order = list(range(10))
        driver.random.Random(driver.derive_seed(3, "epoch", epoch)).shuffle(order)
        assert first + second == order[:8]


def test_interrupted_checkpoint_writes_are_removed_on_resume_and_save(tmp_path):
    class Backend:
        def save(self, directory, step):
            (directory / "state").write_text(str(step))

    job = driver.Driver.__new__(driver.Driver)
    job.root, job.backend, job.streams, job.members = tmp_path, Backend(), {}, {}
    job.job_device_seconds, job.job_flops = 0.0, 0.0
    (tmp_path / "ckpt-5-abc.tmp").mkdir()
    (tmp_path / "ckpt-5-abc.tmp" / "half").write_text("x")
    job.save_checkpoint(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-5"]
    (tmp_path / "ckpt-10-def.tmp").mkdir()
    job.remove_interrupted_writes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-5"]
