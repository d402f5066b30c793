"""The verl side of ``graft_exp.methods.exchange``: rollouts and receiver batches in verl's ``DataProto`` layout.

The exchange itself (which prompts, which rows, advantages, weights, minibatch order) is
``graft_exp.methods.exchange``'s, shared with the local backend; this module only moves its results in and out
of verl's tensors: the receiver's ``Scorer`` backed by one batched log-prob call of its worker group
(``PeerScorer``), peer responses re-tokenized for the receiver (``peer_batch``), the ``ReceiverBatch``
as verl rows with the loss's columns (``receiver_batch``), and its minibatches laid out for verl's
data-parallel dispatch (``minibatch_layout``).

verl's padded layout (as its agent loop writes it): ``prompts`` left-padded to the prompt length,
``responses`` right-padded to the response length, ``input_ids`` = prompts ++ responses,
``attention_mask`` likewise, ``position_ids`` = running count of attended tokens, ``response_mask`` =
the responses' attention. Everything here is CPU tensor work on ``verl.DataProto``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

from graft_exp.algorithms import sequence_log_prob_sums
from graft_exp.backends.verl.loss import (
    DENOMINATOR,
    IS_PEER,
    MINIBATCH_INDEX,
    NLL,
    NLL_DENOMINATOR,
    WEIGHT,
    row_column,
)
from graft_exp.methods.receiver import PEER, SELF, ReceiverBatch, Row
from graft_exp.prompts import end_of_turn_id
from graft_exp.rollouts import Rollouts

#: Non-tensor columns of peer and receiver rows: the prompt's index in the step's batch, the response's
#: index in its generating model's group, and the exchange's group of the row (``Row.group``: the unit
#: minibatches are made of).
PROMPT_INDEX, RESPONSE_INDEX, GROUP = "graft_prompt_index", "graft_response_index", "graft_group"
#: ``log_probs(batch) -> [B, T]``: per-token log-probs of a padded batch's responses under the receiver's
#: current (old) policy, as ``runtime.VerlModel.log_probs`` computes them on its worker group.
LogProbs = Callable[[DataProto], torch.Tensor]
#: ``row_columns(rows) -> {name: tensor [len(rows)]}``: the loss's per-row columns of exchange rows
#: (``objective.row_column_values`` for the step, as the backend binds it).
RowColumns = Callable[[list[Row]], dict[str, torch.Tensor]]


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


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids a model stops generating on: the chat template's end-of-turn token (``prompts.end_of_turn_id``), its
    generation config's ``eos_token_id`` (an int or a list; chat models list their end-of-turn token, e.g.
    ``<|im_end|>``, before ``<|endoftext|>``), then the tokenizer's EOS if it is not among them. vLLM gets the
    same set with every request (``seeded_agent.STOP_COLUMN``). The first id is the one a peer copy of a
    finished response ends with (``retokenize``): the end of the turn, as the receiver's own answers end."""
    ids: list[int] = []
    configured = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    for value in ([end_of_turn_id(tokenizer)] + ([configured] if isinstance(configured, int)
                                                  else list(configured or [])) + [tokenizer.eos_token_id]):
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    if not ids:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} and its generation config name no EOS token")
    return ids


def logprob_gap(batch: DataProto) -> float | None:
    """The largest mean per-token |rollout - trainer| log-prob gap of a response: vLLM's log-probs of the tokens it
    sampled (``rollout_log_probs``) against the FSDP workers' (``old_log_probs``) under the weights the engine was
    just sent. Near 0 where the sync delivered the weights (kernels and precision apart); None without vLLM's."""
    if "rollout_log_probs" not in batch.batch:
        return None
    mask = batch.batch["response_mask"].float()
    gap = (batch.batch["rollout_log_probs"].float() - batch.batch["old_log_probs"].float()).abs() * mask
    return float((gap.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).max())


def decode_responses(batch: DataProto, tokenizer, stop_ids: list[int]) -> tuple[list[str], list[bool]]:
    """Each row's response string and whether it ended with one of the model's ``stop_ids``
    (``stop_token_ids``: finished) rather than at the length limit. The stop token is cut before decoding
    (it need not be a special token) and special tokens are dropped. Rewards and transfers work on
    these strings."""
    texts, finished = [], []
    stops = set(stop_ids)
    for row in range(len(batch)):
        _, response = row_tokens(batch, row)
        done = bool(response) and response[-1] in stops
        texts.append(tokenizer.decode(response[:-1] if done else response, skip_special_tokens=True))
        finished.append(done)
    return texts, finished


