"""Each log-prob path of ``backend.logprob_path`` side by side at the paper vocabularies: the time of a forward and
backward pass over one micro-batch of bf16 logits, its peak memory above the logits, and whether its values and
gradients equal verl's own row-wise function (``logprobs_from_logits_v2``, bit for bit).

    python benchmarks/logprob_path.py                    # CPU: 2,048 tokens; CUDA: 16,384 (the plan's micro-batch)
    python benchmarks/logprob_path.py --fsdp --tiny      # one FSDP training step per model and path (tiny shapes)
    python benchmarks/logprob_path.py --fsdp             # a CUDA GPU: the paper models' real shapes

Paths: ``rowwise`` (verl 0.9.1's fallback, one row per Python iteration), ``chunked`` (the default:
``graft_exp/backends/verl/logprobs.py``), ``naive`` (verl's one-shot log-softmax, for its memory), and
``flash_attn_ce`` (flash-attn's Triton cross-entropy) where flash-attn is installed. Peak memory on CUDA is the
allocator's peak above the logits; on a CPU, where torch keeps no statistics, each path runs in a process of its
own and the figure is its resident high-water mark above the logits (large tensors are their own mappings, freed
when released). ``--fsdp`` runs ``fsdp_step_memory.one_step`` (FSDP2, gradient checkpointing, AdamW) once per
model and path and prints the step's time and peak beside the plan's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graft_exp.backends.verl.logprobs import chunked_logprobs

#: The paper models' vocabularies (SmolLM3-3B and OctoThinker-3B share Llama-3's).
VOCABULARIES = {"qwen3-1.7b-base": 151936, "smollm3-3b-base / octothinker-3b": 128256}
MIB = 2 ** 20


def paths() -> dict:
    from verl.utils import torch_functional as verl_f

    found = {"rowwise": verl_f.logprobs_from_logits_v2, "chunked": chunked_logprobs,
             "naive": verl_f.logprobs_from_logits_naive}
    if verl_f.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE and torch.cuda.is_available():
        found["flash_attn_ce"] = verl_f.logprobs_from_logits_flash_attn
    return found


def inputs(vocab: int, tokens: int, device: str):
    generator = torch.Generator(device=device).manual_seed(vocab)
    # Drawn in bf16 so that nothing larger than the logits precedes a path's peak.
    logits = torch.randn(tokens, vocab, generator=generator, device=device, dtype=torch.bfloat16).mul_(4)
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=device)
    weights = torch.randn(tokens, generator=generator, device=device)
    return logits, labels, weights


def forward_backward(function, logits, labels, weights):
    leaf = logits.detach().clone().requires_grad_(True)
    values = function(leaf, labels)
    (values.float() * weights).sum().backward()
    return values.detach(), leaf.grad


def timed(function, logits, labels, weights, repeats: int) -> tuple[float, tuple]:
    seconds, result = [], None
    for _ in range(repeats + 1):   # the first call warms the allocator and the kernels
        if logits.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = forward_backward(function, logits, labels, weights)
        if logits.is_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]), result


def peak_mib(name: str, vocab: int, tokens: int, device: str) -> float:
    """The path's peak memory above its logits (see the module's docstring)."""
    function = paths()[name]
    if device == "cuda":
        logits, labels, weights = inputs(vocab, tokens, device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        forward_backward(function, logits, labels, weights)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / MIB
    command = [sys.executable, __file__, "--rss-of", name, "--vocab", str(vocab), "--tokens", str(tokens)]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)["peak_mib"]


def rss_of(name: str, vocab: int, tokens: int) -> None:
    logits, labels, weights = inputs(vocab, tokens, "cpu")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB, with the logits
    forward_backward(paths()[name], logits, labels, weights)
    print(json.dumps({"peak_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))


def compare_paths(tokens: int, repeats: int, device: str) -> list[dict]:
    rows = []
    for model, vocab in VOCABULARIES.items():
        logits, labels, weights = inputs(vocab, tokens, device)
        found = paths()
        reference_s, reference = timed(found["rowwise"], logits, labels, weights, repeats)
        for name, function in found.items():
            seconds, (values, grads) = ((reference_s, reference) if name == "rowwise"
                                        else timed(function, logits, labels, weights, repeats))
            rows.append({"vocab": model, "path": name, "seconds": seconds, "speedup": reference_s / seconds,
                         "peak_mib": peak_mib(name, vocab, tokens, device),
                         "values_equal": torch.equal(values, reference[0]),
                         "grads_equal": torch.equal(grads, reference[1]),
                         "max_abs_diff": max((values.float() - reference[0].float()).abs().max().item(),
                                             (grads.float() - reference[1].float()).abs().max().item())})
        del logits
    return rows


def fsdp_steps(tiny: bool, tokens: int | None) -> list[dict]:
    """One FSDP training step per paper model and path (``fsdp_step_memory.one_step``), each in a process of its
    own so that one's allocator peak is not another's."""
    rows = []
    script = Path(__file__).with_name("fsdp_step_memory.py")
    for model in ("qwen3-1.7b-base", "smollm3-3b-base", "octothinker-3b-hybrid-base"):
        for name in [p for p in paths() if p != "naive"]:
            command = [sys.executable, str(script), "--model", model, "--logprob-path", name, "--json"]
            command += ["--tiny"] * tiny + (["--tokens", str(tokens)] if tokens else [])
            result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            measured = result["measured_gib"]
            rows.append({"model": model, "path": name, "step_s": result["step_s"],
                         "peak_allocated_gib": measured.get("peak_allocated"),
                         "planned_train_gib": result["planned_gib"]["train"], "shapes": result["shapes"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (CPU 2048, CUDA 16384)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true", help="an FSDP training step per paper model and path")
    parser.add_argument("--tiny", action="store_true", help="with --fsdp: tiny shapes, the real vocabularies")
    parser.add_argument("--rss-of", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_of:
        return rss_of(args.rss_of, args.vocab, args.tokens)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.fsdp:
        rows = fsdp_steps(args.tiny, args.tokens)
        print(f"{'model':28} {'path':14} {'step s':>8} {'peak GiB':>9} {'plan train GiB':>15}  shapes")
        base = {r["model"]: r["step_s"] for r in rows if r["path"] == "rowwise"}
        for r in rows:
            peak = "-" if r["peak_allocated_gib"] is None else f"{r['peak_allocated_gib']:.1f}"
            print(f"{r['model']:28} {r['path']:14} {r['step_s']:8.2f} {peak:>9} {r['planned_train_gib']:15.1f}  "
                  f"{r['shapes']}  ({base[r['model']] / r['step_s']:.2f}x rowwise)")
        return None
    tokens = args.tokens or (16384 if device == "cuda" else 2048)
    print(f"{device}, {torch.get_num_threads()} threads, {tokens} tokens of bf16 logits, forward + backward, "
          f"median of {args.repeats}")
    print(f"{'vocabulary':34} {'path':14} {'seconds':>8} {'x rowwise':>9} {'peak MiB':>9}  values  grads")
    for r in compare_paths(tokens, args.repeats, device):
        print(f"{r['vocab']:34} {r['path']:14} {r['seconds']:8.3f} {r['speedup']:9.2f} {r['peak_mib']:9.0f}  "
              f"{'equal' if r['values_equal'] else 'differ':6}  {'equal' if r['grads_equal'] else 'differ':6}"
              + ("" if r["values_equal"] and r["grads_equal"] else f"  (max |diff| {r['max_abs_diff']:.2e})"))
    return None


if __name__ == "__main__":
    main()
