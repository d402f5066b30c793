"""The verl backend against verl 0.9.1's behaviour, each test a defect a read of the adapter found: the
benchmark limit, the best checkpoint's record, generation batches that do not split over the agent-loop
workers, and vLLM's sampling seed. On the tiny pair, through the stand-ins of ``test_verl_contract``."""

from __future__ import annotations

import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import torch
from test_verl_contract import BENCH_PROBLEMS, prepared, standin_backend, verl_cfg  # noqa: F401 (fixture)
from verl.utils import hf_tokenizer

from graft_exp.backends.verl.backend import VerlBackend, check_verl_loadable
from graft_exp.backends.verl.config import data_files, model_path
from graft_exp.driver import run_directory
from graft_exp.methods import resolve
from graft_exp.seeds import derive_seed
from graft_exp.tiny.models import ASSETS
from graft_exp.tiny.task import SKILLS

torch.set_num_threads(1)


def built(cfg) -> VerlBackend:
    backend = VerlBackend(cfg, resolve(cfg.method), ["A", "B"], run_directory(cfg))
    train_file, val_files = data_files(cfg)
    backend.build(train_file, val_files, hf_tokenizer(model_path(cfg, "A")))
    return backend


def test_eval_max_problems_limits_every_benchmark(compose_cfg, prepared, tmp_path):  # noqa: F811
    everything = built(verl_cfg(compose_cfg, prepared, tmp_path, "method=graft")).benchmarks()
    assert {name: len(problems) for name, problems in everything.items()} == dict.fromkeys(SKILLS, BENCH_PROBLEMS)
    limited = built(verl_cfg(compose_cfg, prepared, tmp_path, "method=graft", "eval.max_problems=1")).benchmarks()
    assert limited == {name: problems[:1] for name, problems in everything.items()}


def server(backend: VerlBackend, role: str):
    return backend.models[role].agent_loop.llm_client


def test_a_generation_batch_need_not_split_over_the_agent_loop_workers(compose_cfg, prepared, tmp_path):  # noqa: F811
    """One prompt, one sample, two agent-loop workers: verl's DataProto.chunk would assert; the batch is
    padded to the workers (the padding's rollout is generated and dropped)."""
    cfg = verl_cfg(compose_cfg, prepared, tmp_path, "method=graft", "backend.agent_workers=2")
    backend = standin_backend(cfg, resolve(cfg.method), ["A"], run_directory(cfg))
    prompt = backend.benchmarks()[SKILLS[0]][0].prompt
    texts = backend.generate("A", 0)([prompt], 1, float(cfg.eval.temperature), float(cfg.eval.top_p), 7)
    assert len(texts) == 1 and len(texts[0]) == 1
    assert len(server(backend, "A").requests) == 2


def test_vllm_sampling_seeds_follow_the_drivers_seed(compose_cfg, prepared, tmp_path):  # noqa: F811
    """Every sample is requested with its own vLLM seed, derived from the seed the driver passes (itself
    derived from the run seed and the step): two jobs' draws differ, a resumed job's repeat its first
    run's, and the n samples of a prompt differ from one another."""
    cfg = verl_cfg(compose_cfg, prepared, tmp_path, "method=grpo_ds")
    problems = built(cfg).problems()[:2]
    n = int(cfg.method.n)

    def draw(seed):
        backend = standin_backend(cfg, resolve(cfg.method), ["A"], run_directory(cfg))
        generation = backend.sample("A", problems, n, seed, step=1)
        return generation.responses, [request["seed"] for request in server(backend, "A").requests]

    first, seeds = draw(derive_seed(cfg.seed, 1, "A", "rollout", 0))
    assert sorted(seeds) == sorted(derive_seed(derive_seed(cfg.seed, 1, "A", "rollout", 0), i)
                                   for i in range(len(problems) * n))
    assert len(set(seeds)) == len(seeds)
    again, same = draw(derive_seed(cfg.seed, 1, "A", "rollout", 0))       # a resumed job's step 1
    assert again == first and sorted(same) == sorted(seeds)
    _, other = draw(derive_seed(cfg.seed + 1, 1, "A", "rollout", 0))      # another run seed
    assert not set(other) & set(seeds)


def first_weight(backend: VerlBackend, role: str) -> torch.Tensor:
    return next(backend.models[role].wg.model.parameters()).full_tensor().detach().clone()


def test_a_resume_pairs_the_best_record_with_its_weights(compose_cfg, prepared, tmp_path):  # noqa: F811
    """Best kept at step 1 and checkpointed; a better step 2 is kept, and the job is killed before its
    checkpoint. The resumed job restores the step-1 checkpoint, whose driver record says best = 1: its
    best weights must be step 1's, not the newer ones the killed job left on disk."""
    cfg = verl_cfg(compose_cfg, prepared, tmp_path, "method=graft")
    killed = standin_backend(cfg, resolve(cfg.method), ["A"], run_directory(cfg))
    killed.keep_best("A", 1)
    at_step_1 = first_weight(killed, "A")
    checkpoint = tmp_path / "ckpt-1"
    killed.save(checkpoint, 1)
    with torch.no_grad():
        for param in killed.models["A"].wg.model.parameters():
            param.to_local().add_(0.5)
    killed.keep_best("A", 2)                 # validation at step 2; the job dies before its checkpoint
    assert not torch.equal(first_weight(killed, "A"), at_step_1)

    resumed = standin_backend(cfg, resolve(cfg.method), ["A"], run_directory(cfg))
    resumed.load(checkpoint)
    with torch.no_grad():
        for param in resumed.models["A"].wg.model.parameters():
            param.to_local().add_(1.0)       # trained on after the resume; the final evaluation restores best
    resumed.restore_best("A")
    assert torch.equal(first_weight(resumed, "A"), at_step_1)


def test_a_model_verl_would_load_without_its_lm_head_is_refused():
    """verl picks the class by "ForCausalLM" in the architecture's name: GPT-2 would be a bare AutoModel."""
    check_verl_loadable(str(ASSETS / "tiny-char-llama"))
    with pytest.raises(ValueError, match=r"tiny-bpe-gpt2 cannot train on backend=verl: its architecture "
                                         r"GPT2LMHeadModel is not a \*ForCausalLM.*no num_key_value_heads"):
        check_verl_loadable(str(ASSETS / "tiny-bpe-gpt2"))
