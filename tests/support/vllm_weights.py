"""One model in vLLM's CPU engine on its own, outside verl: loaded, sampled, sent new weights through the reload
the verl tier's weight sync ends in (``verl_cpu.update_weights_from_ipc``: vLLM's ``Worker.reload_weights``, then
``repack_kept_weights``), sampled again; each sample's per-token log-probs against transformers' forward on the
weights the engine should hold. Run as a script (vLLM keeps process-wide state): ``python
tests/support/vllm_weights.py MODEL_DIR OUT.json`` (its result as JSON).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the uniprocess executor, which vLLM's CPU
platform allows only then): what is checked here, the model class, the weight reload and sampling, is the same in
the verl tier's engine processes, and the two processes more (an engine core and a worker, each importing torch and
vLLM: ~40 s of the 2-core machine) would check nothing more."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

#: vLLM's CPU engine reserves this fraction of the machine's memory (its "GPU" memory) and its KV cache from it.
MEMORY_FRACTION = 0.15


def reload(worker, weights_file: str) -> int:
    """On the engine's worker: the weights of ``weights_file`` (safetensors) loaded in place, as the verl tier's
    weight sync does with what it received."""
    from safetensors.torch import load_file

    from support.verl_cpu import repack_kept_weights

    worker.reload_weights(weights_iterator=iter(load_file(weights_file).items()))
    return repack_kept_weights(worker.model_runner.model)


def main(model_dir: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # before vLLM reads its settings
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from graft_exp.backends.verl.batch import stop_token_ids
    from graft_exp.tiny.models import EVAL_SIZE, chat_rows
    from graft_exp.tiny.task import benchmark

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = stop_token_ids(tokenizer, GenerationConfig.from_pretrained(model_dir))
    prompts = [prompt for prompt, _ in chat_rows(tokenizer, benchmark("mixed", EVAL_SIZE)[:4])]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=192, max_num_seqs=4, seed=0,
              gpu_memory_utilization=MEMORY_FRACTION, distributed_executor_backend="uni")
    architecture = llm.llm_engine.model_config.architectures

    def sample() -> dict:
        params = SamplingParams(max_tokens=32, temperature=1.0, top_p=1.0, logprobs=0, seed=11, stop_token_ids=stops)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        rows, diff = [], 0.0
        for prompt, output in zip(prompts, outputs):
            sampled = output.outputs[0]
            tokens = list(sampled.token_ids)
            served = torch.tensor([step[token].logprob for step, token in zip(sampled.logprobs, tokens)])
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            own = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            diff = max(diff, float((served - own).abs().max()))
            rows.append({"tokens": tokens, "text": tokenizer.decode(tokens), "finish_reason": sampled.finish_reason})
        return {"rows": rows, "max_logprob_diff": diff}

    before = sample()
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    from safetensors.torch import save_file

    weights_file = str(Path(out).with_suffix(".safetensors"))
    save_file({name: tensor.clone() for name, tensor in model.state_dict().items()}, weights_file)
    repacked = llm.collective_rpc(reload, args=(weights_file,))
    after = sample()
    Path(out).write_text(json.dumps({"architecture": architecture, "stops": stops, "repacked": repacked,
                                     "before": before, "after": after}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
