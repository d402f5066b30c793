"""The paper's prompt (App. B, Table 3), shared by every task and backend: the problem followed by the
step-by-step / boxed-answer suffix, as a single user message; the reward (``graft_exp.reward``) reads the final
``\\boxed{}`` this suffix asks for. And how that message becomes a model's prompt text on ``backend=verl``: each
catalog model names a prompt format (``conf/catalog/prompt_formats.yaml``, a pinned Jinja file of
``graft_exp/formats/``), checked against the model's real tokenizer (``check_format``) wherever the model is
loaded: at ``prepare``, at validation and on the node before Ray starts."""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


def format_prompt(question: str) -> str:
    """The paper's prompt for one problem: ``question`` and the suffix, separated by a space."""
    return f"{question} {SUFFIX}"


#: The prompt formats (their Jinja files) and their catalog.
FORMATS_DIR = Path(__file__).resolve().parent / "formats"
FORMATS_FILE = Path(__file__).resolve().parents[1] / "conf" / "catalog" / "prompt_formats.yaml"
#: ``end_of_turn`` of a format that closes a response with the tokenizer's end of text, not a marker of its own.
EOS = "eos"


@dataclass(frozen=True)
class PromptFormat:
    """One entry of ``conf/catalog/prompt_formats.yaml``: a template file and the control tokens it writes."""

    name: str
    template: str              # a file of FORMATS_DIR
    markers: tuple[str, ...]   # each must be one special token of the model's tokenizer
    end_of_turn: str           # a marker, or EOS

    @functools.cached_property
    def text(self) -> str:
        """The Jinja template, as verl's agent loop applies it (``custom_chat_template``); read once (every run key
        of a hub model's job reads its digest)."""
        return (FORMATS_DIR / self.template).read_text()

    @functools.cached_property
    def digest(self) -> str:
        """16 hex digits of the template's SHA-256: what identifies the format in a run key and on the run."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def model_override(key: str, setting: str, value: str) -> str:
    """The command-line override that sets catalog model ``key``'s ``setting``: ``models.<key>.<setting>=<value>``, or,
    for a key with a dot (``qwen3-1.7b-base``, which Hydra's override grammar splits), the dict form that Hydra merges
    into the catalog entry (a misspelt model or setting still fails at composition)."""
    if "." in key:
        return f"'models={{{key}: {{{setting}: {value}}}}}'"
    return f"models.{key}.{setting}={value}"


class UnknownFormat(ValueError):
    """A prompt format name that is not in the catalog; the message lists the names."""


@functools.lru_cache(maxsize=1)
def formats() -> dict[str, PromptFormat]:
    """Every prompt format of the catalog, by name."""
    entries = yaml.safe_load(FORMATS_FILE.read_text())
    return {name: PromptFormat(name, e["template"], tuple(e["markers"]), e["end_of_turn"])
            for name, e in entries.items()}


def prompt_format(name: str, key: str | None = None) -> PromptFormat:
    """The format ``name``; ``UnknownFormat`` naming catalog model ``key``'s setting and the choices otherwise."""
    found = formats().get(str(name))
    if found is None:
        where = f"models.{key}.prompt_format" if key else "prompt_format"
        raise UnknownFormat(f"{where}={name!r} is not a prompt format; choose one of {', '.join(formats())} "
                            "(conf/catalog/prompt_formats.yaml)")
    return found


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


def check_own_template(tokenizer, model: str) -> None:
    """A model the project built itself, prompted through its tokenizer's own chat template (catalog
    ``prompt_format: null``): it has one (verl's agent loop renders every prompt with one), and what it closes a
    turn with, if anything, is a special token (a stop id; anything else vLLM would write past). Raises ValueError."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{model} has no chat template, and verl's agent loop renders every prompt with one: name "
                         f"its prompt format (models.<key>.prompt_format=<{'|'.join(formats())}>)")
    after = after_the_turn(tokenizer, template) or ""
    if after.strip() and _closing_special(tokenizer, after) is None:
        raise ValueError(f"{model}'s chat template closes an assistant turn with {after.strip()[:40]!r}, which is no "
                         "special token of its tokenizer: vLLM could not stop there. Name a prompt format instead "
                         "(models.<key>.prompt_format)")


#: The problem of the single user message ``check_format`` renders (any text no template alters).
_PROBE_QUESTION = "What is $1+1$?"


def check_format(tokenizer, fmt: PromptFormat, key: str, where: str = "") -> int:
    """``fmt`` fits ``tokenizer`` (the real one of catalog model ``key``): every marker is one special token of it, the format
    renders the paper's single user message (the problem and the suffix, once, unaltered) and closes a turn with
    its ``end_of_turn`` (``end_of_turn_id``: the id ``backends.verl.batch.stop_token_ids`` puts first among the stop
    ids vLLM receives). Returns that id; raises ValueError naming the model (catalog ``key``, loaded from
    ``where``), the format and the fix."""
    model = f"{key} ({where})" if where else key
    fix = f"choose another format: {model_override(key, 'prompt_format', '<' + '|'.join(formats()) + '>')}"
    special = special_ids(tokenizer)
    for marker in fmt.markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) != 1 or ids[0] not in special:
            raise ValueError(f"prompt format {fmt.name}: {marker!r} is not one special token of {model}'s tokenizer "
                             f"(it encodes as {ids[:6]}): {fix}")
    message = format_prompt(_PROBE_QUESTION)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True, chat_template=fmt.text)
    if rendered.count(message) != 1:
        raise ValueError(f"prompt format {fmt.name} does not render {model}'s prompt as the single user message "
                         f"with the paper's suffix (rendered: {rendered[:120]!r}): {fix}")
    if fmt.end_of_turn == EOS:
        expected = tokenizer.eos_token_id
    else:
        expected = tokenizer.convert_tokens_to_ids(fmt.end_of_turn)
    found = end_of_turn_id(tokenizer, fmt.text)
    if expected is None or found != expected:
        raise ValueError(f"prompt format {fmt.name} closes a turn of {model} on {found} "
                         f"({tokenizer.decode([found]) if found is not None else 'no special token'!s}), not on its "
                         f"end of turn {fmt.end_of_turn} ({expected}): vLLM would not stop there; {fix}")
    return expected
