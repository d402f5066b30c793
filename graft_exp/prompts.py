"""The paper's prompt format (App. B, Table 3), shared by every task and backend: the problem followed by
the step-by-step / boxed-answer suffix. The reward (``graft_exp.reward``) reads the final ``\\boxed{}``
this suffix asks for."""

from __future__ import annotations

SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


def format_prompt(question: str) -> str:
    """The paper's prompt for one problem: ``question`` and the suffix, separated by a space."""
    return f"{question} {SUFFIX}"
