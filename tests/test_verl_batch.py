"""The verl side of graft_exp.methods.exchange on real tokenizers with chat templates: re-tokenized peer
responses scored by the receiver, every method's ReceiverBatch as verl rows (verl's padded layout,
weights and source advantages as columns), minibatches in the method's order laid out for verl's
data-parallel dispatch."""

import copy
import math
from pathlib import Path

import numpy as np
import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from test_exchange import plan_pair
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AddedToken, GenerationConfig, PreTrainedTokenizerFast
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl.workers.utils.padding import left_right_2_no_padding

from graft_exp.algorithms import grpo_advantages
from graft_exp.backends.verl import batch as vb
from graft_exp.backends.verl import loss as vl
from graft_exp.methods import resolve
from graft_exp.methods.exchange import select_prompts
from graft_exp.methods.objective import row_column_values
from graft_exp.methods.receiver import PEER
from graft_exp.prompts import end_of_turn_id
from graft_exp.rollouts import Rollouts

CORPUS = ["What is 12 + 30? Let's think step by step and output the final answer within \\boxed{}.",
          "We add the numbers: 12 + 30 = 42, so the answer is \\boxed{42}.", "Compute 7 * 6 and 99 - 3."]
N, PROMPTS, PROMPT_LEN, RESPONSE_LEN = 4, 3, 128, 48
CONF = str(Path(__file__).resolve().parents[1] / "conf")
METHODS = sorted(p.stem for p in (Path(CONF) / "method").glob("*.yaml"))


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


def _stop_ids(tokenizer) -> list[int]:
    """The model's stop tokens: the ChatML-style model's generation config lists <|im_end|> (its end of
    turn) before <|endoftext|>, as chat models' configs do; the char model has only its tokenizer's EOS."""
    if "<|im_end|>" in tokenizer.get_vocab():
        config = GenerationConfig(eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id])
        return vb.stop_token_ids(tokenizer, config)
    return vb.stop_token_ids(tokenizer)


QUESTIONS = ["What is 12 + 30? Let's think step by step and output the final answer within \\boxed{}.",
             "Compute 7 * 6. Let's think step by step and output the final answer within \\boxed{}.",
             "Compute 99 - 3. Let's think step by step and output the final answer within \\boxed{}."]
ANSWERS = ["12 + 30 = 42, so \\boxed{42}", "7 * 6 = 42 \\boxed{42}", "99 - 3 = 96", "\\boxed{96}"]


@pytest.fixture(scope="module")
def methods():
    """Every method's components (its composed config, backend=verl, pair1), by name."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        configs = {m: resolve(compose(config_name="config",
                                      overrides=["backend=verl", "pair=pair1", f"method={m}"]).method)
                   for m in METHODS}
    GlobalHydra.instance().clear()
    return configs


def _rollouts(tokenizer, prompts: int = PROMPTS, n: int = N, finished_every: int = 2) -> DataProto:
    """A model's rollouts as verl's agent loop lays them out: P prompts x n responses, prompt-major, the
    prompt through the model's chat template, responses ending with its EOS unless cut at the limit."""
    prompt_rows, responses = [], []
    for p in range(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[p % len(QUESTIONS)]}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        for i in range(n):
            response = tokenizer.encode(ANSWERS[(p + i) % len(ANSWERS)], add_special_tokens=False)
            if i % finished_every == 0:
                response = response + [_stop_ids(tokenizer)[0]]
            prompt_rows.append(list(ids))
            responses.append(response[:RESPONSE_LEN])
    data = DataProto.from_dict(tensors=vb.pack_rows(prompt_rows, responses, prompt_length=PROMPT_LEN,
                                                    response_length=RESPONSE_LEN, pad_token_id=tokenizer.pad_token_id))
    data.batch["old_log_probs"] = -torch.rand(data.batch["responses"].shape)
    return data