def copy_ids(text: str, tokenizer, *, finished: bool, stop_id: int) -> list[int]:
    """A peer response string in the receiver's tokens: its encoding without special tokens, plus the
    receiver's stop token ``stop_id`` (the first of its ``stop_token_ids``: a chat model's end of turn)
    when the source finished, so that the receiver learns to stop where the source stopped."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids + [int(stop_id)] if finished else ids


def retokenize(text: str, tokenizer, *, finished: bool, max_length: int, stop_id: int) -> list[int]:
    """``copy_ids`` cut at ``max_length`` (a cut response has no stop token, like one generated to the length
    limit; ``method.cut_copies`` says whether the receiver trains on it)."""
    return copy_ids(text, tokenizer, finished=finished, stop_id=stop_id)[:max_length]


def response_token_ids(batch: DataProto, n: int) -> list[list[list[int]]]:
    """Each row's generated token ids (no padding), grouped [P][n] as the trajectory log stores them."""
    ids = [row_tokens(batch, row)[1] for row in range(len(batch))]
    return [ids[q * n:(q + 1) * n] for q in range(len(ids) // n)]


def prompt_token_counts(batch: DataProto, n: int) -> list[int]:
    """Each prompt's length in tokens (no padding), from its first row of a prompt-major batch (``n`` rows each)."""
    width = batch.batch["prompts"].shape[1]
    return batch.batch["attention_mask"][::n, :width].sum(dim=1).tolist()


def peer_batch(receiver_own: DataProto, n: int, pairs: list[tuple[int, int]], source: Rollouts,
               tokenizer, stop_id: int) -> DataProto:
    """The receiver's rows for the source's responses ``pairs`` = [(prompt, sample)]: the receiver's own
    prompt tokens of each prompt (taken from its first rollout of that prompt, so the chat template is
    exactly the one it generated with; its rollouts are prompt-major, ``n`` per prompt) and the
    re-tokenized response string, ending with the receiver's ``stop_id`` where the source finished.
    verl's padded layout at the receiver's widths."""
    prompt_length = receiver_own.batch["prompts"].shape[1]
    response_length = receiver_own.batch["responses"].shape[1]
    prompts = [row_tokens(receiver_own, q * n)[0] for q, _ in pairs]
    responses = [retokenize(source.responses[q][i], tokenizer, finished=bool(source.finished[q, i]),
                            max_length=response_length, stop_id=stop_id) for q, i in pairs]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tensors = pack_rows(prompts, responses, prompt_length=prompt_length, response_length=response_length,
                        pad_token_id=pad)
    return DataProto.from_dict(tensors=tensors, non_tensors={
        PROMPT_INDEX: np.asarray([q for q, _ in pairs], dtype=np.int64),
        RESPONSE_INDEX: np.asarray([i for _, i in pairs], dtype=np.int64),
    })


class PeerScorer:
    """``graft_exp.methods.exchange.Scorer`` of one receiver: the source's responses on the requested prompts
    re-tokenized for the receiver (``peer_batch``) and scored by one batched ``log_probs`` call (eq. 8's
    receiver term). The scored rows, with their ``old_log_probs``, are kept in ``scored`` for the update,
    which trains on exactly those tokens and old log-probs."""

    def __init__(self, receiver_own: DataProto, n: int, tokenizer, log_probs: LogProbs, stop_id: int):
        self.own, self.n, self.tokenizer, self.log_probs = receiver_own, n, tokenizer, log_probs
        self.stop_id = stop_id
        self.scored: DataProto | None = None

    def __call__(self, prompts: list[int], source: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.score([(q, i) for q in prompts for i in range(source.n)], source)
        sums, counts = sequence_log_prob_sums(batch.batch["old_log_probs"], batch.batch["response_mask"])
        # A response that re-tokenizes to nothing (an empty string cut before the EOS) has no tokens to
        # average; count it as one so its score is defined (it adds no token to the update either way).
        shape = (len(prompts), source.n)
        return sums.double().view(shape), counts.clamp(min=1).view(shape)

    def score(self, pairs: list[tuple[int, int]], source: Rollouts) -> DataProto:
        """Re-tokenize and score the responses ``pairs`` of ``source``; they become ``scored``."""
        batch = peer_batch(self.own, self.n, pairs, source, self.tokenizer, self.stop_id)
        batch.batch["old_log_probs"] = self.log_probs(batch)
        self.scored = batch
        return batch


TRAIN_COLUMNS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                 "old_log_probs")


def receiver_batch(own: DataProto, n: int, peer: DataProto | None, plan: ReceiverBatch,
                   row_columns: RowColumns = lambda rows: {}) -> DataProto:
    """The exchange's ``ReceiverBatch`` as verl rows with the loss's columns: own rows from the receiver's
    rollouts ``own`` (prompt-major, ``n`` per prompt), peer rows and SGT's NLL rows from ``peer`` (the
    ``PeerScorer``'s scored rows). Columns: ``advantages`` (the row's advantage on its response tokens,
    verl's [B, T] convention), ``graft_weight``, ``graft_is_peer``, ``graft_nll`` (NLL rows: weight 0,
    advantage 0), the loss's per-row columns (``row_columns(rows)``, each under ``loss.row_column(name)``), and
    the rows' prompt, response and group indices. Both inputs need ``old_log_probs`` under the *receiver's* old
    policy."""
    own_rows = [r for r in plan.rows if r.origin == SELF]
    peer_rows = [r for r in plan.rows if r.origin == PEER]
    parts = [_rows(own, [r.prompt * n + r.sample for r in own_rows], own_rows, row_columns, nll_rows=False)]
    if peer_rows or plan.nll:
        if peer is None:
            raise ValueError("the receiver batch has peer rows but no scored peer batch was given")
        where = {(int(q), int(i)): row for row, (q, i) in
                 enumerate(zip(peer.non_tensor_batch[PROMPT_INDEX], peer.non_tensor_batch[RESPONSE_INDEX]))}
        parts.append(_rows(peer, [where[r.prompt, r.sample] for r in peer_rows], peer_rows, row_columns,
                           nll_rows=False))
        # SGT's drawn correct responses enter only the NLL term (weight 0, advantage 0), in their prompt's group.
        nll = [Row(q, PEER, q, i, 0.0, 0.0) for q, i in plan.nll]
        parts.append(_rows(peer, [where[q, i] for q, i in plan.nll], nll, row_columns, nll_rows=True))
    return DataProto.concat(parts)


def _rows(batch: DataProto, index: list[int], rows: list[Row], row_columns: RowColumns, *,
          nll_rows: bool) -> DataProto:
    """Rows ``index`` of ``batch``, the exchange's ``rows``, with the loss's columns and their exchange indices."""
    part = batch.select(batch_keys=list(TRAIN_COLUMNS), non_tensor_batch_keys=[])[torch.tensor(index, dtype=torch.long)]
    mask = part.batch["response_mask"].float()
    part.batch["advantages"] = torch.tensor([r.advantage for r in rows], dtype=torch.float32).unsqueeze(1) * mask
    part.batch[WEIGHT] = torch.tensor([r.weight for r in rows], dtype=torch.float32)
    part.batch[IS_PEER] = torch.tensor([float(r.origin == PEER) for r in rows], dtype=torch.float32)
    part.batch[NLL] = torch.full((len(index),), float(nll_rows))
    for name, values in row_columns(rows).items():
        part.batch[row_column(name)] = values
    part.non_tensor_batch.update({PROMPT_INDEX: np.asarray([r.prompt for r in rows], dtype=np.int64),
                                  RESPONSE_INDEX: np.asarray([r.sample for r in rows], dtype=np.int64),
                                  GROUP: np.asarray([r.group for r in rows], dtype=np.int64)})
    return part


def minibatch_layout(batch: DataProto, minibatches: list[list[int]], *, dp_size: int,
                     sequence_mean: bool = False) -> list[DataProto]:
    """A receiver batch cut into the exchange's minibatches (``ReceiverBatch.minibatches``: group
    indices per minibatch, in processing order), each ready for one ``update_actor`` call. A minibatch
    whose groups lost every row (all gated out) is skipped; the others keep their position (HACPO's m).

    This replaces verl's ``balance_batch``, which reorders rows across the whole batch and so would mix
    peer rows into early minibatches: here each minibatch is balanced *within itself* across the
    data-parallel ranks (verl's ``get_seqlen_balanced_partitions`` on its rows' lengths), padded to a
    multiple of ``dp_size`` with weight-0 copies, and laid out rank by rank, which is how verl's dispatch
    hands contiguous chunks to ranks. Each minibatch gets its loss denominator (response tokens of rows
    with weight > 0; with ``sequence_mean``, HACPO's, the number of those rows) and, for SGT, the NLL
    rows' token count, plus its position.
    """
    group = np.asarray(batch.non_tensor_batch[GROUP], dtype=np.int64)
    seqlens = batch.batch["attention_mask"].sum(dim=1)
    laid_out = []
    for position, groups in enumerate(minibatches):
        rows = np.flatnonzero(np.isin(group, groups)).tolist()
        if rows:
            laid_out.append(_dp_layout(batch, rows, seqlens, dp_size, position, sequence_mean))
    return laid_out


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
    minibatch.batch[NLL] = torch.where(is_padding, torch.zeros(()), minibatch.batch[NLL])
    mask = minibatch.batch["response_mask"].bool()
    present = weight > 0
    denominator = int(present.sum()) if sequence_mean else int((mask & present.unsqueeze(1)).sum())
    nll_tokens = (mask & minibatch.batch[NLL].bool().unsqueeze(1)).sum()
    rows_count = len(laid_out)
    minibatch.batch[DENOMINATOR] = torch.full((rows_count,), float(max(denominator, 1)))
    minibatch.batch[NLL_DENOMINATOR] = torch.full((rows_count,), float(max(int(nll_tokens), 1)))
    minibatch.batch[MINIBATCH_INDEX] = torch.full((rows_count,), float(position))
    return minibatch
