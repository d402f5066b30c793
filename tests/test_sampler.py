"""The local backend's two samplers (backend.sampler): the static-cache decoder computes the same
next-token distributions as the model's own forward, so with one seed both draw the same samples."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from graft_exp.backends.local_policy import LocalPolicy
from graft_exp.config import ConfigError, validate
from graft_exp.tiny import models as tiny
from graft_exp.tiny.task import SKILLS, train_split

TRAIN = OmegaConf.create({"temperature": 1.0, "grad_clip": 1.0, "lr": 1e-6, "betas": [0.9, 0.999],
                          "weight_decay": 0.0, "lr_warmup_steps": 0})


@pytest.mark.parametrize("key", list(tiny.RECIPES))
@pytest.mark.parametrize("n, temperature, top_p", [(8, 1.0, 1.0), (3, 0.6, 0.95), (1, 0.6, 0.95)])
def test_static_cache_samples_what_the_per_token_loop_samples(key, n, temperature, top_p):
    model, tokenizer = tiny.load(key, progress=False)
    # Prompts of different lengths, so left padding and per-row positions are exercised.
    problems = train_split(SKILLS, tiny.EVAL_SIZE, 200)[::25]
    policies = {s: LocalPolicy(key, model, tokenizer, torch.device("cpu"), TRAIN, 48, s)
                for s in ("loop", "static_cache")}
    ids = [policies["loop"].encode_prompt(tiny.model_input(p.prompt)) for p in problems]
    assert len({len(i) for i in ids}) > 1
    loop = policies["loop"].sample(ids, n, temperature, top_p, 48, seed=5)
    static = policies["static_cache"].sample(ids, n, temperature, top_p, 48, seed=5)
    assert static.token_ids == loop.token_ids and static.texts == loop.texts
    assert static.finished == loop.finished
    for a, b in zip(static.log_probs, loop.log_probs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    if temperature == TRAIN.temperature:
        # The recorded log-probs are the ones training recomputes (the behaviour policy).
        rescored = policies["static_cache"].score([ids[r // n] for r in range(len(ids) * n)], static.token_ids)
        for a, b in zip(static.log_probs, rescored):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_unknown_sampler_is_a_clear_error(compose_cfg, tmp_path):
    store = [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"checkpoint_root={tmp_path}/ckpt"]
    with pytest.raises(ConfigError, match=r"backend.sampler='fast' is not one of static_cache, loop"):
        validate(compose_cfg(*store, "backend.sampler=fast"))
    validate(compose_cfg(*store, "backend.sampler=loop"))
