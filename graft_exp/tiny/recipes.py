"""The tiny models' recipes: what determines each model's weights, the task's held-out size and the text a
tiny model is conditioned on. Torch-free (``graft_exp.tiny.models`` builds and loads the models), so that a config's
validation and a multirun's launcher know the tiny models without importing torch and transformers."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    architecture: str                 # llama | gpt2 | neox | qwen3 | smollm3
    tokenizer: str                    # char | bpe | unigram | paper (a paper model's vocabulary: extra["snapshot"])
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


#: Tiny models of the paper's architectures over the paper models' real vocabularies (``graft_exp.tiny.paper_vocab``,
#: the ``dev`` extra's packages): small in everything but the vocabulary, warm-started on the tiny task in the prompt
#: format chosen for the paper model each stands for (``extra["template"]``, a file of ``graft_exp/formats/``, where the
#: Base snapshot ships none). What is shipped is each model over the task's tokens (a few MB,
#: ``models.warm_start_over_task_tokens``); ``models.locate`` widens it to the whole vocabulary once into the cache
#: (a 128k-152k-row embedding is most of each, 66-78 MB). verl's tier with vLLM trains the first two as its pair
#: (``pair=tiny_paper_vocab``): Qwen's vocabulary in Qwen3's format against Llama 3's with SmolLM3's turn markers in
#: ChatML (its end of turn ``<|im_end|>`` special only in the added-token table), a native vLLM model against one vLLM
#: serves through its Transformers backend (SmolLM3). The third, OctoThinker's Llama in the Llama 3 header format, is
#: loaded, sent weights and sampled once.
PAPER_VOCAB_RECIPES: dict[str, TinyRecipe] = {
    "tiny-qwen3-vocab": TinyRecipe(
        key="tiny-qwen3-vocab", architecture="qwen3", tokenizer="paper",
        skill_mix={"add": 0.4, "mul": 0.4, "sub": 0.1, "mixed": 0.1}, seed=5,
        extra={"snapshot": "qwen3-1.7b-base"},
    ),
    # Llama 3's vocabulary writes every number up to 999 as one token (525 task tokens against Qwen's 43): longer to
    # learn, as C's two-step expressions.
    "tiny-smollm3-vocab": TinyRecipe(
        key="tiny-smollm3-vocab", architecture="smollm3", tokenizer="paper",
        skill_mix={"sub": 0.4, "mixed": 0.4, "add": 0.1, "mul": 0.1}, seed=6, steps=800,
        extra={"snapshot": "smollm3-3b-base", "template": "chatml.jinja"},
    ),
    "tiny-llama3-vocab": TinyRecipe(
        key="tiny-llama3-vocab", architecture="llama", tokenizer="paper",
        skill_mix={"mixed": 0.7, "mul": 0.2, "add": 0.05, "sub": 0.05}, seed=7, steps=800,
        extra={"snapshot": "octothinker-3b-hybrid-base", "template": "llama3.jinja"},
    ),
}


def all_recipes() -> dict[str, TinyRecipe]:
    """Every tiny model's recipe: the task-tokenizer models' and the paper-vocabulary ones' (read at each call, so
    a recipe added to either table counts)."""
    return {**RECIPES, **PAPER_VOCAB_RECIPES}
