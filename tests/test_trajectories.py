"""The stored-trajectory log: Parquet round trip, per-prompt success counts, replay of one step."""

import pandas as pd
import pytest
import torch

from graft_exp.algorithms import grpo_advantages
from graft_exp.rollouts import Rollouts
from graft_exp.trajectories import (
    SCHEMA,
    prompt_success,
    read_log,
    step_rollouts,
    write_prompt_success,
    write_step,
)


def make_rollouts(step: int) -> tuple[Rollouts, list]:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]) if step == 1 else torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    responses = [[f"s{step} q{q} r{i} \\boxed{{{i}}}" for i in range(3)] for q in range(2)]
    token_ids = [[[q, i, step] for i in range(3)] for q in range(2)]
    return Rollouts("tiny-char-llama", [f"add-{step}0", f"sub-{step}1"], responses, rewards, grpo_advantages(rewards),
                    torch.tensor([[-1.5, -2.0, -0.5], [-3.0, -1.0, -2.5]], dtype=torch.float64),
                    torch.tensor([[3, 4, 2], [5, 3, 3]]), torch.tensor([[True, True, False], [True, True, True]])), token_ids


def test_round_trip(tmp_path):
    originals = {}
    for step in (1, 2):
        rollouts, token_ids = make_rollouts(step)
        write_step(tmp_path, step, rollouts, token_ids)
        originals[step] = (rollouts, token_ids)
    log = read_log(tmp_path)
    assert list(log.columns) == SCHEMA.names and len(log) == 12
    for step, (original, token_ids) in originals.items():
        replayed = step_rollouts(log, step, original.model)
        assert replayed.prompt_ids == original.prompt_ids and replayed.responses == original.responses
        for name in ("rewards", "advantages", "logp_sum", "num_tokens", "finished"):
            assert torch.equal(getattr(replayed, name).to(getattr(original, name).dtype), getattr(original, name)), name
        assert log[log.step == step].token_ids.map(list).tolist() == [ids for group in token_ids for ids in group]


def test_rewriting_a_step_is_idempotent(tmp_path):
    rollouts, token_ids = make_rollouts(1)
    write_step(tmp_path, 1, rollouts, token_ids)
    write_step(tmp_path, 1, rollouts, token_ids)        # a resumed job replays its last step
    assert len(read_log(tmp_path)) == 6 and not list(tmp_path.glob("*.tmp"))


def test_prompt_success(tmp_path):
    for step in (1, 2):
        write_step(tmp_path, step, *make_rollouts(step))
    table = prompt_success(read_log(tmp_path))
    assert table.to_dict("records") == [
        {"step": 1, "prompt_id": "add-10", "k": 1}, {"step": 1, "prompt_id": "sub-11", "k": 0},
        {"step": 2, "prompt_id": "add-20", "k": 3}, {"step": 2, "prompt_id": "sub-21", "k": 2},
    ]
    path = write_prompt_success(read_log(tmp_path), tmp_path / "prompt_success.parquet")
    assert pd.read_parquet(path).equals(table)


def test_missing_step_and_empty_log_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trajectory files"):
        read_log(tmp_path)
    write_step(tmp_path, 1, *make_rollouts(1))
    with pytest.raises(KeyError, match="no step 5"):
        step_rollouts(read_log(tmp_path), 5, "m")
