"""Token-by-token decoding of the tiny pair's transformers models over a preallocated KV cache.

A ``model(...)`` call per generated token costs the tiny models ~20 ms of framework work (mask
building, cache bookkeeping, output objects, and a ``torch.cat`` that grows every layer's cache) for
well under 1 ms of arithmetic. ``StaticCacheDecoder`` runs the same layers, with the model's own
modules and weights (so a trained model decodes as trained), over key/value buffers allocated once
per batch: one slot written per step, attention over the filled prefix. The prompt is still encoded
once by the model's own forward; its cache is copied into the buffers, repeated for the n samples.

Supported: ``LlamaForCausalLM`` and ``GPT2LMHeadModel``, the two architectures of the tiny pair.
"""

from __future__ import annotations

import torch
from transformers import GPT2LMHeadModel, LlamaForCausalLM, PreTrainedModel

SUPPORTED = (LlamaForCausalLM, GPT2LMHeadModel)


def supports(model: PreTrainedModel) -> bool:
    return isinstance(model, SUPPORTED)


class StaticCacheDecoder:
    """Decode steps for ``rows`` sequences whose prompts (left-padded to a common width) are already
    encoded in ``prompt_cache``; row r of the batch continues prompt r // n."""

    def __init__(self, model: PreTrainedModel, prompt_cache, prompt_mask: torch.Tensor, n: int,
                 max_new_tokens: int):
        if not supports(model):
            raise TypeError(f"the static-cache sampler decodes {', '.join(c.__name__ for c in SUPPORTED)}; "
                            f"{type(model).__name__} is not one (use backend.sampler=loop)")
        self.model = model
        self.llama = isinstance(model, LlamaForCausalLM)
        width = prompt_mask.shape[1]
        self.slot = width                     # the next free cache position
        capacity = width + max_new_tokens
        prompt_keys = [layer.keys for layer in prompt_cache.layers]
        prompt_values = [layer.values for layer in prompt_cache.layers]
        prompts, heads, _, head_dim = prompt_keys[0].shape
        rows = prompts * n
        self.keys = prompt_keys[0].new_empty((len(prompt_keys), rows, heads, capacity, head_dim))
        self.values = torch.empty_like(self.keys)
        for layer, (k, v) in enumerate(zip(prompt_keys, prompt_values)):
            self.keys[layer, :, :, :width] = k.repeat_interleave(n, dim=0)
            self.values[layer, :, :, :width] = v.repeat_interleave(n, dim=0)
        # Which cache positions each row attends to: its real prompt tokens, then every generated one
        # (an additive bias: 0 where attended, -inf on the prompt's left padding).
        self.bias = self.keys.new_zeros((rows, 1, 1, capacity))
        self.bias[:, 0, 0, :width].masked_fill_(~prompt_mask.bool().repeat_interleave(n, dim=0), float("-inf"))
        if self.llama:
            # RoPE's cos/sin for every position a row can reach, computed once by the model's own module.
            positions = torch.arange(capacity, device=prompt_mask.device)[None]
            dummy = self.keys.new_empty(1)
            self.cos, self.sin = model.model.rotary_emb(dummy, positions)
            self.cos, self.sin = self.cos[0], self.sin[0]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] after feeding ``tokens`` [rows] at ``positions`` [rows]."""
        slot = self.slot
        self.slot += 1
        mask = self.bias[..., :slot + 1]
        if self.llama:
            return self._llama_step(tokens, positions, slot, mask)
        return self._gpt2_step(tokens, positions, slot, mask)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int,
                mask: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k, v: [rows, heads, 1, head_dim]; writes k, v into the slot; returns [rows, 1, hidden]."""
        self.keys[layer, :, :, slot] = k[:, :, 0]
        self.values[layer, :, :, slot] = v[:, :, 0]
        # Written out rather than F.scaled_dot_product_attention: for one query over a strided cache
        # prefix, CPU SDPA's fallback costs ~2x these three kernels.
        scores = torch.matmul(q, self.keys[layer, :, :, :slot + 1].transpose(-1, -2)).mul_(scale).add_(mask)
        out = torch.matmul(torch.softmax(scores, dim=-1), self.values[layer, :, :, :slot + 1])
        return out.transpose(1, 2).reshape(q.shape[0], 1, -1)

    def _llama_step(self, tokens, positions, slot, mask):
        body = self.model.model
        x = body.embed_tokens(tokens[:, None])
        rows = x.shape[0]
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]
        for index, layer in enumerate(body.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            shape = (rows, 1, -1, attn.head_dim)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            x = x + attn.o_proj(self._attend(index, q, k, v, slot, mask, attn.scaling))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(body.norm(x))[:, -1]

    def _gpt2_step(self, tokens, positions, slot, mask):
        body = self.model.transformer
        x = body.wte(tokens[:, None]) + body.wpe(positions[:, None])
        rows = x.shape[0]
        for index, block in enumerate(body.h):
            attn = block.attn
            q, k, v = attn.c_attn(block.ln_1(x)).split(attn.split_size, dim=2)
            shape = (rows, 1, -1, attn.head_dim)
            q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
            scale = attn.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
            if attn.scale_attn_by_inverse_layer_idx:
                scale /= float(attn.layer_idx + 1)
            x = x + attn.c_proj(self._attend(index, q, k, v, slot, mask, scale))
            x = x + block.mlp(block.ln_2(x))
        return self.model.lm_head(body.ln_f(x))[:, -1]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
