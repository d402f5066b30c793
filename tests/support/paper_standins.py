"""Prepared stand-ins of the paper's data and models, as ``python -m graft_exp.prepare`` leaves them, where the hub
cannot be reached: the data in prepare's own row format (one problem per set: validation reads the files' schema),
and each paper model's folder with its real tokenizer (the published vocabulary, special-token table and ids, built
offline by ``graft_exp.tiny.paper_vocab``) and prepare's record of the revision the catalog pins. No weights:
validation and planning read the tokenizer, the record and conf/catalog/sizes.yaml only."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from graft_exp import snapshots
from graft_exp.cache import cache_dir
from graft_exp.config import MODELS_FILE
from graft_exp.prepare import SOURCES, verl_rows

PAPER_MODELS = ("smollm3-3b-base", "qwen3-1.7b-base", "octothinker-3b-hybrid-base")


def prepare_data(data_dir: Path) -> Path:
    """MATH's training split and the five benchmarks under ``data_dir``, one row each."""
    for key, source in SOURCES.items():
        path = data_dir / key / f"{source.output}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        gold = "The sum is $\\boxed{2}$." if source.gold == "boxed" else "2"
        verl_rows([{source.question: "What is $1+1$?", source.answer: gold}], source).to_parquet(path)
    return data_dir


def prepare_models(model_dir: Path, keys=PAPER_MODELS) -> Path:
    """``model_dir/<key>`` for each paper model: its real tokenizer (with the chat template its snapshot ships, where
    it ships one) and prepare's record of the catalog's revision."""
    from graft_exp.tiny.paper_vocab import build

    catalog = OmegaConf.load(MODELS_FILE)
    for key in keys:
        folder = model_dir / key
        build(key, cache_dir("paper_tokenizers")).save_pretrained(folder)
        snapshots.record(folder, catalog[key].hf_id, catalog[key].revision)
    return model_dir
