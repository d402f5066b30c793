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
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

#: Sequences per generation call: much larger batches were measured 2-3x slower on CPU.
GENERATION_CHUNK = 256


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
                 train_cfg, max_response_tokens: int):
        self.key = key
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
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if finished or not ids:
            ids = ids + [self.eos]
        return ids[: self.max_response_tokens]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ----------------------------------------------------------------- sampling
    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
               max_new_tokens: int, seed: int) -> Samples:
        """n samples per prompt with a KV cache (``model.generate``), seeded; log-probs of the sampled
        tokens under softmax(logits / temperature) (exact for the behaviour policy when top_p = 1)."""
        self.model.eval()
        torch.manual_seed(seed)
        rows = [ids for ids in prompt_ids for _ in range(n)]
        config = GenerationConfig(
            do_sample=True, temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new_tokens,
            eos_token_id=self.eos, pad_token_id=self.pad, return_dict_in_generate=True, output_logits=True,
        )
        out = Samples([], [], [], [])
        for start in range(0, len(rows), GENERATION_CHUNK):
            chunk = rows[start:start + GENERATION_CHUNK]
            input_ids, attention_mask = self._left_pad(chunk)
            result = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
            generated = result.sequences[:, input_ids.shape[1]:]
            log_probs = torch.log_softmax(torch.stack(result.logits, dim=1).float() / temperature, dim=-1)
            token_lp = log_probs.gather(-1, generated.unsqueeze(-1)).squeeze(-1).cpu()
            generated = generated.cpu()
            for row in range(generated.shape[0]):
                ids = generated[row].tolist()
                length = ids.index(self.eos) + 1 if self.eos in ids else len(ids)
                out.token_ids.append(ids[:length])
                out.log_probs.append(token_lp[row, :length].clone())
                out.texts.append(self.decode(ids[:length]))
                out.finished.append(self.eos in ids)
        return out

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
        with this tokenizer (HACPO's frozen reference)."""
        prompts, prompt_mask = self._left_pad(prompt_ids)
        width = max(len(r) for r in response_ids)
        responses = torch.full((len(response_ids), width), self.pad, dtype=torch.long)
        response_mask = torch.zeros((len(response_ids), width), dtype=torch.long)
        for i, r in enumerate(response_ids):
            responses[i, :len(r)] = torch.tensor(r)
            response_mask[i, :len(r)] = 1
        responses, response_mask = responses.to(self.device), response_mask.to(self.device)
        input_ids = torch.cat([prompts, responses], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = (model or self.model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logits = logits[:, prompts.shape[1] - 1: -1].float() / self.temperature
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
        """Backward, clip the gradient norm (paper: 1.0), one AdamW step. Returns the pre-clip norm."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return float(norm)

    def padded(self, rows: list[torch.Tensor], width: int) -> torch.Tensor:
        """Stack 1-D tensors right-padded with 0 to ``width`` (old log-probs aligned with a mask)."""
        return torch.stack([F.pad(r, (0, width - r.numel())) for r in rows]).to(self.device)
