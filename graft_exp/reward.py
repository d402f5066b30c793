"""The binary verifiable reward of the paper (App. B): math-verify on the *final* ``\\boxed{}``.

math-verify's default extraction is lenient (for ``...=187 \\boxed{18`` it extracts 187, and with two
boxed answers it accepts either), so the last complete ``\\boxed{...}`` is extracted here, with
balanced braces, and only its content is verified against the gold answer. No box, an unclosed box,
an unparsable answer or a verification timeout all score 0, as in the paper.
"""

from __future__ import annotations

from functools import lru_cache

from math_verify import parse, verify

BOXED = "\\boxed{"
#: Seconds math-verify may spend parsing / comparing one answer; past it the response scores 0.
VERIFY_TIMEOUT_S = 5


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` of ``text`` (braces balanced), or None.

    An unclosed box at the end does not hide an earlier complete one: the search walks back from
    the last ``\\boxed{`` until one closes.
    """
    start = text.rfind(BOXED)
    while start != -1:
        depth, i = 1, start + len(BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(BOXED): i - 1]
        start = text.rfind(BOXED, 0, start)
    return None


@lru_cache(maxsize=65536)
def verify_answer(answer: str, gold: str) -> float:
    """1.0 if math-verify finds ``answer`` equivalent to ``gold``, else 0.0 (timeouts included:
    math-verify returns no match when its timeout fires). Cached: short answers repeat a lot."""
    gold_parsed = parse(gold, parsing_timeout=VERIFY_TIMEOUT_S)
    answer_parsed = parse(answer, parsing_timeout=VERIFY_TIMEOUT_S)
    if not gold_parsed or not answer_parsed:
        return 0.0
    return float(verify(gold_parsed, answer_parsed, timeout_seconds=VERIFY_TIMEOUT_S))


def reward(response: str, gold: str) -> float:
    """Binary reward r(q, o) in {0, 1}: the final complete boxed answer verified against ``gold``."""
    answer = last_boxed(response)
    if answer is None or not answer.strip():
        return 0.0
    return verify_answer(answer, gold)


def rewards(responses: list[str], golds: list[str]) -> list[float]:
    """``reward`` of each response against its gold answer."""
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
    return [reward(r, g) for r, g in zip(responses, golds)]
