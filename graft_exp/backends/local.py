"""The local backend: the tiny pair on CPU or one GPU, in one process (pair=tiny).

An adapter for ``graft_exp.driver``: it samples with per-token log-probs, scores re-tokenized peer
responses under the receiver's old policy, and updates a receiver over the driver's minibatches with
``graft_exp.methods.objective.receiver_loss``; the loop, the exchange and the records are the driver's.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from graft_exp.backends.local_policy import LocalPolicy
from graft_exp.contract import Generation, Sampled
from graft_exp.costs import accounted_gpus, dense_peak, phase
from graft_exp.methods import Method
from graft_exp.methods.objective import COUNT_METRICS, NllRows, receiver_loss, row_column_values
from graft_exp.methods.receiver import PEER, ReceiverBatch, Scorer
from graft_exp.rollouts import Rollouts
from graft_exp.scheduler import job_cores
from graft_exp.tiny import models as tiny
from graft_exp.tiny.task import SKILLS, Problem, train_split

log = logging.getLogger("graft_exp")


@dataclass
class TokenData:
    """One model's rollouts at token level: generated ids and their behaviour log-probs, [P][n]."""

    token_ids: list[list[list[int]]]
    log_probs: list[list[torch.Tensor]]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_member_model(key: str, progress: bool):
    """The warm-started tiny model ``key`` (built once, cached by recipe hash)."""
    if key not in tiny.RECIPES:
        raise ValueError(f"backend=local trains the tiny models ({', '.join(tiny.RECIPES)}); {key!r} is not one. "
                         "Use backend=verl for the paper's models")
    return tiny.load(key, progress=progress)


