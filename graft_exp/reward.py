"""The binary verifiable reward of the paper (App. B): math-verify on the *final* boxed answer.

What is verified (docs/design.md "Rewards"):

- The last complete ``\\boxed{...}`` of the response, braces balanced (``\\{``/``\\}`` are escaped
  characters, not braces). ``\\boxed {...}`` (a space before the brace, valid LaTeX) and ``\\fbox{...}``
  count as boxes too; the bare-argument form ``\\boxed 5`` does not (its end is ambiguous). An unclosed
  box does not hide an earlier complete one. ``<think>`` blocks get no special treatment: the final box of
  the whole response is the answer, so a truncated response whose only box sits in its reasoning is
  scored on that box ("responses that reach the generation limit are scored as generated").
- Both the answer and the gold are handed to math-verify as delimited LaTeX, ``\\boxed{<text>}``, with
  LaTeX extraction only: a bare string would go to math-verify's plain-expression reader, which reads a
  leading number (``2`` "equals" ``2\\sqrt{3}``) and fails on ``\\frac{\\pi}{4}`` against itself.
- Normalisations math-verify's LaTeX reader lacks, applied to both sides: a plain number in
  e-notation (Minerva's golds, ``7.5e5``) becomes ``7.5\\times10^{5}`` (LaTeX would read ``e`` as Euler's
  number); a trailing percent sign is dropped, like the units and ``^\\circ`` math-verify already
  drops (``25\\%`` and ``25`` agree; ``0.25`` does not); ``\\text {unit}`` loses the space before its
  brace, so the unit is dropped as ``\\text{unit}`` is.
- Numbers are compared by relative difference (``REL_TOL``), not by math-verify's rounding to six
  decimals, which makes every number below ~5e-7 equal (Minerva's ``2.88e-19`` and ``1.325e-27``). When
  both sides are numbers (no variable) and the gold is a measured quantity (written with a decimal point or in
  e-notation), relative closeness decides; when the gold is exact (``\\frac{1}{3}``, ``\\pi/4``) a decimal
  answer must be relatively close *and* pass math-verify's own comparison.
- A symbol keeps one meaning on both sides: math-verify makes symbols complex or real per string (a
  standalone ``i`` makes ``\\frac{e^{2 i t}}{(2+2 i)}`` complex, ``\\frac{e^{2it}}{(2+2i)}`` real), and
  sympy holds the two ``t`` for different symbols; the answer's symbols take the gold's assumptions.
- Text answers that math-verify cannot read as mathematics (``\\text{4:30 p.m.}``, ``\\text{A,D}``)
  match when the two strings are the same after removing ``\\text{}`` wrappers, ``\\left``/``\\right``,
  thin spaces, braces around one character (``E_{1}`` is ``E_1``) and spaces (except between two digits).
- No box, an empty box, an unparsable answer or gold, a verification past ``VERIFY_TIMEOUT_S`` and a
  crashed verifier all score 0, as in the paper.

Where it runs: math-verify's own timeouts use ``signal.alarm`` and raise outside the main thread, so
they are disabled (``parsing_timeout=None``, ``timeout_seconds=None``) and every verification runs in a
pool of worker processes (``RewardPool``): a worker busy past the timeout on one answer is killed and
replaced, that answer scores 0 and the rest of the batch goes on. ``reward``/``rewards`` therefore give
the same result from the main thread, any thread and any process. The workers are fresh interpreters
(``python -c``), not forks: nothing of the trainer (torch threads, CUDA, Hydra or submitit state) is
copied into them, and unlike multiprocessing's spawn they do not re-import the caller's ``__main__``.
The default pool starts lazily on the first call, is reused by every later call of the process and is
shut down at exit. It may use one worker per available core (at most ``MAX_WORKERS``) but starts only as
many as its calls need (one per ``PAIRS_PER_WORKER`` answers of a call): a worker costs about a second and
a half of a core to start, and a small job's whole batch verifies in milliseconds on one.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from graft_exp.scheduler import job_cores

#: Wall-clock seconds one answer may take (parsing both sides and comparing); past it it scores 0.
#: math-verify's own default per operation, which the paper's reward used.
VERIFY_TIMEOUT_S = 5.0
#: More workers than this do not pay: a step's 1,024 responses take ~1 s on one core.
MAX_WORKERS = 16
#: Answers of one call per worker: a call of more starts more workers (up to the pool's size), kept for
#: later calls. A worker verifies this many in ~0.1 s; starting one costs ~1.5 s of a core.
PAIRS_PER_WORKER = 128
#: Seconds a fresh worker may take to import math-verify (sympy) on a loaded node.
START_TIMEOUT_S = 120.0
#: Address-space cap of a worker: a runaway expansion raises MemoryError (scored 0) instead of
#: drawing the node's memory down before the timeout fires.
WORKER_MEMORY_BYTES = 4 << 30

# Each kind of answer costs sympy lazy imports and cache fills the first time it is seen (up to a few
# hundred ms each on a loaded node); a fresh worker pays them before it reports ready, not inside the
# timeout of some answer.
WARM_UP = (("1", "1"), ("\\frac{1}{2}", "0.5"), ("2\\sqrt{3}", "\\sqrt{12}"), ("(1,2)", "(1, 2)"),
           ("x \\in [2,5)", "[2,5)"), ("2 \\le x < 5", "[2,5)"), ("x=5", "5"), ("2x+3", "y=2x+3"),
           ("\\{1,2\\}", "2,1"), ("(x+2)(x+5)", "x^2+7x+10"), ("\\text{(C)}", "C"), ("0.785", "\\frac{\\pi}{4}"),
           ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"))
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d+)(?![\w.])")
_TRAILING_PERCENT = re.compile(r"\s*\\?%\s*$")
_SPACED_TEXT = re.compile(r"\\(text|textbf|textit|mathrm|mbox)\s+\{")
_TEXT_OPEN = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox)\{")
_LAYOUT = re.compile(r"\\left|\\right|\\[,!;: ]|~|\$")
_ONE_CHARACTER_GROUP = re.compile(r"(?<!\\)\{(\w)\}")  # E_{1} is E_1: a macro's one-character argument
_SPACE_NOT_BETWEEN_DIGITS = re.compile(r"(?<!\d)\s+|\s+(?!\d)")
_MEASURED = re.compile(r"\d\.\d|\.\d|\d[eE][+-]?\d")
#: Relative difference under which two numbers are equal: the usual graders of these benchmarks
#: use 1e-4, looser than any rounding a gold states and tighter than a wrong leading digit.
REL_TOL = 1e-4
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, or None.

    Braces must balance; a backslash escapes the next character, so ``\\{1,2\\}`` is content. An
    unclosed box at the end does not hide an earlier complete one: the search walks back from the
    last box until one closes.
    """
    for opening in reversed([m.end() for m in _BOX_OPEN.finditer(text)]):
        depth, i = 1, opening
        while i < len(text):
            char = text[i]
            if char == "\\":
                i += 2
                continue
            depth += (char == "{") - (char == "}")
            if depth == 0:
                return text[opening:i]
            i += 1
    return None


