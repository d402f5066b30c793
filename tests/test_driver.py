"""The driver's bookkeeping that no backend can check by itself: GPU-hours by the paper's rules
(App. D; docs/design.md "GPU-hours") with known step timings, and the step's timeline on a test clock."""

from __future__ import annotations

import ast
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support import optional

from graft_exp import costs, driver, schema, step_record
from graft_exp.costs import Timeline, phase, step_costs


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


class Clock:
    """``time.perf_counter`` that moves only when a test says so: the timeline's arithmetic, not the machine's."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(costs.time, "perf_counter", clock)
    return clock


def test_the_timeline_splits_shared_work_and_counts_a_nested_phase_once(clock):
    timeline = Timeline(["A", "B"])
    with timeline("generate", "A"):
        clock.advance(3.0)
        with phase("logprob"):            # a backend's part of the driver's phase: the outer one pauses
            clock.advance(2.0)
        clock.advance(1.0)
    with timeline("score", "A", "B"):      # the exchange's bookkeeping, for both
        clock.advance(1.0)
        with timeline("score", "B"):      # B's scorer
            clock.advance(4.0)
    assert timeline.seconds["A"] == {**dict.fromkeys(schema.PHASES, 0.0), "generate": 4.0, "logprob": 2.0,
                                     "score": 0.5}
    assert timeline.seconds["B"]["score"] == 4.5
    assert timeline.busy("A") == 6.5 and timeline.busy("B") == 4.5


def test_a_phase_outside_a_step_times_nothing_and_threads_keep_their_own(clock):
    with phase("sync"):                    # a backend called directly (tests, the preflight's tools)
        clock.advance(1.0)
    timeline = Timeline(["A", "B"])

    def work(role):
        with timeline("update", role), phase("logprob"):
            clock.advance(0.5)
        return role
    with ThreadPoolExecutor(2) as pool:   # the driver's pool: each thread's phases are its own
        assert list(pool.map(work, ["A", "B"])) == ["A", "B"]
    assert {r: timeline.seconds[r]["logprob"] for r in "AB"} == {"A": 0.5, "B": 0.5}
    assert timeline.busy("A") == timeline.busy("B") == 0.5


def test_timeline_metrics_wait_and_mfu():
    seconds = {**dict.fromkeys(schema.PHASES, 0.0), "generate": 4.0, "update": 2.0}
    # a CPU: no peak, no MFU; the wait is the step (before its record) less the model's busy time
    m = step_record.timeline_metrics(seconds, 10.0, {}, update_flops=4e12, devices=2, peak=None)
    assert m[schema.WAIT_SECONDS] == 4.0 and schema.MFU not in m and m["time/update_s"] == 2.0
    # the local backend on an H200: counted FLOPs over the update's device-seconds at the dense peak
    m = step_record.timeline_metrics(seconds, 10.0, {}, update_flops=989e12, devices=2,
                                     peak=costs.dense_peak("NVIDIA H200"))
    assert m[schema.MFU] == pytest.approx(0.25)
    # verl's own figure wins where its update reported one
    assert step_record.timeline_metrics(seconds, 6.0, {step_record.UPDATE_MFU: 0.31}, 1.0, 2, None)[schema.MFU] == 0.31


def test_dense_peaks_are_verls():
    """verl's own table, read from its source (importing verl takes seconds): the local backend's MFU divides by the
    peaks verl's update divides by."""
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip(optional.WITHOUT_VERL)
    source = (Path(spec.origin).parent / "utils" / "flops_counter.py").read_text()
    table = next(node.value for node in ast.parse(source).body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", "") == "_DEVICE_FLOPS")
    verls = ast.literal_eval(table)
    for name, peak in costs.DENSE_BF16_PEAK.items():
        assert verls[name] == peak, name
    assert costs.dense_peak("NVIDIA H100 80GB HBM3") == 989e12 and costs.dense_peak("NVIDIA GB200") == 2.5e15
    assert costs.dense_peak("Intel Xeon") is None


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
