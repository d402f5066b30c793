"""Token-by-token decoding of the tiny pair's transformers models over a preallocated KV cache.

A ``model(...)`` call per generated token spends much of its time, at the tiny models' size, on
framework work (mask building, cache bookkeeping, output objects, a ``torch.cat`` that grows every
layer's cache, the prompt's keys and values repeated for each of its n samples) rather than on
arithmetic. ``StaticCacheDecoder`` runs the same layers, with the model's own modules and weights (so
a trained model decodes as trained), over key/value buffers allocated once per batch: one slot
written per step. The prompt is still encoded once by the model's own forward; its keys and values
are kept once per prompt and attended to by its n samples together.

Supported: ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``GPTNeoXForCausalLM`` and ``Qwen3ForCausalLM`` (as many
key/value heads as query heads), the architectures of the tiny models.
"""

from __future__ import annotations

import torch
from transformers import (
    GPT2LMHeadModel,
    GPTNeoXForCausalLM,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3ForCausalLM,
)

SUPPORTED = (LlamaForCausalLM, GPT2LMHeadModel, GPTNeoXForCausalLM, Qwen3ForCausalLM)


def supports(model: PreTrainedModel) -> bool:
    if type(model) is Qwen3ForCausalLM:   # grouped key/value heads would need their own cache layout
        return model.config.num_key_value_heads == model.config.num_attention_heads
    return type(model) in SUPPORTED


