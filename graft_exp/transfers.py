"""The transfer log (docs/design.md "Transfer log"): every peer group a receiver's exchange considered at a step,
transferred or not, response by response, with what became of it.

One Parquet file per step, ``step_000012.parquet``, under a model run's ``transfers/`` artifact directory (the
receiver's run), beside its trajectory log; one row per response of each source's group on each prompt of the
step's batch (long format, as the trajectory log):

==================  ========  =======================================================================
column              type      meaning
==================  ========  =======================================================================
step                int32     training step
receiver            string    the receiver's model key
source              string    the source's model key (the replayed log's model for stored replay)
prompt_id           string    stable id of the prompt (joins both models' trajectory logs)
prompt_index        int32     position of the prompt in the step's batch
subject             string    the problem's skill or subject ("" where the data has none)
sample              int32     the response's index in the source's group (joins the source's log)
k_source            int32     the source's successes on the prompt (of n)
k_receiver          int32     the receiver's own successes on the prompt (of n)
selected            bool      the selection (and, in a group, the source rule) gave the receiver this group
admitted            bool      the response is among the receiver's trained rows (SGT: its NLL row)
reason              string    admitted | gated (selected, not admitted) | not selected
weight              float32   its weight in the receiver's update (0 when not admitted)
minibatch           int32     index of the minibatch it was trained in (-1 when not admitted): peer-last
receiver_logp_mean  float64   mean token log-prob under the receiver's old policy (NaN unless scored)
receiver_tokens     int32     its length in the receiver's tokens (-1 unless scored)
reward              float32   its verified reward
replaced_own        bool      the receiver's own group on this prompt is not in its update (replaced)
k_receiver_after    int32     the receiver's successes on the prompt after this step's update (the probe,
                              ``train.probe_transfers``; -1 when not probed)
==================  ========  =======================================================================

The scorer runs only on the groups the exchange scores: a response of a group it did not score has no
receiver log-prob. Writing the log draws nothing: a job's metrics are the same with or without it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from graft_exp.scores import rescue_candidate

SCHEMA = pa.schema([
    ("step", pa.int32()), ("receiver", pa.string()), ("source", pa.string()), ("prompt_id", pa.string()),
    ("prompt_index", pa.int32()), ("subject", pa.string()), ("sample", pa.int32()), ("k_source", pa.int32()),
    ("k_receiver", pa.int32()), ("selected", pa.bool_()), ("admitted", pa.bool_()), ("reason", pa.string()),
    ("weight", pa.float32()), ("minibatch", pa.int32()), ("receiver_logp_mean", pa.float64()),
    ("receiver_tokens", pa.int32()), ("reward", pa.float32()), ("replaced_own", pa.bool_()),
    ("k_receiver_after", pa.int32()),
])
ADMITTED, GATED, NOT_SELECTED = "admitted", "gated", "not selected"


@dataclass
class Scored:
    """What a receiver's scorer computed this step: (log-prob sum, tokens) of each scored response, by prompt and
    text (the score depends on nothing else, so a response one source shares with another is scored once)."""

    values: dict[tuple[int, str, bool], tuple[float, int]] = field(default_factory=dict)

    def keep(self, q: int, source, i: int, logp_sum: float, tokens: int) -> None:
        self.values[q, source.responses[q][i], bool(source.finished[q, i])] = (logp_sum, tokens)

    def of(self, q: int, source, i: int) -> tuple[float, int]:
        """(log-prob sum, tokens) of ``source``'s response i on prompt q: (NaN, -1) if it was not scored."""
        return self.values.get((q, source.responses[q][i], bool(source.finished[q, i])), (math.nan, -1))

    def mean_logp(self, q: int, source, i: int) -> tuple[float, int]:
        logp, tokens = self.of(q, source, i)
        return (logp / tokens if tokens > 0 else math.nan), tokens


def subject_of(problem) -> str:
    """The problem's skill (the tiny task) or subject (MATH), "" where it has neither."""
    return str(getattr(problem, "skill", None) or getattr(problem, "subject", None) or "")