def _exchange_view(data: DataProto, tokenizer, model: str, rewards: torch.Tensor,
                   scores: torch.Tensor | None = None) -> Rollouts:
    """The same rollouts as graft_exp.methods.exchange sees them. With ``scores``, the generation log-probs are
    set so that a receiver whose old policy gives every token log-prob 0 scores them s = ``scores``."""
    prompts, n = rewards.shape
    texts, finished = vb.decode_responses(data, tokenizer, _stop_ids(tokenizer))
    logp_sum, num_tokens = (data.batch["old_log_probs"] * data.batch["response_mask"]).sum(1).double(), \
        data.batch["response_mask"].sum(1)
    if scores is not None:
        logp_sum = -torch.log(scores.double().flatten()) * num_tokens
    return Rollouts(model=model, prompt_ids=[f"q{p}" for p in range(prompts)],
                    responses=[texts[p * n:(p + 1) * n] for p in range(prompts)], rewards=rewards.float(),
                    advantages=grpo_advantages(rewards.float()), logp_sum=logp_sum.view(prompts, n),
                    num_tokens=num_tokens.view(prompts, n), finished=torch.tensor(finished).view(prompts, n))


def certain_log_probs(batch: DataProto) -> torch.Tensor:
    """A receiver's old policy that gives each response token log-prob 0 (in place of its worker group)."""
    return torch.zeros(batch.batch["responses"].shape)


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
    assert vb.response_token_ids(data, N)[1][2] == vb.row_tokens(data, N + 2)[1]


def test_peer_responses_retokenized_with_receiver_prompt_and_eos(char_tokenizer, bpe_tokenizer):
    source_rows, receiver = _rollouts(char_tokenizer), _rollouts(bpe_tokenizer)
    source = _exchange_view(source_rows, char_tokenizer, "a", torch.zeros(PROMPTS, N))
    assert source.responses[0][0] == ANSWERS[0] and bool(source.finished[0, 0]) and not bool(source.finished[0, 1])
    pairs = [(1, i) for i in range(N)]                   # the whole group of prompt 1
    peer = vb.peer_batch(receiver, N, pairs, source, bpe_tokenizer, _stop_ids(bpe_tokenizer)[0])
    for row, (q, i) in enumerate(pairs):
        prompt, response = vb.row_tokens(peer, row)
        assert prompt == vb.row_tokens(receiver, q * N)[0]   # the receiver's own chat-template prompt
        assert bpe_tokenizer.decode(response, skip_special_tokens=True) == source.responses[q][i]
        # a finished source response ends with the receiver's end of turn, <|im_end|>, not its <|endoftext|>
        assert (response[-1] == bpe_tokenizer.convert_tokens_to_ids("<|im_end|>")) == bool(source.finished[q, i])
        assert response != vb.row_tokens(source_rows, q * N + i)[1]   # a different tokenization of the string
    assert torch.equal(peer.batch["position_ids"], compute_position_id_with_mask(peer.batch["attention_mask"]))
    assert list(peer.non_tensor_batch[vb.PROMPT_INDEX]) == [1] * N
    assert list(peer.non_tensor_batch[vb.RESPONSE_INDEX]) == list(range(N))


def test_scorer_sums_receiver_log_probs_over_retokenized_responses(char_tokenizer, bpe_tokenizer):
    source = _exchange_view(_rollouts(char_tokenizer), char_tokenizer, "a", torch.zeros(PROMPTS, N))
    receiver = _rollouts(bpe_tokenizer)
    scorer = vb.PeerScorer(receiver, N, bpe_tokenizer, lambda b: -b.batch["responses"].float() / 1000,
                           _stop_ids(bpe_tokenizer)[0])
    sums, counts = scorer([0, 2], source)
    assert sums.shape == counts.shape == (2, N)
    for j, q in enumerate([0, 2]):
        for i in range(N):
            ids = vb.retokenize(source.responses[q][i], bpe_tokenizer, finished=bool(source.finished[q, i]),
                                max_length=RESPONSE_LEN, stop_id=_stop_ids(bpe_tokenizer)[0])
            assert int(counts[j, i]) == len(ids) and float(sums[j, i]) == pytest.approx(-sum(ids) / 1000)
    assert list(scorer.scored.non_tensor_batch[vb.PROMPT_INDEX]) == [0] * N + [2] * N   # kept for the update


