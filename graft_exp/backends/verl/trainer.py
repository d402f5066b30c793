"""The verl co-training driver: Alg. 1 step by step over two ``VerlModel`` stacks (runtime.py).

Per step: the same prompt batch to both models; rollouts; rewards (``graft_exp.reward`` on the decoded
strings); old log-probs; then the exchange of ``graft_exp.exchange``, the same code the local backend runs
(selection, compatibility weights, receiver rows, HACPO / SGT / pooled variants, minibatch order), with
each receiver's ``Scorer`` backed by one batched log-prob call of its worker group (``batch.PeerScorer``);
its ``ReceiverBatch`` laid out as verl rows and minibatches (batch.py); one optimizer step per minibatch
through the ``actor_loss`` set on the workers. Single-model methods use verl's vanilla GRPO loss and its
standard minibatching (DAPO's group filter for ``grpo_ds``). Trajectories are logged in the format of
``graft_exp.trajectories``; validation, best checkpoint and final evaluation follow
``graft_exp.evaluation``.

This orchestration has never run on a GPU (no GPU in this project's CI); its CPU-side pieces are tested.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from verl import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from graft_exp import reward, tracking
from graft_exp.algorithms import (
    dynamic_sampling_batch_full,
    dynamic_sampling_group_mask,
    grpo_advantages,
    hacpo_capability,
    hacpo_capability_ratio,
    hacpo_positive_rate,
    sequence_log_prob_sums,
)
from graft_exp.backends.verl import batch as vb
from graft_exp.backends.verl.config import minibatch_prompts, verl_config
from graft_exp.backends.verl.loss import LossSpec
from graft_exp.backends.verl.runtime import VerlModel, start_models
from graft_exp.evaluation import AVG, BestCheckpoint, evaluate, final_evaluation, is_validation_step
from graft_exp.exchange import (
    ReceiverBatch,
    Rollouts,
    assemble,
    peer_solved_frac,
    plan_step,
    rollout_metrics,
    select_prompts,
)
from graft_exp.trajectories import read_log, step_rollouts, write_prompt_success, write_step

log = logging.getLogger("graft_exp.verl")
ROLES = ("A", "B")
PEER_OF = {"A": "B", "B": "A"}
#: Most prompt batches DAPO dynamic sampling draws for one step before training on what it kept.
MAX_DYNAMIC_BATCHES = 20


def prompt_order(num_prompts: int, seed: int, epoch: int) -> torch.Tensor:
    """The training prompt order of one epoch: a permutation that depends only on (seed, epoch), so
    every model of a job, and a stored run replayed against it, sees the same prompts at each step."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_prompts, generator=generator)


@dataclass(frozen=True)
class BenchProblem:
    """One validation problem as ``graft_exp.evaluation`` takes it, and its row in verl's dataset."""

    prompt: str
    answer: str
    row: int


def val_benchmarks(dataset: RLHFDataset) -> dict[str, list[BenchProblem]]:
    """The validation set (prepare.py's benchmark Parquet files) per benchmark key (``data_source``): the
    problem's prompt text (its user message: the problem with the paper's suffix) and gold answer."""
    frame = dataset.dataframe
    benchmarks: dict[str, list[BenchProblem]] = {}
    for row, (messages, gold, source) in enumerate(zip(frame[dataset.prompt_key], frame["reward_model"],
                                                       frame["data_source"])):
        benchmarks.setdefault(str(source), []).append(BenchProblem(messages[-1]["content"], gold["ground_truth"], row))
    return benchmarks


@dataclass
class Sampled:
    """One model's rollouts of a step: verl's rows (prompt-major, ``n`` per prompt, with the old
    log-probs) and the same rollouts as the exchange and the trajectory log see them."""

    out: DataProto
    rollouts: Rollouts
    golds: list[str]          # per prompt