def as_latex(text: str) -> str:
    """``text`` (a boxed answer or a gold) as the delimited LaTeX math-verify is given, normalised."""
    text = _E_NOTATION.sub(r"\1\\times10^{\2}", text.strip())
    text = _SPACED_TEXT.sub(r"\\\1{", text)
    return "\\boxed{" + _TRAILING_PERCENT.sub("", text) + "}"


def plain_text(text: str) -> str:
    """``text`` without ``\\text{}`` wrappers (their content kept), ``\\left``/``\\right``, thin spaces,
    dollars and spaces (a space between two digits is kept: ``2 3`` is not ``23``)."""
    text = _SPACED_TEXT.sub(r"\\\1{", text.strip())
    while (match := _TEXT_OPEN.search(text)) is not None:
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += (text[i] == "{") - (text[i] == "}")
            i += 1
        closing = i - 1 if depth == 0 else len(text)
        text = text[:match.start()] + text[match.end():closing] + text[closing + 1:]
    text = _ONE_CHARACTER_GROUP.sub(r"\1", _LAYOUT.sub(" ", text))
    return _SPACE_NOT_BETWEEN_DIGITS.sub("", text).strip()


def _parse(text: str) -> list:
    # Imported here: the trainer process only dispatches, and need not import sympy at all.
    from math_verify import LatexExtractionConfig, parse

    # LaTeX extraction only: math-verify's ExprExtractionConfig would read a leading number. The
    # boxed pattern first, so the whole delimited string is taken. No signal-based timeout (see module doc).
    return parse(as_latex(text), extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                 parsing_timeout=None)


