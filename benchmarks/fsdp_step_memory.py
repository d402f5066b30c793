"""One verl-style FSDP2 training step of a catalog model at the plan's micro-batch: memory measured beside what
``graft_exp.resources`` plans for it, as JSON.

    python benchmarks/fsdp_step_memory.py --model qwen3-1.7b-base --json          # a CUDA GPU: the real shapes
    python benchmarks/fsdp_step_memory.py --model qwen3-1.7b-base --tiny --json   # CPU: tiny shapes, real vocabulary

The step is the one docs/verl.md's table was measured with: world size 1, fp32 master parameters with bf16 compute
(fp32 on CPU), gradient checkpointing, one micro-batch of ``--tokens`` (default the plan's
``backend.max_token_len_per_gpu``, 16,384; 1,024 with ``--tiny``), log-probs by the path ``--logprob-path`` names
(``backend.logprob_path``: ``chunked``, the default, ``graft_exp/backends/verl/logprobs.py``; ``rowwise``, verl
0.9.1's ``logprobs_from_logits_v2``, row by row; ``flash_attn_ce`` where flash-attn is installed), AdamW, then the
gradients freed as verl frees them. ``step_s`` is the step's wall time (forward, backward, optimizer). Random weights of the snapshot's shapes (``ARCHITECTURES``: each snapshot's config.json; their
parameter counts equal conf/catalog/sizes.yaml's, which the script checks).

On CUDA it prints the allocator's peak allocated and reserved and what stays allocated after the step, beside the
plan's state + activations, ``train`` and the params + AdamW it keeps resident. On CPU, where torch keeps no
allocator statistics, it counts the bytes of the parameters, gradients and optimizer state the step really
created against the plan's state terms for the same shapes (the arithmetic), and says the rest is not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from graft_exp import resources

#: The snapshots' config.json shapes (hidden, intermediate, layers, attention heads, key-value heads, head size).
ARCHITECTURES = {
    "qwen3-1.7b-base": ("Qwen3Config", {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                                        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}),
    "smollm3-3b-base": ("SmolLM3Config", {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                                          "num_attention_heads": 16, "num_key_value_heads": 4}),
    "octothinker-3b-hybrid-base": ("LlamaConfig", {"hidden_size": 3072, "intermediate_size": 8192,
                                                   "num_hidden_layers": 28, "num_attention_heads": 24,
                                                   "num_key_value_heads": 8, "head_dim": 128}),
}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
GIB = 2 ** 30


def model_config(key: str, tiny: bool):
    import transformers

    class_name, shapes = ARCHITECTURES[key]
    size = resources.model_size(key)
    return getattr(transformers, class_name)(**(TINY if tiny else shapes), vocab_size=size.vocab,
                                             tie_word_embeddings=size.tied_embeddings)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def logprob_function(path: str):
    from verl.utils import torch_functional

    from graft_exp.backends.verl.logprobs import chunked_logprobs

    return {"chunked": chunked_logprobs, "rowwise": torch_functional.logprobs_from_logits_v2,
            "flash_attn_ce": torch_functional.logprobs_from_logits_flash_attn}[path]


def one_step(key: str, tiny: bool, tokens: int, path: str = "chunked") -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    config = model_config(key, tiny)
    with torch.device("meta"):
        counted = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if not tiny:
        assert counted == resources.model_size(key).params, (counted, resources.model_size(key).params)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    model.gradient_checkpointing_enable()
    compute = torch.bfloat16 if cuda else torch.float32
    fully_shard(model, mesh=init_device_mesh(device, (1,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    log_probs_of = logprob_function(path)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    log_probs = log_probs_of(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    (-log_probs.mean()).backward()
    grads = tensor_bytes(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters())
    optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - start
    state = tensor_bytes(v.to_local() if hasattr(v, "to_local") else v
                         for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    params = tensor_bytes(p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    optimizer.zero_grad(set_to_none=True)
    del logits, log_probs
    measured = {"params": params / GIB, "grads": grads / GIB, "optimizer": state / GIB}
    if cuda:
        torch.cuda.synchronize()
        measured |= {"peak_allocated": torch.cuda.max_memory_allocated() / GIB,
                     "peak_reserved": torch.cuda.max_memory_reserved() / GIB,
                     "after_step_allocated": torch.cuda.memory_allocated() / GIB,
                     "gpu": torch.cuda.get_device_name(0)}
    else:
        measured["note"] = "CPU: torch keeps no allocator statistics; peaks and the after-step residue are not measured"
    size = resources.ModelSize(params=counted, layers=config.num_hidden_layers, hidden=config.hidden_size,
                               vocab=config.vocab_size, tied_embeddings=bool(config.tie_word_embeddings))
    per_param = {"params": 4, "grads": 4, "optimizer": 8}
    activations = resources.activations_bytes(size, tokens, path) / GIB   # the path this step takes
    planned = {name: counted * b / GIB for name, b in per_param.items()}
    state_gib = sum(planned.values())
    planned |= {"activations": activations, "headroom": resources.ALLOCATOR_HEADROOM * activations,
                "state_plus_activations": state_gib + activations,
                "train": state_gib + activations * (1 + resources.ALLOCATOR_HEADROOM) + resources.GPU_RESERVE_GB,
                "params_plus_adamw": planned["params"] + planned["optimizer"]}
    ratios = {f"{name}_measured_over_planned": measured[name] / planned[name] for name in per_param}
    if cuda:
        ratios |= {"peak_allocated_over_state_plus_activations":
                   measured["peak_allocated"] / planned["state_plus_activations"],
                   "peak_reserved_over_train": measured["peak_reserved"] / planned["train"]}
    return {"model": key, "shapes": "tiny" if tiny else "real", "device": device, "tokens": tokens,
            "logprob_path": path, "step_s": step_s,
            "params": counted, "measured_gib": measured, "planned_gib": planned, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1.7b-base", choices=sorted(ARCHITECTURES))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes with the real vocabulary (CPU)")
    parser.add_argument("--tokens", type=int, default=None, help="the micro-batch (default: 16384; 1024 with --tiny)")
    parser.add_argument("--logprob-path", default="chunked", choices=["chunked", "rowwise", "flash_attn_ce"])
    parser.add_argument("--json", action="store_true", help="one JSON object (default: indented)")
    args = parser.parse_args()
    result = one_step(args.model, args.tiny, args.tokens or (1024 if args.tiny else 16384), args.logprob_path)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
