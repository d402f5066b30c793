"""The local backend: every method of DESIGN.md on CPU or one GPU, in one process (pair=tiny).

One training step (Alg. 1): both models sample n responses on the same prompt batch, rewards and
GRPO advantages; the method's exchange (``graft_exp.exchange``, i.e. ``graft_exp.algorithms``) with
receiver-side scoring of re-tokenized peer responses under the receiver's old policy; each receiver
then takes one AdamW step per minibatch (peer-last by default). Single-model methods train each model
alone; ``graft_stored`` replays the peer's logged GRPO n=8 trajectories instead of a live peer.
Validation every K steps on the benchmark average selects the best checkpoint, which is evaluated
R x k times at the end. Everything lands in MLflow (DESIGN.md schema); checkpoints make a requeued
job continue where it stopped, and a replayed step logs nothing twice.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from graft_exp import tracking
from graft_exp.algorithms import (
    POLICY_LOSSES,
    dynamic_sampling_batch_full,
    dynamic_sampling_group_mask,
    grpo_advantages,
    hacpo_capability,
    hacpo_capability_ratio,
    hacpo_kl_loss,
    hacpo_policy_loss,
    hacpo_positive_rate,
    sgt_nll_loss,
)
from graft_exp.backends.local_policy import LocalPolicy
from graft_exp.evaluation import AVG, BestCheckpoint, evaluate, final_evaluation, is_validation_step
from graft_exp.exchange import (
    PEER,
    ReceiverBatch,
    Rollouts,
    assemble,
    peer_solved_frac,
    plan_step,
    rollout_metrics,
    select_prompts,
)
from graft_exp.reward import rewards as verify_rewards
from graft_exp.tiny import models as tiny
from graft_exp.tiny.task import SKILLS, Problem, train_split
from graft_exp.tracking import TrackedRun
from graft_exp.trajectories import read_log, step_rollouts, write_prompt_success, write_step

log = logging.getLogger("graft_exp.local")
ROLES = ("A", "B")
#: DAPO's cap on extra prompt batches drawn to fill one dynamic-sampling batch.
MAX_GEN_BATCHES = 10


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read; the message names the file and the way out."""


class StoredLogMissing(RuntimeError):
    """graft_stored cannot find the peer's finished GRPO n=8 trajectory log."""


def derive_seed(*parts) -> int:
    """A 31-bit seed from the run seed and a purpose (step, role, ...): reproducible and independent
    of everything that happened before, so a resumed job draws exactly what an uninterrupted one does."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


class PromptStream:
    """The training prompts in a seeded order: a fresh permutation each epoch, batches consecutive.
    The order depends only on the seed, so every method with the same seed sees the same batches
    (what ``graft_stored`` replay relies on)."""

    def __init__(self, problems: list[Problem], seed: int, cursor: int = 0):
        self.problems, self.seed, self.cursor = problems, seed, cursor

    def next(self, size: int) -> list[Problem]:
        out = []
        for _ in range(size):
            epoch, index = divmod(self.cursor, len(self.problems))
            order = list(range(len(self.problems)))
            random.Random(derive_seed(self.seed, "epoch", epoch)).shuffle(order)
            out.append(self.problems[order[index]])
            self.cursor += 1
        return out


@dataclass
class Member:
    """One model of the job: its policy, MLflow run (None if that run is already FINISHED) and state."""

    role: str
    key: str
    policy: LocalPolicy
    run: TrackedRun | None
    best: BestCheckpoint = field(default_factory=BestCheckpoint)
    best_state: dict | None = None
    seconds: float = 0.0
    positive_rates: list[float] = field(default_factory=list)
    reference: torch.nn.Module | None = None
    stored_peer: object = None          # graft_stored: the peer's logged trajectories (DataFrame)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log_metrics({k: v for k, v in metrics.items() if not math.isnan(v)}, step)


@dataclass
class StepData:
    """One model's rollouts at a step, with the token-level data the update needs."""

    rollouts: Rollouts
    problems: list[Problem]
    token_ids: list[list[list[int]]]          # [P][n] generated ids
    token_log_probs: list[list[torch.Tensor]]  # [P][n] generation log-probs (the old policy)


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


