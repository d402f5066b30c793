"""python -m graft_exp.prepare: verl Parquet rows from a fixture the test writes itself (no hub), read
back by verl's own RLHFDataset; a clear error where the hub cannot be reached."""

import os
import re
import subprocess
import sys

import pandas as pd
import pytest
from omegaconf import OmegaConf
from support.optional import from_verl
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from graft_exp.prepare import SOURCES, PrepareError, gold_answer, verl_rows, write_parquet

SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
MATH_FIXTURE = [
    {"problem": "What is $1+1$?", "solution": "We add: $1+1=\\boxed{2}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "Simplify $\\frac{4}{6}$.", "solution": "Both divide by 2, $\\boxed{\\frac{2}{3}}$.",
     "level": "Level 2", "type": "Prealgebra"},
    {"problem": "Find $x$ if $x^2=9$, $x>0$.", "solution": "First $\\boxed{-3}$ is out, so $\\boxed{3}$.",
     "level": "Level 1", "type": "Algebra"},
]


def test_gold_answer_is_last_complete_box_of_math_solutions():
    source = SOURCES["math"]
    assert [gold_answer(r, source) for r in MATH_FIXTURE] == ["2", "\\frac{2}{3}", "3"]
    assert gold_answer({"solution": "So $\\boxed{17}$; check: $\\boxed{1"}, source) == "17"
    assert gold_answer({"solution": "Hence $\\fbox{\\$18.90}$."}, source) == "\\$18.90"
    with pytest.raises(PrepareError, match="no \\\\boxed"):
        gold_answer({"solution": "no box here"}, source)
    with pytest.raises(PrepareError, match="no \\\\boxed"):
        gold_answer({"solution": "an empty $\\boxed{ }$"}, source)


@pytest.mark.parametrize("key, value, expected", [
    ("aime2024", "204", "204"),
    ("aime2025", "033", "33"),        # leading zeros, as AIME answer sheets write them
    ("aime2024", 7, "7"),
    ("amc23", 27.0, "27"),            # AMC23 stores floats
    ("amc23", 0.5, "0.5"),
    ("amc23", "40", "40"),
    ("math500", " \\left( 3, \\frac{\\pi}{2} \\right) ", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("minerva", "7.5e5", "7.5e5"),
])
def test_gold_answer_of_each_benchmark_format(key, value, expected):
    assert gold_answer({SOURCES[key].answer: value}, SOURCES[key]) == expected


@pytest.mark.parametrize("key, value, message", [
    ("aime2024", "1000", "integer 0-999"),
    ("aime2025", "\\frac{1}{2}", "integer 0-999"),
    ("amc23", "(C)", "not a number"),
    ("minerva", "  ", "empty 'answer'"),
])
def test_malformed_gold_is_an_error(key, value, message):
    with pytest.raises(PrepareError, match=re.escape(message)):
        gold_answer({SOURCES[key].answer: value}, SOURCES[key])


def test_rows_follow_verl_schema_and_paper_prompt(tmp_path):
    frame = verl_rows(MATH_FIXTURE, SOURCES["math"])
    path = write_parquet(frame, SOURCES["math"], tmp_path, check_rows=False)
    assert path == tmp_path / "math" / "train.parquet"
    back = pd.read_parquet(path)
    assert list(back.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    first = back.iloc[0]
    assert first["data_source"] == "math"
    assert first["prompt"][0]["content"] == f"What is $1+1$? {SUFFIX}"
    assert first["reward_model"]["ground_truth"] == "2"
    with pytest.raises(PrepareError, match="7500"):
        write_parquet(frame, SOURCES["math"], tmp_path)


def test_verl_dataset_reads_prepared_parquet(tmp_path):
    RLHFDataset = from_verl("verl.utils.dataset.rl_dataset").RLHFDataset

    frame = verl_rows([{"question": "What is 6*7?", "answer": "42"}, {"question": "2+2?", "answer": "4"}],
                      SOURCES["amc23"])
    path = write_parquet(frame, SOURCES["amc23"], tmp_path, check_rows=False)
    chars = sorted(set("".join(frame["prompt"].map(lambda p: p[0]["content"]))) | set("[]userassistant \n"))
    tok = Tokenizer(models.WordLevel({"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>",
        chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}[assistant] {% endif %}")
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 2048, "filter_overlong_prompts": True,
                               "truncation": "error", "return_raw_chat": True, "cache_dir": str(tmp_path / "cache")})
    dataset = RLHFDataset(data_files=str(path), tokenizer=tokenizer, config=config)
    assert len(dataset) == 2
    item = dataset[0]
    assert item["raw_prompt"][0]["content"].endswith(SUFFIX)
    assert item["reward_model"]["ground_truth"] == "42" and item["data_source"] == "amc23"


def _prepare(tmp_path, *args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    return subprocess.run([sys.executable, "-m", "graft_exp.prepare", "--data-dir", str(tmp_path / "data"), *args],
                          check=False, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow   # a python -m graft_exp.prepare launch that waits for the hub
def test_unreachable_hub_gives_clear_error(tmp_path):
    result = _prepare(tmp_path, "--sets", "amc23", "--no-models")
    assert result.returncode == 2
    assert "cannot fetch data set math-ai/amc23 from the Hugging Face Hub" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data" / "amc23").exists()


def test_unknown_set_is_named(tmp_path):
    result = _prepare(tmp_path, "--sets", "gsm8k", "--no-models")
    assert result.returncode == 2 and "unknown data set 'gsm8k'" in result.stderr
