"""The tiny models' three tokenizers, deliberately different so re-tokenization is exercised for real:
a character-level one (tiny-char-llama), a byte-level BPE trained on the task corpus that splits
digits (tiny-bpe-gpt2) and a SentencePiece-style unigram model over metaspace-marked text
(tiny-unigram-neox). All are ``transformers`` fast tokenizers, saved and loaded like any Hugging Face one.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<eos>"
UNK = "<unk>"


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    # The end-of-sequence token doubles as padding: padding is always masked out, and a model can
    # then never sample a token that decodes to nothing but is not the end of its response.
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, unk_token=UNK)


def char_tokenizer(corpus: Iterable[str]) -> PreTrainedTokenizerFast:
    """One token per character seen in ``corpus`` (sorted, so the vocabulary is deterministic),
    plus ``<eos>`` and ``<unk>`` for characters never seen."""
    chars = sorted({c for text in corpus for c in text})
    vocab = {EOS: 0, UNK: 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return _wrap(tokenizer)


def bpe_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``corpus`` with every digit its own pre-token (numbers are spelt
    digit by digit, as in Llama/Qwen-style tokenizers); words and the prompt suffix get merges."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, UNK], show_progress=False)
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    return _wrap(tokenizer)


def unigram_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A unigram language-model tokenizer (SentencePiece's algorithm) trained on ``corpus``: spaces
    become the metaspace ``▁`` and may sit inside a piece (``▁step▁``), digits are single pieces.
    No space is prepended, so decoding a text's ids gives the text back exactly (the peer texts a
    model receives are re-tokenized with it)."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Metaspace(prepend_scheme="never", split=False),
    ])
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="never", split=False)
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=[EOS, UNK], unk_token=UNK,
                                      show_progress=False)
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    return _wrap(tokenizer)