class StaticCacheDecoder:
    """Decode steps for ``rows = P * n`` sequences whose P prompts (left-padded to a common width)
    are already encoded in ``prompt_cache``; row r continues prompt r // n.

    The prompt's keys and values are kept once per prompt, not once per sample: the n samples of a
    prompt attend to them together (one [n, head_dim] x [head_dim, width] product per prompt and
    head instead of n vector products), and only the generated tokens' keys and values are per row.
    """

    def __init__(self, model: PreTrainedModel, prompt_cache, prompt_mask: torch.Tensor, n: int,
                 max_new_tokens: int):
        if not supports(model):
            raise TypeError(f"the static-cache sampler decodes {', '.join(c.__name__ for c in SUPPORTED)}; "
                            f"{type(model).__name__} is not one (use backend.sampler=loop)")
        self.model = model
        self.step_of = {LlamaForCausalLM: self._llama_step, GPT2LMHeadModel: self._gpt2_step,
                        GPTNeoXForCausalLM: self._neox_step, Qwen3ForCausalLM: self._llama_step}[type(model)]
        self.n = n
        self.generated = 0                    # tokens fed so far = filled generated cache slots
        # [layers, P, heads, width, head_dim], as the model's own forward computed them.
        self.prompt_keys = torch.stack([layer.keys for layer in prompt_cache.layers])
        self.prompt_values = torch.stack([layer.values for layer in prompt_cache.layers])
        layers, prompts, heads, width, head_dim = self.prompt_keys.shape
        self.keys = self.prompt_keys.new_empty((layers, prompts, heads, n, max_new_tokens, head_dim))
        self.values = torch.empty_like(self.keys)
        # 0 where a prompt's tokens are, -inf on its left padding.
        self.prompt_bias = self.prompt_keys.new_zeros((prompts, 1, 1, width)).masked_fill_(
            ~prompt_mask.bool()[:, None, None, :], float("-inf"))
        rotary = {LlamaForCausalLM: lambda: model.model.rotary_emb, Qwen3ForCausalLM: lambda: model.model.rotary_emb,
                  GPTNeoXForCausalLM: lambda: model.gpt_neox.rotary_emb}.get(type(model))
        if rotary is not None:
            # RoPE's cos/sin for every position a row can reach, computed once by the model's own module.
            positions = torch.arange(width + max_new_tokens, device=prompt_mask.device)[None]
            self.cos, self.sin = rotary()(self.keys.new_empty(1), positions)
            self.cos, self.sin = self.cos[0], self.sin[0]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] after feeding ``tokens`` [rows] at ``positions`` [rows]."""
        slot = self.generated
        self.generated += 1
        return self.step_of(tokens, positions, slot)

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, 1, heads * head_dim] -> [P, heads, n, head_dim]."""
        prompts, heads, head_dim = self.prompt_keys.shape[1], self.prompt_keys.shape[2], self.prompt_keys.shape[-1]
        return x.view(prompts, self.n, heads, head_dim).transpose(1, 2)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int,
                scale: float) -> torch.Tensor:
        """q, k, v: [P, heads, n, head_dim] of the fed tokens; writes k, v into the slot; returns the
        attention output [rows, 1, hidden]."""
        self.keys[layer, :, :, :, slot] = k
        self.values[layer, :, :, :, slot] = v
        keys, values = self.keys[layer, :, :, :, :slot + 1], self.values[layer, :, :, :, :slot + 1]
        q = q * scale
        prompt_scores = torch.matmul(q, self.prompt_keys[layer].transpose(-1, -2)) + self.prompt_bias
        own_scores = torch.matmul(q.unsqueeze(-2), keys.transpose(-1, -2)).squeeze(-2)
        width = prompt_scores.shape[-1]
        probs = torch.softmax(torch.cat([prompt_scores, own_scores], dim=-1), dim=-1)
        out = torch.matmul(probs[..., :width], self.prompt_values[layer])
        out = out + torch.matmul(probs[..., width:].unsqueeze(-2), values).squeeze(-2)
        return out.transpose(1, 2).reshape(-1, 1, out.shape[1] * out.shape[-1])

    def _rotary(self, positions):
        """RoPE's cos, sin at ``positions`` [rows], as [P, 1, n, rotary_dim]."""
        grouped = lambda t: t.view(self.prompt_keys.shape[1], 1, self.n, -1)
        return grouped(self.cos[positions]), grouped(self.sin[positions])

    def _llama_step(self, tokens, positions, slot):
        """Llama's layer; also Qwen3's, whose attention normalises each head's query and key (RMSNorm over the
        head's dimensions, ``q_norm`` / ``k_norm``) before the rotary embedding."""
        body = self.model.model
        x = body.embed_tokens(tokens[:, None])
        cos, sin = self._rotary(positions)
        for index, layer in enumerate(body.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self._grouped(attn.q_proj(h)), self._grouped(attn.k_proj(h)), self._grouped(attn.v_proj(h))
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            x = x + attn.o_proj(self._attend(index, q, k, v, slot, attn.scaling))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(body.norm(x))[:, -1]

    def _gpt2_step(self, tokens, positions, slot):
        body = self.model.transformer
        x = body.wte(tokens[:, None]) + body.wpe(positions[:, None])
        for index, block in enumerate(body.h):
            attn = block.attn
            q, k, v = (self._grouped(t) for t in attn.c_attn(block.ln_1(x)).split(attn.split_size, dim=2))
            scale = attn.head_dim ** -0.5 if attn.scale_attn_weights else 1.0
            if attn.scale_attn_by_inverse_layer_idx:
                scale /= float(attn.layer_idx + 1)
            x = x + attn.c_proj(self._attend(index, q, k, v, slot, scale))
            x = x + block.mlp(block.ln_2(x))
        return self.model.lm_head(body.ln_f(x))[:, -1]

    def _neox_step(self, tokens, positions, slot):
        body = self.model.gpt_neox
        x = body.embed_in(tokens[:, None])
        cos, sin = self._rotary(positions)
        for index, layer in enumerate(body.layers):
            attn = layer.attention
            # query_key_value's output is per head [q | k | v], each head_size wide.
            qkv = attn.query_key_value(layer.input_layernorm(x)).view(x.shape[0], 1, -1, 3 * attn.head_size)
            q, k, v = (self._grouped(t.reshape(x.shape[0], 1, -1)) for t in qkv.chunk(3, dim=-1))
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            out = attn.dense(self._attend(index, q, k, v, slot, attn.scaling))
            if layer.use_parallel_residual:
                x = x + out + layer.mlp(layer.post_attention_layernorm(x))
            else:
                x = x + out
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.embed_out(body.final_layer_norm(x))[:, -1]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first ``cos.shape[-1]`` dims of each head (all of them in Llama, a
    quarter in GPT-NeoX), the rest passed through."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passed = x[..., :rotary], x[..., rotary:]
    return torch.cat([rotated * cos + _rotate_half(rotated) * sin, passed], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
