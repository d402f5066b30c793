"""What a job is charged: GPU-hours (paper App. D; docs/design.md "GPU-hours"), the devices a job is charged for,
each role's busy time in a step and how a step's wall time becomes each model's and the job's device-seconds;
and the counted charge (``ModelFlops``), the FLOPs of the work a step does, counted from its tokens."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from omegaconf import DictConfig

from graft_exp.schema import PHASES


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


_frames = threading.local()   # each thread's open phases, innermost last (the driver runs a pool per thread)


class Timeline:
    """A step's timeline (``schema.PHASES``, ``time/<phase>_s``): busy seconds per role and phase, read off the
    host's clock around the calls that do the work. No device synchronisation is added: each timed call returns
    when its work is done (a Ray call waits for its result, torch on a CPU is synchronous, and the local backend
    reads a GPU's results back before it returns).

    Phases nest: a backend marks the parts of a driver phase (``phase("logprob")`` inside ``generate``), and the
    outer phase is paused meanwhile, so each second is counted once. Work for several roles at once (the
    exchange's bookkeeping) is split evenly between them."""

    def __init__(self, roles: Sequence[str]):
        self.seconds = {role: dict.fromkeys(PHASES, 0.0) for role in roles}   # schema.PHASES

    @contextmanager
    def __call__(self, name: str, *roles: str):
        stack = _frames.__dict__.setdefault("stack", [])
        now = time.perf_counter()
        if stack:
            stack[-1].pause(now)
        stack.append(_Span(self, name, roles, now))
        try:
            yield
        finally:
            now = time.perf_counter()
            stack.pop().pause(now)
            if stack:
                stack[-1].started = now

    def busy(self, role: str) -> float:
        """All of ``role``'s timed seconds in the step."""
        return sum(self.seconds[role].values())


@dataclass
class _Span:
    timeline: Timeline
    name: str
    roles: tuple[str, ...]
    started: float

    def pause(self, now: float) -> None:
        share = (now - self.started) / len(self.roles)
        for role in self.roles:
            self.timeline.seconds[role][self.name] += share
        self.started = now


@contextmanager
def phase(name: str):
    """Time the enclosed work as phase ``name`` of the roles the enclosing phase times (a backend's part of a
    driver phase: ``with phase("sync"): ...``); nothing outside a driver's step (the tests' direct calls)."""
    stack = getattr(_frames, "stack", None)
    if not stack:
        yield
        return
    with stack[-1].timeline(name, *stack[-1].roles):
        yield


#: Dense bf16 peak FLOP/s by GPU model, as verl's flops counter takes them (verl/utils/flops_counter.py: the H100's
#: and H200's 989 TFLOP/s dense, not the 1,979 with sparsity): the denominator of the local backend's ``perf/mfu``.
DENSE_BF16_PEAK = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362.05e12, "B200": 2.25e15, "GB200": 2.5e15}


def dense_peak(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (``torch.cuda.get_device_name``: "NVIDIA H200"), or None
    where it is not known (then no MFU is logged). The longest matching model name wins (GB200 over B200)."""
    known = [name for name in DENSE_BF16_PEAK if name in device_name]
    return DENSE_BF16_PEAK[max(known, key=len)] if known else None


def mfu(flops: float, seconds: float, devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops`` done in ``seconds`` on ``devices`` GPUs of dense peak ``peak``."""
    if peak is None or seconds <= 0:
        return None
    return flops / (seconds * devices * peak)


@contextmanager
def paused():
    """This thread's open phase paused while the enclosed code waits for other threads' phases (the driver's
    pool): their seconds are their roles', not also this thread's shared bookkeeping."""
    stack = getattr(_frames, "stack", None)
    if not stack:
        yield
        return
    stack[-1].pause(time.perf_counter())
    try:
        yield
    finally:
        stack[-1].started = time.perf_counter()


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
