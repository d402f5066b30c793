"""The reward checks the *final complete* boxed answer with math-verify (DESIGN.md "Rewards — a trap")."""

import pytest

from graft_exp.reward import last_boxed, reward, rewards


@pytest.mark.parametrize("response, expected", [
    ("7+8=15, 4+3+1=8, so 85. \\boxed{85}", "85"),
    ("...=187 \\boxed{18", None),                       # unclosed: math-verify alone would extract 187
    ("\\boxed{17} and then \\boxed{18}", "18"),          # two boxes: the last one counts
    ("\\boxed{17} \\boxed{1", "17"),                     # a trailing unclosed box does not hide the last complete one
    ("\\boxed{\\frac{34}{2}}", "\\frac{34}{2}"),         # nested braces are balanced
    ("no box at all: 85", None),
    ("", None),
])
def test_last_boxed(response, expected):
    assert last_boxed(response) == expected


@pytest.mark.parametrize("response, gold, expected", [
    ("7+8=15, 4+3+1=8, so 85. \\boxed{85}", "85", 1.0),
    ("...=187 \\boxed{18", "187", 0.0),
    ("...=187 \\boxed{18", "18", 0.0),
    ("\\boxed{17} and then \\boxed{18}", "17", 0.0),
    ("\\boxed{17} and then \\boxed{18}", "18", 1.0),
    ("\\boxed{\\frac{34}{2}}", "17", 1.0),               # math-verify's equivalence, not string equality
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{3}", "-3", 0.0),
    ("\\boxed{}", "0", 0.0),
    ("the answer is 85", "85", 0.0),                    # no box, no reward (no format leniency)
])
def test_reward(response, gold, expected):
    assert reward(response, gold) == expected


def test_rewards_needs_one_gold_per_response():
    assert rewards(["\\boxed{1}", "\\boxed{2}"], ["1", "1"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        rewards(["\\boxed{1}", "\\boxed{2}"], ["1"])
