"""Receiver batches in verl's layout: peer responses re-tokenized for the receiver, the exchange's
weights and source advantages as columns, and minibatches in the method's order (peer-last).

verl's padded layout (as its agent loop writes it): ``prompts`` left-padded to the prompt length,
``responses`` right-padded to the response length, ``input_ids`` = prompts ++ responses,
``attention_mask`` likewise, ``position_ids`` = running count of attended tokens, ``response_mask`` =
the responses' attention. Everything here is CPU tensor work on ``verl.DataProto``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

from graft_exp.algorithms import MINIBATCH_ORDERINGS
from graft_exp.backends.verl.loss import DENOMINATOR, IS_PEER, MINIBATCH_INDEX, SFT, SFT_DENOMINATOR, WEIGHT

#: Non-tensor columns every receiver row carries: the prompt's index in the step's batch, the response's
#: index in its source group, and which model generated it ("A" / "B").
PROMPT_INDEX, RESPONSE_INDEX, SOURCE = "graft_prompt_index", "graft_response_index", "graft_source"


def pack_rows(prompts: list[list[int]], responses: list[list[int]], *, prompt_length: int, response_length: int,
              pad_token_id: int) -> dict[str, torch.Tensor]:
    """verl's padded tensors for token-id rows (see the module docstring). Prompts longer than
    ``prompt_length`` or responses longer than ``response_length`` are an error: truncate first."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    rows = len(prompts)
    prompt_ids = torch.full((rows, prompt_length), pad_token_id, dtype=torch.long)
    response_ids = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_length), dtype=torch.long)
    response_mask = torch.zeros((rows, response_length), dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        if not 0 < len(prompt) <= prompt_length or len(response) > response_length:
            raise ValueError(f"row {i}: prompt of {len(prompt)} / response of {len(response)} tokens does not fit "
                             f"({prompt_length} / {response_length}); prompts must be non-empty")
        if prompt:
            prompt_ids[i, prompt_length - len(prompt):] = torch.tensor(prompt)
            prompt_mask[i, prompt_length - len(prompt):] = 1
        if response:
            response_ids[i, :len(response)] = torch.tensor(response)
            response_mask[i, :len(response)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
    }


def row_tokens(batch: DataProto, row: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one row of a padded batch, without padding."""
    attention = batch.batch["attention_mask"][row].bool()
    prompt_width = batch.batch["prompts"].shape[1]
    prompt = batch.batch["prompts"][row][attention[:prompt_width]].tolist()
    response = batch.batch["responses"][row][attention[prompt_width:]].tolist()
    return prompt, response


def decode_responses(batch: DataProto, tokenizer) -> tuple[list[str], list[bool]]:
    """Each row's response string (special tokens dropped) and whether it ended with the model's EOS
    (finished) rather than at the length limit. Rewards and transfers work on these strings."""
    texts, finished = [], []
    eos = _eos_ids(tokenizer)
    for row in range(len(batch)):
        _, response = row_tokens(batch, row)
        texts.append(tokenizer.decode(response, skip_special_tokens=True))
        finished.append(bool(response) and response[-1] in eos)
    return texts, finished


def _eos_ids(tokenizer) -> set[int]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos_token_id")
    return {eos} if isinstance(eos, int) else set(eos)


def retokenize(text: str, tokenizer, *, finished: bool, max_length: int) -> list[int]:
    """A peer response string in the receiver's tokens: its encoding without special tokens, plus the
    receiver's EOS when the source finished (so the receiver learns to stop where the source stopped),
    cut at ``max_length`` (a cut response has no EOS, like one generated to the length limit)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if finished:
        ids = ids + [tokenizer.eos_token_id]
    return ids[:max_length]


def peer_batch(receiver_own: DataProto, own_row_of_prompt: dict[int, int], prompt_index: list[int],
               texts: list[str], finished: list[bool], tokenizer, *, source: str) -> DataProto:
    """The receiver's rows for transferred peer responses: the receiver's own prompt tokens of each prompt
    (taken from one of its rollouts, so the chat template is exactly the one it generated with) and the
    re-tokenized response. ``own_row_of_prompt`` maps a prompt index to one receiver row of that prompt.
    The batch has verl's padded layout at the receiver's widths; its old log-probs are computed next."""
    prompt_length = receiver_own.batch["prompts"].shape[1]
    response_length = receiver_own.batch["responses"].shape[1]
    prompts = [row_tokens(receiver_own, own_row_of_prompt[p])[0] for p in prompt_index]
    responses = [retokenize(t, tokenizer, finished=f, max_length=response_length) for t, f in zip(texts, finished)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tensors = pack_rows(prompts, responses, prompt_length=prompt_length, response_length=response_length,
                        pad_token_id=pad)
    return DataProto.from_dict(tensors=tensors, non_tensors={
        PROMPT_INDEX: np.asarray(prompt_index, dtype=np.int64),
        SOURCE: np.asarray([source] * len(prompt_index), dtype=object),
    })


@dataclass(frozen=True)
class ReceiverRows:
    """One receiver's training rows for a step, before layout: which rows of its own rollouts and of the
    re-tokenized peer batch it trains on, each with its advantage and weight (per ``graft_exp.exchange``).

    ``own`` / ``peer`` index rows of the receiver's own batch / of ``peer_batch``; ``*_advantage`` and
    ``*_weight`` are per listed row; ``peer_sft`` marks SGT's NLL rows (their weight must be 0).
    """

    own: torch.Tensor
    own_advantage: torch.Tensor
    peer: torch.Tensor
    peer_advantage: torch.Tensor
    peer_weight: torch.Tensor
    peer_sft: torch.Tensor

    @classmethod
    def own_only(cls, rows: int, advantages: torch.Tensor) -> ReceiverRows:
        empty = torch.zeros(0)
        return cls(torch.arange(rows), advantages.float(), torch.zeros(0, dtype=torch.long), empty, empty,
                   torch.zeros(0, dtype=torch.bool))


TRAIN_COLUMNS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                 "old_log_probs")


def receiver_batch(own: DataProto, peer: DataProto | None, rows: ReceiverRows) -> DataProto:
    """Concatenate the selected own rows and peer rows into one receiver batch with the loss columns:
    ``advantages`` (the row's advantage on its response tokens, verl's [B, T] convention), ``graft_weight``,
    ``graft_is_peer``, ``graft_sft``. Both inputs need ``old_log_probs`` under the *receiver's* old policy."""
    parts = [_select(own, rows.own, rows.own_advantage, torch.ones(len(rows.own)), peer=False,
                     sft=torch.zeros(len(rows.own), dtype=torch.bool))]
    if len(rows.peer):
        if peer is None:
            raise ValueError("rows.peer lists peer rows but no peer batch was given")
        if bool((rows.peer_weight[rows.peer_sft] != 0).any()):
            raise ValueError("SGT rows enter only the NLL term: their policy-gradient weight must be 0")
        parts.append(_select(peer, rows.peer, rows.peer_advantage, rows.peer_weight, peer=True, sft=rows.peer_sft))
    return DataProto.concat(parts)


def _select(batch: DataProto, index: torch.Tensor, advantage: torch.Tensor, weight: torch.Tensor, *, peer: bool,
            sft: torch.Tensor) -> DataProto:
    keep = batch.select(batch_keys=list(TRAIN_COLUMNS), non_tensor_batch_keys=[PROMPT_INDEX, SOURCE])
    part = keep[index.long()] if len(index) else keep[torch.zeros(0, dtype=torch.long)]
    mask = part.batch["response_mask"].float()
    part.batch["advantages"] = advantage.float().unsqueeze(1) * mask
    part.batch[WEIGHT] = weight.float()
    part.batch[IS_PEER] = torch.full((len(index),), float(peer))
    part.batch[SFT] = sft.float()
    return part


def minibatch_plan(batch: DataProto, *, prompts_per_minibatch: int, ordering: str, dp_size: int,
                   generator: torch.Generator | None = None, peer_groups_separate: bool = False,
                   sequence_mean: bool = False) -> list[DataProto]:
    """Cut a receiver batch into optimizer minibatches in the method's order, each ready for one
    ``update_actor`` call.

    Groups are (prompt, kind) pairs: a replaced prompt's peer rows form a peer group; with
    ``peer_groups_separate`` (HACPO, which keeps own and peer rows of every prompt) a prompt has an own
    and a peer group, otherwise a prompt's rows are one group, peer if any row is a peer row. Minibatches
    come from ``graft_exp.algorithms.MINIBATCH_ORDERINGS[ordering]`` over those groups.

    This replaces verl's ``balance_batch``, which reorders rows across the whole batch and so would mix
    peer rows into early minibatches: here each minibatch is balanced *within itself* across the
    data-parallel ranks (verl's ``get_seqlen_balanced_partitions`` on its rows' lengths), padded to a
    multiple of ``dp_size`` with weight-0 copies, and laid out rank by rank, which is how verl's dispatch
    hands contiguous chunks to ranks. Each minibatch gets its loss denominator (response tokens of rows
    with weight > 0; with ``sequence_mean``, HACPO's, the number of those rows) and, for SGT, the NLL
    rows' token count, plus its position (HACPO's m).
    """
    prompt = np.asarray(batch.non_tensor_batch[PROMPT_INDEX], dtype=np.int64)
    is_peer = batch.batch[IS_PEER].bool().numpy()
    groups: dict[tuple[int, bool], list[int]] = {}
    for row, p in enumerate(prompt):
        key = (int(p), bool(is_peer[row])) if peer_groups_separate else (int(p), False)
        groups.setdefault(key, []).append(row)
    keys = sorted(groups, key=lambda k: (k[1], k[0]) if peer_groups_separate else k)
    group_is_peer = torch.tensor([bool(is_peer[groups[k]].any()) for k in keys], dtype=torch.bool)
    order = MINIBATCH_ORDERINGS[ordering](group_is_peer, prompts_per_minibatch, generator)
    seqlens = batch.batch["attention_mask"].sum(dim=1)
    minibatches = []
    for position, group_index in enumerate(order):
        rows = [r for g in group_index.tolist() for r in groups[keys[g]]]
        minibatches.append(_dp_layout(batch, rows, seqlens, dp_size, position, sequence_mean))
    return minibatches


def _dp_layout(batch: DataProto, rows: list[int], seqlens: torch.Tensor, dp_size: int, position: int,
               sequence_mean: bool) -> DataProto:
    padding = (-len(rows)) % dp_size
    index = rows + rows[:1] * padding
    workload = [int(seqlens[r]) for r in index]
    partitions = get_seqlen_balanced_partitions(workload, k_partitions=dp_size, equal_size=True)
    laid_out = [index[i] for part in partitions for i in sorted(part)]
    is_padding = torch.tensor([i >= len(rows) for part in partitions for i in sorted(part)])
    minibatch = batch[torch.tensor(laid_out)]
    weight = torch.where(is_padding, torch.zeros(()), minibatch.batch[WEIGHT])
    minibatch.batch[WEIGHT] = weight
    minibatch.batch[SFT] = torch.where(is_padding, torch.zeros(()), minibatch.batch[SFT])
    mask = minibatch.batch["response_mask"].bool()
    present = weight > 0
    denominator = int(present.sum()) if sequence_mean else int((mask & present.unsqueeze(1)).sum())
    sft_tokens = (mask & minibatch.batch[SFT].bool().unsqueeze(1)).sum()
    rows_count = len(laid_out)
    minibatch.batch[DENOMINATOR] = torch.full((rows_count,), float(max(denominator, 1)))
    minibatch.batch[SFT_DENOMINATOR] = torch.full((rows_count,), float(max(int(sft_tokens), 1)))
    minibatch.batch[MINIBATCH_INDEX] = torch.full((rows_count,), float(position))
    return minibatch