def test_retokenize_cut_at_limit_drops_eos(bpe_tokenizer):
    ids = vb.retokenize("12 + 30 = 42, so \\boxed{42}", bpe_tokenizer, finished=True, max_length=5,
                        stop_id=_stop_ids(bpe_tokenizer)[0])
    assert len(ids) == 5 and not set(ids) & set(_stop_ids(bpe_tokenizer))


#: Five prompts, n = 8: C_{A->B} = prompts 0, 1 (B failed all, 1 <= k_A < n), C_{B->A} = prompt 2.
REWARDS_A = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [0] * 8, [1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]])
REWARDS_B = torch.tensor([[0] * 8, [0] * 8, [1, 0, 0, 0, 0, 0, 0, 0], [0] * 8, [1, 1, 1, 1, 1, 1, 1, 0]])
SCORES = torch.tensor([[0.9, 0.7, 1.3, 0.85, 0.78, 0.95, 0.5, 1.0]])


def _step(method, char_tokenizer, bpe_tokenizer, scores=None):
    """Both models' rollouts of one step (A: char tokenizer, B: BPE) and B's receiver plan and batch (with the
    loss's per-row columns, at capability ratio 0.7)."""
    prompts, n = REWARDS_A.shape
    rows = {"A": _rollouts(char_tokenizer, prompts, n), "B": _rollouts(bpe_tokenizer, prompts, n)}
    a = _exchange_view(rows["A"], char_tokenizer, "a", REWARDS_A, scores)
    b = _exchange_view(rows["B"], bpe_tokenizer, "b", REWARDS_B)
    scorers = (vb.PeerScorer(rows["A"], n, char_tokenizer, certain_log_probs, _stop_ids(char_tokenizer)[0]),
               vb.PeerScorer(rows["B"], n, bpe_tokenizer, certain_log_probs, _stop_ids(bpe_tokenizer)[0]))
    gen = torch.Generator().manual_seed(0)
    if method.replays_stored_log:    # B replays A's log: one direction, no balancing
        a_to_b, _ = select_prompts(method, a.k, b.k, n, gen)
        plan = method.peer_loss.assemble(method, b, a, a_to_b, scorers[1], gen)
    else:
        _, plan, (a_to_b, _) = plan_pair(method, a, b, scorers, gen, (1.0, 1.0))
    peer = scorers[1].score(plan.nll, a) if plan.nll else scorers[1].scored

    def columns(part):
        return row_column_values(method.loss, part, b, a, 0.7)
    return rows["B"], a, a_to_b, plan, vb.receiver_batch(rows["B"], n, peer, plan, columns)