class LocalTrainer:
    """Runs one job (pair x method x seed) of the local backend."""

    def __init__(self, cfg: DictConfig, job: TrackedRun):
        self.cfg, self.job, self.method, self.train_cfg = cfg, job, cfg.method, cfg.train
        if cfg.pair.data != "tiny_arith":
            raise ValueError(f"backend=local runs the generated tiny task (pair=tiny); pair={cfg.pair.name} "
                             f"uses data {cfg.pair.data!r}: use backend=verl")
        torch.manual_seed(cfg.seed)
        if cfg.backend.get("threads"):
            torch.set_num_threads(int(cfg.backend.threads))
        self.device = resolve_device(cfg.backend.device)
        self.progress = bool(cfg.backend.progress)
        self.problems = train_split(SKILLS, tiny.EVAL_SIZE, int(cfg.pair.train_size))
        size = cfg.eval.get("max_problems") or tiny.EVAL_SIZE
        self.benchmarks = {k: v[:size] for k, v in tiny.benchmarks(list(cfg.pair.benchmarks)).items()}
        batch = int(self.train_cfg.batch_prompts)
        self.total_steps = int(self.train_cfg.max_steps or self.train_cfg.total_epochs * len(self.problems) // batch)
        self.root = Path(cfg.checkpoint_root) / tracking.run_key(cfg)
        self._hacpo_clipfracs: dict[str, float] = {}
        # The stored peer logs are looked up before any run is opened: a missing one fails cleanly.
        self.stored = {}
        if self.method.source == "stored":
            for role in ROLES:
                peer = cfg.pair["B" if role == "A" else "A"]
                self.stored[role] = find_stored_log(cfg, job.client, peer, self.root / "stored" / peer)
        self.members = self._open_members()
        self.job_seconds = 0.0
        self.streams = self._streams()
        self.start_step = 1

    # ------------------------------------------------------------------ setup
    def _open_members(self) -> dict[str, Member]:
        members = {}
        runs = {role: tracking.open_model_run(self.cfg, self.job, role) for role in ROLES}
        # A co-trained pair needs both models even if one run was already closed (a job stopped
        # between its two final evaluations); a single-model baseline someone finished is skipped.
        needed = [r for r in ROLES if runs[r] is not None or (self.method.co_train and any(runs.values()))]
        for role in needed:
            key = self.cfg.pair[role]
            model, tokenizer = load_member_model(key, self.progress)
            policy = LocalPolicy(key, model, tokenizer, self.device, self.train_cfg,
                                 int(self.train_cfg.max_response_length))
            member = Member(role, key, policy, runs[role])
            if self.method.peer_loss == "hacpo":
                member.reference = copy.deepcopy(policy.model).eval().requires_grad_(False)
            members[role] = member
            if member.run is not None:
                member.run.log_params(tracking.flatten(OmegaConf.to_container(self.cfg, resolve=True)))
            member.stored_peer = self.stored.get(role)
        return members

    def _streams(self) -> dict[str, PromptStream]:
        if self.method.dynamic_sampling:   # each model draws as many batches as it needs
            return {role: PromptStream(self.problems, self.cfg.seed) for role in self.members}
        return {"shared": PromptStream(self.problems, self.cfg.seed)}

    # ------------------------------------------------------------------ checkpoints
    def checkpoints(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("ckpt-*") if p.is_dir() and not p.name.endswith(".tmp")]
        return sorted(found, key=lambda p: int(p.name.split("-")[1]))

    def save_checkpoint(self, step: int) -> None:
        """Model + optimiser + best weights + data cursor + step, written to a temp dir then renamed."""
        state = {
            "step": step, "job_seconds": self.job_seconds,
            "cursors": {name: s.cursor for name, s in self.streams.items()},
            "members": {
                role: {"model": m.policy.model.state_dict(), "optimizer": m.policy.optimizer.state_dict(),
                       "best_step": m.best.step, "best_score": m.best.score, "best_state": m.best_state,
                       "seconds": m.seconds, "positive_rates": m.positive_rates}
                for role, m in self.members.items()
            },
        }
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"ckpt-{step}-", suffix=".tmp", dir=self.root))
        torch.save(state, tmp / "state.pt")
        final = self.root / f"ckpt-{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.checkpoints():
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self) -> None:
        """Continue from the newest checkpoint of this run key, if any."""
        found = self.checkpoints()
        if not found:
            return
        path = found[-1] / "state.pt"
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
            for role, m in self.members.items():
                saved = state["members"][role]
                m.policy.model.load_state_dict(saved["model"])
                m.policy.optimizer.load_state_dict(saved["optimizer"])
                m.best = BestCheckpoint(saved["best_step"], saved["best_score"])
                m.best_state, m.seconds = saved["best_state"], saved["seconds"]
                m.positive_rates = list(saved["positive_rates"])
        except Exception as err:  # torch raises many kinds for a truncated or foreign file
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded ({type(err).__name__}: {err}). Delete {found[-1]} to "
                "resume from scratch, or launch again with rerun=true for a fresh run") from err
        for name, cursor in state["cursors"].items():
            self.streams[name].cursor = cursor
        self.job_seconds = state["job_seconds"]
        self.start_step = state["step"] + 1
        log.info("resumed from %s (step %d)", found[-1], state["step"])

    # ------------------------------------------------------------------ rollouts
    def rollout(self, member: Member, problems: list[Problem], step: int, attempt: int = 0) -> StepData:
        """n samples per prompt at the training temperature, rewards, GRPO advantages."""
        n, policy = int(self.method.n), member.policy
        prompt_ids = [policy.encode_prompt(tiny.model_input(p.prompt)) for p in problems]
        samples = policy.sample(prompt_ids, n, float(self.train_cfg.temperature), float(self.train_cfg.top_p),
                                int(self.train_cfg.max_response_length),
                                derive_seed(self.cfg.seed, step, member.role, "rollout", attempt))
        golds = [p.answer for p in problems for _ in range(n)]
        rewards = torch.tensor(verify_rewards(samples.texts, golds)).view(len(problems), n)
        grid = lambda flat: [flat[q * n:(q + 1) * n] for q in range(len(problems))]
        rollouts = Rollouts(
            model=member.key, prompt_ids=[p.uid for p in problems], responses=grid(samples.texts),
            rewards=rewards, advantages=grpo_advantages(rewards, float(self.method.adv_eps)),
            logp_sum=torch.tensor([float(lp.sum()) for lp in samples.log_probs], dtype=torch.float64).view(-1, n),
            num_tokens=torch.tensor([len(t) for t in samples.token_ids]).view(-1, n),
            finished=torch.tensor(samples.finished).view(-1, n),
        )
        return StepData(rollouts, problems, grid(samples.token_ids), grid(samples.log_probs))

    def dynamic_sampling_rollout(self, member: Member, step: int) -> StepData:
        """DAPO dynamic sampling: keep groups with 0 < k < n, draw more batches until the batch is full
        (at most MAX_GEN_BATCHES draws; then train on what was kept)."""
        size, kept = int(self.train_cfg.batch_prompts), []
        for attempt in range(MAX_GEN_BATCHES):
            data = self.rollout(member, self.streams[member.role].next(size), step, attempt)
            keep = dynamic_sampling_group_mask(data.rollouts.rewards)
            kept += [(data, q) for q in torch.nonzero(keep).flatten().tolist()]
            if dynamic_sampling_batch_full(len(kept), size):
                break
        kept = kept[:size] or [(data, q) for q in range(size)]   # nothing informative: train on the last draw
        return subset_step(kept)

    # ------------------------------------------------------------------ exchange
    def scorer(self, receiver: Member, problems: list[Problem], cache: dict):
        """Receiver-old log-probs of re-tokenized source responses (eq. 8's first term); the per-token
        values are kept in ``cache`` for the update that follows."""
        def score(prompts: list[int], source: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
            policy = receiver.policy
            items = [(q, i) for q in prompts for i in range(source.n)]
            prompt_ids = [policy.encode_prompt(tiny.model_input(problems[q].prompt)) for q, _ in items]
            response_ids = [policy.encode_response(source.responses[q][i], bool(source.finished[q, i]))
                            for q, i in items]
            token_lp = policy.score(prompt_ids, response_ids)
            for item, ids, lp in zip(items, response_ids, token_lp):
                cache[item] = (ids, lp)
            sums = torch.tensor([float(lp.sum()) for lp in token_lp], dtype=torch.float64).view(len(prompts), -1)
            counts = torch.tensor([lp.numel() for lp in token_lp]).view(len(prompts), -1)
            return sums, counts
        return score

    def capability_ratios(self, data: dict[str, StepData]) -> tuple[float, float]:
        """HACPO: (capability ratio B->A, A->B) from each model's recent positive rates."""
        for role, member in self.members.items():
            member.positive_rates.append(float(hacpo_positive_rate(data[role].rollouts.rewards)))
        cap = {role: hacpo_capability(m.positive_rates) for role, m in self.members.items()}
        return hacpo_capability_ratio(cap["B"], cap["A"]), hacpo_capability_ratio(cap["A"], cap["B"])

    # ------------------------------------------------------------------ update
    def update(self, member: Member, batch: ReceiverBatch, own: StepData, peer: Rollouts | None,
               peer_cache: dict, step: int, capability_ratio: float = 1.0) -> dict[str, float]:
        """One epoch over the receiver's batch, one AdamW step per minibatch, in the method's order."""
        method, policy = self.method, member.policy
        hacpo = method.peer_loss == "hacpo"
        groups_per_minibatch = int(method.hacpo.minibatch_prompts if hacpo else self.train_cfg.minibatch_prompts)
        order = batch.minibatches(method, groups_per_minibatch, generator(self.cfg.seed, step, member.role, "order"))
        policy.model.train()
        totals = {"tokens_self": 0.0, "tokens_peer": 0.0, "clipped_tokens_self": 0.0, "clipped_tokens_peer": 0.0}
        losses = []
        for index, groups in enumerate(order):
            rows, nll = batch.rows_in(groups), batch.nll_in(groups)
            if not rows and not nll:
                continue
            prompt_ids = [policy.encode_prompt(tiny.model_input(own.problems[r.prompt].prompt)) for r in rows]
            response_ids, old = [], []
            for r in rows:
                ids, lp = (peer_cache[(r.prompt, r.sample)] if r.origin == PEER else
                           (own.token_ids[r.prompt][r.sample], own.token_log_probs[r.prompt][r.sample]))
                response_ids.append(ids)
                old.append(lp)
            log_prob, mask = policy.token_log_probs(prompt_ids, response_ids)
            is_peer = torch.tensor([r.origin == PEER for r in rows], device=self.device)
            advantages = torch.tensor([r.advantage for r in rows], device=self.device)
            weights = torch.tensor([r.weight for r in rows], device=self.device)
            if hacpo:
                loss, metrics = self.hacpo_loss(member, rows, own, peer, prompt_ids, response_ids, log_prob, mask,
                                                is_peer, advantages, capability_ratio, index)
            else:
                old_log_prob = policy.padded(old, log_prob.shape[1])
                kwargs = {"gamma": float(method.luffy_gamma)} if method.peer_loss == "luffy" else {}
                loss_fn = POLICY_LOSSES["luffy" if method.peer_loss == "luffy" else
                                        "sequence_ratio" if method.ratio == "sequence" else "graft"]
                loss, metrics = loss_fn(log_prob, old_log_prob, advantages, weights, mask, float(method.clip_low),
                                        float(method.clip_high), is_peer=is_peer, **kwargs)
                for key in totals:
                    totals[key] += float(metrics[key])
            if nll:
                nll_prompts = [policy.encode_prompt(tiny.model_input(own.problems[q].prompt)) for q, _ in nll]
                nll_ids = [policy.encode_response(peer.responses[q][i], bool(peer.finished[q, i])) for q, i in nll]
                nll_lp, nll_mask = policy.token_log_probs(nll_prompts, nll_ids)
                aux, _ = sgt_nll_loss(nll_lp, nll_mask, float(method.sgt_lambda))
                loss = loss + aux
            policy.apply_gradients(loss)
            losses.append(float(loss.detach()))
        out = {"train/loss": sum(losses) / len(losses) if losses else float("nan")}
        if not hacpo:
            out["train/clipfrac_self"] = totals["clipped_tokens_self"] / max(totals["tokens_self"], 1.0)
            if totals["tokens_peer"] > 0:
                out["train/clipfrac_peer"] = totals["clipped_tokens_peer"] / totals["tokens_peer"]
        else:
            out.update(self._hacpo_clipfracs)
        return out

    def hacpo_loss(self, member, rows, own: StepData, peer: Rollouts, prompt_ids, response_ids, log_prob, mask,
                   is_peer, advantages, capability_ratio, index):
        """HACPO's sequence-level loss with its cross-model clamp and k3 KL to the initial policy."""
        h = self.method.hacpo
        source_mean = torch.tensor([
            float((peer if r.origin == PEER else own.rollouts).logp_sum[r.prompt, r.sample]
                  / (peer if r.origin == PEER else own.rollouts).num_tokens[r.prompt, r.sample]) for r in rows
        ], device=self.device)
        loss, metrics = hacpo_policy_loss(
            log_prob, mask, source_mean.to(log_prob.dtype), advantages, is_peer, capability_ratio, index,
            self_clip_low=float(h.self_clip_low), self_clip_high=float(h.self_clip_high),
            cross_clip_delta=1.0 - float(h.peer_clip_init), cross_clip_step=float(h.peer_clip_step))
        with torch.no_grad():
            ref_log_prob, _ = member.policy.token_log_probs(prompt_ids, response_ids, model=member.reference)
        kl, _ = hacpo_kl_loss(log_prob, ref_log_prob, mask, is_peer, float(h.kl_coef))
        self._hacpo_clipfracs = {"train/clipfrac_self": float(metrics["clipfrac_self"]),
                                 "train/clipfrac_peer": float(metrics["clipfrac_peer"])}
        return loss + kl, metrics

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, dict[str, float]]:
        """Sample, exchange, update; returns each role's metrics (and the job's under "job")."""
        method, members = self.method, self.members
        timings = {role: 0.0 for role in members}
        data: dict[str, StepData] = {}
        shared = None if method.dynamic_sampling else self.streams["shared"].next(int(self.train_cfg.batch_prompts))
        for role, member in members.items():
            start = time.perf_counter()
            data[role] = self.dynamic_sampling_rollout(member, step) if method.dynamic_sampling else \
                self.rollout(member, shared, step)
            timings[role] += time.perf_counter() - start

        gen = generator(self.cfg.seed, step, "exchange")
        caches = {role: {} for role in members}
        batches: dict[str, ReceiverBatch] = {}
        sources: dict[str, Rollouts | None] = {role: None for role in members}
        job_metrics: dict[str, float] = {}
        ratios = {"A": 1.0, "B": 1.0}
        if method.co_train and method.source == "online":
            a, b = data["A"].rollouts, data["B"].rollouts
            if method.peer_loss == "hacpo":
                ratios["A"], ratios["B"] = self.capability_ratios(data)
            scorers = (self.scorer(members["A"], data["A"].problems, caches["A"]),
                       self.scorer(members["B"], data["B"].problems, caches["B"]))
            start = time.perf_counter()
            batches["A"], batches["B"], (a_to_b, b_to_a) = plan_step(method, a, b, scorers, gen,
                                                                    (ratios["A"], ratios["B"]))
            exchange_time = time.perf_counter() - start
            for role in members:
                timings[role] += exchange_time / len(members)
            sources = {"A": b, "B": a}
            job_metrics = {"exchange/A_to_B": float(a_to_b.sum()), "exchange/B_to_A": float(b_to_a.sum())}
        elif method.source == "stored":
            for role, member in members.items():
                start = time.perf_counter()
                source = replayed_rollouts(member.stored_peer, step, data[role], self.cfg.pair["B" if role == "A" else "A"])
                own = data[role].rollouts
                to_receiver, _ = select_prompts(method, source.k, own.k, own.n, gen)  # (source->own, own->source)
                batches[role] = assemble(method, own, source, to_receiver,
                                         self.scorer(member, data[role].problems, caches[role]), gen)
                sources[role] = source
                timings[role] += time.perf_counter() - start
        else:
            for role in members:
                own = data[role].rollouts
                nothing = torch.zeros(own.rewards.shape[0], dtype=torch.bool)
                batches[role] = assemble(method, own, own, nothing, None, gen)

        metrics: dict[str, dict[str, float]] = {}
        for role, member in members.items():
            start = time.perf_counter()
            update_metrics = self.update(member, batches[role], data[role], sources[role], caches[role], step,
                                         ratios[role])
            timings[role] += time.perf_counter() - start
            own = data[role].rollouts
            m = {f"train/{k}": v for k, v in rollout_metrics(own).items()}
            m.update(update_metrics)
            if method.co_train:
                m.update({f"train/{k}": v for k, v in batches[role].metrics.items()})
            peer = sources[role] if sources[role] is not None else \
                next((data[r].rollouts for r in members if r != role and not method.dynamic_sampling), None)
            if peer is not None:
                m["train/peer_solved_frac"] = peer_solved_frac(own, peer)
            metrics[role] = m
        for role, member in members.items():
            write_step(self.root / "trajectories" / role, step, data[role].rollouts, data[role].token_ids)
        step_seconds = sum(timings.values())
        self.job_seconds += step_seconds
        for role, member in members.items():
            member.seconds += timings[role]
            metrics[role]["cost/gpu_hours"] = self.device_hours(member.seconds)
        job_metrics["cost/gpu_hours"] = self.device_hours(self.job_seconds)
        metrics["job"] = job_metrics
        return metrics

    def device_hours(self, seconds: float) -> float:
        """Device-hours: wall seconds of training steps x the job's accounted GPUs (DESIGN.md)."""
        return seconds * tracking.accounted_gpus(self.cfg) / 3600.0

    # ------------------------------------------------------------------ evaluation
    def generate_fn(self, member: Member):
        policy = member.policy

        def generate(prompts: list[str], k: int, temperature: float, top_p: float, seed: int) -> list[list[str]]:
            ids = [policy.encode_prompt(tiny.model_input(p)) for p in prompts]
            samples = policy.sample(ids, k, temperature, top_p, int(self.train_cfg.max_response_length), seed)
            return [samples.texts[i * k:(i + 1) * k] for i in range(len(prompts))]
        return generate

    def validate(self, member: Member, step: int) -> None:
        ev = self.cfg.eval
        scores = evaluate(self.generate_fn(member), self.benchmarks, int(ev.get("val_samples", 1)),
                          float(ev.temperature), float(ev.top_p), derive_seed(self.cfg.seed, step, "val"))
        member.log({f"val/{k}": v for k, v in scores.items()}, step)
        if member.best.update(step, scores[AVG]):
            member.best_state = {k: v.detach().clone() for k, v in member.policy.model.state_dict().items()}

    def finish_member(self, member: Member) -> dict[str, float]:
        """Final evaluation of the best checkpoint (R runs x k samples), artifacts, FINISHED."""
        ev = self.cfg.eval
        member.policy.model.load_state_dict(member.best_state)
        results = final_evaluation(self.generate_fn(member), self.benchmarks, int(ev.runs), int(ev.samples),
                                   float(ev.temperature), float(ev.top_p), derive_seed(self.cfg.seed, "test"))
        for r, scores in enumerate(results):
            member.log({f"test/{k}": v for k, v in scores.items()}, r)
        run = member.run
        if run is not None:
            run.set_tags({"graft.best_step": member.best.step})
            traj = self.root / "trajectories" / member.role
            write_prompt_success(read_log(traj), self.root / f"prompt_success_{member.role}.parquet")
            staged = self.root / f"artifacts_{member.role}"
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir()
            shutil.copy(self.root / f"prompt_success_{member.role}.parquet", staged / "prompt_success.parquet")
            run.log_artifact(staged / "prompt_success.parquet")
            run.client.log_artifacts(run.run_id, str(traj), "trajectories")
            run.finish("FINISHED")
        return {k: sum(r[k] for r in results) / len(results) for k in results[0]}

    # ------------------------------------------------------------------ main loop
    def run(self, stop_at_step: int | None = None) -> dict[str, dict[str, float]]:
        """Train to ``total_steps`` (validating, checkpointing), evaluate, close the model runs.

        ``stop_at_step`` leaves the job unfinished right after checkpointing that step, as a preempted
        job would (resumption tests). Returns each role's mean final test scores."""
        if not self.members:
            log.info("every model run of this job is FINISHED already; nothing to train")
            return {}
        if self.job.resumed:
            self.load_checkpoint()
        else:   # a fresh run never inherits another run's state
            for stale in [*self.checkpoints(), self.root / "trajectories"]:
                shutil.rmtree(stale, ignore_errors=True)
        self.log_config()
        every = int(self.cfg.eval.val_every)
        checkpoint_every = int(self.cfg.backend.checkpoint_every)
        if self.start_step == 1:
            for member in self.members.values():
                self.validate(member, 0)
        with progress_bar(self.progress, self.total_steps, self.start_step - 1, list(self.members)) as bar:
            for step in range(self.start_step, self.total_steps + 1):
                metrics = self.step(step)
                self.job.log_metrics(metrics.pop("job"), step)
                for role, member in self.members.items():
                    member.log(metrics[role], step)
                    if is_validation_step(step, every, self.total_steps):
                        self.validate(member, step)
                bar.advance({role: m["train/reward_mean"] for role, m in metrics.items()})
                if step % checkpoint_every == 0 or step == self.total_steps or step == stop_at_step:
                    self.save_checkpoint(step)
                if step == stop_at_step:
                    return {}
        return {role: self.finish_member(m) for role, m in self.members.items()}

    def log_config(self) -> None:
        path = self.root / "config.yaml"
        self.root.mkdir(parents=True, exist_ok=True)
        path.write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
        self.job.log_artifact(path)


