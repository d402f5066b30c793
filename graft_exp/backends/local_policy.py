"""One model of the local backend: sampling with per-token log-probs, log-probs of any (prompt,
response) pair under the current policy, re-tokenization of peer responses, and the optimiser.

Sequences are laid out as in ``model.generate``: prompts left-padded, responses right-padded, and
position ids counted over real tokens only, so the log-probs recomputed for training equal the
ones recorded while sampling (float rounding aside).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from graft_exp.backends.static_cache import StaticCacheDecoder
from graft_exp.config import LOCAL_SAMPLERS

#: Sequences per generation call: much larger batches were measured 2-3x slower on CPU.
GENERATION_CHUNK = 256


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` (the most
    likely token always stays); the rest get probability 0 (``multinomial`` renormalises)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


@dataclass
class Samples:
    """n responses to each of P prompts, prompt-major (row p * n + i)."""

    token_ids: list[list[int]]        # generated ids, up to and including the end token
    log_probs: list[torch.Tensor]     # per generated token, under the sampling policy (temperature applied)
    texts: list[str]
    finished: list[bool]


class LocalPolicy:
    """A causal LM with its tokenizer and AdamW optimiser (paper Table 3 settings, scaled)."""

    def __init__(self, key: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device,
                 train_cfg, max_response_tokens: int, sampler: str = "static_cache"):
        # backend.sampler: static_cache decodes over preallocated KV buffers (graft_exp.backends.static_cache);
        # loop calls the model once per token with its growing cache (the reference it is measured against).
        if sampler not in LOCAL_SAMPLERS:
            raise ValueError(f"backend.sampler={sampler!r} is not one of {', '.join(LOCAL_SAMPLERS)}")
        self.key = key
        self.sampler = sampler
        self.model = model.to(device)
        self.tokenizer = tokenizer
        self.device = device
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.max_response_tokens = max_response_tokens
        self.temperature = float(train_cfg.temperature)
        self.grad_clip = float(train_cfg.grad_clip)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=float(train_cfg.lr), betas=tuple(train_cfg.betas),
            weight_decay=float(train_cfg.weight_decay),
        )
        # train.lr_warmup_steps: linear warm-up from 0 over that many optimizer steps, then constant
        # (verl's constant schedule with warm-up; 0 = constant from the first step, as the paper).
        warmup = int(train_cfg.lr_warmup_steps)
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda done: min(1.0, done / warmup) if warmup else 1.0)
        self._prompt_ids: dict[str, list[int]] = {}

    # ----------------------------------------------------------------- tokenization
    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of the model input for a prompt text (cached: prompts repeat every step)."""
        if text not in self._prompt_ids:
            self._prompt_ids[text] = self.tokenizer(text, add_special_tokens=False).input_ids
        return self._prompt_ids[text]

    def encode_response(self, text: str, finished: bool) -> list[int]:
        """Re-tokenize a response string for this model (§3.2): its tokens, plus the end token when the
        source ended its response, truncated to the response length limit. Never empty."""
        return self.copy_ids(text, finished)[: self.max_response_tokens]

    def copy_ids(self, text: str, finished: bool) -> list[int]:
        """``encode_response`` before the cut at the response length limit."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return ids + [self.eos] if finished or not ids else ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ----------------------------------------------------------------- sampling
    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
               max_new_tokens: int, seed: int) -> Samples:
        """n samples per prompt, KV-cached, each prompt encoded once and its cache shared by its n
        samples; log-probs of the sampled tokens under softmax(logits / temperature) (the behaviour
        policy exactly when top_p = 1). Deterministic in ``seed``."""
        self.model.eval()
        rng = torch.Generator(device=self.device).manual_seed(seed)
        out = Samples([], [], [], [])
        per_chunk = max(1, GENERATION_CHUNK // n)
        for start in range(0, len(prompt_ids), per_chunk):
            ids, lps = self._sample_chunk(prompt_ids[start:start + per_chunk], n, temperature, top_p,
                                          max_new_tokens, rng)
            for row in range(ids.shape[0]):
                tokens = ids[row].tolist()
                length = tokens.index(self.eos) + 1 if self.eos in tokens else len(tokens)
                out.token_ids.append(tokens[:length])
                out.log_probs.append(lps[row, :length].clone())
                out.texts.append(self.decode(tokens[:length]))
                out.finished.append(self.eos in tokens)
        return out

    def _sample_chunk(self, prompts: list[list[int]], n: int, temperature: float, top_p: float,
                      max_new_tokens: int, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Generated ids and their log-probs [rows, T] for n samples of each prompt. Both samplers
        draw from the same distribution with the same random stream; they differ only in how the
        next-token logits are computed."""
        input_ids, mask = self._left_pad(prompts)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        result = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        logits = result.logits[:, -1].repeat_interleave(n, dim=0)
        position = positions[:, -1].repeat_interleave(n, dim=0)
        if self.sampler == "static_cache":
            decoder = StaticCacheDecoder(self.model, result.past_key_values, mask, n, max_new_tokens)
            next_logits = decoder.step
        else:
            cache = result.past_key_values
            cache.batch_repeat_interleave(n)
            mask = mask.repeat_interleave(n, dim=0)

            def next_logits(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
                nonlocal mask
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                return self.model(input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=position[:, None],
                                  past_key_values=cache, use_cache=True).logits[:, -1]
        done = torch.zeros(logits.shape[0], dtype=torch.bool, device=self.device)
        tokens, log_probs = [], []
        for _ in range(max_new_tokens):
            lp = torch.log_softmax(logits.float() / temperature, dim=-1)
            token = torch.multinomial(top_p_filter(lp.exp(), top_p), 1, generator=rng).squeeze(1)
            token = torch.where(done, torch.full_like(token, self.pad), token)
            tokens.append(token)
            log_probs.append(lp.gather(1, token.unsqueeze(1)).squeeze(1))
            done |= token == self.eos
            if bool(done.all()):
                break
            position = position + 1
            logits = next_logits(token, position)
        return torch.stack(tokens, dim=1).cpu(), torch.stack(log_probs, dim=1).cpu()

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    # ----------------------------------------------------------------- log-probs
    def token_log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                        model: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs [B, T] of each response given its prompt under the current parameters
        (with grad if enabled by the caller), and the response mask [B, T]. ``model``: another model
        with this tokenizer (HACPO's frozen reference).

        Rows sharing a prompt (a group) share one forward pass over it: the prompt's KV cache is
        computed once and repeated, which is exact and, with the paper's long prompt suffix, most of
        the cost saved."""
        model = model or self.model
        unique: dict[tuple[int, ...], int] = {}
        index = [unique.setdefault(tuple(p), len(unique)) for p in prompt_ids]
        prompts, prompt_mask = self._left_pad([list(p) for p in unique])
        positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
        prefix = model(input_ids=prompts, attention_mask=prompt_mask, position_ids=positions, use_cache=True)
        select = torch.tensor(index, device=self.device)
        cache = prefix.past_key_values
        cache.batch_select_indices(select)
        width = max(len(r) for r in response_ids)
        responses = torch.full((len(response_ids), width), self.pad, dtype=torch.long)
        response_mask = torch.zeros((len(response_ids), width), dtype=torch.long)
        for i, r in enumerate(response_ids):
            responses[i, :len(r)] = torch.tensor(r)
            response_mask[i, :len(r)] = 1
        responses, response_mask = responses.to(self.device), response_mask.to(self.device)
        prompt_mask, positions = prompt_mask[select], positions[select]
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        response_positions = positions[:, -1:] + response_mask.cumsum(dim=1)
        logits = model(input_ids=responses, attention_mask=attention_mask, position_ids=response_positions,
                       past_key_values=cache, use_cache=True).logits
        # The first response token is predicted by the prompt's last position, the others by the previous
        # response position.
        logits = torch.cat([prefix.logits[:, -1:][select], logits[:, :-1]], dim=1).float() / self.temperature
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        return log_probs, response_mask.bool()

    @torch.no_grad()
    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]], chunk: int = 128
              ) -> list[torch.Tensor]:
        """Per-token log-probs (one tensor per response) under the current (= old) policy, no grad."""
        self.model.eval()
        out = []
        for start in range(0, len(response_ids), chunk):
            lp, mask = self.token_log_probs(prompt_ids[start:start + chunk], response_ids[start:start + chunk])
            lp = lp.cpu()
            out += [lp[i, :int(mask[i].sum())].clone() for i in range(lp.shape[0])]
        return out

    # ----------------------------------------------------------------- update
    def apply_gradients(self, loss: torch.Tensor) -> float:
        """Backward, clip the gradient norm (paper: 1.0), one AdamW step, one learning-rate schedule step.
        Returns the pre-clip norm."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.lr_schedule.step()
        return float(norm)

    def padded(self, rows: list[torch.Tensor], width: int) -> torch.Tensor:
        """Stack 1-D tensors right-padded with 0 to ``width`` (old log-probs aligned with a mask)."""
        return torch.stack([F.pad(r, (0, width - r.numel())) for r in rows]).to(self.device)
