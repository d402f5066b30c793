"""The tiny heterogeneous models: recipes, deterministic build (supervised warm-start), cache.

Each model is described by a ``TinyRecipe``: architecture, tokenizer and the supervised warm-start
(skill mix, steps, optimiser). The recipes train on *different* skill mixes so that each model
solves prompts the others fail, the complementarity GRAFT exploits: the tiny pair (A, B) and a
third model for groups (``conf/group/tiny3.yaml``), each strong on two of the four skills. A built model is stored under a
directory named by the content hash of its recipe and of the task data it was trained on, so a
changed recipe (or task) rebuilds, and an unchanged one loads in a second. The project ships the
weights it built (``graft_exp/tiny/assets/``, rebuilt with ``python -m graft_exp.tiny build``);
they are used whenever their recorded hash matches the current recipe.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from graft_exp.cache import cache_dir
from graft_exp.tiny.task import SKILLS, Problem, benchmark, train_split, warmstart_stream
from graft_exp.tiny.tokenization import bpe_tokenizer, char_tokenizer, unigram_tokenizer

ASSETS = Path(__file__).resolve().parent / "assets"
HASH_FILE = "recipe_hash.txt"
#: Number of problems per benchmark held out of every training set (the tiny pair's eval sets).
EVAL_SIZE = 64
#: The model sees the prompt, then this separator, then its response.
SEPARATOR = "\n"


def model_input(prompt: str) -> str:
    """The text a tiny model is conditioned on for ``prompt`` (no chat template: base models)."""
    return prompt + SEPARATOR


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines a tiny model's weights."""

    key: str
    architecture: str                 # llama | gpt2 | neox | qwen3
    tokenizer: str                    # char | bpe | unigram
    skill_mix: dict[str, float]       # warm-start sampling weights per skill
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 384           # llama and neox MLP width (gpt2 uses 4 x hidden)
    bpe_vocab_size: int = 400
    max_positions: int = 192
    steps: int = 500
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    # Settings only some recipes have (e.g. ``unigram_vocab_size``); a new dataclass field would
    # change every recipe's hash and rebuild the shipped models.
    extra: dict = field(default_factory=dict)


RECIPES: dict[str, TinyRecipe] = {
    # Role A: good at column addition and multiplication, weak at subtraction and two-step expressions.
    "tiny-char-llama": TinyRecipe(
        key="tiny-char-llama", architecture="llama", tokenizer="char",
        skill_mix={"add": 0.4, "mul": 0.4, "sub": 0.1, "mixed": 0.1}, seed=1,
    ),
    # Role B: the mirror image.
    "tiny-bpe-gpt2": TinyRecipe(
        key="tiny-bpe-gpt2", architecture="gpt2", tokenizer="bpe",
        skill_mix={"sub": 0.4, "mixed": 0.4, "add": 0.1, "mul": 0.1}, seed=2,
    ),
    # Group member C: mostly two-step expressions, some multiplication; so that each of the three
    # models has a skill the other two lack (A add, B sub, C mixed).
    "tiny-unigram-neox": TinyRecipe(
        key="tiny-unigram-neox", architecture="neox", tokenizer="unigram",
        skill_mix={"mixed": 0.7, "mul": 0.2, "add": 0.05, "sub": 0.05}, seed=3, steps=800,
        extra={"unigram_vocab_size": 200},
    ),
    # Role B of the verl pair (``pair=tiny_verl``): verl trains *ForCausalLM models only and vLLM serves
    # them, which GPT-2's ``GPT2LMHeadModel`` is not; a Qwen3 (the paper's Qwen3-1.7B-Base family: RMSNorm,
    # per-head q/k RMSNorm, SwiGLU, rotary, tied embeddings) with the byte-level BPE, whose tokens share
    # nothing with tiny-char-llama's characters. The same skill mix as tiny-bpe-gpt2 (B's role).
    "tiny-bpe-qwen3": TinyRecipe(
        key="tiny-bpe-qwen3", architecture="qwen3", tokenizer="bpe",
        skill_mix={"sub": 0.4, "mixed": 0.4, "add": 0.1, "mul": 0.1}, seed=4,
    ),
}


def _tokenizer_corpus() -> list[str]:
    """Text every tokenizer is built from: every training prompt with its worked solution."""
    return [model_input(p.prompt) + p.solution for p in train_split(SKILLS, EVAL_SIZE, 2000)]