@pytest.mark.parametrize("name", [m for m in METHODS if not m.startswith("grpo")])
def test_every_exchange_method_becomes_verl_rows(name, methods, char_tokenizer, bpe_tokenizer):
    """Every row of the exchange's plan for receiver B is one verl row with its advantage and weight: own
    rows are B's rollouts, peer rows A's response strings in B's tokens after B's prompt; SGT's drawn
    responses are NLL-only rows; the minibatches are the plan's, peer-containing ones last."""
    method = methods[name]
    own, source, a_to_b, plan, batch = _step(method, char_tokenizer, bpe_tokenizer)
    n = source.n
    expected = sorted([(r.prompt, r.sample, r.origin == PEER, False, r.group, round(r.advantage, 5), r.weight)
                       for r in plan.rows] + [(q, i, True, True, q, 0.0, 0.0) for q, i in plan.nll])
    cols = batch.non_tensor_batch
    mask = batch.batch["response_mask"].float()
    row_advantage = (batch.batch["advantages"] * mask).sum(1) / mask.sum(1)
    got = sorted(zip(cols[vb.PROMPT_INDEX].tolist(), cols[vb.RESPONSE_INDEX].tolist(),
                     batch.batch[vl.IS_PEER].bool().tolist(), batch.batch[vl.NLL].bool().tolist(),
                     cols[vb.GROUP].tolist(), [round(float(a), 5) for a in row_advantage],
                     [pytest.approx(float(w)) for w in batch.batch[vl.WEIGHT]]))
    assert got == expected
    assert all(0 < r.weight <= 1 for r in plan.rows)                  # removed responses are absent
    for row in range(len(batch)):
        q, i = int(cols[vb.PROMPT_INDEX][row]), int(cols[vb.RESPONSE_INDEX][row])
        prompt, response = vb.row_tokens(batch, row)
        assert prompt == vb.row_tokens(own, q * n)[0]
        if batch.batch[vl.IS_PEER][row]:
            assert bpe_tokenizer.decode(response, skip_special_tokens=True) == source.responses[q][i]
        else:
            assert response == vb.row_tokens(own, q * n + i)[1]
    assert plan.metrics["peer_groups"] == float(len({r.prompt for r in plan.rows if r.origin == PEER} | 
                                                     {q for q, _ in plan.nll}))
    if name in ("graft", "graft_stored"):
        # GRAFT balances to m = 1 and keeps the candidate with the larger k_A (prompt 1); stored replay is
        # one-way and unbalanced.
        assert a_to_b.tolist() == ([True, True, False, False, False] if name == "graft_stored" else
                                   [False, True, False, False, False])
    if method.objective == "sgt":
        assert plan.nll and all(int(source.rewards[q, i]) == 1 for q, i in plan.nll)   # a correct response

    groups = plan.minibatches(method, 2, torch.Generator().manual_seed(1))
    minibatches = vb.minibatch_layout(batch, groups, dp_size=2, sequence_mean=method.loss.sequence_level)
    real = [mb[torch.nonzero((mb.batch[vl.WEIGHT] > 0) | mb.batch[vl.NLL].bool()).flatten()] for mb in minibatches]
    assert sum(len(mb) for mb in real) == len(batch)                    # every row once, dp padding aside
    nonempty = [g for g in groups if any(r.group in g for r in plan.rows) or any(q in g for q, _ in plan.nll)]
    assert [set(mb.non_tensor_batch[vb.GROUP].tolist()) for mb in real] == [set(g) & set(cols[vb.GROUP].tolist())
                                                                          for g in nonempty]
    if method.config.peer_position == "last" and method.objective != "sgt":   # SGT keeps GRPO's order
        kinds = [bool(mb.batch[vl.IS_PEER].bool().any()) for mb in real]
        assert kinds == sorted(kinds)                                   # own-only minibatches first