def _numbers_verdict(gold, answer, measured: bool) -> bool | None:
    """The verdict of the relative comparison when both sides are real numbers (no variable: ``1.6``,
    ``2.88 \\cdot 10^{-19}``, ``\\arcsin(10/13)``) and the gold or the answer holds a decimal, else None
    (math-verify decides). ``measured``: the gold is written as a decimal or in e-notation."""
    from sympy import Basic, Float

    if not (isinstance(gold, Basic) and isinstance(answer, Basic) and gold.is_number and answer.is_number):
        return None
    if not (measured or gold.has(Float) or answer.has(Float)):
        return None
    try:
        gold_value, answer_value = float(gold.evalf(30)), float(answer.evalf(30))
    except (TypeError, ValueError):  # complex, or not a number after all
        return None
    close = abs(gold_value - answer_value) <= REL_TOL * max(abs(gold_value), abs(answer_value))
    if measured or gold.has(Float):
        return close
    return None if close else False  # an exact gold: close is necessary, math-verify decides the rest


def _with_gold_symbols(gold, answer):
    """``answer`` with each symbol replaced by the gold's symbol of the same name (see module doc)."""
    from sympy import Basic, Symbol

    if not (isinstance(gold, Basic) and isinstance(answer, Basic)):
        return answer
    by_name = {s.name: s for s in gold.atoms(Symbol)}
    swap = {s: by_name[s.name] for s in answer.atoms(Symbol) if s.name in by_name and by_name[s.name] != s}
    return answer.xreplace(swap) if swap else answer


def _parse_gold(gold: str) -> tuple[list, bool]:
    """The parsed gold and whether it is a measured quantity (a decimal or e-notation number)."""
    return _parse(gold), bool(_MEASURED.search(gold))


def _verify(gold: str, gold_parsed: tuple[list, bool], answer: str) -> float:
    from math_verify import verify

    parsed, measured = gold_parsed
    answer_parsed = _parse(answer)
    if not parsed or not answer_parsed:
        return 0.0
    answer_parsed = [_with_gold_symbols(parsed[0], answer_parsed[0]), *answer_parsed[1:]]
    verdict = _numbers_verdict(parsed[0], answer_parsed[0], measured)
    if verdict is not None:
        return float(verdict)
    if verify(parsed, answer_parsed, timeout_seconds=None):
        return 1.0
    return float(plain_text(answer) == plain_text(gold) != "")


def verify_answer(answer: str, gold: str) -> float:
    """1.0 if the boxed ``answer`` (its content) is equivalent to ``gold``, else 0.0 (math-verify with
    the normalisations of the module doc).

    Runs in the calling thread with no timeout and no cache: this is what a worker of ``RewardPool``
    runs; callers that need the timeout use ``rewards``.
    """
    return _verify(gold, _parse_gold(gold), answer)