def subset_step(kept: list[tuple[StepData, int]]) -> StepData:
    """Concatenate chosen groups (data, prompt index) of several rollout draws into one StepData."""
    first = kept[0][0].rollouts
    pick = lambda d, q, attr: getattr(d.rollouts, attr)[q]
    stack = lambda attr: torch.stack([pick(d, q, attr) for d, q in kept])
    rollouts = Rollouts(
        model=first.model, prompt_ids=[d.rollouts.prompt_ids[q] for d, q in kept],
        responses=[d.rollouts.responses[q] for d, q in kept], rewards=stack("rewards"),
        advantages=stack("advantages"), logp_sum=stack("logp_sum"), num_tokens=stack("num_tokens"),
        finished=stack("finished"),
    )
    return StepData(rollouts, [d.problems[q] for d, q in kept], [d.token_ids[q] for d, q in kept],
                    [d.token_log_probs[q] for d, q in kept])


def find_stored_log(cfg: DictConfig, client, peer: str, download_to: Path):
    """The trajectory log of the peer's FINISHED GRPO n=8 run with this seed (graft_stored's source)."""
    experiments = [e.experiment_id for e in client.search_experiments(filter_string="name LIKE 'graft/%'")]
    query = (f"tags.`graft.method` = 'grpo_n8' and tags.`graft.model` = '{peer}' and "
             f"tags.`graft.seed` = '{cfg.seed}' and attributes.status = 'FINISHED'")
    runs = client.search_runs(experiments, query, max_results=1, order_by=["attributes.start_time DESC"]) \
        if experiments else []
    if not runs:
        raise StoredLogMissing(
            f"graft_stored replays the trajectory log of {peer}'s finished GRPO n=8 run with seed {cfg.seed}, "
            f"and there is none in {cfg.tracking.uri}: launch `python -m graft_exp pair={cfg.pair.name} "
            f"method=grpo_n8 seed={cfg.seed}` first")
    shutil.rmtree(download_to, ignore_errors=True)
    download_to.mkdir(parents=True)
    local = client.download_artifacts(runs[0].info.run_id, "trajectories", str(download_to))
    return read_log(Path(local))