def group_rows(step: int, receiver: str, source: str, problems: Sequence, source_rollouts, receiver_k: Sequence[int],
               selected: Sequence[bool], admitted: dict[tuple[int, int], tuple[float, int]], replaced: set[int],
               scored: Scored, after: dict[int, int]) -> dict[str, list]:
    """The rows of one (receiver, source) pair at one step: every response of the source's groups.

    ``admitted[(q, i)]`` = (weight, minibatch) of the source's responses in the receiver's update;
    ``replaced``: prompts whose own group the receiver does not train on; ``after[q]``: the probe's k."""
    rows = {name: [] for name in SCHEMA.names}
    k_source = source_rollouts.k.tolist()
    for q, problem in enumerate(problems):
        for i in range(source_rollouts.n):
            weight, minibatch = admitted.get((q, i), (0.0, -1))
            taken = (q, i) in admitted
            logp, tokens = scored.mean_logp(q, source_rollouts, i)
            values = {
                "step": step, "receiver": receiver, "source": source, "prompt_id": source_rollouts.prompt_ids[q],
                "prompt_index": q, "subject": subject_of(problem), "sample": i, "k_source": int(k_source[q]),
                "k_receiver": int(receiver_k[q]), "selected": bool(selected[q]), "admitted": taken,
                "reason": ADMITTED if taken else GATED if selected[q] else NOT_SELECTED, "weight": float(weight),
                "minibatch": int(minibatch), "receiver_logp_mean": logp, "receiver_tokens": int(tokens),
                "reward": float(source_rollouts.rewards[q, i]), "replaced_own": bool(selected[q]) and q in replaced,
                "k_receiver_after": int(after.get(q, -1)),
            }
            for name, value in values.items():
                rows[name].append(value)
    return rows


def prompt_outcomes(log: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """One row per prompt of one receiver's log (``by``: the columns that name a prompt): ``received`` (a source's
    group was), ``k_receiver``, ``k_source`` (a received prompt's, from the source it came from; a control's, the
    most any source solved), ``k_after`` (the probe's) and ``candidate`` (``scores.rescue_candidate``)."""
    chosen_k = log[log["selected"]].groupby(by)["k_source"].first()
    prompts = log.groupby(by).agg(received=("selected", "any"), k_receiver=("k_receiver", "first"),
                                  k_any=("k_source", "max"), k_after=("k_receiver_after", "first"))
    prompts["k_source"] = chosen_k.reindex(prompts.index).fillna(prompts["k_any"]).astype(int)
    prompts["candidate"] = rescue_candidate(prompts["k_receiver"], prompts["k_source"])
    return prompts.drop(columns="k_any")


def transfer_metrics(rows: dict[str, list]) -> dict[str, float]:
    """A receiver's per-step metrics from its transfer-log rows: the peer responses admitted into its update and,
    where the probe ran, of its candidates (prompts it failed entirely that the source solved) the share it now
    solves at least once: those it received a group on, and the others (its controls)."""
    frame = pd.DataFrame(rows)
    out = {"transfers/admitted": float(frame["admitted"].sum())}
    probed = frame[frame["k_receiver_after"] >= 0]
    if not probed.empty:
        prompts = prompt_outcomes(probed, ["prompt_index"])
        candidates = prompts[prompts["candidate"]]
        for name, part in (("absorbed", candidates[candidates["received"]]),
                           ("control_absorbed", candidates[~candidates["received"]])):
            if not part.empty:
                out[f"transfers/{name}"] = float((part["k_after"] > 0).mean())
    return out


def write_step(directory: Path, step: int, parts: list[dict[str, list]]) -> Path:
    """Write one step's rows of one receiver atomically (a replayed step overwrites them identically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    merged = {name: [v for part in parts for v in part[name]] for name in SCHEMA.names}
    path = directory / f"step_{step:06d}.parquet"
    tmp = path.with_suffix(".tmp")
    pq.write_table(pa.Table.from_pydict(merged, schema=SCHEMA), tmp)
    os.replace(tmp, path)
    return path


def read_log(directory: Path) -> pd.DataFrame:
    """Every step file of one receiver's transfer log, in step order (an empty frame when there is none)."""
    files = sorted(Path(directory).glob("step_*.parquet"))
    if not files:
        return SCHEMA.empty_table().to_pandas()
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)
