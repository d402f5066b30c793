"""The tiny heterogeneous models: deterministic build (supervised warm-start), cache, load.

Each model is described by a ``TinyRecipe`` (``graft_exp.tiny.recipes``): architecture, tokenizer and the
supervised warm-start (skill mix, steps, optimiser). The recipes train on *different* skill mixes so that each model
solves prompts the others fail, the complementarity GRAFT exploits: the tiny pair (A, B) and a
third model for groups (``conf/group/tiny3.yaml``), each strong on two of the four skills. A built model is stored under a
directory named by the content hash of its recipe and of the task data it was trained on, so a
changed recipe (or task) rebuilds, and an unchanged one loads in a second. The project ships the
weights it built (``graft_exp/tiny/assets/``, rebuilt with ``python -m graft_exp.tiny build``);
they are used whenever their recorded hash matches the current recipe.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
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
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from graft_exp import prompts
from graft_exp.cache import cache_dir
from graft_exp.tiny.recipes import (
    EVAL_SIZE,
    RECIPES,
    TinyRecipe,
    all_recipes,
    model_input,
)
from graft_exp.tiny.task import SKILLS, Problem, benchmark, every_problem, train_split, warmstart_stream
from graft_exp.tiny.tokenization import bpe_tokenizer, char_tokenizer, unigram_tokenizer

ASSETS = Path(__file__).resolve().parent / "assets"
HASH_FILE = "recipe_hash.txt"
#: The day a paper-vocabulary model's warm-start prompts show where its template writes the date.
WARM_START_DATE = datetime.date(2025, 1, 1)


def _tokenizer_corpus() -> list[str]:
    """Text every tokenizer is built from: every training prompt with its worked solution."""
    return [model_input(p.prompt) + p.solution for p in train_split(SKILLS, EVAL_SIZE, 2000)]


def recipe_hash(recipe: TinyRecipe) -> str:
    """Content hash of a recipe and of the task data it trains on (a changed task rebuilds too)."""
    task_fingerprint = [model_input(p.prompt) + p.solution for p in train_split(SKILLS, EVAL_SIZE, 64)]
    payload = {"recipe": asdict(recipe), "task": task_fingerprint}
    if recipe.tokenizer == "paper":   # the vocabulary (its ranks' SHA-256, special tokens) and the template read
        from graft_exp.tiny import paper_vocab

        snapshot = paper_vocab.SNAPSHOTS[recipe.extra["snapshot"]]
        template = recipe.extra.get("template", snapshot.template)
        payload["vocabulary"] = [asdict(snapshot), (paper_vocab.TEMPLATES / template).read_text()]
    payload = json.dumps(payload, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def build_tokenizer(recipe: TinyRecipe) -> PreTrainedTokenizerFast:
    corpus = _tokenizer_corpus()
    if recipe.tokenizer == "char":
        return char_tokenizer(corpus)
    if recipe.tokenizer == "bpe":
        return bpe_tokenizer(corpus, recipe.bpe_vocab_size)
    if recipe.tokenizer == "unigram":
        return unigram_tokenizer(corpus, recipe.extra["unigram_vocab_size"])
    if recipe.tokenizer == "paper":
        from graft_exp.tiny import paper_vocab

        tokenizer = paper_vocab.build(recipe.extra["snapshot"], cache_dir("paper_tokenizers"))
        if "template" in recipe.extra:
            tokenizer.chat_template = (paper_vocab.TEMPLATES / recipe.extra["template"]).read_text()
        return tokenizer
    raise ValueError(f"unknown tokenizer {recipe.tokenizer!r} (char | bpe | unigram | paper)")


def init_model(recipe: TinyRecipe, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A freshly initialised causal LM of the recipe's architecture over its tokenizer (seeded by the caller)."""
    eos = tokenizer.eos_token_id
    return architecture(recipe, len(tokenizer), bos=eos, eos=eos, pad=eos)