def replayed_rollouts(stored, step: int, own: StepData, peer: str) -> Rollouts:
    """The peer's logged rollouts of this step, rewards re-verified (App. B "Saved peer logs")."""
    source = step_rollouts(stored, step, peer)
    if source.prompt_ids != own.rollouts.prompt_ids:
        raise ValueError(f"step {step}: the stored log of {peer} has different prompts than this run "
                         "(different data order or batch size); replay needs the same seed and train settings")
    golds = [p.answer for p in own.problems for _ in range(source.n)]
    flat = [r for group in source.responses for r in group]
    source.rewards = torch.tensor(verify_rewards(flat, golds)).view(-1, source.n)
    source.advantages = grpo_advantages(source.rewards)
    return source


class progress_bar:
    """Rich console progress: step, each model's reward, ETA (disabled with backend.progress=false)."""

    def __init__(self, enabled: bool, total: int, done: int, roles: list[str]):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        fields = " ".join(f"{r} {{task.fields[{r}]:.2f}}" for r in roles)
        self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("reward " + fields),
                            TextColumn("ETA"), TimeRemainingColumn(), disable=not enabled)
        self.task = self.bar.add_task("train", total=total, completed=done, **{r: float("nan") for r in roles})

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def advance(self, rewards: dict[str, float]) -> None:
        self.bar.update(self.task, advance=1, **rewards)


def train(cfg: DictConfig, job: TrackedRun, *, stop_at_step: int | None = None) -> dict[str, dict[str, float]]:
    """Backend entry point (graft_exp.backends): train, evaluate and record one job."""
    trainer = LocalTrainer(cfg, job)
    try:
        return trainer.run(stop_at_step=stop_at_step)
    except (Exception, KeyboardInterrupt) as err:
        # A preemption (SystemExit from submitit's signal handler) is not caught: those runs stay
        # RUNNING, and the requeued job resumes them.
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        for member in trainer.members.values():
            if member.run is not None and member.run.status == "RUNNING":
                member.run.finish(status)
        raise
