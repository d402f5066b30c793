"""The log-prob pass verl's FSDP engine takes on the job's workers (``backend.logprob_path``).

verl 0.9.1's ``logprobs_from_logits`` (verl/utils/torch_functional.py) takes flash-attn's Triton cross-entropy
when flash-attn is installed and ``VERL_DISABLE_FLASH_ATTN_CE`` is not ``1``, else ``logprobs_from_logits_v2``.
For half-precision logits v2 loops over the rows in Python, one log-softmax per row; with padding removed a row
is one token, so a 16,384-token micro-batch is ~16k kernel launches forward and as many autograd nodes backward.

``chunked`` (the default) is v2's computation in blocks of rows: verl's own ``logprobs_from_logits_naive``
(log-softmax, gather) on each block of ``chunk_rows`` rows of a ``Tensor.split``. A log-softmax over the last
dimension computes each row on its own, whatever the number of rows beside it (one reduction per row, CPU and
CUDA kernels alike), so the values and the gradients are v2's bit for bit (tests/test_verl_logprobs.py; the
benchmark ``benchmarks/logprob_path.py`` shows it at the paper vocabularies). ``split``, not slicing: a slice's
backward writes a gradient of the whole tensor, a split's one concatenation. Memory is v2's: each block's bf16
log-softmax kept for the backward, and the concatenated bf16 gradient (``resources.LOGITS_BYTES``).

fp32 (or fp64) logits, ``train.precision=fp32``, keep verl's v2, whose logsumexp over a whole row reduces in a
different order from a block's on a multi-threaded CPU (equal to ~4e-6, not bitwise).
"""

from __future__ import annotations

import os

import torch

#: The environment variable the job sets on every Ray worker (``config.ray_init_kwargs``) to the path it planned.
LOGPROB_PATH_ENV = "GRAFT_LOGPROB_PATH"

#: Bytes of logits per block. On a GPU a block must be large enough that its kernels outlast their launch: 64 MiB
#: is ~220 tokens at Qwen3's 151,936 entries, ~75 blocks per 16,384-token micro-batch, each log-softmax ~30 us of
#: H200 memory traffic against a launch's ~5 us. On a CPU it must stay in cache: 4 MiB (~14 tokens) measured
#: 2-4x faster than v2 and than 1,024-token blocks (benchmarks/logprob_path.py).
BLOCK_BYTES = {"cuda": 64 * 2**20, "cpu": 4 * 2**20}


def chunk_rows(logits: torch.Tensor) -> int:
    """Rows per block for ``logits`` (rows, vocabulary) on its device (``BLOCK_BYTES``)."""
    budget = BLOCK_BYTES["cuda" if logits.is_cuda else "cpu"]
    return max(1, budget // (logits.shape[-1] * logits.element_size()))


def chunked_logprobs(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """``log softmax(logits)[labels]`` per row, as verl's ``logprobs_from_logits_v2`` computes it, in blocks of
    ``chunk_rows`` rows. ``logits`` (..., vocab), ``labels`` (...,); the signature of verl's
    ``logprobs_from_logits``, whose ``inplace_backward`` only flash-attn's kernel reads."""
    from verl.utils.torch_functional import logprobs_from_logits_naive, logprobs_from_logits_v2

    if logits.dtype in (torch.float32, torch.float64):
        return logprobs_from_logits_v2(logits, labels)
    batch = logits.shape[:-1]
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    rows = chunk_rows(flat_logits)
    blocks = [logprobs_from_logits_naive(block, block_labels)
              for block, block_labels in zip(flat_logits.split(rows), flat_labels.split(rows), strict=True)]
    return torch.cat(blocks).view(batch)


def install(path: str | None = None) -> None:
    """Make verl's FSDP engine (actor, and HACPO's reference model, which runs the same engine) take the log-prob
    pass ``path`` (default: ``LOGPROB_PATH_ENV``, which the job sets on its workers). ``rowwise`` and
    ``flash_attn_ce`` are verl's own function, which reads ``VERL_DISABLE_FLASH_ATTN_CE`` per call; ``chunked``
    replaces the name the engine module imported."""
    from verl.utils import torch_functional
    from verl.workers.engine.fsdp import transformer_impl

    path = path or os.environ[LOGPROB_PATH_ENV]
    if not hasattr(transformer_impl, "logprobs_from_logits"):
        raise RuntimeError("verl's FSDP engine (verl.workers.engine.fsdp.transformer_impl) no longer calls "
                           "logprobs_from_logits: backend.logprob_path=chunked needs the verl version pinned in "
                           "pyproject.toml")
    transformer_impl.logprobs_from_logits = (chunked_logprobs if path == "chunked"
                                             else torch_functional.logprobs_from_logits)