class LocalBackend:
    """The models of one job as ``LocalPolicy`` objects on one device (``contract.Backend``)."""

    def __init__(self, cfg: DictConfig, method: Method, roles: list[str], run_dir: Path | None = None):
        # run_dir (the contract's) is unused: the local backend keeps its best weights in memory and in
        # the driver's checkpoints.
        if cfg.pair.data != "tiny_arith":
            raise ValueError(f"backend=local runs the generated tiny task (pair=tiny); pair={cfg.pair.name} "
                             f"uses data {cfg.pair.data!r}: use backend=verl")
        torch.manual_seed(cfg.seed)
        if cfg.backend.threads:
            torch.set_num_threads(int(cfg.backend.threads))
        self.cfg, self.method, self.roles, self.train = cfg, method, roles, cfg.train
        self.device = resolve_device(cfg.backend.device)
        # On CPU each model's work runs on a core of its own when the job has cores to spare, and each model
        # is then charged as one device: torch's kernels release the GIL, and with one intra-op thread each
        # the threads never spin against each other (so only with backend.threads=1). One GPU is one device:
        # its models take turns; so do the models of a job that shares the machine's cores with others (a
        # cluster=local multirun, scheduler.job_cores).
        self.concurrent = (bool(cfg.backend.concurrent) and self.device.type == "cpu" and len(roles) > 1
                           and cfg.backend.threads == 1 and job_cores() > 1)
        log.info("backend=local on %s: %s", self.device,
                 "the models run at the same time, a core each" if self.concurrent else "the models take turns")
        self.gpus = accounted_gpus(cfg)
        size = cfg.eval.max_problems or tiny.EVAL_SIZE
        self._benchmarks = {k: v[:size] for k, v in tiny.benchmarks(list(cfg.pair.benchmarks)).items()}
        self._problems = train_split(SKILLS, tiny.EVAL_SIZE, int(cfg.pair.train_size))
        self.policies: dict[str, LocalPolicy] = {}
        self.references: dict[str, torch.nn.Module] = {}
        for role in roles:
            model, tokenizer = load_member_model(cfg.pair[role], bool(cfg.backend.progress))
            self.policies[role] = LocalPolicy(cfg.pair[role], model, tokenizer, self.device, cfg.train,
                                              int(cfg.train.max_response_length), str(cfg.backend.sampler))
            if method.loss.needs_reference_model:   # its KL anchor: the initial policy
                self.references[role] = copy.deepcopy(self.policies[role].model).eval().requires_grad_(False)
        self.best: dict[str, dict] = {}
        self.peer_cache: dict[str, dict] = {role: {} for role in roles}

    def problems(self) -> list[Problem]:
        return self._problems

    def benchmarks(self) -> dict[str, list[Problem]]:
        return self._benchmarks

    def devices(self, role: str) -> int:
        return self.gpus

    def peak_flops(self, role: str) -> float | None:
        return dense_peak(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None

    def model_config(self, role: str):
        return self.policies[role].model.config

    def prompting(self, role: str) -> dict[str, str]:
        return {"stop_ids": str(self.policies[role].eos), "rendered_prompt": tiny.model_input(self._problems[0].prompt)}

    def prompt_ids(self, role: str, problems: list[Problem]) -> list[list[int]]:
        return [self.policies[role].encode_prompt(tiny.model_input(p.prompt)) for p in problems]

    # ------------------------------------------------------------------ rollouts and scoring
    def sample(self, role: str, problems: list[Problem], n: int, seed: int, step: int) -> Generation:
        prompts = self.prompt_ids(role, problems)
        samples = self.policies[role].sample(prompts, n, float(self.train.temperature),
                                             float(self.train.top_p), int(self.train.max_response_length), seed)
        grid = lambda flat: [flat[q * n:(q + 1) * n] for q in range(len(problems))]
        return Generation(
            responses=grid(samples.texts),
            logp_sum=torch.tensor([float(lp.sum()) for lp in samples.log_probs], dtype=torch.float64).view(-1, n),
            num_tokens=torch.tensor([len(t) for t in samples.token_ids]).view(-1, n),
            finished=torch.tensor(samples.finished).view(-1, n), token_ids=grid(samples.token_ids),
            data=TokenData(grid(samples.token_ids), grid(samples.log_probs)), prompt_tokens=[len(p) for p in prompts])

    def gather(self, role: str, parts: list[tuple[TokenData, list[int]]]) -> TokenData:
        return TokenData([d.token_ids[q] for d, groups in parts for q in groups],
                         [d.log_probs[q] for d, groups in parts for q in groups])

    def scorer(self, role: str, own: Sampled) -> Scorer:
        """Receiver-old log-probs of re-tokenized source responses (eq. 8's first term); the per-token
        values are kept for the update that follows."""
        policy, cache = self.policies[role], {}
        self.peer_cache[role] = cache

        def score(prompts: list[int], source: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
            items = [(q, i) for q in prompts for i in range(source.n)]
            prompt_ids = self.prompt_ids(role, [own.problems[q] for q, _ in items])
            response_ids = [policy.encode_response(source.responses[q][i], bool(source.finished[q, i]))
                            for q, i in items]
            token_lp = policy.score(prompt_ids, response_ids)
            for item, ids, lp in zip(items, response_ids, token_lp):
                cache[item] = (ids, lp)
            sums = torch.tensor([float(lp.sum()) for lp in token_lp], dtype=torch.float64).view(len(prompts), -1)
            counts = torch.tensor([lp.numel() for lp in token_lp]).view(len(prompts), -1)
            return sums, counts
        return score

    def copy_lengths(self, role: str, source: Rollouts, copies: list[tuple[int, int]]) -> list[int]:
        policy = self.policies[role]
        return [len(policy.copy_ids(source.responses[q][i], bool(source.finished[q, i]))) for q, i in copies]

    # ------------------------------------------------------------------ update
    def update(self, role: str, batch: ReceiverBatch, minibatches: list[list[int]], own: Sampled,
               source: Rollouts | None, capability_ratio: float) -> dict[str, float]:
        """One AdamW step per minibatch, in the driver's order, on ``receiver_loss``; ``train.ppo_epochs``
        passes over the minibatches, every pass against the sampling policy's log-probs (as verl)."""
        policy, cache, data, spec = self.policies[role], self.peer_cache[role], own.data, self.method.loss
        policy.model.train()
        totals, losses = dict.fromkeys(COUNT_METRICS, 0.0), []
        passes = [(index, groups) for _ in range(int(self.train.ppo_epochs)) for index, groups in enumerate(minibatches)]
        for index, groups in passes:
            rows, nll = batch.rows_in(groups), batch.nll_in(groups)
            if not rows and not nll:
                continue
            prompt_ids = self.prompt_ids(role, [own.problems[r.prompt] for r in rows])
            response_ids, old = [], []
            for r in rows:
                ids, lp = (cache[(r.prompt, r.sample)] if r.origin == PEER else
                           (data.token_ids[r.prompt][r.sample], data.log_probs[r.prompt][r.sample]))
                response_ids.append(ids)
                old.append(lp)
            log_prob, mask = policy.token_log_probs(prompt_ids, response_ids)
            columns = {"is_peer": torch.tensor([r.origin == PEER for r in rows], device=self.device),
                       "advantages": torch.tensor([r.advantage for r in rows], device=self.device),
                       "weights": torch.tensor([r.weight for r in rows], device=self.device)}
            needs = spec.columns
            if "old_log_prob" in needs:
                columns["old_log_prob"] = policy.padded(old, log_prob.shape[1])
            for name, values in row_column_values(spec, rows, own.rollouts, source, capability_ratio).items():
                columns[name] = values.to(device=self.device, dtype=log_prob.dtype)
            if "minibatch_index" in needs:
                columns["minibatch_index"] = index
            if spec.needs_reference_model:
                with torch.no_grad(), phase("logprob"):
                    columns["ref_log_prob"], _ = policy.token_log_probs(prompt_ids, response_ids,
                                                                        model=self.references[role])
            if nll:
                nll_prompts = self.prompt_ids(role, [own.problems[q] for q, _ in nll])
                nll_ids = [policy.encode_response(source.responses[q][i], bool(source.finished[q, i])) for q, i in nll]
                columns["nll_rows"] = NllRows(*policy.token_log_probs(nll_prompts, nll_ids))
            loss, raw = receiver_loss(spec, log_prob, mask, **columns)
            for key in COUNT_METRICS:
                totals[key] += float(raw.get(key, 0.0))
            policy.apply_gradients(loss)
            losses.append(float(loss.detach()))
        return {"loss": sum(losses) / len(losses) if losses else float("nan"), **totals}

    # ------------------------------------------------------------------ evaluation and state
    def generate(self, role: str, step: int):
        policy = self.policies[role]

        def generate(prompts: list[str], k: int, temperature: float, top_p: float, seed: int) -> list[list[str]]:
            ids = [policy.encode_prompt(tiny.model_input(p)) for p in prompts]
            samples = policy.sample(ids, k, temperature, top_p, int(self.train.max_response_length), seed)
            return [samples.texts[i * k:(i + 1) * k] for i in range(len(prompts))]
        return generate

    def keep_best(self, role: str, step: int) -> None:
        self.best[role] = {k: v.detach().clone() for k, v in self.policies[role].model.state_dict().items()}

    def restore_best(self, role: str) -> None:
        if role in self.best:   # no trained checkpoint was validated: the final weights stand
            self.policies[role].model.load_state_dict(self.best[role])

    def save(self, directory: Path, step: int) -> None:
        torch.save({role: {"model": p.model.state_dict(), "optimizer": p.optimizer.state_dict(),
                           "lr_schedule": p.lr_schedule.state_dict(), "best": self.best.get(role)}
                    for role, p in self.policies.items()}, directory / "state.pt")

    def load(self, directory: Path) -> None:
        state = torch.load(directory / "state.pt", map_location=self.device, weights_only=False)
        for role, policy in self.policies.items():
            policy.model.load_state_dict(state[role]["model"])
            policy.optimizer.load_state_dict(state[role]["optimizer"])
            policy.lr_schedule.load_state_dict(state[role]["lr_schedule"])
            if state[role]["best"] is not None:
                self.best[role] = state[role]["best"]

    def close(self) -> None:
        """Nothing to release: the models are tensors of this process."""
