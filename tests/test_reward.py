"""The reward: math-verify on the final complete boxed answer, parsed as LaTeX on both sides, with the
same result in the main thread, in threads and in the worker pool, and a real timeout (docs/design.md
"Rewards — traps measured here"). Real math-verify throughout; golds go through prepare.gold_answer.

The cases of tests/data/reward_cases.yaml run (1) in the main thread, (2) in a ThreadPoolExecutor, each
after clearing math-verify's own parse caches, and (3) as one batch through a fresh RewardPool's
worker processes. graft_exp.reward keeps no cache of its own.
"""

import multiprocessing
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from math_verify import parser as math_verify_parser

from graft_exp.prepare import SOURCES, gold_answer
from graft_exp.reward import (
    MAX_WORKERS,
    PAIRS_PER_WORKER,
    RewardPool,
    default_workers,
    last_boxed,
    reward,
    rewards,
    verify_answer,
)

CASES = yaml.safe_load((Path(__file__).parent / "data" / "reward_cases.yaml").read_text())
# A power tower: sympy evaluates 9^(9^9) digit by digit for minutes, in bounded memory.
PATHOLOGICAL = "So the count is $\\boxed{9^{9^{9^{9}}}}$."


def gold(case: dict) -> str:
    source = SOURCES[case["source"]]
    return gold_answer({source.answer: case["gold"]}, source)


def in_process(response: str, gold_text: str) -> float:
    """The reward computed in the calling thread, with math-verify's caches emptied first."""
    math_verify_parser.parse_latex_cached.cache_clear()
    math_verify_parser.parse_expr_cached.cache_clear()
    answer = last_boxed(response)
    return 0.0 if answer is None or not answer.strip() else verify_answer(answer, gold_text)


@pytest.fixture(scope="module")
def pool():
    pool = RewardPool(workers=2)
    yield pool
    pool.close()


def test_enough_realistic_cases_over_every_benchmark():
    assert len(CASES) >= 60
    assert len({c["case"] for c in CASES}) == len(CASES)
    assert {c["source"] for c in CASES} == set(SOURCES)
    assert sum(c.get("issue", False) for c in CASES) >= 8
    assert {c["reward"] for c in CASES} == {0, 1}


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_case_in_main_thread_and_in_a_thread(case):
    assert in_process(case["response"], gold(case)) == case["reward"]
    with ThreadPoolExecutor(max_workers=1) as executor:
        assert executor.submit(in_process, case["response"], gold(case)).result() == case["reward"]


@pytest.mark.slow   # starts the verifier worker processes
def test_cases_through_the_worker_pool(pool):
    scores = rewards([c["response"] for c in CASES], [gold(c) for c in CASES], pool=pool)
    assert {c["case"]: s for c, s in zip(CASES, scores)} == {c["case"]: float(c["reward"]) for c in CASES}
    assert pool.timeouts == 0


@pytest.mark.slow   # starts the verifier worker processes
def test_shared_pool_from_concurrent_threads():
    """verl scores rollouts and validations in threads: they share the process's pool."""
    responses, golds = [c["response"] for c in CASES], [gold(c) for c in CASES]
    expected = [float(c["reward"]) for c in CASES]
    slices = [slice(start, start + 25) for start in range(0, 100, 25)]
    with ThreadPoolExecutor(max_workers=4) as executor:
        results = list(executor.map(lambda part: rewards(responses[part], golds[part]), slices))
    assert results == [expected[part] for part in slices]
    assert [reward(r, g) for r, g in zip(responses[:5], golds[:5])] == expected[:5]


@pytest.mark.slow   # waits out the 5 s verification timeout
@pytest.mark.timeout(120)
def test_pathological_answer_times_out_and_the_pool_goes_on():
    pool = RewardPool(workers=2, timeout_s=3.0)
    try:
        pool.start(2 * PAIRS_PER_WORKER)   # both workers, started outside the timed part
        rewards(["\\boxed{1}"], ["1"], pool=pool)
        before = {w.process.pid for w in pool._workers}
        batch = [PATHOLOGICAL] + [c["response"] for c in CASES[:20]]
        golds = ["5"] + [gold(c) for c in CASES[:20]]
        start = time.monotonic()
        scores = rewards(batch, golds, pool=pool)
        elapsed = time.monotonic() - start
        assert scores == [0.0] + [float(c["reward"]) for c in CASES[:20]]
        assert pool.timeouts == 1
        assert elapsed < 60, f"a 3 s timeout held the batch for {elapsed:.1f} s"
        replaced = before - {w.process.pid for w in pool._workers}
        assert len(replaced) == 1 and not _alive(replaced.pop())
        after = CASES[20:50]
        assert rewards([c["response"] for c in after], [gold(c) for c in after], pool=pool) == \
            [float(c["reward"]) for c in after]
    finally:
        pool.close()


@pytest.mark.slow   # starts the verifier worker processes
def test_start_returns_at_once_and_close_stops_the_workers():
    pool = RewardPool(workers=2)
    start = time.monotonic()
    pool.start(2 * PAIRS_PER_WORKER)
    assert time.monotonic() - start < 1.0  # the interpreters import math-verify in the background
    processes = [w.process for w in pool._workers]
    assert len(processes) == 2
    assert rewards(["\\boxed{\\pi}"], ["\\pi"], pool=pool) == [1.0]
    pool.close()
    # stdin closed: an idle worker exits on its own, one still starting is killed after a second
    assert all(p.returncode is not None for p in processes)
    assert rewards(["\\boxed{\\pi}"], ["\\pi"], pool=pool) == [1.0]  # a closed pool starts again
    pool.close()


