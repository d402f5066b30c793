"""The paper's prompt format (App. B, Table 3), shared by every task and backend: the problem followed by
the step-by-step / boxed-answer suffix. The reward (``graft_exp.reward``) reads the final ``\\boxed{}``
this suffix asks for."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


def format_prompt(question: str) -> str:
    """The paper's prompt for one problem: ``question`` and the suffix, separated by a space."""
    return f"{question} {SUFFIX}"


#: A chat template's reading of the clock (transformers' ``strftime_now`` global): SmolLM3's template writes
#: today's date into every conversation, Llama 3.x's its "Today Date" when it can.
_CLOCK_READ = re.compile(r"""strftime_now\(\s*(?P<quote>['"])(?P<format>[^'"]*)(?P=quote)\s*\)""")


def reads_the_clock(template: str | None) -> bool:
    """Whether rendering ``template`` depends on the day it is rendered."""
    return bool(template) and "strftime_now" in template


def pin_template_date(template: str, day: datetime.date) -> str:
    """``template`` rendering the date ``day`` wherever it reads the clock: a template macro named
    ``strftime_now``, defined first, shadows transformers' global of that name and returns ``day`` in each format
    the template asks for. Every process that renders the template (verl's agent-loop workers included, which
    apply a model's ``custom_chat_template``) then renders the same prompt tokens on any day: a job requeued
    after midnight, or repeated next month with the same date, trains on the same prompts. A template that reads
    the clock in a format it does not spell out (not a string literal) is refused."""
    if not reads_the_clock(template):
        return template
    formats = sorted({m.group("format") for m in _CLOCK_READ.finditer(template)})
    if template.count("strftime_now") != len(_CLOCK_READ.findall(template)) + template.count("strftime_now is"):
        raise ValueError("the chat template calls strftime_now with a format that is not a string literal; "
                         "its date cannot be pinned")
    branches = "".join(f"{{%- {'if' if i == 0 else 'elif'} format == {json.dumps(f)} -%}}{day.strftime(f)}"
                       for i, f in enumerate(formats))
    return f"{{%- macro strftime_now(format) -%}}{branches}{{%- endif -%}}{{%- endmacro -%}}" + template


def job_prompt_date(run_dir: Path) -> datetime.date:
    """The date a job's chat templates render (``pin_template_date``): the UTC day of the job's first start,
    kept in its directory (``<run_dir>/prompt_date``), which a resumed or requeued job keeps and a fresh run
    starts without; recorded on the job run as ``graft.prompt_date``."""
    path = run_dir / "prompt_date"
    if path.is_file():
        return datetime.date.fromisoformat(path.read_text().strip())
    today = datetime.datetime.now(datetime.timezone.utc).date()
    run_dir.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(".tmp")
    staged.write_text(today.isoformat())
    staged.replace(path)
    return today


#: An assistant message no chat template alters, to find what the template writes after it.
_TURN_PROBE = "GRAFT_END_OF_TURN_PROBE"


def after_the_turn(tokenizer, template: str | None = None) -> str | None:
    """What the chat template (``template``, default the tokenizer's) writes after an assistant message, or None
    without a template."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"},
                                          {"role": "assistant", "content": _TURN_PROBE}], tokenize=False,
                                         chat_template=template)
    return text.rsplit(_TURN_PROBE, 1)[-1] if _TURN_PROBE in text else ""   # "": it writes no assistant turn


def special_ids(tokenizer) -> set[int]:
    """The ids of the tokenizer's special tokens: the named ones and every added token marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


def end_of_turn_id(tokenizer, template: str | None = None) -> int | None:
    """The special token the chat template closes an assistant turn with (ChatML's ``<|im_end|>``, Llama 3's
    ``<|eot_id|>``), or None (no template, or nothing special after the turn). A base model's generation config
    names only its end-of-text token (Qwen3-1.7B-Base: ``<|endoftext|>``), yet prompted through the template it
    ends its answer with the template's end-of-turn token and, not stopped there, writes the next user turn
    itself. Special means named (``all_special_ids``) or marked special in the added-token table: Llama 3.x
    tokenizers mark ``<|eot_id|>`` special only there."""
    return _closing_special(tokenizer, after_the_turn(tokenizer, template))


def _closing_special(tokenizer, after: str | None) -> int | None:
    """The first visible token of ``after`` (what a template writes after a turn) if it is special, else None."""
    ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    first = next((i for i in ids if tokenizer.decode([i]).strip()), None)
    return first if first is not None and first in special_ids(tokenizer) else None


def check_prompting(tokenizer, model: str, template: str | None = None) -> None:
    """A model a chat-template rollout can prompt and stop: it has a chat template (``template`` or its own:
    verl's agent loop renders every prompt with one), and what the template closes a turn with, if anything, is a
    special token (a stop id; anything else vLLM would write past). Raises ValueError naming the fix."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{model} has no chat template, and verl's agent loop renders every prompt with one: give "
                         "it one (backend.verl_overrides=[actor_rollout_ref.model.custom_chat_template=...]) or use "
                         "a model that ships one")
    after = after_the_turn(tokenizer, template) or ""
    if after.strip() and _closing_special(tokenizer, after) is None:
        raise ValueError(f"{model}'s chat template closes an assistant turn with {after.strip()[:40]!r}, which is no "
                         "special token of its tokenizer: vLLM could not stop there. Use a template that ends turns "
                         "with a special token (or nothing)")