def recipe_hash(recipe: TinyRecipe) -> str:
    """Content hash of a recipe and of the task data it trains on (a changed task rebuilds too)."""
    task_fingerprint = [model_input(p.prompt) + p.solution for p in train_split(SKILLS, EVAL_SIZE, 64)]
    payload = json.dumps({"recipe": asdict(recipe), "task": task_fingerprint}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def build_tokenizer(recipe: TinyRecipe) -> PreTrainedTokenizerFast:
    corpus = _tokenizer_corpus()
    if recipe.tokenizer == "char":
        return char_tokenizer(corpus)
    if recipe.tokenizer == "bpe":
        return bpe_tokenizer(corpus, recipe.bpe_vocab_size)
    if recipe.tokenizer == "unigram":
        return unigram_tokenizer(corpus, recipe.extra["unigram_vocab_size"])
    raise ValueError(f"unknown tokenizer {recipe.tokenizer!r} (char | bpe | unigram)")


def init_model(recipe: TinyRecipe, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A freshly initialised causal LM of the recipe's architecture (seeded by the caller)."""
    eos = tokenizer.eos_token_id
    if recipe.architecture == "llama":
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
            num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
            num_key_value_heads=recipe.heads, max_position_embeddings=recipe.max_positions,
            bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=True,
        )
        return LlamaForCausalLM(config)
    if recipe.architecture == "gpt2":
        config = GPT2Config(
            vocab_size=len(tokenizer), n_embd=recipe.hidden, n_layer=recipe.layers, n_head=recipe.heads,
            n_positions=recipe.max_positions, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
            # No dropout: RL needs the same policy when sampling and when computing log-probs.
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(config)
    if recipe.architecture == "neox":
        # GPT-NeoX's own defaults otherwise: LayerNorm, GELU MLP, attention and MLP in parallel
        # residual branches, rotary embeddings on a quarter of each head, untied output head.
        config = GPTNeoXConfig(
            vocab_size=len(tokenizer), hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
            num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
            max_position_embeddings=recipe.max_positions, bos_token_id=eos, eos_token_id=eos,
            pad_token_id=eos, hidden_dropout=0.0, attention_dropout=0.0,
        )
        return GPTNeoXForCausalLM(config)
    if recipe.architecture == "qwen3":
        config = Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
            num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
            num_key_value_heads=recipe.heads, head_dim=recipe.hidden // recipe.heads,
            max_position_embeddings=recipe.max_positions, bos_token_id=eos, eos_token_id=eos,
            pad_token_id=eos, tie_word_embeddings=True, attention_dropout=0.0,
        )
        return Qwen3ForCausalLM(config)
    raise ValueError(f"unknown architecture {recipe.architecture!r} (llama | gpt2 | neox | qwen3)")


def supervised_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+solution sequences; the loss covers the solution and its end token only."""
    rows = []
    for p in problems:
        prompt = tokenizer(model_input(p.prompt), add_special_tokens=False).input_ids
        answer = tokenizer(p.solution, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((prompt, answer))
    length = max(len(a) + len(b) for a, b in rows)
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    labels = torch.full((len(rows), length), -100)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        total = len(prompt) + len(answer)
        input_ids[i, :total] = torch.tensor(prompt + answer)
        labels[i, len(prompt):total] = torch.tensor(answer)
        attention_mask[i, :total] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def warm_start(
    recipe: TinyRecipe,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    on_step: Callable[[int, float], None] | None = None,
) -> None:
    """Supervised warm-start on the recipe's skill mix: AdamW, linear warm-up then constant LR."""
    torch.manual_seed(recipe.seed)
    stream = warmstart_stream(recipe.skill_mix, EVAL_SIZE, recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / recipe.warmup))
    model.train()
    for step in range(recipe.steps):
        batch = supervised_batch(tokenizer, [next(stream) for _ in range(recipe.batch)])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, float(loss.detach()))
    model.eval()


def build(recipe: TinyRecipe, out_dir: Path, progress: bool = True) -> None:
    """Build one tiny model from scratch into ``out_dir`` (atomically: a temp dir renamed at the end)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    tokenizer = build_tokenizer(recipe)
    torch.manual_seed(recipe.seed)
    model = init_model(recipe, tokenizer)
    with Progress(
        TextColumn(f"building {recipe.key}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn(), disable=not progress,
    ) as bar:
        task = bar.add_task("build", total=recipe.steps, loss=float("nan"))
        warm_start(recipe, model, tokenizer, lambda step, loss: bar.update(task, advance=1, loss=loss))
    save(recipe, model, tokenizer, out_dir)


def save(recipe: TinyRecipe, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """Write a built model, its tokenizer and its recipe hash; a temp dir renamed at the end, so a
    reader never sees a half-written model."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{recipe.key}-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)   # mkdtemp's 0700 would hide the shipped assets from other users
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / HASH_FILE).write_text(recipe_hash(recipe) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_root() -> Path:
    """Where built tiny models live: $GRAFT_CACHE/tiny, else ~/.cache/graft_exp/tiny."""
    return cache_dir("tiny")


def _matches(directory: Path, digest: str) -> bool:
    hash_file = directory / HASH_FILE
    return hash_file.is_file() and hash_file.read_text().strip() == digest


def locate(key: str, progress: bool = True) -> Path:
    """Directory of the built model ``key``: the shipped assets if their hash matches the recipe,
    else the cache entry of that hash, built now if missing."""
    if key not in RECIPES:
        raise KeyError(f"{key!r} is not a tiny model; tiny models are {', '.join(RECIPES)}")
    recipe = RECIPES[key]
    digest = recipe_hash(recipe)
    shipped = ASSETS / key
    if _matches(shipped, digest):
        return shipped
    cached = cache_root() / f"{key}-{digest}"
    if not _matches(cached, digest):
        build(recipe, cached, progress=progress)
    return cached


def load(key: str, progress: bool = True) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The warm-started tiny model ``key`` and its tokenizer (float32, eval mode, on CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = locate(key, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # GPT-2's tanh-approximated GELU in PyTorch's fused kernel ("gelu_pytorch_tanh") instead of the
    # "gelu_new" it was built with: the same function (float rounding aside), but gelu_new spells it as
    # five tensor operations, each with its backward, about a tenth of this model's training step.
    fused = {"activation_function": "gelu_pytorch_tanh"} if RECIPES[key].architecture == "gpt2" else {}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **fused)
    model.eval()
    return model, tokenizer


def benchmarks(keys: list[str] | tuple[str, ...] = SKILLS) -> dict[str, list[Problem]]:
    """The tiny models' evaluation benchmarks, one per skill key."""
    return {k: benchmark(k, EVAL_SIZE) for k in keys}