@pytest.mark.slow   # starts the verifier worker processes
def test_a_pool_starts_the_workers_its_calls_need():
    """A worker costs about a second and a half of a core to start and verifies a small batch in milliseconds:
    a small call runs on one worker; a larger one starts one per PAIRS_PER_WORKER pairs, at most the pool's
    size, and the pool keeps them."""
    pool = RewardPool(workers=3)
    try:
        assert rewards([c["response"] for c in CASES[:10]], [gold(c) for c in CASES[:10]], pool=pool) == \
            [float(c["reward"]) for c in CASES[:10]]
        assert len(pool._workers) == 1
        many = [(str(i), str(i)) for i in range(PAIRS_PER_WORKER + 1)]
        assert pool.score(many) == [1.0] * len(many) and len(pool._workers) == 2
        assert pool.score(many * 3) == [1.0] * 3 * len(many) and len(pool._workers) == 3   # the pool's size
        assert pool.score(many[:3]) == [1.0] * 3 and len(pool._workers) == 3
    finally:
        pool.close()


def test_workers_import_this_package_whatever_the_working_directory(tmp_path, monkeypatch):
    """A caller in a directory holding another graft_exp (an older checkout) still gets this reward."""
    (tmp_path / "graft_exp").mkdir()
    (tmp_path / "graft_exp" / "__init__.py").write_text("raise ImportError('the other checkout')\n")
    monkeypatch.chdir(tmp_path)
    pool = RewardPool(workers=1)
    try:
        assert rewards(["\\boxed{2.88e-18}", "\\boxed{4:30 \\text{ p.m.}}"], ["2.88e-19", "\\text{4:30 p.m.}"],
                       pool=pool) == [0.0, 1.0]
    finally:
        pool.close()


def test_a_worker_killed_between_batches_is_replaced(pool):
    rewards(["\\boxed{1}"], ["1"], pool=pool)
    victim = next(w for w in pool._workers if w.ready)  # as the OOM killer would pick it
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.wait()
    assert rewards(["\\boxed{\\frac{1}{2}}"] * 8 + ["\\boxed{3}"] * 8, ["0.5"] * 8 + ["4"] * 8, pool=pool) == \
        [1.0] * 8 + [0.0] * 8


def _score_in_child(queue, parent_pool):
    try:
        parent_pool.score([("1", "1")])
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    queue.put((refused, rewards(["\\boxed{\\dfrac{9}{7}}", "\\boxed{2}"], ["\\frac{9}{7}", "2\\sqrt{3}"])))


@pytest.mark.slow   # a forked child starts its own worker processes
def test_forked_child_gets_its_own_pool(pool):
    """A forked child (a data loader, a launcher) must not use its parent's worker pipes: the shared
    pool is remade there, and a pool made by the parent refuses to run."""
    rewards(["\\boxed{1}"], ["1"])  # the parent's shared pool is running
    rewards(["\\boxed{1}"], ["1"], pool=pool)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_score_in_child, args=(queue, pool))
    child.start()
    refused, scores = queue.get(timeout=120)
    child.join(30)
    assert child.exitcode == 0
    assert "forked child" in refused and scores == [1.0, 0.0]
    assert reward("\\boxed{7}", "7") == 1.0 and rewards(["\\boxed{7}"], ["7"], pool=pool) == [1.0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("response, expected", [
    ("7+8=15, 4+3+1=8, so 85. \\boxed{85}", "85"),
    ("...=187 \\boxed{18", None),                       # unclosed: math-verify alone would extract 187
    ("\\boxed{17} and then \\boxed{18}", "18"),          # two boxes: the last one counts
    ("\\boxed{17} \\boxed{1", "17"),                     # a trailing unclosed box does not hide the last complete one
    ("\\boxed{\\frac{34}{2}}", "\\frac{34}{2}"),         # nested braces are balanced
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),                 # escaped braces are content
    ("\\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),  # even unpaired
    ("\\boxed {12} then \\fbox{13}", "13"),              # \boxed {..} and \fbox{..} are boxes
    ("\\boxed 5", None),                                 # the bare-argument form is not
    ("\\boxed{\\boxed{5}}", "5"),                         # nested: the inner box is the last to open
    ("no box at all: 85", None),
    ("", None),
])
def test_last_boxed(response, expected):
    assert last_boxed(response) == expected


def test_tiny_pair_answers_unchanged():
    """The tiny task's answers: small integers, negative ones from `sub`'s steps never reach the box."""
    golds = [str(v) for v in (0, 7, 42, 85, 99, 100, 324, 891)]
    assert rewards([f"so {g}. \\boxed{{{g}}}" for g in golds], golds) == [1.0] * len(golds)
    assert rewards([f"\\boxed{{{int(g) + 1}}}" for g in golds], golds) == [0.0] * len(golds)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        rewards(["\\boxed{1}", "\\boxed{2}"], ["1"])
    with pytest.raises(TypeError, match="must be strings, got int 7"):
        rewards(["\\boxed{7}"], [7])
    with pytest.raises(ValueError, match="at least one worker"):
        RewardPool(workers=0)
    assert rewards([], []) == []


def test_a_pool_has_a_worker_per_core_of_its_job(monkeypatch):
    """A job whose launcher shares the machine's cores between jobs (``GRAFT_JOB_CORES``, cluster=local) starts
    one worker per core of its share, not one per core of the machine."""
    monkeypatch.setenv("GRAFT_JOB_CORES", "1")
    assert default_workers() == 1
    monkeypatch.delenv("GRAFT_JOB_CORES")
    assert default_workers() == min(MAX_WORKERS, len(os.sched_getaffinity(0)))