def architecture(recipe: TinyRecipe, vocab_size: int, bos: int | None, eos: int, pad: int | None) -> PreTrainedModel:
    """A freshly initialised causal LM of the recipe's architecture with ``vocab_size`` embedding rows."""
    if recipe.architecture in ("llama", "smollm3"):
        # SmolLM3 is Llama's layout with rotary embeddings left out of every fourth layer (NoPE, its config's
        # default); both tie their embeddings, as SmolLM3-3B and Llama 3.2 3B do.
        config_class, model_class = ((LlamaConfig, LlamaForCausalLM) if recipe.architecture == "llama"
                                     else (SmolLM3Config, SmolLM3ForCausalLM))
        config = config_class(
            vocab_size=vocab_size, hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
            num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
            num_key_value_heads=recipe.heads, max_position_embeddings=recipe.max_positions,
            bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True, attention_dropout=0.0,
        )
        return model_class(config)
    if recipe.architecture == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size, n_embd=recipe.hidden, n_layer=recipe.layers, n_head=recipe.heads,
            n_positions=recipe.max_positions, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
            # No dropout: RL needs the same policy when sampling and when computing log-probs.
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(config)
    if recipe.architecture == "neox":
        # GPT-NeoX's own defaults otherwise: LayerNorm, GELU MLP, attention and MLP in parallel
        # residual branches, rotary embeddings on a quarter of each head, untied output head.
        config = GPTNeoXConfig(
            vocab_size=vocab_size, hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
            num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
            max_position_embeddings=recipe.max_positions, bos_token_id=bos, eos_token_id=eos,
            pad_token_id=pad, hidden_dropout=0.0, attention_dropout=0.0,
        )
        return GPTNeoXForCausalLM(config)
    if recipe.architecture == "qwen3":
        config = Qwen3Config(
            vocab_size=vocab_size, hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
            num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
            num_key_value_heads=recipe.heads, head_dim=recipe.hidden // recipe.heads,
            max_position_embeddings=recipe.max_positions, bos_token_id=bos, eos_token_id=eos,
            pad_token_id=pad, tie_word_embeddings=True, attention_dropout=0.0,
        )
        return Qwen3ForCausalLM(config)
    raise ValueError(f"unknown architecture {recipe.architecture!r} (llama | gpt2 | neox | qwen3 | smollm3)")


def supervised_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+solution sequences; the loss covers the solution and its end token only."""
    rows = []
    for p in problems:
        prompt = tokenizer(model_input(p.prompt), add_special_tokens=False).input_ids
        answer = tokenizer(p.solution, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((prompt, answer))
    return padded_batch(rows, tokenizer.pad_token_id)


def chat_rows(tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) ids of each problem as a chat model sees them: the prompt rendered through the tokenizer's
    chat template (its date pinned to ``WARM_START_DATE``), the solution closed by the template's end of turn."""
    template = prompts.pin_template_date(tokenizer.chat_template, WARM_START_DATE)
    end = prompts.end_of_turn_id(tokenizer)
    rows = []
    for p in problems:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}], chat_template=template,
                                             add_generation_prompt=True, tokenize=False)
        rows.append((tokenizer(text, add_special_tokens=False).input_ids,
                     tokenizer(p.solution, add_special_tokens=False).input_ids + [end]))
    return rows


