"""The paper models' real vocabularies, built offline from registry packages, with each snapshot's special-token
table, ids and chat template as their published files give them (docs/verl.md, "Stop tokens of the paper
models", says what each fact rests on). The tiny models of the paper's architectures (``PAPER_VOCAB_RECIPES`` of
``graft_exp.tiny.recipes``) are built over them; the packages are in the ``dev`` extra.

- Qwen3-1.7B-Base: Qwen's BPE ranks from ``dashscope`` 2.0.2 (``dashscope/resources/qwen.tiktoken``, 151,643 ranks,
  shared by Qwen2/2.5/3), Qwen2's split pattern (digits one by one), the 26 added tokens 151643-151668 with their
  special flags, and the chat template of the Qwen3 release (``templates/qwen3-1.7b-base.jinja``).
- SmolLM3-3B-Base and OctoThinker-3B-Hybrid-Base: Llama 3's BPE ranks from ``llama-models`` 0.3.0
  (``llama_models/llama3/tokenizer.model``, 128,000 ranks) and its split pattern (digits in groups of up to three),
  the 256 added tokens 128000-128255 of Llama 3.1/3.2's ``tokenizer_config.json``, all special in
  ``added_tokens_decoder`` and none in ``additional_special_tokens``; SmolLM3's with its own names for eight reserved
  entries (``SMOLLM3_RENAMED``: ``<|im_start|>`` 128011, ``<|im_end|>`` 128012, ...); neither Base snapshot ships a
  chat template.
- ``llama3_instruct``: the same vocabulary with Llama 3.2 Instruct's chat template (its end of turn
  ``<|eot_id|>``, its date read from the clock), the template a Llama-3-style tokenizer meets in the wild.

Each package file is checked by its SHA-256 before use; a built tokenizer is cached on disk by that hash.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from graft_exp.prompts import FORMATS_DIR

#: The chat templates: the prompt formats' files (graft_exp/formats/README.md says where each comes from).
TEMPLATES = FORMATS_DIR

QWEN_RANKS = ("dashscope", "resources/qwen.tiktoken",
              "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186")
LLAMA3_RANKS = ("llama_models", "llama3/tokenizer.model",
                "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55")
#: Qwen2's pre-tokenizer split (tokenizer.json of Qwen2/2.5/3): ``\p{N}`` alone, one digit a piece.
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
#: Llama 3's (llama_models/llama3/tokenizer.py ``pat_str``): ``\p{N}{1,3}``, digits in groups of up to three.
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

#: Qwen3's added tokens from 151643 on, (content, special) as its tokenizer_config's added_tokens_decoder lists them.
QWEN3_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
               *[(t, True) for t in ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                                     "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                                     "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")],
               *[(t, False) for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                                      "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                                      "<tool_response>", "</tool_response>", "<think>", "</think>")]]
QWEN3_ADDITIONAL_SPECIAL = [t for t, _ in QWEN3_ADDED[1:14]]   # <|im_start|>, <|im_end|> and the 11 vision tokens
#: Llama 3.1/3.2's 256 added tokens from 128000 on (all special); reserved names fill the gaps in order.
_LLAMA3_NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
                 6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
                 10: "<|python_tag|>"}


#: SmolLM3's names for reserved entries of Llama 3's table (docs/verl.md, "Special tokens of the paper models", says
#: what each rests on): the ChatML turn markers its family is prompted with, its reasoning and tool markers.
SMOLLM3_RENAMED = {2: "<think>", 3: "</think>", 11: "<|im_start|>", 12: "<|im_end|>", 13: "<tool_response>",
                   14: "</tool_response>", 15: "<tool_call>", 16: "</tool_call>"}


def _llama3_added(renamed: dict[int, str] | None = None) -> list[tuple[str, bool]]:
    """Llama 3.1/3.2's 256 added tokens (all special), with ``renamed`` entries (offset from 128000) in place of
    their reserved names; the other reserved names keep Llama's numbering."""
    reserved = iter(range(256))
    table = []
    for i in range(256):
        name = _LLAMA3_NAMED.get(i) or f"<|reserved_special_token_{next(reserved)}|>"
        table.append(((renamed or {}).get(i, name), True))
    return table


