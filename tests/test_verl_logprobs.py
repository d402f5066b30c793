"""The default log-prob pass of verl's workers (``backends/verl/logprobs.py``): verl's own row-wise function's
values and gradients, bit for bit, at the paper models' vocabularies, in blocks of rows."""

from __future__ import annotations

import pytest
import torch
from verl.utils import torch_functional
from verl.workers.engine.fsdp import transformer_impl

from graft_exp.backends.verl import logprobs
from graft_exp.resources import activations_bytes, model_size

#: Qwen3's and SmolLM3's / Llama-3.2's (OctoThinker's) vocabularies.
VOCABULARIES = [151936, 128256]


def _forward_backward(function, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    leaf = logits.clone().requires_grad_(True)
    values = function(leaf, labels)
    (values.float() * weights).sum().backward()
    return values.detach(), leaf.grad


@pytest.mark.parametrize("vocab", VOCABULARIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_equals_verls_rowwise_bit_for_bit(vocab, dtype):
    generator = torch.Generator().manual_seed(vocab)
    rows = 3 * logprobs.chunk_rows(torch.empty(1, vocab, dtype=dtype)) + 5    # several blocks and a short last one
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    weights = torch.randn(rows, generator=generator)
    expected = _forward_backward(torch_functional.logprobs_from_logits_v2, logits, labels, weights)
    got = _forward_backward(logprobs.chunked_logprobs, logits, labels, weights)
    assert got[0].dtype == expected[0].dtype == dtype
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_chunked_keeps_the_batch_shape_and_sizes_blocks_by_device_bytes():
    logits = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    labels = torch.randint(0, 64, (2, 7))
    got = logprobs.chunked_logprobs(logits, labels)
    assert got.shape == (2, 7)
    assert torch.equal(got, torch_functional.logprobs_from_logits_v2(logits.reshape(14, 64), labels.reshape(14)).view(2, 7))
    qwen3 = torch.empty(1, 151936, dtype=torch.bfloat16)
    assert logprobs.chunk_rows(qwen3) == logprobs.BLOCK_BYTES["cpu"] // (151936 * 2) == 13
    assert logprobs.BLOCK_BYTES["cuda"] // (151936 * 2) == 220


def test_install_sets_the_engines_function_and_the_plan_counts_the_same_memory(monkeypatch):
    monkeypatch.setattr(transformer_impl, "logprobs_from_logits", transformer_impl.logprobs_from_logits)
    logprobs.install("chunked")
    assert transformer_impl.logprobs_from_logits is logprobs.chunked_logprobs
    monkeypatch.setenv(logprobs.LOGPROB_PATH_ENV, "rowwise")
    logprobs.install()
    assert transformer_impl.logprobs_from_logits is torch_functional.logprobs_from_logits
    size = model_size("qwen3-1.7b-base")
    assert activations_bytes(size, 16384, "chunked") == activations_bytes(size, 16384, "rowwise")
