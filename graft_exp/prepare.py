"""``python -m graft_exp.prepare``: fetch the paper's data and models once, on a machine that reaches the
Hugging Face Hub, into the directories the verl backend reads (``backend.data_dir`` / ``backend.model_dir``).

Data: the MATH training split (7,500 problems, all levels) and the five benchmarks (MATH500, AIME2024,
AIME2025, AMC23, Minerva), each as verl Parquet: one row per problem with ``data_source``, ``prompt`` (one
user message: the problem plus the paper's suffix), ``ability``, ``reward_model.ground_truth`` and
``extra_info``. Models: a snapshot of every hub model of ``conf/catalog/models.yaml`` at its pinned ``revision``,
recorded beside it and checked against its prompt format (``graft_exp.snapshots``).

    python -m graft_exp.prepare                      # data and models into ./data and ./models
    python -m graft_exp.prepare --data-dir /scratch/graft/data --no-models
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from graft_exp.config import folder_problem
from graft_exp.extras import MissingExtra, require
from graft_exp.prompts import format_prompt
from graft_exp.reward import last_boxed

CATALOG = Path(__file__).resolve().parents[1] / "conf" / "catalog" / "models.yaml"
#: Training solutions without an answer that may be left out (the MATH release has 2 of 7,500).
MAX_UNANSWERED = 10
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")


class PrepareError(RuntimeError):
    """A data set or model cannot be fetched or does not look as expected; the message says why."""


@dataclass(frozen=True)
class Source:
    """Where one data set lives on the hub and which fields hold the problem and its answer."""

    key: str                      # the bench key (or "math" for the training split)
    hub_id: str
    split: str
    question: str
    answer: str                   # field holding the gold answer
    rows: int                     # the paper's size, checked after loading
    configs: tuple[str, ...] = ()  # hub configs to concatenate (MATH's subjects)
    output: str = "test"          # Parquet file name under <data_dir>/<key>/
    gold: str = "latex"           # how the field holds it: see gold_answer


SOURCES = {
    "math": Source("math", "EleutherAI/hendrycks_math", "train", "problem", "solution", 7500, MATH_SUBJECTS, "train",
                   gold="boxed"),
    "math500": Source("math500", "HuggingFaceH4/MATH-500", "test", "problem", "answer", 500),
    "aime2024": Source("aime2024", "HuggingFaceH4/aime_2024", "train", "problem", "answer", 30, gold="integer"),
    "aime2025": Source("aime2025", "yentinglin/aime_2025", "train", "problem", "answer", 30, gold="integer"),
    "amc23": Source("amc23", "math-ai/amc23", "test", "question", "answer", 40, gold="number"),
    "minerva": Source("minerva", "math-ai/minervamath", "test", "question", "answer", 272),
}


def gold_answer(record: dict, source: Source) -> str:
    """The reference answer of one record, as the LaTeX the reward verifies against.

    ``source.gold`` says how the field holds it: ``latex`` (MATH-500, Minerva: the string itself, see ``latex_gold``),
    ``boxed`` (MATH's training split has no answer field: the last complete ``\\boxed{}`` of the worked
    solution, extracted as the reward extracts a response's; Python spellings become LaTeX, see
    ``latex_gold``), ``integer`` (AIME: 0 to 999, leading zeros
    dropped) or ``number`` (AMC23 stores floats: ``27.0`` becomes ``27``). A gold that does not fit is
    an error here, not a silent zero reward at every step.
    """
    value = record[source.answer]
    text = str(value).strip()
    if source.gold == "boxed":
        boxed = last_boxed(text)
        if boxed is None and (bare := _BARE_BOX.findall(text)):
            boxed = bare[-1]  # two training solutions box one digit without braces: ``$\\boxed 9$``
        if boxed is None or not boxed.strip():
            raise PrepareError(f"{source.key}: a solution has no \\boxed{{}} answer: {text[:120]!r}")
        return latex_gold(boxed)
    if source.gold == "integer":
        if not re.fullmatch(r"\d{1,3}", text):
            raise PrepareError(f"{source.key}: an AIME answer must be an integer 0-999, got {value!r}")
        return str(int(text))
    if source.gold == "number":
        try:
            number = float(text)
        except ValueError:
            raise PrepareError(f"{source.key}: the answer {value!r} is not a number") from None
        return str(int(number)) if number.is_integer() else text
    if not text:
        raise PrepareError(f"{source.key}: a record has an empty {source.answer!r}")
    return latex_gold(text)


_BARE_BOX = re.compile(r"\\boxed\s+([0-9a-zA-Z])(?![0-9a-zA-Z])")  # TeX's one-token argument, one character

# A few of Minerva's golds are written in Python (numpy) rather than LaTeX; the reward reads LaTeX only.
_PYTHON_FRACTION = re.compile(r"(?<![\w.])(\d+)\./(\d+)(?![\w.])")  # -1./3
_NUMPY_FUNCTION = re.compile(r"\bnp\.(arcsin|arccos|arctan|sin|cos|tan|exp|log|sqrt)\b")  # np.arcsin(10/13)
_EXP_CALL = re.compile(r"\\exp\s*\{")  # \exp{a*t}: \exp takes parentheses, braces are a power
_STRAY_DOLLARS = re.compile(r"\$\s*\$")  # x_{0} \cos (\omega t)+$ $\dot{x}_{0} ...


def latex_gold(text: str) -> str:
    """A gold answer as LaTeX: the Python spellings some golds use become LaTeX, others are unchanged.

    ``-1./3`` -> ``\\frac{1}{3}`` with its sign, ``np.arcsin(x)`` -> ``\\arcsin(x)``, ``\\exp{a*t}`` ->
    ``e^{a \\cdot t}`` (a ``*`` is a product), and an empty math break ``$ $`` inside a gold is dropped.
    """
    text = _PYTHON_FRACTION.sub(r"\\frac{\1}{\2}", text)
    text = _NUMPY_FUNCTION.sub(r"\\\1", text)
    text = _EXP_CALL.sub("e^{", text)
    text = _STRAY_DOLLARS.sub(" ", text)
    return text.replace("*", " \\cdot ").strip()


def verl_rows(records: Iterable[dict], source: Source) -> pd.DataFrame:
    """verl's RL Parquet schema for ``records`` (dicts with the source's fields), in their order.

    A training solution whose last box is empty has no gold: it is left out with a note on stderr, and
    ``frame.attrs["unanswered"]`` counts it (MATH's training split has two, number theory 7115 and 7117,
    ``... there are $\\boxed{}$ primes``). A benchmark's gold must be there.
    """
    rows, unanswered = [], []
    for index, record in enumerate(records):
        question = str(record[source.question]).strip()
        try:
            gold = gold_answer(record, source)
        except PrepareError:
            if source.gold != "boxed" or last_boxed(str(record[source.answer])) is None:
                raise
            unanswered.append(index)
            continue
        rows.append({
            "data_source": source.key,
            "prompt": [{"role": "user", "content": format_prompt(question)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gold},
            "extra_info": {"split": source.output, "index": index, "question": question},
        })
    if unanswered:
        print(f"{source.key}: left out {len(unanswered)} problem(s) whose solution boxes no answer "
              f"(record {', '.join(map(str, unanswered))})", file=sys.stderr)
    frame = pd.DataFrame(rows)
    frame.attrs["unanswered"] = len(unanswered)
    return frame


def write_parquet(frame: pd.DataFrame, source: Source, data_dir: Path, check_rows: bool = True) -> Path:
    """Write one data set to ``<data_dir>/<key>/<output>.parquet`` (checking the paper's row count)."""
    unanswered = frame.attrs.get("unanswered", 0)
    if check_rows and (len(frame) + unanswered != source.rows or unanswered > MAX_UNANSWERED):
        raise PrepareError(f"{source.key}: {source.hub_id} gave {len(frame) + unanswered} rows ({unanswered} without "
                           f"an answer), the paper's set has {source.rows}")
    path = data_dir / source.key / f"{source.output}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
    return path


def _hub_error(what: str, err: Exception) -> PrepareError:
    return PrepareError(
        f"cannot fetch {what} from the Hugging Face Hub ({type(err).__name__}: {err}). Run "
        "`python -m graft_exp.prepare` on a machine with Hub access (HF_ENDPOINT selects a mirror; "
        "HF_TOKEN a login), then copy the data and model directories to the cluster.")


def load_records(source: Source) -> list[dict]:
    """All records of a hub data set (its configs concatenated), as dicts."""
    from datasets import load_dataset

    records: list[dict] = []
    for config in source.configs or (None,):
        try:
            records.extend(load_dataset(source.hub_id, config, split=source.split))
        except Exception as err:  # datasets raises many kinds (connection, offline, missing repo)
            raise _hub_error(f"data set {source.hub_id}" + (f" ({config})" if config else ""), err) from err
    return records


def fetch_model(key: str, entry, target: Path) -> Path:
    """A full snapshot of catalog model ``key`` (``entry``: its hub id and pinned ``revision``) in ``target``
    (reused when already complete), recorded there (``snapshots.record``) and checked: at the revision, its real
    tokenizer prompts and stops in the model's format (``snapshots.check_prepared``)."""
    from huggingface_hub import snapshot_download

    from graft_exp import snapshots

    try:
        snapshot_download(repo_id=entry.hf_id, revision=entry.revision, local_dir=str(target))
    except Exception as err:  # connection, offline mode, gated repo, unknown revision
        at = f" at revision {entry.revision}" if entry.revision else ""
        raise _hub_error(f"model {entry.hf_id}{at}", err) from err
    snapshots.record(target, entry.hf_id, entry.revision)
    try:
        snapshots.check_prepared(target, key, entry)
    except ValueError as err:
        raise PrepareError(str(err)) from None
    return target


def hub_models() -> dict:
    """Model key -> catalog entry (``hf_id``, ``revision``, ``prompt_format``) of every model on the hub."""
    catalog = OmegaConf.load(CATALOG)
    return {key: entry for key, entry in catalog.items() if entry.hf_id}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graft_exp.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("GRAFT_DATA_DIR", "data")))
    parser.add_argument("--model-dir", type=Path, default=Path(os.environ.get("GRAFT_MODEL_DIR", "models")))
    parser.add_argument("--sets", default=",".join(SOURCES), help="comma-separated data sets (default: all)")
    parser.add_argument("--models", default=",".join(hub_models()), help="comma-separated model keys")
    parser.add_argument("--no-models", action="store_true", help="fetch data only")
    args = parser.parse_args(argv)
    try:
        require("python -m graft_exp.prepare")
        for flag, folder in (("--data-dir", args.data_dir), ("--model-dir", args.model_dir)):
            problem = folder_problem(folder)
            if problem and not (flag == "--model-dir" and args.no_models):   # before hours of downloads
                raise PrepareError(f"{flag} {folder}: {problem}; give a folder you can write")
        for key in [s for s in args.sets.split(",") if s]:
            if key not in SOURCES:
                raise PrepareError(f"unknown data set {key!r}; choose from {', '.join(SOURCES)}")
            source = SOURCES[key]
            frame = verl_rows(load_records(source), source)
            print(f"{key}: {len(frame)} problems -> {write_parquet(frame, source, args.data_dir)}")
        if not args.no_models:
            known = hub_models()
            for key in [m for m in args.models.split(",") if m]:
                if key not in known:
                    raise PrepareError(f"unknown hub model {key!r}; choose from {', '.join(known)}")
                print(f"{key}: {fetch_model(key, known[key], args.model_dir / key)}")
    except PrepareError as err:
        print(f"prepare: {err}", file=sys.stderr)
        return 2
    except MissingExtra as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
