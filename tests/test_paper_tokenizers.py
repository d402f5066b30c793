"""The paper models at their seams, on their real vocabularies built offline (graft_exp/tiny/paper_vocab.py):
stop tokens (docs/verl.md's table), the end of turn a Llama 3 tokenizer marks special only in its added-token
table, chat templates refused before a job starts, prompts pinned to the job's date, and peer responses
re-tokenized between the Qwen and Llama 3 vocabularies on real solutions."""

from __future__ import annotations

import copy
import datetime
import gzip
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import GenerationConfig

from graft_exp import prompts
from graft_exp.cache import cache_dir
from graft_exp.config import MODELS_FILE
from graft_exp.reward import reward
from graft_exp.tiny.paper_vocab import SNAPSHOTS, TEMPLATES, build, why_unavailable
from graft_exp.tiny.recipes import PAPER_VOCAB_RECIPES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(why_unavailable() is not None, reason=str(why_unavailable()))]


@pytest.fixture(scope="module")
def tokenizers():
    """Each snapshot's tokenizer (built once per machine: a few seconds per vocabulary)."""
    return {key: build(key, cache_dir("paper_tokenizers")) for key in SNAPSHOTS}


def with_template(tokenizer, name: str):
    """A copy of ``tokenizer`` with the chat template ``name`` of graft_exp/formats."""
    clone = copy.deepcopy(tokenizer)
    clone.chat_template = (TEMPLATES / name).read_text()
    return clone


def stop_table() -> list[dict[str, str]]:
    """docs/verl.md's table of the paper models' stop tokens, a dict per row."""
    text = (ROOT / "docs" / "verl.md").read_text()
    section = text[text.index("**Special tokens of the paper models.**"):].splitlines()
    start = next(i for i, line in enumerate(section) if line.startswith("|"))
    end = next(i for i in range(start, len(section)) if not section[i].startswith("|"))
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))] for line in section[start:end]]
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def ids(cell: str) -> list[int]:
    return [int(x) for x in re.findall(r"\b\d{3,}\b", cell)]


def test_the_docs_stop_token_table_is_what_the_real_tokenizers_give(tokenizers):
    from graft_exp.backends.verl import batch as vb

    rows = stop_table()
    assert len(rows) == 4, rows
    catalog = OmegaConf.load(MODELS_FILE)
    for row in rows:
        key = row["model"].split(" + ")[0]
        name = row["prompt format"].strip("`")
        if "+" not in row["model"]:   # the model's default format
            assert catalog[key].prompt_format == name, row
        tokenizer = with_template(tokenizers[key], prompts.prompt_format(name).template)
        config = GenerationConfig(eos_token_id=SNAPSHOTS[key].generation_eos)
        eot = prompts.end_of_turn_id(tokenizer)
        assert (ids(row["end of turn"]) or [None]) == [eot], row
        assert vb.stop_token_ids(tokenizer, config) == ids(row["stop ids"]), row
        assert [tokenizer.eos_token_id, SNAPSHOTS[key].generation_eos] == ids(row["eos (tokenizer / generation config)"])
        assert [SNAPSHOTS[key].vocab_size, len(tokenizer)] == ids(row["vocab (config / tokenizer)"]), row


def test_llama3_end_of_turn_is_found_in_the_added_token_table(tokenizers):
    """Llama 3.x tokenizers mark <|eot_id|> special only in added_tokens_decoder: the named special tokens
    (which the end of turn used to be looked up in) miss it, and vLLM would write on past the answer."""
    from graft_exp.backends.verl import batch as vb

    llama = with_template(tokenizers["octothinker-3b-hybrid-base"], "llama-3.2-instruct.jinja")
    eot = llama.convert_tokens_to_ids("<|eot_id|>")
    assert eot == 128009 and eot not in llama.all_special_ids and llama.added_tokens_decoder[eot].special
    assert prompts.end_of_turn_id(llama) == eot
    assert vb.stop_token_ids(llama, GenerationConfig(eos_token_id=128001)) == [128009, 128001]


def test_a_tokenizers_own_template_that_cannot_prompt_or_stop_is_refused(tokenizers):
    """A model prompted in its tokenizer's own template (catalog ``prompt_format: null``, only models the project
    builds): none at all, or one that closes a turn on plain text, is refused; Qwen3's own passes."""
    octo = tokenizers["octothinker-3b-hybrid-base"]
    with pytest.raises(ValueError, match="has no chat template, and verl's agent loop renders every prompt"):
        prompts.check_own_template(octo, "models.octothinker-3b-hybrid-base")
    prompts.check_own_template(tokenizers["qwen3-1.7b-base"], "models.qwen3-1.7b-base")
    plain_end = copy.deepcopy(octo)
    plain_end.chat_template = "{% for m in messages %}{{ m['content'] }}END{% endfor %}"   # a turn closed by text
    with pytest.raises(ValueError, match="closes an assistant turn with 'END', which is no special token"):
        prompts.check_own_template(plain_end, "models.octothinker-3b-hybrid-base")


