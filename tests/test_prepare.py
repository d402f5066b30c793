"""python -m graft_exp.prepare: verl Parquet rows from a fixture the test writes itself (no hub), read
back by verl's own RLHFDataset; a clear error where the hub cannot be reached."""

import os
import subprocess
import sys

import pandas as pd
import pytest
from omegaconf import OmegaConf
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
    with pytest.raises(PrepareError, match="no \\\\boxed"):
        gold_answer({"solution": "no box here"}, source)
    assert gold_answer({"question": "q", "answer": 40}, SOURCES["amc23"]) == "40"


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
    from verl.utils.dataset.rl_dataset import RLHFDataset

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


def test_unreachable_hub_gives_clear_error(tmp_path):
    result = _prepare(tmp_path, "--sets", "amc23", "--no-models")
    assert result.returncode == 2
    assert "cannot fetch data set math-ai/amc23 from the Hugging Face Hub" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data" / "amc23").exists()


def test_unknown_set_is_named(tmp_path):
    result = _prepare(tmp_path, "--sets", "gsm8k", "--no-models")
    assert result.returncode == 2 and "unknown data set 'gsm8k'" in result.stderr
