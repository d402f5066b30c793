"""The stored-trajectory log (docs/design.md "Stored trajectories"): every response a model sampled, per
training step and prompt, with what a later receiver needs to replay it (``graft_stored``).

One Parquet file per step, ``step_000012.parquet``, under a model run's ``trajectories/`` artifact
directory; one row per response (long format, so pandas can group by step and prompt):

==============  ===========  ====================================================================
column          type         meaning
==============  ===========  ====================================================================
step            int32        training step the response was sampled at
prompt_id       string       stable id of the prompt (the task's uid)
prompt_index    int32        position of the prompt in the step's batch
sample          int32        index of the response within its group (0..n-1)
response        string       decoded response text
token_ids       list<int32>  the source model's generated token ids
logp_sum        float64      sum of the source's generation log-probs over those tokens
num_tokens      int32        number of generated tokens (>= 1)
finished        bool         the response ended with the end-of-sequence token
reward          float32      verified reward in {0, 1}
advantage       float32      the source's GRPO advantage
==============  ===========  ====================================================================

``prompt_success.parquet`` summarises it: (step, prompt_id, k) with k the successes out of n.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from graft_exp.rollouts import Rollouts

SCHEMA = pa.schema([
    ("step", pa.int32()),
    ("prompt_id", pa.string()),
    ("prompt_index", pa.int32()),
    ("sample", pa.int32()),
    ("response", pa.string()),
    ("token_ids", pa.list_(pa.int32())),
    ("logp_sum", pa.float64()),
    ("num_tokens", pa.int32()),
    ("finished", pa.bool_()),
    ("reward", pa.float32()),
    ("advantage", pa.float32()),
])
SUCCESS_SCHEMA = pa.schema([("step", pa.int32()), ("prompt_id", pa.string()), ("k", pa.int32())])


def step_file(step: int) -> str:
    return f"step_{step:06d}.parquet"


def to_table(step: int, rollouts: Rollouts, token_ids: list[list[list[int]]]) -> pa.Table:
    """One step's rows of one model."""
    prompts, n = rollouts.rewards.shape
    rows = {name: [] for name in SCHEMA.names}
    for q in range(prompts):
        for i in range(n):
            rows["step"].append(step)
            rows["prompt_id"].append(rollouts.prompt_ids[q])
            rows["prompt_index"].append(q)
            rows["sample"].append(i)
            rows["response"].append(rollouts.responses[q][i])
            rows["token_ids"].append(token_ids[q][i])
            rows["logp_sum"].append(float(rollouts.logp_sum[q, i]))
            rows["num_tokens"].append(int(rollouts.num_tokens[q, i]))
            rows["finished"].append(bool(rollouts.finished[q, i]))
            rows["reward"].append(float(rollouts.rewards[q, i]))
            rows["advantage"].append(float(rollouts.advantages[q, i]))
    return pa.Table.from_pydict(rows, schema=SCHEMA)


def write_step(directory: Path, step: int, rollouts: Rollouts, token_ids: list[list[list[int]]]) -> Path:
    """Write one step's file atomically (a replayed step overwrites it with identical content)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / step_file(step)
    tmp = path.with_suffix(".tmp")
    pq.write_table(to_table(step, rollouts, token_ids), tmp)
    os.replace(tmp, path)
    return path


def read_log(directory: Path) -> pd.DataFrame:
    """All steps of a log directory, sorted by (step, prompt_index, sample)."""
    files = sorted(Path(directory).glob("step_*.parquet"))
    if not files:
        raise FileNotFoundError(f"no trajectory files (step_*.parquet) in {directory}")
    frame = pd.concat([pq.read_table(f, schema=SCHEMA).to_pandas() for f in files], ignore_index=True)
    return frame.sort_values(["step", "prompt_index", "sample"], ignore_index=True)


def prompt_success(log: pd.DataFrame) -> pd.DataFrame:
    """(step, prompt_id, k): successes of each prompt's group at each step."""
    k = log.groupby(["step", "prompt_index", "prompt_id"], sort=True)["reward"].sum().round().astype("int32").rename("k")
    return k.reset_index().drop(columns="prompt_index")[["step", "prompt_id", "k"]]


def write_prompt_success(log: pd.DataFrame, path: Path) -> Path:
    table = pa.Table.from_pandas(prompt_success(log), schema=SUCCESS_SCHEMA, preserve_index=False)
    pq.write_table(table, path)
    return path


def step_rollouts(log: pd.DataFrame, step: int, model: str) -> Rollouts:
    """Rebuild the ``Rollouts`` of one logged step (rewards and advantages as logged; a replaying
    receiver re-verifies the rewards itself)."""
    rows = log[log["step"] == step]
    if rows.empty:
        raise KeyError(f"the trajectory log has no step {step} (it covers steps "
                       f"{int(log['step'].min())}..{int(log['step'].max())})")
    prompts = int(rows["prompt_index"].max()) + 1
    n = int(rows["sample"].max()) + 1
    if len(rows) != prompts * n:
        raise ValueError(f"step {step} of the trajectory log has {len(rows)} rows, expected {prompts} x {n}")

    def grid(column: str, dtype) -> torch.Tensor:
        return torch.tensor(rows[column].to_numpy(), dtype=dtype).view(prompts, n)

    return Rollouts(
        model=model,
        prompt_ids=rows["prompt_id"].iloc[::n].tolist(),
        responses=[rows["response"].iloc[q * n:(q + 1) * n].tolist() for q in range(prompts)],
        rewards=grid("reward", torch.float32),
        advantages=grid("advantage", torch.float32),
        logp_sum=grid("logp_sum", torch.float64),
        num_tokens=grid("num_tokens", torch.long),
        finished=grid("finished", torch.bool),
    )
