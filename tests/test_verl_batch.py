"""Receiver batches on real tokenizers with chat templates: re-tokenized peer responses, verl's padded
layout (masks, position ids), weights and source advantages as columns, peer-last minibatches laid out
for verl's data-parallel dispatch."""

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl.workers.utils.padding import left_right_2_no_padding

from graft_exp.backends.verl import batch as vb
from graft_exp.backends.verl import loss as vl

CORPUS = ["What is 12 + 30? Let's think step by step and output the final answer within \\boxed{}.",
          "We add the numbers: 12 + 30 = 42, so the answer is \\boxed{42}.", "Compute 7 * 6 and 99 - 3."]
N, PROMPTS, PROMPT_LEN, RESPONSE_LEN = 4, 3, 128, 48


@pytest.fixture(scope="module")
def char_tokenizer():
    """Role A: one token per character, a Llama-style chat template."""
    chars = sorted({c for text in CORPUS for c in text} | set("<>|/_[]"))
    vocab = {"<eos>": 0, "<unk>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """Role B: byte-level BPE with single-digit pre-tokens, a ChatML-style template, pad = eos."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


QUESTIONS = ["What is 12 + 30? Let's think step by step and output the final answer within \\boxed{}.",
             "Compute 7 * 6. Let's think step by step and output the final answer within \\boxed{}.",
             "Compute 99 - 3. Let's think step by step and output the final answer within \\boxed{}."]
ANSWERS = ["12 + 30 = 42, so \\boxed{42}", "7 * 6 = 42 \\boxed{42}", "99 - 3 = 96", "\\boxed{96}"]


def _rollouts(tokenizer, finished_every: int = 2) -> DataProto:
    """A model's rollouts as verl's agent loop lays them out: P prompts x N responses, prompt-major, the
    prompt through the model's chat template, responses ending with its EOS unless cut at the limit."""
    prompts, responses, prompt_index = [], [], []
    for p, question in enumerate(QUESTIONS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        for i in range(N):
            response = tokenizer.encode(ANSWERS[(p + i) % len(ANSWERS)], add_special_tokens=False)
            if i % finished_every == 0:
                response = response + [tokenizer.eos_token_id]
            prompts.append(list(ids))
            responses.append(response[:RESPONSE_LEN])
            prompt_index.append(p)
    pad = tokenizer.pad_token_id
    data = DataProto.from_dict(
        tensors=vb.pack_rows(prompts, responses, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
                             pad_token_id=pad),
        non_tensors={vb.PROMPT_INDEX: torch.tensor(prompt_index).numpy(),
                     vb.SOURCE: __import__("numpy").asarray(["x"] * len(prompts), dtype=object)})
    data.batch["old_log_probs"] = -torch.rand(data.batch["responses"].shape)
    return data


def test_pack_rows_matches_verl_layout(char_tokenizer):
    data = _rollouts(char_tokenizer)
    attention = data.batch["attention_mask"]
    assert torch.equal(data.batch["position_ids"], compute_position_id_with_mask(attention))
    assert torch.equal(data.batch["input_ids"], torch.cat([data.batch["prompts"], data.batch["responses"]], 1))
    assert torch.equal(data.batch["response_mask"], attention[:, PROMPT_LEN:])
    # left-padded prompts, right-padded responses
    prompt_mask = attention[:, :PROMPT_LEN]
    assert bool((prompt_mask[:, -1] == 1).all()) and bool((prompt_mask.diff(dim=1) >= 0).all())
    assert bool((data.batch["response_mask"].diff(dim=1) <= 0).all())
    td = left_right_2_no_padding(data.to_tensordict())   # verl accepts the layout
    assert td["input_ids"].offsets().diff().tolist() == attention.sum(1).tolist()


def test_peer_responses_retokenized_with_receiver_prompt_and_eos(char_tokenizer, bpe_tokenizer):
    source, receiver = _rollouts(char_tokenizer), _rollouts(bpe_tokenizer)
    texts, finished = vb.decode_responses(source, char_tokenizer)
    assert texts[0] == ANSWERS[0] and finished[0] and not finished[1]
    rows = [4, 5, 6, 7]                                  # the whole group of prompt 1
    own_row = {p: p * N for p in range(PROMPTS)}
    peer = vb.peer_batch(receiver, own_row, [1] * 4, [texts[r] for r in rows], [finished[r] for r in rows],
                         bpe_tokenizer, source="A")
    for i, r in enumerate(rows):
        prompt, response = vb.row_tokens(peer, i)
        assert prompt == vb.row_tokens(receiver, 4)[0]   # the receiver's own chat-template prompt
        assert bpe_tokenizer.decode(response, skip_special_tokens=True) == texts[r]
        assert (response[-1] == bpe_tokenizer.eos_token_id) == finished[r]
        assert response != vb.row_tokens(source, r)[1]   # a different tokenization of the same string
    assert torch.equal(peer.batch["position_ids"], compute_position_id_with_mask(peer.batch["attention_mask"]))
    assert list(peer.non_tensor_batch[vb.SOURCE]) == ["A"] * 4


def test_retokenize_cut_at_limit_drops_eos(bpe_tokenizer):
    ids = vb.retokenize("12 + 30 = 42, so \\boxed{42}", bpe_tokenizer, finished=True, max_length=5)
    assert len(ids) == 5 and bpe_tokenizer.eos_token_id not in ids


def _receiver_with_replaced_group(char_tokenizer, bpe_tokenizer):
    source, receiver = _rollouts(char_tokenizer), _rollouts(bpe_tokenizer)
    texts, finished = vb.decode_responses(source, char_tokenizer)
    peer = vb.peer_batch(receiver, {p: p * N for p in range(PROMPTS)}, [1] * N, texts[N:2 * N], finished[N:2 * N],
                         bpe_tokenizer, source="A")
    peer.batch["old_log_probs"] = -torch.rand(peer.batch["responses"].shape)
    own_rows = torch.tensor([r for r in range(PROMPTS * N) if r // N != 1])
    rows = vb.ReceiverRows(own=own_rows, own_advantage=torch.linspace(-1, 1, len(own_rows)),
                           peer=torch.arange(N), peer_advantage=torch.tensor([0.87, -0.87, 0.87, -0.87]),
                           peer_weight=torch.tensor([1.0, 0.9, 0.0, 0.85]), peer_sft=torch.zeros(N, dtype=torch.bool))
    return vb.receiver_batch(receiver, peer, rows), rows


def test_receiver_batch_columns(char_tokenizer, bpe_tokenizer):
    batch, rows = _receiver_with_replaced_group(char_tokenizer, bpe_tokenizer)
    assert len(batch) == PROMPTS * N
    is_peer = batch.batch[vl.IS_PEER].bool()
    assert is_peer.sum() == N and list(batch.non_tensor_batch[vb.PROMPT_INDEX][is_peer.numpy()]) == [1] * N
    assert torch.equal(batch.batch[vl.WEIGHT][is_peer], rows.peer_weight)
    mask = batch.batch["response_mask"].float()
    row_advantage = (batch.batch["advantages"] * mask).sum(1) / mask.sum(1)
    assert torch.allclose(row_advantage[is_peer], rows.peer_advantage)
    assert bool((batch.batch["advantages"][mask == 0] == 0).all())
    assert torch.equal(batch.batch[vl.WEIGHT][~is_peer], torch.ones(len(rows.own)))


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_peer_last_minibatches_laid_out_for_dp_dispatch(char_tokenizer, bpe_tokenizer, dp_size):
    batch, _ = _receiver_with_replaced_group(char_tokenizer, bpe_tokenizer)
    minibatches = vb.minibatch_plan(batch, prompts_per_minibatch=1, ordering="last", dp_size=dp_size)
    kinds = [bool(mb.batch[vl.IS_PEER].bool().any()) for mb in minibatches]
    assert kinds == [False, False, True]                 # own prompts 0 and 2 first, the replaced group last
    for position, mb in enumerate(minibatches):
        assert len(mb) % dp_size == 0
        assert set(mb.non_tensor_batch[vb.PROMPT_INDEX]) == {[0, 2, 1][position]}
        present = mb.batch[vl.WEIGHT] > 0
        tokens = (mb.batch["response_mask"].bool() & present.unsqueeze(1)).sum()
        assert bool((mb.batch[vl.DENOMINATOR] == tokens).all())
        assert bool((mb.batch[vl.MINIBATCH_INDEX] == position).all())
        # verl's dispatch gives rank r the r-th contiguous chunk: token loads are balanced
        loads = [int(c.batch["attention_mask"].sum()) for c in mb.chunk(dp_size)]
        assert max(loads) - min(loads) <= max(int(mb.batch["attention_mask"].sum(1).max()), 1)
    assert int((minibatches[2].batch[vl.WEIGHT] > 0).sum()) == 3   # the gated-out response stays weight 0


def test_peer_first_and_hacpo_groups(char_tokenizer, bpe_tokenizer):
    batch, _ = _receiver_with_replaced_group(char_tokenizer, bpe_tokenizer)
    first = vb.minibatch_plan(batch, prompts_per_minibatch=2, ordering="first", dp_size=2)
    assert [bool(mb.batch[vl.IS_PEER].bool().any()) for mb in first] == [True, False]
    hacpo = vb.minibatch_plan(batch, prompts_per_minibatch=2, ordering="last", dp_size=1,
                              peer_groups_separate=True, sequence_mean=True)
    assert [int(mb.batch[vl.IS_PEER].sum()) for mb in hacpo] == [0, N]
    assert float(hacpo[1].batch[vl.DENOMINATOR][0]) == 3     # present sequences, not tokens


def test_sgt_rows_must_have_zero_weight(char_tokenizer, bpe_tokenizer):
    receiver = _rollouts(bpe_tokenizer)
    rows = vb.ReceiverRows(own=torch.arange(4), own_advantage=torch.zeros(4), peer=torch.tensor([0]),
                           peer_advantage=torch.zeros(1), peer_weight=torch.ones(1), peer_sft=torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="NLL"):
        vb.receiver_batch(receiver, receiver, rows)