def serve() -> None:
    """A worker's loop: one JSON line of ``[answer, gold]`` pairs in, one line per score out, in order.

    Started by ``RewardPool`` as a fresh interpreter; it exits when its stdin closes. The first line
    it writes is ``ready`` (math-verify imported and warmed up on each kind of answer).
    """
    import resource
    import signal

    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (sympy, math-verify) go to stderr, never into the score stream
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the pool
    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ValueError, OSError):  # a lower hard limit already set, or a platform (macOS) that refuses it
        pass
    # "Timeout is disabled" is by design here, and parse failures are scored 0, not errors.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for answer, gold in WARM_UP:
        verify_answer(answer, gold)
    channel.write("ready\n")
    for line in sys.stdin:
        golds: dict[str, tuple[list, bool]] = {}  # a group's n responses share one gold: parse it once per chunk
        for answer, gold in json.loads(line):
            try:
                if gold not in golds:
                    golds[gold] = _parse_gold(gold)
                score = _verify(gold, golds[gold], answer)
            except Exception:  # noqa: BLE001 -- math-verify catches its own; anything left (MemoryError) scores 0
                score = 0.0
            channel.write(f"{score}\n")


def default_workers() -> int:
    """One worker per core this job may use (``scheduler.job_cores``: Slurm's allocation, or this job's share
    of a machine whose cores a launcher divides between concurrent jobs), at most ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, job_cores()))


class _Worker:
    """One worker process and the unread part of its output."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT,
                                                                          os.environ.get("PYTHONPATH")]))}
        # `python -c` puts its working directory first on sys.path: started in the package root, a worker
        # imports this graft_exp, not another checkout's that the caller's directory happens to hold.
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from graft_exp.reward import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=_PACKAGE_ROOT, text=False)
        self.fd = self.process.stdout.fileno()
        self.buffer = b""
        self.ready = False
        self.started = time.monotonic()
        self.chunk: list[int] = []     # indices of the pairs sent and not yet scored
        self.since = 0.0               # when the worker began its current pair

    def send(self, chunk: list[int], pairs: list[tuple[str, str]]) -> None:
        self.chunk, self.since = list(chunk), time.monotonic()
        self.process.stdin.write(json.dumps([pairs[i] for i in chunk]).encode() + b"\n")
        self.process.stdin.flush()

    def lines(self) -> list[str] | None:
        """Complete lines available now, or None when the worker has exited."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        self.buffer += data
        *complete, self.buffer = self.buffer.split(b"\n")
        return [line.decode() for line in complete]

    def close_stdin(self) -> None:
        try:
            self.process.stdin.close()
        except BrokenPipeError:  # it already exited with a request unread
            pass

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.close_stdin()
        self.process.stdout.close()


class RewardPool:
    """Worker processes that verify ``(answer, gold)`` pairs with a per-answer wall-clock timeout.

    ``score`` spreads a batch over the workers in chunks; a worker that passes ``timeout_s`` on one
    pair (or dies) is killed and replaced, that pair scores 0 and the rest of its chunk is re-queued.
    Thread-safe: concurrent calls take turns (each already uses every worker). Workers start when a call
    (or ``start``) needs them: one per ``PAIRS_PER_WORKER`` pairs, at most ``size``, kept for later calls.
    ``timeouts`` counts the pairs scored 0 that way.
    """

    def __init__(self, workers: int | None = None, timeout_s: float = VERIFY_TIMEOUT_S) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"the verification timeout must be positive, got {timeout_s}")
        self.size = workers or default_workers()
        self.timeout_s = timeout_s
        self.timeouts = 0
        self.pid = os.getpid()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """The score of each ``(answer, gold)`` pair (``verify_answer``), 0.0 past the timeout."""
        with self._lock:
            self._start(len(pairs))
            return self._run(pairs)

    def start(self, pairs: int = 1) -> None:
        """Start the workers a call of ``pairs`` pairs will use, without waiting for them (they import
        math-verify in the background): a trainer that calls this while it loads its models hides the start-up."""
        with self._lock:
            self._start(pairs)

    def _start(self, pairs: int) -> None:
        if os.getpid() != self.pid:
            raise RuntimeError("a RewardPool cannot be used from a forked child; make a new one there")
        wanted = min(self.size, max(1, -(-pairs // PAIRS_PER_WORKER)))
        self._workers += [_Worker() for _ in range(wanted - len(self._workers))]

    def _run(self, pairs: list[tuple[str, str]]) -> list[float]:
        scores = [0.0] * len(pairs)
        # Several chunks per worker balance slow answers; large chunks amortise the pipe round trip.
        size = max(1, min(64, -(-len(pairs) // (4 * len(self._workers)))))
        queue = deque(list(range(start, min(start + size, len(pairs)))) for start in range(0, len(pairs), size))
        while queue or any(w.chunk for w in self._workers):
            for index, worker in enumerate(self._workers):
                if worker.ready and not worker.chunk and queue:
                    chunk = queue.popleft()
                    try:
                        worker.send(chunk, pairs)
                    except BrokenPipeError:  # it died while idle (killed from outside): nothing was in flight
                        worker.kill()
                        self._workers[index] = _Worker()
                        queue.appendleft(chunk)
            waiting = [w for w in self._workers if w.chunk or not w.ready]
            now = time.monotonic()
            deadlines = [w.since + self.timeout_s if w.chunk else w.started + START_TIMEOUT_S for w in waiting]
            readable, _, _ = select.select([w.fd for w in waiting], [], [], max(0.0, min(deadlines) - now))
            for worker in [w for w in waiting if w.fd in readable]:
                lines = worker.lines()
                if lines is None:
                    self._replace(worker, queue, died=True)
                    continue
                for line in lines:
                    if not worker.ready:
                        worker.ready = line == "ready"
                        continue
                    scores[worker.chunk.pop(0)] = float(line)
                    worker.since = time.monotonic()
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.chunk and now - worker.since > self.timeout_s:
                    self._replace(worker, queue, died=False)
                elif not worker.ready and now - worker.started > START_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"a reward worker did not start within {START_TIMEOUT_S:.0f} s")
        return scores

    def _replace(self, worker: _Worker, queue: deque, died: bool) -> None:
        """Kill ``worker`` (hung or dead), score its current pair 0, re-queue the rest of its chunk."""
        if not worker.ready:
            self.close()
            raise RuntimeError(f"a reward worker exited while starting (code {worker.process.poll()}); "
                               "its error is on stderr above")
        worker.kill()
        self.timeouts += not died
        if worker.chunk[1:]:
            queue.appendleft(worker.chunk[1:])  # its current pair keeps the 0.0 it was given
        self._workers[self._workers.index(worker)] = _Worker()
        logging.getLogger(__name__).warning("reward worker %s on one answer; it scores 0 and the worker is "
                                            "replaced", "died" if died else f"timed out ({self.timeout_s:g} s)")

    def close(self) -> None:
        """Stop the workers: their stdin closes and they exit; any still busy after a second is killed."""
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.close_stdin()
        deadline = time.monotonic() + 1.0
        for worker in workers:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.process.stdout.close()


_default_pool: RewardPool | None = None
_default_lock = threading.Lock()


def default_pool() -> RewardPool:
    """The process's shared pool (a forked child gets its own: the parent's pipes are not its to use)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.pid != os.getpid():
            _default_pool = RewardPool()
        return _default_pool


@atexit.register
def _close_default_pool() -> None:
    if _default_pool is not None and _default_pool.pid == os.getpid():
        _default_pool.close()


def rewards(responses: list[str], golds: list[str], pool: RewardPool | None = None) -> list[float]:
    """Binary reward of each response against its gold answer, verified in ``pool`` (default: the
    process's shared pool). Identical ``(answer, gold)`` pairs of the batch are verified once."""
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
    for value in (*responses, *golds):
        if not isinstance(value, str):
            raise TypeError(f"responses and gold answers must be strings, got {type(value).__name__} {value!r}")
    answers = [last_boxed(r) for r in responses]
    unique: dict[tuple[str, str], int] = {}
    for answer, gold in zip(answers, golds):
        if answer is not None and answer.strip():
            unique.setdefault((answer, gold), len(unique))
    if not unique:
        return [0.0] * len(responses)
    scores = (pool or default_pool()).score(list(unique))
    return [scores[unique[(a, g)]] if (a, g) in unique else 0.0 for a, g in zip(answers, golds)]


def reward(response: str, gold: str) -> float:
    """Binary reward r(q, o) in {0, 1}: the final complete boxed answer verified against ``gold``."""
    return rewards([response], [gold])[0]