class Trainer:
    """Both models of one job, their MLflow model runs, checkpoints and the step loop."""

    def __init__(self, cfg: DictConfig, job: tracking.TrackedRun, checkpoint_dir: Path):
        self.cfg, self.job, self.method = cfg, job, cfg.method
        self.dir = checkpoint_dir
        self.co_train = bool(cfg.method.co_train)
        # The stored peer logs are looked up before any run is opened: a missing one fails cleanly.
        self.stored = {}
        if self.method.source == "stored":
            self.stored = {peer: _download_stored_log(job, cfg, peer, self.dir / "stored" / peer) for peer in ROLES}
        self.runs: dict[str, tracking.TrackedRun] = {}
        for role in ROLES:
            run = tracking.open_model_run(cfg, job, role)
            if run is not None:
                self.runs[role] = run
        loss = LossSpec.from_method(cfg.method) if self.co_train else None
        self.models = {role: VerlModel(role, verl_config(cfg, role, str(self.dir / role)), loss)
                       for role in self.runs}
        self.generator = torch.Generator().manual_seed(int(cfg.seed))
        self.best = {role: BestCheckpoint() for role in self.models}
        self.state = {"step": 0, "cursors": {role: 0 for role in self.models}, "gpu_hours": {},
                      "job_gpu_hours": 0.0, "positive_rates": {role: [] for role in ROLES}}
        self.pool = ThreadPoolExecutor(max_workers=2)

    # --- setup ------------------------------------------------------------------------------------
    def start(self) -> None:
        with_ref = bool(next(iter(self.models.values())).config.actor_rollout_ref.actor.use_kl_loss)
        start_models(list(self.models.values()), with_ref=with_ref)
        first = next(iter(self.models.values()))
        data = first.config.data
        self.train_set = RLHFDataset(data_files=data.train_files, tokenizer=first.tokenizer, config=data)
        self.val_set = RLHFDataset(data_files=list(data.val_files), tokenizer=first.tokenizer, config=data)
        self.benchmarks = val_benchmarks(self.val_set)
        self.val_row = {p.prompt: p.row for problems in self.benchmarks.values() for p in problems}
        self._resume()

    def _state_file(self) -> Path:
        return self.dir / "state.json"

    def _resume(self) -> None:
        if not self._state_file().exists():
            return
        self.state = json.loads(self._state_file().read_text())
        self.best = {role: BestCheckpoint(**best) for role, best in self.state.pop("best").items()}
        for role, model in self.models.items():
            model.load(str(self.dir / role / "latest"))
        log.info("resumed at step %d from %s", self.state["step"], self.dir)

    def _checkpoint(self) -> None:
        for role, model in self.models.items():
            model.save(str(self.dir / role / "latest"), self.state["step"])
        best = {role: asdict(b) for role, b in self.best.items()}
        self._state_file().write_text(json.dumps({**self.state, "best": best}))

    # --- data -------------------------------------------------------------------------------------
    def total_steps(self) -> int:
        per_epoch = len(self.train_set) // int(self.cfg.train.batch_prompts)
        if self.cfg.train.max_steps is not None:
            return int(self.cfg.train.max_steps)
        return per_epoch * int(self.cfg.train.total_epochs)

    def prompt_batch(self, cursor: int, size: int) -> DataProto:
        """``size`` prompts starting at the global position ``cursor`` of the epoch-wise orders."""
        per_epoch = len(self.train_set)
        index = [int(prompt_order(per_epoch, int(self.cfg.seed), (cursor + i) // per_epoch)[(cursor + i) % per_epoch])
                 for i in range(size)]
        batch = DataProto.from_single_dict(collate_fn([self.train_set[i] for i in index]))
        batch.non_tensor_batch["graft_prompt_id"] = np.asarray(index, dtype=np.int64)
        batch.non_tensor_batch["uid"] = np.asarray([str(uuid.uuid4()) for _ in index], dtype=object)
        return batch

    # --- one model's rollouts ---------------------------------------------------------------------
    def sample(self, role: str, prompts: DataProto, n: int, step: int,
               validate: bool = False) -> tuple[DataProto, list[str], list[bool]]:
        """``n`` responses to each prompt (rows prompt-major: the agent loop keeps the input order), their
        decoded strings and whether each ended with the model's EOS."""
        model = self.models[role]
        out = model.generate(prompts.repeat(repeat_times=n, interleave=True), step, validate)
        return out, *vb.decode_responses(out, model.tokenizer)

    def rollout(self, role: str, prompts: DataProto, step: int) -> Sampled:
        """A training step's rollouts of one model: rewards, old log-probs, GRPO advantages."""
        model, n = self.models[role], int(self.method.n)
        out, texts, finished = self.sample(role, prompts, n, step)
        golds = [r["ground_truth"] for r in prompts.non_tensor_batch["reward_model"]]
        rewards = torch.tensor(reward.rewards(texts, [g for g in golds for _ in range(n)])).view(-1, n)
        out.batch["old_log_probs"] = model.log_probs(out)
        logp_sum, num_tokens = sequence_log_prob_sums(out.batch["old_log_probs"], out.batch["response_mask"])
        rollouts = Rollouts(
            model=str(self.cfg.pair[role]), prompt_ids=[str(i) for i in prompts.non_tensor_batch["graft_prompt_id"]],
            responses=[texts[q * n:(q + 1) * n] for q in range(len(golds))], rewards=rewards,
            advantages=grpo_advantages(rewards, float(self.method.adv_eps)),
            logp_sum=logp_sum.double().view(-1, n), num_tokens=num_tokens.view(-1, n),
            finished=torch.tensor(finished).view(-1, n))
        return Sampled(out, rollouts, golds)

    def both(self, fn, *args):
        """Run ``fn(role, *args)`` for every trained model at once (their pools are disjoint)."""
        futures = {role: self.pool.submit(fn, role, *args) for role in self.models}
        return {role: f.result() for role, f in futures.items()}

    # --- steps ------------------------------------------------------------------------------------
    def step_single(self, step: int) -> dict[str, dict[str, float]]:
        """GRPO (n = method.n) for each model on its own, with verl's vanilla loss; DAPO's filter for grpo_ds."""
        size = int(self.cfg.train.batch_prompts)
        sampled = {}
        for role in self.models:
            cursor = self.state["cursors"][role]
            if self.method.dynamic_sampling:
                sampled[role], used = self.dynamic_sampling_rollout(role, cursor, step)
            else:
                sampled[role], used = self.rollout(role, self.prompt_batch(cursor, size), step), size
            self.state["cursors"][role] = cursor + used
            out, rollouts = sampled[role].out, sampled[role].rollouts
            out.batch["advantages"] = rollouts.advantages.flatten().unsqueeze(1) * out.batch["response_mask"].float()
            self.models[role].update_grpo(out)
        metrics = {role: {f"train/{k}": v for k, v in rollout_metrics(s.rollouts).items()} for role, s in sampled.items()}
        if len(sampled) == 2 and not self.method.dynamic_sampling:   # both saw the same prompts
            for role in ROLES:
                metrics[role]["train/peer_solved_frac"] = peer_solved_frac(sampled[role].rollouts,
                                                                           sampled[PEER_OF[role]].rollouts)
        for role, s in sampled.items():
            self._record(role, step, s)
        return metrics

    def dynamic_sampling_rollout(self, role: str, cursor: int, step: int) -> tuple[Sampled, int]:
        """DAPO dynamic sampling: keep groups with 0 < k < n, draw more prompt batches until the batch is
        full (at most MAX_DYNAMIC_BATCHES; then train on what was kept, or on the last draw if nothing
        was informative). Returns the rollouts and the number of prompts drawn."""
        size, draws, kept = int(self.cfg.train.batch_prompts), [], 0
        for attempt in range(MAX_DYNAMIC_BATCHES):
            drawn = self.rollout(role, self.prompt_batch(cursor + attempt * size, size), step)
            groups = torch.nonzero(dynamic_sampling_group_mask(drawn.rollouts.rewards)).flatten().tolist()
            draws.append((drawn, groups[:size - kept]))
            kept += len(draws[-1][1])
            if dynamic_sampling_batch_full(kept, size):
                break
        used = len(draws) * size
        if not kept:
            draws = [(drawn, list(range(size)))]
        return take_groups(draws), used

    def step_co_train(self, step: int) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """Alg. 1, one training step of both models (see the module docstring)."""
        size, n = int(self.cfg.train.batch_prompts), int(self.method.n)
        prompts = self.prompt_batch(self.state["cursors"]["A"], size)
        for role in ROLES:
            self.state["cursors"][role] += size
        sampled = self.both(self.rollout, prompts, step)
        own = {role: sampled[role].rollouts for role in ROLES}
        scorers = {role: vb.PeerScorer(sampled[role].out, n, self.models[role].tokenizer, self.models[role].log_probs)
                   for role in ROLES}
        ratios = {"A": 1.0, "B": 1.0}
        if self.method.source == "stored":
            # Each receiver replays its peer's GRPO n=8 log of this step (rewards re-verified); one direction
            # per receiver, so no balancing.
            sources = {role: self.stored_source(PEER_OF[role], step, sampled[role]) for role in ROLES}
            selected, plans = {}, {}
            for role in ROLES:
                selected[role], _ = select_prompts(self.method, sources[role].k, own[role].k, n, self.generator)
                plans[role] = assemble(self.method, own[role], sources[role], selected[role], scorers[role],
                                       self.generator)
            a_to_b, b_to_a = selected["B"], selected["A"]
        else:
            if self.method.peer_loss == "hacpo":
                ratios["A"], ratios["B"] = self.capability_ratios(own)
            sources = {"A": own["B"], "B": own["A"]}
            plans = {}
            plans["A"], plans["B"], (a_to_b, b_to_a) = plan_step(
                self.method, own["A"], own["B"], (scorers["A"], scorers["B"]), self.generator, (ratios["A"], ratios["B"]))
        minibatches = {role: self._receiver_minibatches(role, sampled[role], sources[role], plans[role],
                                                        scorers[role], ratios[role]) for role in ROLES}
        updates = self.both(self._update_receiver, minibatches)
        metrics = {}
        for role in ROLES:
            metrics[role] = {f"train/{k}": v for k, v in {**rollout_metrics(own[role]), **plans[role].metrics}.items()}
            metrics[role]["train/peer_solved_frac"] = peer_solved_frac(own[role], sources[role])
            metrics[role].update(updates[role])
            self._record(role, step, sampled[role])
        return metrics, {"exchange/A_to_B": float(a_to_b.sum()), "exchange/B_to_A": float(b_to_a.sum())}

    def _receiver_minibatches(self, role: str, sampled: Sampled, source: Rollouts, plan: ReceiverBatch,
                              scorer: vb.PeerScorer, capability_ratio: float) -> list[DataProto]:
        """The exchange's batch of one receiver as verl minibatches, in the method's order."""
        peer = scorer.score(plan.nll, source) if plan.nll else scorer.scored   # SGT scores its NLL rows only
        batch = vb.receiver_batch(sampled.out, int(self.method.n), peer, plan)
        hacpo = self.method.peer_loss == "hacpo"
        if hacpo:
            vb.hacpo_columns(batch, sampled.rollouts, source, capability_ratio)
            if self.cfg.method.hacpo.kl_coef > 0:
                batch.batch["ref_log_prob"] = self.models[role].log_probs(batch, reference=True)
        groups = plan.minibatches(self.method, minibatch_prompts(self.cfg), self.generator)
        return vb.minibatch_layout(batch, groups, dp_size=self.models[role].gpus, sequence_mean=hacpo)

    def capability_ratios(self, own: dict[str, Rollouts]) -> tuple[float, float]:
        """HACPO: (capability ratio B->A, A->B) from each model's positive rates so far, this step's included."""
        rates = self.state["positive_rates"]
        for role in ROLES:
            rates[role].append(float(hacpo_positive_rate(own[role].rewards)))
        capability = {role: hacpo_capability(rates[role]) for role in ROLES}
        return (hacpo_capability_ratio(capability["B"], capability["A"]),
                hacpo_capability_ratio(capability["A"], capability["B"]))

    def stored_source(self, peer: str, step: int, own: Sampled) -> Rollouts:
        """The peer's recorded GRPO n=8 rollouts of ``step`` (same seed, same prompt order) as a source,
        rewards re-verified and advantages recomputed from them (App. B "Saved peer logs")."""
        source = step_rollouts(self.stored[peer], step, str(self.cfg.pair[peer]))
        if source.prompt_ids != own.rollouts.prompt_ids:
            raise RuntimeError(f"stored log of {self.cfg.pair[peer]} step {step} has other prompts than this run: "
                               "replay needs the same seed and data")
        n, flat = source.n, [r for group in source.responses for r in group]
        source.rewards = torch.tensor(reward.rewards(flat, [g for g in own.golds for _ in range(n)])).view(-1, n)
        source.advantages = grpo_advantages(source.rewards, float(self.method.adv_eps))
        return source

    def _update_receiver(self, role: str, minibatches: dict[str, list[DataProto]]) -> dict:
        raw = self.models[role].update_minibatches(minibatches[role])
        kind = "seqs" if self.method.peer_loss == "hacpo" else "tokens"
        counts = {key: float(np.sum(raw.get(f"graft/{key}", [0.0])))
                  for key in (f"{kind}_self", f"{kind}_peer", f"clipped_{kind}_self", f"clipped_{kind}_peer")}
        return {"train/clipfrac_self": counts[f"clipped_{kind}_self"] / max(counts[f"{kind}_self"], 1.0),
                "train/clipfrac_peer": counts[f"clipped_{kind}_peer"] / max(counts[f"{kind}_peer"], 1.0),
                "train/grad_norm": float(np.mean(raw.get("grad_norm", [0.0])))}

    # --- records ----------------------------------------------------------------------------------
    def _trajectory_dir(self, role: str) -> Path:
        return self.dir / role / "trajectories"

    def _record(self, role: str, step: int, sampled: Sampled) -> None:
        """This step's rollouts into the model's stored-trajectory log (``graft_exp.trajectories``)."""
        tokens = vb.response_token_ids(sampled.out, sampled.rollouts.n)
        path = write_step(self._trajectory_dir(role), step, sampled.rollouts, tokens)
        self.runs[role].log_artifact(path, "trajectories")

    # --- validation and evaluation ----------------------------------------------------------------
    def generate_fn(self, role: str, step: int):
        """``graft_exp.evaluation``'s ``generate`` for one model: its validation prompts by text, sampled
        by verl's agent loop at the config's ``val_kwargs`` (= ``eval.temperature`` / ``eval.top_p``).
        The agent loop takes no per-call seed: repeated runs differ by vLLM's sampling noise."""
        val_kwargs = self.models[role].config.actor_rollout_ref.rollout.val_kwargs

        def generate(prompts: list[str], k: int, temperature: float, top_p: float, seed: int) -> list[list[str]]:
            if (temperature, top_p) != (float(val_kwargs.temperature), float(val_kwargs.top_p)):
                raise ValueError(f"verl samples evaluations at val_kwargs temperature {val_kwargs.temperature}, top-p "
                                 f"{val_kwargs.top_p}; {temperature} / {top_p} were asked for")
            batch = DataProto.from_single_dict(collate_fn([self.val_set[self.val_row[p]] for p in prompts]))
            _, texts, _ = self.sample(role, batch, k, step, validate=True)
            return [texts[i * k:(i + 1) * k] for i in range(len(prompts))]
        return generate

    def _evaluate(self, role: str, step: int) -> dict[str, float]:
        ev = self.cfg.eval
        return evaluate(self.generate_fn(role, step), self.benchmarks, int(ev.get("val_samples", ev.samples)),
                        float(ev.temperature), float(ev.top_p), int(self.cfg.seed))

    def validate(self, step: int) -> None:
        """Every model on the benchmarks; a new best average saves the best checkpoint."""
        for role, scores in self.both(self._evaluate, step).items():
            self.runs[role].log_metrics({f"val/{b}": v for b, v in scores.items()}, step)
            if self.best[role].update(step, scores[AVG]):
                self.models[role].save(str(self.dir / role / "best"), step)

    def _finish(self, role: str) -> None:
        """Final evaluation of the best checkpoint (R runs x k samples), prompt successes, FINISHED."""
        ev, run, best = self.cfg.eval, self.runs[role], self.best[role]
        self.models[role].load(str(self.dir / role / "best"))
        results = final_evaluation(self.generate_fn(role, best.step), self.benchmarks, int(ev.runs), int(ev.samples),
                                   float(ev.temperature), float(ev.top_p), int(self.cfg.seed))
        for index, scores in enumerate(results):
            run.log_metrics({f"test/{b}": v for b, v in scores.items()}, index)
        run.set_tags({"graft.best_step": str(best.step)})
        table = write_prompt_success(read_log(self._trajectory_dir(role)), self.dir / role / "prompt_success.parquet")
        run.log_artifact(table)
        run.finish("FINISHED")

    # --- the loop ---------------------------------------------------------------------------------
    def fit(self) -> None:
        total, val_every = self.total_steps(), int(self.cfg.eval.val_every)
        if self.state["step"] == 0:
            self.validate(0)
        for step in range(self.state["step"] + 1, total + 1):
            started = time.monotonic()
            if self.co_train:
                metrics, job_metrics = self.step_co_train(step)
            else:
                metrics, job_metrics = self.step_single(step), {}
            seconds = time.monotonic() - started
            self.state["job_gpu_hours"] += seconds * sum(m.gpus for m in self.models.values()) / 3600
            self.job.log_metrics({**job_metrics, "cost/gpu_hours": self.state["job_gpu_hours"]}, step)
            for role, values in metrics.items():
                hours = self.state["gpu_hours"].get(role, 0.0) + seconds * self.models[role].gpus / 3600
                self.state["gpu_hours"][role] = hours
                logged = {k: v for k, v in values.items() if not math.isnan(v)}   # e.g. no all-fail prompt
                self.runs[role].log_metrics({**logged, "cost/gpu_hours": hours}, step)
            self.state["step"] = step
            if is_validation_step(step, val_every, total):
                self.validate(step)
            if step % int(self.cfg.backend.save_every) == 0 or step == total:
                self._checkpoint()
        self.both(self._finish)


def take_groups(draws: list[tuple[Sampled, list[int]]]) -> Sampled:
    """DAPO: the chosen prompt groups of several draws, in order, as one step's rollouts."""
    n = draws[0][0].rollouts.n
    rows = [(s.out, torch.tensor([q * n + i for q in groups for i in range(n)], dtype=torch.long))
            for s, groups in draws if groups]
    field = lambda name: torch.cat([getattr(s.rollouts, name)[groups] for s, groups in draws])
    rollouts = Rollouts(
        model=draws[0][0].rollouts.model,
        prompt_ids=[s.rollouts.prompt_ids[q] for s, groups in draws for q in groups],
        responses=[s.rollouts.responses[q] for s, groups in draws for q in groups],
        rewards=field("rewards"), advantages=field("advantages"), logp_sum=field("logp_sum"),
        num_tokens=field("num_tokens"), finished=field("finished"))
    return Sampled(DataProto.concat([out[index] for out, index in rows]), rollouts,
                   [s.golds[q] for s, groups in draws for q in groups])


def _download_stored_log(job: tracking.TrackedRun, cfg: DictConfig, peer: str, target: Path):
    """The trajectory log (a DataFrame, ``graft_exp.trajectories.read_log``) of the peer model's finished
    GRPO n=8 run with this seed (backend verl)."""
    tags = {"graft.model": cfg.pair[peer], "graft.method": "grpo_n8", "graft.seed": str(cfg.seed),
            "graft.backend": "verl"}
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items()) + " and attributes.status = 'FINISHED'"
    experiments = [e.experiment_id for e in job.client.search_experiments(filter_string="name LIKE 'graft/%'")]
    runs = job.client.search_runs(experiments, query, max_results=1, order_by=["attributes.start_time DESC"])
    if not runs:
        raise RuntimeError(f"graft_stored needs the finished grpo_n8 run of {cfg.pair[peer]} with seed {cfg.seed} on "
                           f"backend verl; train it first (method=grpo_n8)")
    target.mkdir(parents=True, exist_ok=True)
    return read_log(Path(job.client.download_artifacts(runs[0].info.run_id, "trajectories", str(target))))
