"""What a job is charged: GPU-hours (paper App. D; docs/design.md "GPU-hours"), the devices a job is charged for,
each role's busy time in a step and how a step's wall time becomes each model's and the job's device-seconds;
and the counted charge (``ModelFlops``), the FLOPs of the work a step does, counted from its tokens."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from omegaconf import DictConfig


def accounted_gpus(cfg: DictConfig) -> int:
    """N_GPU of ``cost/gpu_hours`` (paper App. D: N_GPU x summed per-step training wall time).

    The GPUs Slurm allocated to this job (``SLURM_GPUS_ON_NODE`` x nodes) when it runs under Slurm
    with GPUs, else what the pair asks for (``pair.gpus``: 4 for pair1..3, as in the paper). A
    CPU-only job (the tiny pair) is charged as one device so that its compute curves keep a scale.
    """
    on_node = os.environ.get("SLURM_GPUS_ON_NODE")
    if on_node and on_node.isdigit() and int(on_node) > 0:
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1
        return int(on_node) * int(nodes)
    return max(int(cfg.pair.gpus), 1)


class Timer:
    """Busy seconds per role; ``shared`` work (reward checks, the exchange's bookkeeping) is split evenly."""

    def __init__(self, roles: Sequence[str]):
        self.seconds = {role: 0.0 for role in roles}

    @contextmanager
    def __call__(self, *roles: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            share = (time.perf_counter() - started) / len(roles)
            for role in roles:
                self.seconds[role] += share


def step_costs(busy: dict[str, float], wall: float, devices: dict[str, int], co_train: bool,
               concurrent: bool) -> tuple[dict[str, float], float]:
    """Device-seconds of one training step: (each model's, the job's). Paper App. D, docs/design.md "GPU-hours".

    Independent models pay their own busy time on their own devices; the job is their sum. A co-trained
    pair pays the step's wall time on every device it holds (both pools when they are disjoint, the one
    shared device otherwise), split between the models in proportion to their busy time, so the shares
    add up to the joint cost."""
    if not co_train:
        own = {role: busy[role] * devices[role] for role in busy}
        return own, sum(own.values())
    joint = wall * (sum(devices.values()) if concurrent else max(devices.values()))
    total_busy = sum(busy.values())
    shares = {role: joint * (busy[role] / total_busy if total_busy > 0 else 1 / len(busy)) for role in busy}
    return shares, joint


# ---------------------------------------------------------------------------------------- counted FLOPs
#: A trained token costs its forward pass and a backward pass of twice that (Kaplan et al. 2020: 6N).
TRAIN_PASSES = 3


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of one model by sequence length: the counted charge (``cost/flops``, docs/clusters.md
    "Counted FLOPs"). Kaplan et al. (2020, sec. 2.1): 2 FLOPs per token and per parameter it multiplies with,
    plus attention's 2 x n_layer x n_ctx x d_attn, here summed exactly over a causal sequence (position t
    attends to t positions: QK^T and AV, 4 x width FLOPs each per layer). Embedding lookups cost nothing;
    the unembedding (the logits of every position) counts as a matmul, tied or not: with a 152k vocabulary it
    is much of a small model's work. 1-D parameters (norms, biases), activations, softmax and rotary are left
    out (well under 1 % at these widths)."""

    matmul_params: int      # parameters of the blocks' linear layers and of the unembedding (d x V)
    layers: int
    attention_width: int    # heads x head dim (queries), what the scores and the weighted values run over

    def forward(self, tokens: int) -> float:
        """A causal forward pass over ``tokens`` positions."""
        return 2.0 * self.matmul_params * tokens + 2.0 * self.layers * self.attention_width * tokens * (tokens + 1)

    def generation(self, prompt_tokens: Sequence[int], response_tokens: Sequence[Sequence[int]]) -> float:
        """Sampling ``response_tokens[q]`` (n lengths) after prompt q: each prompt prefilled once (vLLM's prefix
        cache, the local sampler's shared prefill), each sampled token one decoding step over its context."""
        total = 0.0
        for prompt, lengths in zip(prompt_tokens, response_tokens):
            prefill = self.forward(prompt)
            total += prefill + sum(self.forward(prompt + int(r)) - prefill for r in lengths)
        return total

    @classmethod
    def of(cls, config) -> ModelFlops:
        """From a transformers model config: the architecture built on the meta device (no memory, no
        weights) and its parameters counted, so every architecture transformers knows counts alike."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        head = model.get_output_embeddings().weight
        blocks = sum(p.numel() for p in model.parameters()   # tied or not, the head counts once (below)
                     if p.dim() >= 2 and id(p) not in embeddings and p is not head)
        width = config.num_attention_heads * (getattr(config, "head_dim", None)
                                              or config.hidden_size // config.num_attention_heads)
        return cls(int(blocks + head.numel()), int(config.num_hidden_layers), int(width))
