"""The tiny test bed: generated task, three tokenizers, shipped warm-started models and their cache."""

import dataclasses

import pytest

from graft_exp.reward import reward
from graft_exp.tiny import models as tiny
from graft_exp.tiny.task import SKILLS, SUFFIX, benchmark, train_split


def test_prompts_carry_the_paper_suffix():
    problem = benchmark("add", 64)[0]
    assert problem.prompt.endswith("Let's think step by step and output the final answer within \\boxed{}.")
    assert SUFFIX in problem.prompt


@pytest.mark.parametrize("skill", SKILLS)
def test_every_solution_earns_the_reward(skill):
    for problem in benchmark(skill, 64)[:20]:
        assert reward(problem.solution, problem.answer) == 1.0
        assert int(problem.answer) == eval(problem.question.removeprefix("Compute ").rstrip("."))


def test_splits_are_deterministic_and_disjoint():
    train = train_split(SKILLS, 64, 2000)
    assert [p.uid for p in train] == [p.uid for p in train_split(SKILLS, 64, 2000)]
    assert len(train) == 2000 and {p.skill for p in train} == set(SKILLS)
    held_out = {p.question for s in SKILLS for p in benchmark(s, 64)}
    assert not held_out & {p.question for p in train}
    assert len({p.uid for p in train}) == len(train)


def test_tokenizers_differ_and_round_trip():
    _, char = tiny.load("tiny-char-llama", progress=False)
    _, bpe = tiny.load("tiny-bpe-gpt2", progress=False)
    _, unigram = tiny.load("tiny-unigram-neox", progress=False)
    text = benchmark("mixed", 64)[3].solution
    char_ids = char(text, add_special_tokens=False).input_ids
    bpe_ids = bpe(text, add_special_tokens=False).input_ids
    unigram_ids = unigram(text, add_special_tokens=False).input_ids
    assert char.decode(char_ids) == text and bpe.decode(bpe_ids) == text and unigram.decode(unigram_ids) == text
    assert len(char_ids) == len(text)                      # one token per character
    assert len(bpe_ids) < len(char_ids)                    # merges for words, digits split
    prompt = tiny.model_input(benchmark("add", 64)[0].prompt)
    assert len(bpe(prompt).input_ids) < len(prompt) / 2
    # Unigram pieces: metaspace-marked, spaces inside pieces, every digit its own piece.
    pieces = unigram.convert_ids_to_tokens(unigram(prompt, add_special_tokens=False).input_ids)
    assert any("\u2581" in p and len(p) > 1 for p in pieces) and unigram.decode(unigram(prompt).input_ids) == prompt
    assert len(unigram(prompt).input_ids) < len(prompt)
    for problems in (train_split(SKILLS, tiny.EVAL_SIZE, 400), benchmark("mul", 64)):
        for p in problems:
            whole = tiny.model_input(p.prompt) + p.solution
            assert unigram.decode(unigram(whole, add_special_tokens=False).input_ids) == whole
    assert len({len(char), len(bpe), len(unigram)}) == 3


def test_shipped_models_match_their_recipes():
    for key in tiny.RECIPES:
        directory = tiny.locate(key, progress=False)
        assert directory == tiny.ASSETS / key, f"{key}: shipped weights do not match the recipe hash"
    types = {key: tiny.load(key, progress=False)[0].config.model_type for key in tiny.RECIPES}
    assert types == {"tiny-char-llama": "llama", "tiny-bpe-gpt2": "gpt2", "tiny-unigram-neox": "gpt_neox",
                     "tiny-bpe-qwen3": "qwen3"}


def test_recipe_hash_follows_the_recipe():
    recipe = tiny.RECIPES["tiny-char-llama"]
    assert tiny.recipe_hash(recipe) == tiny.recipe_hash(dataclasses.replace(recipe))
    assert tiny.recipe_hash(recipe) != tiny.recipe_hash(dataclasses.replace(recipe, steps=recipe.steps + 1))
    assert tiny.recipe_hash(recipe) != tiny.recipe_hash(dataclasses.replace(recipe, skill_mix={"add": 1.0}))


def test_changed_recipe_builds_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path))
    recipe = dataclasses.replace(tiny.RECIPES["tiny-bpe-gpt2"], steps=2, batch=4, hidden=32, layers=1)
    monkeypatch.setitem(tiny.RECIPES, "tiny-bpe-gpt2", recipe)
    directory = tiny.locate("tiny-bpe-gpt2", progress=False)
    assert directory.parent == tmp_path / "tiny" and tiny.recipe_hash(recipe) in directory.name
    assert (directory / tiny.HASH_FILE).read_text().strip() == tiny.recipe_hash(recipe)
    assert tiny.locate("tiny-bpe-gpt2", progress=False) == directory     # cached: no second build


def test_unknown_tiny_model_is_a_clear_error():
    with pytest.raises(KeyError, match="not a tiny model"):
        tiny.locate("qwen3-1.7b-base")