def test_graft_rows_replace_groups_with_gated_source_responses(methods, char_tokenizer, bpe_tokenizer):
    """graft_stored (B replays A's log on eq. (3)'s candidates, unbalanced): B's own groups are replaced by
    A's whole groups, gated by the receiver-side scores, with A's advantages (not re-normalised); removed
    responses are absent."""
    scores = torch.cat([SCORES, SCORES.flip(1), torch.ones(3, 8)])
    _, source, a_to_b, plan, batch = _step(methods["graft_stored"], char_tokenizer, bpe_tokenizer, scores)
    assert a_to_b.tolist() == [True, True, False, False, False]
    is_peer = batch.batch[vl.IS_PEER].bool()
    prompts = batch.non_tensor_batch[vb.PROMPT_INDEX]
    assert sorted(set(prompts[~is_peer.numpy()].tolist())) == [2, 3, 4]          # prompts 0, 1 replaced
    first = torch.from_numpy(prompts == 0) & is_peer
    assert batch.non_tensor_batch[vb.RESPONSE_INDEX][first.numpy()].tolist() == [0, 2, 3, 5, 7]
    assert batch.batch[vl.WEIGHT][first].tolist() == pytest.approx([0.9, 1.0, 0.85, 0.95, 1.0], abs=1e-5)
    mask = batch.batch["response_mask"].float()
    row_advantage = (batch.batch["advantages"] * mask).sum(1) / mask.sum(1)
    assert torch.allclose(row_advantage[first], source.advantages[0, [0, 2, 3, 5, 7]].float())
    assert bool((batch.batch["advantages"][mask == 0] == 0).all())
    assert torch.equal(batch.batch[vl.WEIGHT][~is_peer], torch.ones(int((~is_peer).sum())))
    assert plan.metrics["peer_admitted"] == 5 + 5 and plan.metrics["compat_mean"] == pytest.approx(
        float(scores[:2].mean()), abs=1e-5)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_peer_last_minibatches_laid_out_for_dp_dispatch(methods, char_tokenizer, bpe_tokenizer, dp_size):
    scores = torch.cat([SCORES, SCORES.flip(1), torch.ones(3, 8)])
    method = methods["graft_stored"]
    _, _, _, plan, batch = _step(method, char_tokenizer, bpe_tokenizer, scores)
    minibatches = vb.minibatch_layout(batch, plan.minibatches(method, 1, None), dp_size=dp_size)
    kinds = [bool(mb.batch[vl.IS_PEER].bool().any()) for mb in minibatches]
    assert kinds == [False, False, False, True, True]      # own prompts 2, 3, 4 first, the replaced groups last
    for position, mb in enumerate(minibatches):
        assert len(mb) % dp_size == 0
        assert set(mb.non_tensor_batch[vb.GROUP]) == {[2, 3, 4, 0, 1][position]}
        present = mb.batch[vl.WEIGHT] > 0
        tokens = (mb.batch["response_mask"].bool() & present.unsqueeze(1)).sum()
        assert bool((mb.batch[vl.DENOMINATOR] == tokens).all())
        assert bool((mb.batch[vl.MINIBATCH_INDEX] == position).all())
        # verl's dispatch gives rank r the r-th contiguous chunk: token loads are balanced
        loads = [int(c.batch["attention_mask"].sum()) for c in mb.chunk(dp_size)]
        assert max(loads) - min(loads) <= max(int(mb.batch["attention_mask"].sum(1).max()), 1)
    assert int((minibatches[3].batch[vl.WEIGHT] > 0).sum()) == 5   # the gated-out responses are not trained on


def test_peer_first_and_hacpo_groups(methods, char_tokenizer, bpe_tokenizer):
    method = methods["graft_peer_first"]
    _, _, _, plan, batch = _step(method, char_tokenizer, bpe_tokenizer)
    first = vb.minibatch_layout(batch, plan.minibatches(method, 2, None), dp_size=2)
    assert [bool(mb.batch[vl.IS_PEER].bool().any()) for mb in first] == [True, False, False]
    method = methods["hacpo"]
    _, source, _, plan, batch = _step(method, char_tokenizer, bpe_tokenizer)
    hacpo = vb.minibatch_layout(batch, plan.minibatches(method, 5, None), dp_size=1, sequence_mean=True)
    assert [int(mb.batch[vl.IS_PEER].sum()) for mb in hacpo] == [0, 5 * 8]    # own groups, then peer groups
    assert float(hacpo[1].batch[vl.DENOMINATOR][0]) == 5 * 8                  # sequences, not tokens
    peer_row = int(torch.nonzero(batch.batch[vl.IS_PEER]).flatten()[0])
    q, i = (int(batch.non_tensor_batch[c][peer_row]) for c in (vb.PROMPT_INDEX, vb.RESPONSE_INDEX))
    assert float(batch.batch[vl.row_column("source_mean_log_prob")][peer_row]) == pytest.approx(
        float(source.logp_sum[q, i] / source.num_tokens[q, i]))
    assert bool((batch.batch[vl.row_column("capability_ratio")] == 0.7).all())


def test_peer_rows_need_the_scored_peer_batch(methods, char_tokenizer, bpe_tokenizer):
    own, _, _, plan, _ = _step(methods["graft_stored"], char_tokenizer, bpe_tokenizer)
    with pytest.raises(ValueError, match="no scored peer batch"):
        vb.receiver_batch(own, 8, None, plan)
    assert not math.isnan(plan.metrics["compat_mean"]) and np.isfinite(plan.metrics["peer_admitted"])


