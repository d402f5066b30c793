"""Dataset inputs of a model run: its training split and benchmarks, logged as MLflow datasets (the UI's
"Datasets used"), idempotently (concurrent jobs race on MLflow's find-or-create of a dataset)."""

from __future__ import annotations

import hashlib
import time
import warnings
from pathlib import Path

import mlflow.data
import mlflow.exceptions
import pandas as pd
from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.entities import DatasetInput, InputTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

DATASET_CONTEXT_TAG = "mlflow.data.context"   # what mlflow.log_input(context=...) writes


def _frame_input(frame: pd.DataFrame, name: str, source, context: str, digest: str | None = None) -> DatasetInput:
    with warnings.catch_warnings():
        # MLflow registers its local-file source class twice and warns that a path is ambiguous.
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
        dataset = mlflow.data.from_pandas(frame, source=source, name=name, digest=digest)
    return DatasetInput(dataset._to_mlflow_entity(), [InputTag(DATASET_CONTEXT_TAG, context)])


def _tiny_inputs(cfg: DictConfig) -> list[DatasetInput]:
    """The tiny pair's generated splits, as the local backend draws them (graft_exp/tiny/task.py)."""
    from graft_exp.tiny import recipes as tiny
    from graft_exp.tiny.task import DATA_SEED, SKILLS, benchmark, train_split

    def frame(problems):
        return pd.DataFrame([(p.uid, p.skill, p.question, p.answer) for p in problems],
                            columns=["uid", "skill", "question", "answer"])

    size = int(cfg.pair.train_size)
    source = {"generator": "graft_exp.tiny.task.train_split", "skills": ",".join(SKILLS),
              "size": size, "eval_size": tiny.EVAL_SIZE, "data_seed": DATA_SEED}
    inputs = [_frame_input(frame(train_split(SKILLS, tiny.EVAL_SIZE, size)), f"{cfg.pair.data}/train",
                           CodeDatasetSource(source), "training")]
    limit = cfg.eval.get("max_problems") or tiny.EVAL_SIZE
    for bench in cfg.pair.benchmarks:
        source = {"generator": "graft_exp.tiny.task.benchmark", "skill": bench, "problems": limit,
                  "data_seed": DATA_SEED}
        inputs.append(_frame_input(frame(benchmark(bench, tiny.EVAL_SIZE)[:limit]), f"{cfg.pair.data}/{bench}",
                                   CodeDatasetSource(source), "evaluation"))
    return inputs


def _parquet_inputs(cfg: DictConfig) -> list[DatasetInput]:
    """The Parquet files ``python -m graft_exp.prepare`` writes under ``backend.data_dir``; a digest of
    the file's bytes (MLflow's own digest skips the nested prompt and answer columns)."""
    from graft_exp.prepare import SOURCES

    root = Path(cfg.backend.get("data_dir") or "data")
    inputs = []
    for key, context in [(cfg.pair.data, "training"), *((b, "evaluation") for b in cfg.pair.benchmarks)]:
        if key not in SOURCES:
            continue
        path = (root / key / f"{SOURCES[key].output}.parquet").resolve()
        if not path.is_file():
            continue   # the backend reports the missing file when it reads it
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        inputs.append(_frame_input(pd.read_parquet(path), key, str(path), context, digest))
    return inputs


def dataset_inputs(cfg: DictConfig) -> list[DatasetInput]:
    """The training data and benchmarks of ``cfg``'s pair as MLflow dataset inputs (name, digest,
    source, schema, row count), so that the UI's Dataset column says what a model was trained on."""
    return _tiny_inputs(cfg) if cfg.pair.data == "tiny_arith" else _parquet_inputs(cfg)


def log_dataset_inputs(client: MlflowClient, run_id: str, cfg: DictConfig, attempts: int = 5) -> None:
    """Log :func:`dataset_inputs` on ``run_id``. MLflow's store finds or creates each dataset of the
    experiment in two statements, so jobs that start together (a multirun, a Slurm array) can both try
    to create the same one and the second fails on the unique key. Logging is idempotent (inputs
    already logged are skipped), so the loser retries and finds the winner's rows."""
    datasets = dataset_inputs(cfg)
    for attempt in range(attempts):
        try:
            client.log_inputs(run_id, datasets=datasets)
            return
        except mlflow.exceptions.MlflowException:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