@dataclass(frozen=True)
class Snapshot:
    """One paper model's tokenizer as its snapshot publishes it."""

    key: str
    ranks: tuple[str, str, str]         # (package, file in it, SHA-256)
    pattern: str
    added: list[tuple[str, bool]]       # added tokens from the first id after the ranks: (content, special)
    bos: str | None
    eos: str
    pad: str | None
    generation_eos: int | list[int]     # generation_config.json's eos_token_id
    vocab_size: int                     # config.json's (the embedding rows; the tokenizer holds fewer)
    template: str | None = None         # a file of TEMPLATES, or None: the snapshot ships no chat template
    additional_special: list[str] = field(default_factory=list)


SNAPSHOTS = {
    "qwen3-1.7b-base": Snapshot("qwen3-1.7b-base", QWEN_RANKS, QWEN_PATTERN, QWEN3_ADDED, None, "<|endoftext|>",
                                "<|endoftext|>", 151643, 151936, "qwen3-1.7b-base.jinja", QWEN3_ADDITIONAL_SPECIAL),
    "smollm3-3b-base": Snapshot("smollm3-3b-base", LLAMA3_RANKS, LLAMA3_PATTERN, _llama3_added(SMOLLM3_RENAMED),
                                "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", 128001, 128256),
    "octothinker-3b-hybrid-base": Snapshot("octothinker-3b-hybrid-base", LLAMA3_RANKS, LLAMA3_PATTERN,
                                           _llama3_added(), "<|begin_of_text|>", "<|end_of_text|>", None, 128001,
                                           128256),
    "llama3_instruct": Snapshot("llama3_instruct", LLAMA3_RANKS, LLAMA3_PATTERN, _llama3_added(),
                                "<|begin_of_text|>", "<|eot_id|>", None, [128001, 128008, 128009], 128256,
                                "llama-3.2-instruct.jinja"),
}


def why_unavailable() -> str | None:
    """Why the real vocabularies cannot be built here (a package of the dev extra missing), or None."""
    for package, _, _ in (QWEN_RANKS, LLAMA3_RANKS):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed (pip install -e '.[dev]' installs it): the paper vocabularies come from it"
    return None


def ranks_file(ranks: tuple[str, str, str]) -> Path:
    """The package's rank file, checked against its SHA-256."""
    package, relative, sha256 = ranks
    path = Path(importlib.util.find_spec(package).origin).parent / relative
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise ValueError(f"{path} has SHA-256 {digest}, not {sha256}: another release of {package}")
    return path


def build(key: str, cache: Path):
    """The fast tokenizer of snapshot ``key`` (``SNAPSHOTS``), built once into ``cache`` and loaded from there."""
    from transformers import AddedToken, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    snap = SNAPSHOTS[key]
    path = ranks_file(snap.ranks)
    folder = cache / f"{snap.ranks[2][:12]}"
    backend = folder / "tokenizer.json"
    if not backend.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        converted = TikTokenConverter(vocab_file=str(path), pattern=snap.pattern).converted()
        staged = backend.with_suffix(".tmp")
        converted.save(str(staged))
        staged.replace(backend)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(backend), clean_up_tokenization_spaces=False)
    first = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    tokenizer.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in snap.added], special_tokens=False)
    assert tokenizer.convert_tokens_to_ids(snap.added[0][0]) == first, "added tokens must follow the ranks"
    tokenizer.add_special_tokens({"eos_token": snap.eos, **({"bos_token": snap.bos} if snap.bos else {}),
                                  **({"pad_token": snap.pad} if snap.pad else {})})
    if snap.additional_special:
        tokenizer.add_special_tokens({"additional_special_tokens": snap.additional_special})
    if snap.template:
        tokenizer.chat_template = (TEMPLATES / snap.template).read_text()
    return tokenizer
