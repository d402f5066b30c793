"""The counted charge (``costs.ModelFlops``, ``cost/flops``), checked by hand: parameter counts of real
architectures, the forward and generation formulas, and a driver step's count from the rows it trained."""

from __future__ import annotations

import shutil

import pytest
from support.memory_backend import MemoryBackend
from transformers import GPT2Config, LlamaConfig, Qwen3Config

from graft_exp import driver, schema, tracking
from graft_exp.config import validate
from graft_exp.costs import TRAIN_PASSES, ModelFlops
from graft_exp.methods.receiver import PEER


def test_qwen3_1_7b_counts_its_published_non_embedding_parameters_plus_the_unembedding():
    """Qwen3-1.7B's config.json (hub, Qwen/Qwen3-1.7B-Base): the model card's 1.4B non-embedding parameters are
    28 x (q 2048x2048 + k, v 2048x1024 + o 2048x2048 + 3 MLP 2048x6144) = 1,409,286,144; its tied unembedding
    adds 151,936 x 2048 (the logits are computed whether or not the matrix is shared with the input)."""
    config = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    assert ModelFlops.of(config) == ModelFlops(1_409_286_144 + 151_936 * 2048, 28, 16 * 128)


@pytest.mark.parametrize("tied", [True, False])
def test_small_shapes_by_hand(tied):
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=100, tie_word_embeddings=tied)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert ModelFlops.of(llama) == ModelFlops(2 * per_layer + 100 * 64, 2, 64)
    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=128, bos_token_id=0, eos_token_id=0)
    per_block = 64 * 3 * 64 + 64 * 64 + 2 * 64 * 256   # c_attn, c_proj, MLP; position embeddings cost nothing
    assert ModelFlops.of(gpt2) == ModelFlops(2 * per_block + 100 * 64, 2, 64)


def test_forward_and_generation_formulas():
    shape = ModelFlops(matmul_params=10, layers=2, attention_width=4)
    # 3 positions: 2 x 10 FLOPs per position, plus 4 x width per layer per attended position (1 + 2 + 3).
    assert shape.forward(3) == 2 * 10 * 3 + 4 * 4 * 2 * (1 + 2 + 3)
    # A 2-token prompt prefilled once, then responses of 1 and 3 tokens decoded over their growing context.
    decode = lambda p, r: sum(2 * 10 + 4 * 4 * 2 * t for t in range(p + 1, p + r + 1))
    assert shape.generation([2], [[1, 3]]) == shape.forward(2) + decode(2, 1) + decode(2, 3)
    assert shape.generation([2, 5], [[0], [1]]) == shape.forward(2) + shape.forward(5) + decode(5, 1)


@pytest.mark.parametrize("method", ["grpo_n8", "graft", "sgt", "hacpo"])
def test_a_step_s_count_is_its_generation_scoring_and_trained_rows(compose_cfg, store_template, tmp_path, method):
    """One step of the in-memory backend: each model's ``cost/flops`` is what it sampled, the peer responses it
    scored (the scorer's token counts) and every row it trained (ppo_epochs x 3 forward passes), plus HACPO's
    reference forward, recomputed here from what the backend received."""
    shutil.copy(store_template, tmp_path / "mlflow.db")
    cfg = compose_cfg(f"method={method}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                      f"checkpoint_root={tmp_path}/ckpt", "train.max_steps=1", "train.batch_prompts=8",
                      "train.minibatch_prompts=4", "eval.runs=1", "eval.samples=1", "backend.progress=false")
    validate(cfg)
    backends = []

    class Recording(MemoryBackend):
        """Records every (prompt, sample) its scorers scored, per receiver."""

        def scorer(self, role, own):
            score = super().scorer(role, own)

            def recorded(prompts, source):
                self.scored.setdefault(role, []).extend((q, i) for q in prompts for i in range(source.n))
                return score(prompts, source)
            return recorded

    def factory(*args):
        backends.append(Recording(*args))
        backends[0].scored = {}
        return backends[0]
    job = tracking.open_job(cfg)
    driver.fit(cfg, job, factory)
    backend = backends[0]
    shape = ModelFlops.of(backend.model_config("A"))
    total = 0.0
    for update in backend.updates:
        own, source, prompts = update.own.rollouts, update.source, update.own.prompt_tokens
        expected = shape.generation(prompts, own.num_tokens.tolist())
        expected += sum(shape.forward(prompts[q] + int(source.num_tokens[q, i]))   # the memory scorer's counts
                        for q, i in backend.scored.get(update.role, []))
        lengths = [prompts[r.prompt] + int((source if r.origin == PEER else own).num_tokens[r.prompt, r.sample])
                   for r in update.batch.rows]
        nll = [prompts[q] + int(source.num_tokens[q, i]) for q, i in update.batch.nll]
        expected += TRAIN_PASSES * int(cfg.train.ppo_epochs) * sum(shape.forward(t) for t in lengths + nll)
        if method == "hacpo":
            expected += sum(shape.forward(t) for t in lengths)
        model_run = next(r for r in job.client.search_runs([job.client.get_run(job.run_id).info.experiment_id])
                         if r.data.tags.get(schema.ROLE) == update.role)
        assert model_run.data.metrics[schema.FLOPS] == pytest.approx(expected, rel=1e-12), update.role
        total += expected
    assert job.client.get_run(job.run_id).data.metrics[schema.FLOPS] == pytest.approx(total, rel=1e-12)