def test_stop_tokens_from_generation_config(bpe_tokenizer):
    """A chat model stops on its generation config's eos ids (<|im_end|>, <|endoftext|>), not only on its
    tokenizer's EOS: a response ending with either is finished, its stop token is not part of the text,
    and the peer copy of a finished response ends with the receiver's end of turn."""
    stops = _stop_ids(bpe_tokenizer)
    im_end, endoftext = bpe_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert stops == [im_end, endoftext] and bpe_tokenizer.eos_token_id == endoftext
    body = bpe_tokenizer.encode("so \\boxed{42}", add_special_tokens=False)
    data = DataProto.from_dict(tensors=vb.pack_rows([[5]] * 3, [body + [im_end], body + [endoftext], body],
                                                    prompt_length=2, response_length=32,
                                                    pad_token_id=bpe_tokenizer.pad_token_id))
    texts, finished = vb.decode_responses(data, bpe_tokenizer, stops)
    assert finished == [True, True, False] and texts == ["so \\boxed{42}"] * 3
    # with the tokenizer's EOS alone (the old rule) the <|im_end|> response looked cut at the length limit
    assert vb.decode_responses(data, bpe_tokenizer, [endoftext])[1] == [False, True, False]
    ids = vb.retokenize(texts[0], bpe_tokenizer, finished=True, max_length=32, stop_id=stops[0])
    assert ids[-1] == im_end and bpe_tokenizer.decode(ids, skip_special_tokens=True) == texts[0]


def test_base_model_stops_at_its_chat_templates_end_of_turn(bpe_tokenizer):
    """A base model's generation config names only its end-of-text token (Qwen3-1.7B-Base: eos_token_id
    <|endoftext|>), while the ChatML template it is prompted with closes the assistant turn with <|im_end|>
    (Qwen3, SmolLM3): the rollout stops there too, the end of turn first (the peer copies' ending); a Llama-3
    template's <|eot_id|> likewise. A tokenizer without a template keeps its EOS alone."""
    im_end, endoftext = bpe_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    base_config = GenerationConfig(eos_token_id=endoftext)
    assert end_of_turn_id(bpe_tokenizer) == im_end
    assert vb.stop_token_ids(bpe_tokenizer, base_config) == [im_end, endoftext]
    llama3 = copy.deepcopy(bpe_tokenizer)   # as Llama 3.x tokenizers: special in the added-token table only
    llama3.add_tokens([AddedToken(t, special=True, normalized=False)
                       for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")])
    assert llama3.convert_tokens_to_ids("<|eot_id|>") not in llama3.all_special_ids
    llama3.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                            "{{ m['content'] }}<|eot_id|>{% endfor %}")
    assert vb.stop_token_ids(llama3, base_config) == [llama3.convert_tokens_to_ids("<|eot_id|>"), endoftext]
    plain = copy.deepcopy(bpe_tokenizer)
    plain.chat_template = None
    assert end_of_turn_id(plain) is None and vb.stop_token_ids(plain, base_config) == [endoftext]


def test_tiny_pair_stop_tokens_from_their_assets():
    """The tiny pair's own tokenizers and generation configs (graft_exp/tiny/assets): one EOS each."""
    from transformers import AutoTokenizer

    from graft_exp.tiny.models import ASSETS

    for key in ("tiny-char-llama", "tiny-bpe-gpt2"):
        tokenizer = AutoTokenizer.from_pretrained(ASSETS / key)
        config = GenerationConfig.from_pretrained(ASSETS / key)
        stops = vb.stop_token_ids(tokenizer, config)
        assert stops == [tokenizer.eos_token_id]
        text = "7 * 6 = 42 \\boxed{42}"
        ids = vb.retokenize(text, tokenizer, finished=True, max_length=64, stop_id=stops[0])
        data = DataProto.from_dict(tensors=vb.pack_rows([[ids[0]]], [ids], prompt_length=1, response_length=64,
                                                        pad_token_id=tokenizer.pad_token_id))
        assert vb.decode_responses(data, tokenizer, stops) == ([tokenizer.decode(ids[:-1], skip_special_tokens=True)],
                                                               [True])


def test_stop_tokens_need_an_eos():
    tok = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    with pytest.raises(ValueError, match="no EOS"):
        vb.stop_token_ids(tokenizer, GenerationConfig())