def test_a_template_that_reads_the_clock_renders_the_jobs_date_on_any_day(tokenizers, monkeypatch, tmp_path):
    """Llama 3.2 Instruct's template writes "Today Date" from the clock: pinned, two renders on two different
    days give the same prompt tokens (unpinned, they differ); the job's date is kept in its directory."""
    import transformers.utils.chat_template_utils as chat

    llama = with_template(tokenizers["octothinker-3b-hybrid-base"], "llama-3.2-instruct.jinja")
    assert prompts.reads_the_clock(llama.chat_template)
    day = prompts.job_prompt_date(tmp_path / "job")
    assert prompts.job_prompt_date(tmp_path / "job") == day   # a resumed job keeps its date
    pinned = prompts.pin_template_date(llama.chat_template, datetime.date(2026, 11, 27))
    messages = [{"role": "user", "content": "What is $1+1$? " + prompts.SUFFIX}]

    def render(on: datetime.datetime, template: str) -> list[int]:
        class Clock(datetime.datetime):
            @classmethod
            def now(cls, tz=None):
                return on
        monkeypatch.setattr(chat, "datetime", Clock)
        return list(llama.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))

    before, after = datetime.datetime(2026, 11, 27, 23, 59), datetime.datetime(2026, 12, 28, 0, 1)
    assert render(before, llama.chat_template) != render(after, llama.chat_template)
    assert render(before, pinned) == render(after, pinned)
    assert "Today Date: 27 Nov 2026" in llama.decode(render(after, pinned))


def real_solutions(count: int) -> list[tuple[str, str]]:
    """(correct solution, gold) pairs of real model outputs for MATH problems (tests/data)."""
    found = []
    with gzip.open(ROOT / "tests" / "data" / "math_labelled_solutions.jsonl.gz", "rt") as f:
        for line in f:
            record = json.loads(line)
            for text, label in zip(record["responses"], record["labels"]):
                if label:
                    found.append((text, record["answer"]))
                    break
            if len(found) == count:
                break
    return found


@pytest.mark.parametrize("donor,receiver", [("qwen3-1.7b-base", "octothinker-3b-hybrid-base"),
                                            ("octothinker-3b-hybrid-base", "qwen3-1.7b-base")])
def test_peer_responses_cross_the_real_vocabularies(tokenizers, donor, receiver):
    """Real solutions (LaTeX, \\boxed{}, digits, whitespace) as a donor's finished responses, re-tokenized for the
    receiver: its tokens decode to the donor's text, end with its stop id, and score the donor's reward."""
    from graft_exp.backends.verl import batch as vb

    src, dst = tokenizers[donor], tokenizers[receiver]
    stop = vb.stop_token_ids(dst, GenerationConfig(eos_token_id=SNAPSHOTS[receiver].generation_eos))[0]
    for text, gold in real_solutions(12):
        donor_text = src.decode(src.encode(text, add_special_tokens=False))
        assert donor_text == text
        ids = vb.retokenize(donor_text, dst, finished=True, max_length=8192, stop_id=stop)
        assert ids[-1] == stop and dst.decode(ids[:-1]) == text
        assert reward(dst.decode(ids, skip_special_tokens=True), gold) == reward(text, gold) == 1.0
    # the vocabularies split numbers differently: one digit a piece (Qwen), up to three (Llama 3)
    qwen, llama = tokenizers["qwen3-1.7b-base"], tokenizers["octothinker-3b-hybrid-base"]
    assert len(qwen.tokenize("2026")) == 4 and len(llama.tokenize("2026")) == 2


# ------------------------------------------------------------------ tiny models over the real vocabularies
def test_a_paper_vocabulary_model_widens_to_the_distribution_it_trained(tmp_path, monkeypatch):
    """A task-token model (the task's tokens plus one row for the rest of the vocabulary, its logit + log(rest))
    widened to the whole vocabulary gives every task token the probability it trained and the rest together that
    of the rest row, on a prompt and answer as the model sees them (Llama 3.2's template, its end of turn)."""
    import dataclasses
    import math

    import torch

    from graft_exp.tiny import models as tiny
    from graft_exp.tiny.task import benchmark

    monkeypatch.setenv("GRAFT_CACHE", str(tmp_path))
    recipe = dataclasses.replace(PAPER_VOCAB_RECIPES["tiny-llama3-vocab"], steps=3, batch=4, hidden=32,
                                 heads=1, layers=1, intermediate=64)
    tokenizer = tiny.build_tokenizer(recipe)
    small, used = tiny.warm_start_over_task_tokens(recipe, tokenizer)
    wide = tiny.widen(recipe, tokenizer, small, used)
    assert wide.config.vocab_size == 128256 and wide.generation_config.eos_token_id == 128001
    prompt, answer = tiny.chat_rows(tokenizer, benchmark("add", tiny.EVAL_SIZE)[:1])[0]
    assert answer[-1] == tokenizer.convert_tokens_to_ids("<|eot_id|>") and set(prompt + answer) <= set(used)
    ids = torch.tensor([prompt + answer])
    to_subset = {real: i for i, real in enumerate(used)}
    with torch.no_grad():
        # in float64: a float32 sum over 128k entries is off by ~1e-4, the models' own logits are not
        trained = small(torch.tensor([[to_subset[i] for i in prompt + answer]])).logits[0].double()
        trained[:, -1] += math.log(128256 - len(used))
        trained = torch.log_softmax(trained, -1)
        whole = torch.log_softmax(wide(ids).logits[0].double(), -1)
    rest = torch.ones(128256, dtype=torch.bool)
    rest[used] = False
    assert torch.allclose(whole[:, used], trained[:, :-1], atol=1e-5)
    assert torch.allclose(torch.logsumexp(whole[:, rest], -1), trained[:, -1], atol=1e-5)