def padded_batch(rows: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt+answer sequences; the loss covers the answer only."""
    length = max(len(a) + len(b) for a, b in rows)
    input_ids = torch.full((len(rows), length), pad)
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
    batch_of: Callable[[list[Problem]], dict[str, torch.Tensor]] | None = None,
    loss_of: Callable[[PreTrainedModel, dict[str, torch.Tensor]], torch.Tensor] | None = None,
) -> None:
    """Supervised warm-start on the recipe's skill mix: AdamW, linear warm-up then constant LR. ``batch_of`` and
    ``loss_of`` replace the tiny prompt format's batch (``supervised_batch``) and the model's own loss."""
    torch.manual_seed(recipe.seed)
    stream = warmstart_stream(recipe.skill_mix, EVAL_SIZE, recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / recipe.warmup))
    model.train()
    for step in range(recipe.steps):
        problems = [next(stream) for _ in range(recipe.batch)]
        batch = batch_of(problems) if batch_of else supervised_batch(tokenizer, problems)
        loss = loss_of(model, batch) if loss_of else model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, float(loss.detach()))
    model.eval()


def build(recipe: TinyRecipe, out_dir: Path, progress: bool = True) -> None:
    """Build one tiny model from scratch into ``out_dir`` (atomically: a temp dir renamed at the end). A model over
    a paper vocabulary is built as its task-token model (``warm_start_over_task_tokens``), widened on load."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    tokenizer = build_tokenizer(recipe)
    with Progress(
        TextColumn(f"building {recipe.key}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn(), disable=not progress,
    ) as bar:
        task = bar.add_task("build", total=recipe.steps, loss=float("nan"))
        on_step = lambda step, loss: bar.update(task, advance=1, loss=loss)
        if recipe.tokenizer == "paper":
            model, used = warm_start_over_task_tokens(recipe, tokenizer, on_step)
            save(recipe, model, None, out_dir, {TASK_TOKENS_FILE: json.dumps(used)})
            return
        torch.manual_seed(recipe.seed)
        model = init_model(recipe, tokenizer)
        warm_start(recipe, model, tokenizer, on_step)
    save(recipe, model, tokenizer, out_dir)


#: A paper-vocabulary model's task tokens: the real ids of its embedding rows but the last (the rest of the vocabulary).
TASK_TOKENS_FILE = "task_token_ids.json"


def warm_start_over_task_tokens(recipe: TinyRecipe, tokenizer: PreTrainedTokenizerFast,
                                on_step: Callable[[int, float], None] | None = None
                                ) -> tuple[PreTrainedModel, list[int]]:
    """The recipe's model over a paper model's vocabulary, warm-started at the cost of the few hundred tokens the task
    uses: it trains over those tokens (their real ids returned in order) plus one row standing for the rest of the
    vocabulary, whose logit carries ``log(rest)``. ``widen`` copies that row into every other id: the softmax over the
    whole vocabulary is then the trained one exactly (``rest`` equal logits add ``log(rest)`` to one)."""
    from graft_exp.tiny.paper_vocab import SNAPSHOTS

    vocab_size = SNAPSHOTS[recipe.extra["snapshot"]].vocab_size
    used = sorted({i for prompt, answer in chat_rows(tokenizer, every_problem(EVAL_SIZE)) for i in prompt + answer})
    rest = len(used)
    to_subset = torch.full((vocab_size,), rest)
    to_subset[used] = torch.arange(rest)
    offset = torch.zeros(rest + 1)
    offset[rest] = math.log(vocab_size - rest)

    def batch_of(problems: list[Problem]) -> dict[str, torch.Tensor]:
        batch = padded_batch(chat_rows(tokenizer, problems), pad=used[0])
        batch["input_ids"] = to_subset[batch["input_ids"]]
        batch["labels"] = torch.where(batch["labels"] >= 0, to_subset[batch["labels"].clamp(min=0)], -100)
        return batch

    def loss_of(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits + offset
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                 ignore_index=-100)

    torch.manual_seed(recipe.seed)
    model = architecture(recipe, rest + 1, bos=None, eos=int(to_subset[tokenizer.eos_token_id]), pad=None)
    warm_start(recipe, model, tokenizer, on_step, batch_of=batch_of, loss_of=loss_of)
    return model, used


def widen(recipe: TinyRecipe, tokenizer: PreTrainedTokenizerFast, small: PreTrainedModel,
          used: list[int]) -> PreTrainedModel:
    """The task-token model ``small`` over the whole vocabulary of its snapshot (``warm_start_over_task_tokens``),
    with the snapshot's token ids in its config and generation config."""
    from graft_exp.tiny.paper_vocab import SNAPSHOTS

    snapshot = SNAPSHOTS[recipe.extra["snapshot"]]
    model = architecture(recipe, snapshot.vocab_size, bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id,
                         pad=tokenizer.pad_token_id)
    state = small.state_dict()
    for key, rows in state.items():
        if key.endswith(("embed_tokens.weight", "lm_head.weight")):   # the (tied) embedding: rows to real ids
            wide = rows[len(used)].repeat(snapshot.vocab_size, 1)
            wide[used] = rows[:len(used)]
            state[key] = wide
    model.load_state_dict(state)
    model.generation_config.eos_token_id = snapshot.generation_eos
    model.eval()
    return model


def save(recipe: TinyRecipe, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast | None, out_dir: Path,
         files: dict[str, str] | None = None) -> None:
    """Write a built model, its tokenizer (if any), ``files`` (name: text) and its recipe hash; a temp dir renamed at
    the end, so a reader never sees a half-written model."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{recipe.key}-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)   # mkdtemp's 0700 would hide the shipped assets from other users
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
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
    recipes = all_recipes()
    if key not in recipes:
        raise KeyError(f"{key!r} is not a tiny model; tiny models are {', '.join(recipes)}")
    recipe = recipes[key]
    digest = recipe_hash(recipe)
    shipped = ASSETS / key
    if recipe.tokenizer == "paper":   # shipped (or built) over the task's tokens, widened once into the cache
        built = shipped if _matches(shipped, digest) else _built(recipe, digest, cache_root() / f"{key}-{digest}-task",
                                                                 progress)
        widened = cache_root() / f"{key}-{digest}"
        if not _matches(widened, digest):
            from transformers import AutoModelForCausalLM

            tokenizer = build_tokenizer(recipe)
            small = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
            used = json.loads((built / TASK_TOKENS_FILE).read_text())
            save(recipe, widen(recipe, tokenizer, small, used), tokenizer, widened)
        return widened
    if _matches(shipped, digest):
        return shipped
    return _built(recipe, digest, cache_root() / f"{key}-{digest}", progress)


def _built(recipe: TinyRecipe, digest: str, directory: Path, progress: bool) -> Path:
    """``directory``, holding the model of ``recipe`` (whose hash is ``digest``), built there now if missing."""
    if not _matches(directory, digest):
        build(recipe, directory, progress=progress)
    assert _matches(directory, digest)
    return directory


def load(key: str, progress: bool = True) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The warm-started tiny model ``key`` and its tokenizer (float32, eval mode, on CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = locate(key, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # GPT-2's tanh-approximated GELU in PyTorch's fused kernel ("gelu_pytorch_tanh") instead of the
    # "gelu_new" it was built with: the same function (float rounding aside), but gelu_new spells it as
    # five tensor operations, each with its backward, about a tenth of this model's training step.
    fused = {"activation_function": "gelu_pytorch_tanh"} if key in RECIPES and RECIPES[key].architecture == "gpt2" else {}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **fused)
    model.eval()
    return model, tokenizer


def benchmarks(keys: list[str] | tuple[str, ...] = SKILLS) -> dict[str, list[Problem]]:
    """The tiny models' evaluation benchmarks, one per skill key."""
    return {k: benchmark(k, EVAL_SIZE) for k in keys}