def test_the_shipped_paper_vocabulary_models_match_their_recipes_and_solve_the_task():
    """Each shipped task-token model matches its recipe; widened (once per machine, into the cache), it solves
    tiny problems through its chat template on the whole vocabulary (greedy, 8 per skill, the 8 in one left-padded
    batch). That the pair's models solve what the other fails is the vLLM tier's: GRAFT exchanges both ways there."""
    import torch

    from graft_exp.tiny import models as tiny
    from graft_exp.tiny.task import SKILLS, benchmark

    solved = {}
    for key, recipe in PAPER_VOCAB_RECIPES.items():
        assert (tiny.ASSETS / key / tiny.HASH_FILE).read_text().strip() == tiny.recipe_hash(recipe), key
        model, tokenizer = tiny.load(key, progress=False)
        assert model.config.vocab_size == SNAPSHOTS[recipe.extra["snapshot"]].vocab_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        for skill in SKILLS:
            problems = benchmark(skill, tiny.EVAL_SIZE)[:8]
            prompts = [prompt for prompt, _ in tiny.chat_rows(tokenizer, problems)]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=pad)
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            solved[key, skill] = sum(reward(text, problem.answer) for text, problem in zip(texts, problems))
    print(solved)
    for key in PAPER_VOCAB_RECIPES:
        assert sum(solved[key, skill] for skill in SKILLS) >= 3, (key, solved)


def test_a_peer_copy_cut_at_the_receiver_s_limit_is_not_transferred(tokenizers):
    """Real solutions a Llama 3 model finished within a 512-token limit, copied to Qwen3 (which splits digits one by
    one): some no longer fit. Cut at the limit they lose the end of turn and, nearly always, the boxed answer the
    source's reward was for; graft's rule (``method.cut_copies: drop``) leaves them out of the receiver's batch, the
    old one (``train``) trains them as cut; both count them."""
    import torch

    from graft_exp.backends.verl import batch as vb
    from graft_exp.methods import CUT_COPIES
    from graft_exp.methods.receiver import PEER, SELF, ReceiverBatch, Row

    limit, src, dst = 512, tokenizers["octothinker-3b-hybrid-base"], tokenizers["qwen3-1.7b-base"]
    stop = vb.stop_token_ids(dst, GenerationConfig(eos_token_id=SNAPSHOTS["qwen3-1.7b-base"].generation_eos))[0]
    finished = [(text, gold) for text, gold in real_solutions(100)
                if len(src.encode(text, add_special_tokens=False)) + 1 <= limit]
    lengths = [len(vb.copy_ids(text, dst, finished=True, stop_id=stop)) for text, _ in finished]
    cut = [i for i, length in enumerate(lengths) if length > limit]
    assert len(finished) >= 80 and 1 <= len(cut) <= len(finished) // 10   # measured: 5 of 88
    for i in cut:
        text, gold = finished[i]
        ids = vb.retokenize(text, dst, finished=True, max_length=limit, stop_id=stop)
        assert len(ids) == limit and stop not in ids
        assert reward(text, gold) == 1.0 and reward(dst.decode(ids, skip_special_tokens=True), gold) == 0.0
    for i in set(range(len(finished))) - set(cut):
        assert vb.retokenize(finished[i][0], dst, finished=True, max_length=limit, stop_id=stop)[-1] == stop

    rows = [Row(0, SELF, 0, 0, 0.5, 1.0)] + [Row(1, PEER, 1, i, 1.0, 1.0) for i in range(len(finished))]
    batch = ReceiverBatch(rows, torch.tensor([False, True]), [], {"peer_admitted": float(len(finished))})
    copies = {(1, i) for i in cut}
    dropped = CUT_COPIES.get("drop")(None)(batch, copies)
    assert [(r.prompt, r.sample) for r in dropped.rows if r.origin == PEER] == \
        [(1, i) for i in range(len(finished)) if i not in cut]
    assert dropped.metrics["peer_admitted"] == len(finished) - len(cut) and dropped.rows[0] == rows[0]
    assert CUT_COPIES.get("train")(None)(batch, copies) is batch
