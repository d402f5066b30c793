"""The training loop, written once for every backend (paper Alg. 1, App. B/D).

``co_train_step`` is one training step of every method; ``fit`` runs a job around it: resume,
steps, validation every ``eval.val_every`` steps, checkpoints (in ``run_directory``), the best
checkpoint, the final evaluation, GPU-hours and the MLflow lifecycle of the job and its model runs.
A backend (``graft_exp.contract.Backend``, implemented by ``backends/local.py`` and ``backends/verl/``)
only does what depends on the hardware: generate, score, update with the method's loss
(``graft_exp.methods.objective``), save and load. The method is resolved once (``methods.resolve``): the driver,
the exchange (``graft_exp.methods.exchange.plan_step`` routes every method's step) and the backend receive it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from graft_exp import methods, prompts, reward, scheduler, schema, step_record, tracking
from graft_exp.algorithms import dynamic_sampling_batch_full, grpo_advantages
from graft_exp.config import peers, roles, total_steps, trained
from graft_exp.contract import Backend, BackendFactory, Sampled
from graft_exp.costs import TRAIN_PASSES, ModelFlops, Timeline, paused, phase, step_costs
from graft_exp.evaluation import AVG, BestCheckpoint, evaluate, final_evaluation, is_validation_step
from graft_exp.methods.exchange import REPLAYED, plan_step
from graft_exp.methods.receiver import PEER, ReceiverBatch, Scorer
from graft_exp.rollouts import Rollouts
from graft_exp.scores import checkpoint_score, job_score, rescue_candidate
from graft_exp.seeds import derive_seed
from graft_exp.trajectories import read_log, step_rollouts, write_prompt_success
from graft_exp.transfers import Scored, transfer_metrics

log = logging.getLogger("graft_exp.driver")
#: DAPO's cap on prompt batches drawn to fill one dynamic-sampling batch (its ``max_num_gen_batches``).
MAX_GEN_BATCHES = 10


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read; the message names the file and the way out."""


# ---------------------------------------------------------------------------------------- seeds, data
def checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints in a job directory, oldest first (``ckpt-<step>``; ``.tmp`` ones are unfinished)."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("ckpt-*") if p.is_dir() and not p.name.endswith(".tmp")]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def check_newest_checkpoint(cfg: DictConfig) -> None:
    """Before the job's run is opened: the newest checkpoint of this run key, which a resumed job would
    load, has a readable loop state (a truncated or foreign one would fail the job after it started)."""
    found = checkpoints(run_directory(cfg))
    if not found:
        return
    try:
        json.loads((found[-1] / "driver.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {found[-1]} cannot be loaded ({type(err).__name__}: {err}). Delete it to resume "
            "from the previous one (or from scratch), or launch again with rerun=true for a fresh run") from None


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


class PromptStream:
    """The training prompts in a seeded order: a fresh permutation each epoch, batches consecutive.
    A batch never crosses an epoch boundary: the permutation's tail too short for it is skipped, as
    verl's dataloader drops the last partial batch. The order depends only on the seed, so every
    method with the same seed sees the same batches (what ``graft_stored`` replay relies on)."""

    def __init__(self, problems: Sequence, seed: int, cursor: int = 0):
        self.problems, self.seed, self.cursor = problems, seed, cursor
        self._order: tuple[int, list[int]] | None = None   # (epoch, its permutation), drawn once per epoch

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s permutation of the problems' indices."""
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.problems)))
            random.Random(derive_seed(self.seed, "epoch", epoch)).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def next(self, size: int) -> list:
        epoch, index = divmod(self.cursor, len(self.problems))
        if index + size > len(self.problems):
            self.cursor = (epoch + 1) * len(self.problems)
        out = []
        for _ in range(size):
            epoch, index = divmod(self.cursor, len(self.problems))
            out.append(self.problems[self.order(epoch)[index]])
            self.cursor += 1
        return out


# ---------------------------------------------------------------------------------------- state
@dataclass
class Member:
    """One trained model of the job: its MLflow run (None if already FINISHED) and its loop state."""

    role: str
    key: str
    run: tracking.TrackedRun | None
    best: BestCheckpoint = field(default_factory=BestCheckpoint)
    device_seconds: float = 0.0          # its cost/gpu_hours x 3600
    flops: float = 0.0                   # its cost/flops: the counted work of its steps
    tracked: list[float] = field(default_factory=list)   # what the peer loss tracks across steps (HACPO: positive rates)
    replayed: object = None              # the peer's logged trajectories it replays (DataFrame; graft_stored)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log_metrics({k: v for k, v in metrics.items() if not math.isnan(v)}, step)


@dataclass
class Exchanged:
    """What a step's exchange hands its update and its record."""

    batches: dict[str, ReceiverBatch]     # each receiver's rows: its own groups and the peer groups it received
    sources: dict[str, Rollouts | None]   # the rollouts each receiver's peer rows come from (None: no peer rows)
    ratios: dict[str, float]              # each receiver's capability ratio to its peer (1.0: nothing tracked)
    transfers: dict                       # (source, receiver) -> the mask of the prompts transferred
    scored: dict[str, Scored]             # what each receiver's scorer computed (the update's count, the log)
    metrics: dict[str, float]             # the job's exchange metrics
    update_flops: dict[str, float]        # the counted work of each receiver's coming update


# ---------------------------------------------------------------------------------------- the driver
class Driver:
    """One job (pair x method x seed) on one backend."""

    def __init__(self, cfg: DictConfig, job: tracking.TrackedRun, backend_factory: BackendFactory):
        self.cfg, self.job = cfg, job
        self.method = methods.resolve(cfg.method)   # config, components and loss, built once for the job
        self.root = self.own_directory()
        self.members = self.open_members()
        needed = list(self.members)
        self.backend: Backend = backend_factory(cfg, self.method, needed, self.root) if needed else None
        self.job_device_seconds, self.job_flops = 0.0, 0.0
        self.start_step = 1
        if self.backend is not None:
            self.tag_prompting()
            self.shapes = {role: ModelFlops.of(self.backend.model_config(role)) for role in needed}
            problems = self.backend.problems()
            self.total_steps = total_steps(cfg, len(problems))
            streams = needed if self.method.sampling.own_prompts else ["shared"]
            self.streams = {name: PromptStream(problems, int(cfg.seed)) for name in streams}
            self.pool = ThreadPoolExecutor(max_workers=len(needed)) if self.backend.concurrent else None

    def own_directory(self) -> Path:
        """The job's run directory: emptied for a fresh run, which never inherits another run's state
        (checkpoints, best weights, logs); its tracking spool, where the job's runs keep what the store does not
        take while it does not answer; the date its chat templates render, fixed there on the first start."""
        root = run_directory(self.cfg)
        if not self.job.resumed:
            shutil.rmtree(root, ignore_errors=True)
        track = self.cfg.tracking
        self.spool = tracking.Spool(root / tracking.SPOOL_DIR, str(track.uri), self.job.client,
                                    float(track.outage_probe_s))
        self.job.keep_in(self.spool)
        # Chat templates that write today's date render this one in every process, however long the job runs.
        self.job.set_tags({schema.PROMPT_DATE: prompts.job_prompt_date(root).isoformat()})
        return root

    def open_members(self) -> dict[str, Member]:
        """The models this job trains, each with its MLflow run and the stored log it replays: every member
        whose run has not finished, or all of them while any co-trained one has not (``config.trained``)."""
        members = roles(self.cfg.pair)
        replayed = stored_logs(self.cfg, self.job.client, self.root / "stored")
        # The verification workers a step's batch needs start while the models load.
        reward.default_pool().start(int(self.cfg.train.batch_prompts) * int(self.method.config.n))
        runs = {role: tracking.open_model_run(self.cfg, self.job, role) for role in members}
        for run in runs.values():
            if run is not None:
                run.keep_in(self.spool)
        needed = trained(self.cfg.pair, bool(self.method.co_train), {r for r in members if runs[r] is not None})
        return {role: Member(role, str(self.cfg.pair[role]), runs[role], replayed=replayed.get(role))
                for role in needed}

    def tag_prompting(self) -> None:
        """What a rollout of each model starts from and stops on, on its run: the rendered prompt, the stop ids."""
        for role, member in self.members.items():
            if member.run is not None:
                shown = self.backend.prompting(role)
                member.run.set_tags({schema.STOP_IDS: shown["stop_ids"],
                                     schema.RENDERED_PROMPT: shown["rendered_prompt"][:5000]})

    def each(self, fn, roles: Sequence[str] | None = None) -> dict:
        """``fn(role)`` for every model: at the same time when the backend's models sit on disjoint devices."""
        roles = list(roles or self.members)
        if self.pool is None:
            return {role: fn(role) for role in roles}
        futures = {role: self.pool.submit(fn, role) for role in roles}
        return {role: f.result() for role, f in futures.items()}

    def at_once(self, fn, roles: Sequence[str]) -> dict:
        """``each`` from inside a phase of this thread's (the exchange's): that phase paused meanwhile, so the
        models' own phases in the pool are not also counted as its shared time."""
        with paused():
            return self.each(fn, roles)

    # -------------------------------------------------------------------- rollouts
    def scored(self, problems: list, responses: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Binary rewards [P, n] of each problem's responses (``reward.rewards``) and their GRPO advantages
        (eq. 1): for a model's own rollouts and for a replayed log alike."""
        n = len(responses[0])
        golds = [p.answer for p in problems for _ in range(n)]
        with phase("reward"):
            rewards = torch.tensor(reward.rewards([r for group in responses for r in group], golds)).view(-1, n)
        return rewards, grpo_advantages(rewards, float(self.method.config.adv_eps))

    def rollout(self, role: str, problems: list, step: int, attempt: int = 0) -> Sampled:
        """n samples per prompt, rewards, GRPO advantages (eq. 1)."""
        n = int(self.method.config.n)
        out = self.backend.sample(role, problems, n, derive_seed(self.cfg.seed, step, role, "rollout", attempt), step)
        self.work[role] += self.shapes[role].generation(out.prompt_tokens, out.num_tokens.tolist())
        rewards, advantages = self.scored(problems, out.responses)
        rollouts = Rollouts(model=self.members[role].key, prompt_ids=[p.uid for p in problems],
                            responses=out.responses, rewards=rewards, advantages=advantages,
                            logp_sum=out.logp_sum, num_tokens=out.num_tokens, finished=out.finished)
        return Sampled(rollouts, problems, out.data, out.token_ids, out.prompt_tokens, out.logprob_gap)

    def refilled_rollout(self, role: str, step: int) -> Sampled:
        """A batch of the groups ``method.sampling`` keeps (DAPO: 0 < k < n), drawing more batches until it is full
        (at most MAX_GEN_BATCHES draws; then train on what was kept, or on the last draw if nothing was)."""
        size, kept = int(self.cfg.train.batch_prompts), []
        for attempt in range(MAX_GEN_BATCHES):
            drawn = self.rollout(role, self.streams[role].next(size), step, attempt)
            kept += [(drawn, q) for q in torch.nonzero(self.method.sampling.keep(drawn.rollouts.rewards)).flatten().tolist()]
            if dynamic_sampling_batch_full(len(kept), size):
                break
        kept = kept[:size] or [(drawn, q) for q in range(size)]
        parts: list[tuple[Sampled, list[int]]] = []
        for sampled, q in kept:
            if parts and parts[-1][0] is sampled:
                parts[-1][1].append(q)
            else:
                parts.append((sampled, [q]))
        return Sampled(Rollouts.concat_groups([(s.rollouts, g) for s, g in parts]),
                       [s.problems[q] for s, g in parts for q in g],
                       self.backend.gather(role, [(s.data, g) for s, g in parts]),
                       [s.token_ids[q] for s, g in parts for q in g], [s.prompt_tokens[q] for s, g in parts for q in g],
                       max((s.logprob_gap for s, _ in parts if s.logprob_gap is not None), default=None))

    def replayed_source(self, role: str, step: int, own: Sampled) -> Rollouts:
        """The peer's logged GRPO n=8 rollouts of this step, rewards re-verified (App. B "Saved peer logs")."""
        peer = str(self.cfg.pair[peers(self.cfg.pair, role)[0]])
        source = step_rollouts(self.members[role].replayed, step, peer)
        if source.prompt_ids != own.rollouts.prompt_ids:
            raise ValueError(f"step {step}: the stored log of {peer} has different prompts than this run "
                             "(different data order or batch size); replay needs the same seed and train settings")
        source.rewards, source.advantages = self.scored(own.problems, source.responses)
        return source

    # -------------------------------------------------------------------- the step (Alg. 1)
    def co_train_step(self, step: int) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """Alg. 1, one training step of every method: (each model's metrics, the job's metrics)."""
        method, timeline = self.method, Timeline(self.members)
        started = time.perf_counter()
        self.work = dict.fromkeys(self.members, 0.0)   # this step's counted FLOPs per model
        # The shared prompt batch; none where each model draws its own (``method.sampling``: DAPO refills its batch).
        shared = None if method.sampling.own_prompts else self.streams["shared"].next(int(self.cfg.train.batch_prompts))
        own = self.sample(step, shared, timeline)
        exchanged = self.exchange(step, own, timeline)
        orders, counts = self.update(step, own, exchanged, timeline)
        return self.record(step, own, exchanged, orders, counts, timeline, started)

    def sample(self, step: int, shared: list | None, timeline: Timeline) -> dict[str, Sampled]:
        """Alg. 1 "Sample n responses": n responses per prompt from each model on the ``shared`` prompts (DAPO,
        without them: each model refills its own batch), binary rewards, GRPO advantages (eq. 1)."""
        def draw(role):
            with timeline("generate", role):
                return self.refilled_rollout(role, step) if shared is None else self.rollout(role, shared, step)
        return self.each(draw)

    def exchange(self, step: int, own: dict[str, Sampled], timeline: Timeline) -> Exchanged:
        """Alg. 1 "Select complementary groups" and "Replace selected groups" (``methods.exchange.plan_step``): which
        prompts (eq. 3), the source's whole groups scored by the receiver's old policy (eq. 8), gated weights
        (eq. 9), each receiver's rows. The driver adds what only the job holds: the replayed log's rollouts of this
        step (stored replay) and the capability ratios of what the peer loss tracks across steps (HACPO's positive
        rates); and it counts the scoring's and the coming update's work."""
        method, roles = self.method, list(self.members)
        scored = {role: Scored() for role in roles}   # what each receiver's scorer computed, for the count and log
        scorers = {role: self.counted(role, self.backend.scorer(role, own[role]), own[role], scored[role], timeline)
                   for role in roles}
        with timeline("score", *roles):
            rollouts = {role: s.rollouts for role, s in own.items()}
            ratios = method.peer_loss.capability_ratios({role: m.tracked for role, m in self.members.items()},
                                                        rollouts, {role: peers(self.cfg.pair, role)[0] for role in own})
            replayed = {role: self.replayed_source(role, step, sampled) for role, sampled in own.items()
                        if self.members[role].replayed is not None}
            batches, sources, transfers = plan_step(method, rollouts, scorers,
                                                    generator(self.cfg.seed, step, "exchange"),
                                                    replayed=replayed, capability_ratios=ratios,
                                                    at_once=self.at_once)
            batches = {role: self.cut_copies(role, batch, sources[role]) for role, batch in batches.items()}
            exchanged = {schema.exchange_metric(s, r): float(mask.sum())
                         for (s, r), mask in transfers.items() if s != REPLAYED}
        planned = {role: self.update_flops(role, batches[role], own[role], sources[role], scored[role])
                   for role in roles}
        for role in roles:
            self.work[role] += planned[role]
        return Exchanged(batches, sources, ratios, transfers, scored, exchanged, planned)

    def update(self, step: int, own: dict[str, Sampled], exchanged: Exchanged,
               timeline: Timeline) -> tuple[dict[str, list[list[int]]], dict[str, dict[str, float]]]:
        """Alg. 1 "Optimize": each receiver's batch in minibatches, in the method's order (peer groups last), one
        optimizer step each on the method's loss (eq. 10 for GRAFT; methods/objective.py). Returns (each receiver's
        minibatches, its update's counts)."""
        method, orders = self.method, {}

        def optimize(role):
            with timeline("update", role):
                batch = exchanged.batches[role]
                orders[role] = batch.minibatches(method, method.minibatch_prompts(self.cfg.train),
                                                 generator(self.cfg.seed, step, role, "order"))
                return self.backend.update(role, batch, orders[role], own[role], exchanged.sources[role],
                                           exchanged.ratios[role])
        counts = self.each(optimize)
        return orders, counts

    def record(self, step: int, own: dict[str, Sampled], exchanged: Exchanged, orders: dict[str, list[list[int]]],
               counts: dict[str, dict[str, float]], timeline: Timeline,
               started: float) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """Per-model metrics and the trajectory log (``step_record``), the step's GPU-hours and counted FLOPs; then,
        not charged, the transfer log, with the receivers' successes after the update where the probe is on; and
        the step's timeline (``step_record.timeline_metrics``). Returns (each model's metrics, the job's)."""
        method, batches, sources = self.method, exchanged.batches, exchanged.sources
        recording = time.perf_counter()
        metrics = {role: step_record.model_step(self.root, role, step, own[role], batches[role], counts[role],
                                                self.peer_rollouts(role, own, sources[role]), method.loss,
                                                bool(method.co_train)) for role in self.members}
        busy = {role: timeline.busy(role) for role in self.members}
        job_metrics = {**exchanged.metrics, **self.charge(busy, time.perf_counter() - started, metrics)}
        if exchanged.transfers:
            probe = self.probe if self.cfg.train.probe_transfers else None
            for role, rows in step_record.transfer_log(self.root, step, own, batches, orders, exchanged.transfers,
                                                       sources, exchanged.scored, probe).items():
                metrics[role].update(transfer_metrics(rows))
        for role in self.members:
            metrics[role].update(step_record.timeline_metrics(
                timeline.seconds[role], recording - started, counts[role],
                exchanged.update_flops[role], self.backend.devices(role), self.backend.peak_flops(role)))
        ended = time.perf_counter()
        job_metrics.update({schema.STEP_SECONDS: ended - started, schema.RECORD_SECONDS: ended - recording})
        return metrics, job_metrics

    def counted(self, role: str, scorer: Scorer, own: Sampled, scored: Scored, timeline: Timeline) -> Scorer:
        """``scorer`` timed as the receiver's ``score`` phase, counting its work, a forward pass of the receiver over
        each scored peer response (prompt + response in its tokens), and keeping what it computed in ``scored``
        (the update's count, the transfer log)."""
        def score(prompts: list[int], source: Rollouts):
            with timeline("score", role):
                logp, tokens = scorer(prompts, source)
            for row, q in enumerate(prompts):
                for i, count in enumerate(tokens[row].tolist()):
                    scored.keep(q, source, i, float(logp[row, i]), int(count))
                    self.work[role] += self.shapes[role].forward(own.prompt_tokens[q] + int(count))
            return logp, tokens
        return score

    def update_flops(self, role: str, batch: ReceiverBatch, own: Sampled, source: Rollouts | None,
                     scored: Scored) -> float:
        """The counted work of ``role``'s update: every row (and SGT's NLL rows) forward and backward in each of
        ``train.ppo_epochs`` passes, and the reference model's forward over the rows when the loss has a KL
        term. A peer response counts the receiver's tokens the scorer saw; one it did not score (an NLL row)
        counts the source's tokens."""
        def length(q: int, i: int, peer: bool) -> int:
            if not peer:
                return own.prompt_tokens[q] + int(own.rollouts.num_tokens[q, i])
            tokens = scored.of(q, source, i)[1]
            return own.prompt_tokens[q] + (tokens if tokens >= 0 else int(source.num_tokens[q, i]))
        rows = [length(r.prompt, r.sample, r.origin == PEER) for r in batch.rows]
        updated = rows + [length(q, i, True) for q, i in batch.nll]
        shape = self.shapes[role]
        flops = TRAIN_PASSES * int(self.cfg.train.ppo_epochs) * sum(shape.forward(t) for t in updated)
        if self.method.loss.needs_reference_model:
            flops += sum(shape.forward(t) for t in rows)
        return flops

    def cut_copies(self, role: str, batch: ReceiverBatch, source: Rollouts | None) -> ReceiverBatch:
        """``batch`` as the method treats peer copies longer in the receiver's tokens than its response limit
        (``method.cut_copies``), their number kept as ``peer_copies_cut`` either way. A receiver whose vocabulary
        splits text finer than its source's (Qwen's digit by digit) receives such copies of the source's longest
        finished answers."""
        if source is None:
            return batch
        copies = batch.peer_copies()
        lengths = self.backend.copy_lengths(role, source, copies)
        cut = {copy for copy, length in zip(copies, lengths) if length > int(self.cfg.train.max_response_length)}
        batch.metrics["peer_copies_cut"] = float(len(cut))
        return self.method.cut_copies(batch, cut) if cut else batch

    def probe(self, role: str, step: int, own: Sampled, pairs: list, sources: dict[str, Rollouts]) -> dict[int, int]:
        """The receiver's successes after its update on the prompts it received a group on and on its controls
        (prompts it failed entirely that some source solved, not received): {prompt: k}."""
        received = torch.stack([mask for _, mask in pairs]).any(dim=0)
        candidates = torch.stack([rescue_candidate(own.rollouts.k, sources[s].k) for s, _ in pairs]).any(dim=0)
        probed = torch.nonzero(received | candidates).flatten().tolist()
        if not probed:
            return {}
        problems = [own.problems[q] for q in probed]
        out = self.backend.sample(role, problems, int(self.method.config.n),
                                  derive_seed(self.cfg.seed, step, role, "probe"), step)
        rewards, _ = self.scored(problems, out.responses)
        return dict(zip(probed, rewards.sum(dim=1).int().tolist()))

    def peer_rollouts(self, role: str, own: dict[str, Sampled], source: Rollouts | None) -> dict[str, Rollouts]:
        """What ``role``'s peers sampled on its prompts, by peer role: the replayed log, or the other members'
        rollouts of this step (none where each model draws its own prompts: ``method.sampling``)."""
        if self.members[role].replayed is not None:
            return {peers(self.cfg.pair, role)[0]: source}
        if self.method.sampling.own_prompts:
            return {}
        return {peer: own[peer].rollouts for peer in peers(self.cfg.pair, role) if peer in own}

    def charge(self, busy: dict[str, float], wall: float, metrics: dict[str, dict[str, float]]) -> dict[str, float]:
        """Add the step's two charges to each model's metrics: device-hours (``step_costs``) and its counted
        FLOPs (``self.work``). The job's cumulative costs (each model's FLOPs are its own; the job's, their sum)."""
        shares, joint = step_costs(busy, wall, {r: self.backend.devices(r) for r in busy},
                                   bool(self.method.co_train), self.backend.concurrent)
        self.job_device_seconds += joint
        for role, member in self.members.items():
            member.device_seconds += shares[role]
            member.flops += self.work[role]
            self.job_flops += self.work[role]
            metrics[role][schema.GPU_HOURS] = member.device_seconds / 3600.0
            metrics[role][schema.FLOPS] = member.flops
        return self.costs()

    def costs(self) -> dict[str, float]:
        """The job's cumulative charges by metric: ``cost/gpu_hours`` (App. D) and ``cost/flops`` (counted)."""
        return {schema.GPU_HOURS: self.job_device_seconds / 3600.0, schema.FLOPS: self.job_flops}

    # -------------------------------------------------------------------- validation, checkpoints
    def validate(self, step: int) -> None:
        """Every model on the benchmark average; step 0 is recorded for the curves but is no candidate for
        the best checkpoint (only trained weights are)."""
        ev = self.cfg.eval
        benchmarks = self.backend.benchmarks()

        def run(role):
            started = time.perf_counter()
            scores = evaluate(self.backend.generate(role, step), benchmarks, int(ev.val_samples),
                              float(ev.temperature), float(ev.top_p), derive_seed(self.cfg.seed, step, "val"))
            return scores, time.perf_counter() - started
        for role, (scores, seconds) in self.each(run).items():
            member = self.members[role]
            member.log({**{schema.VAL + k: v for k, v in scores.items()}, schema.VALIDATE_SECONDS: seconds}, step)
            if step > 0 and member.best.update(step, scores[AVG]):
                self.backend.keep_best(role, step)

    def checkpoints(self) -> list[Path]:
        return checkpoints(self.root)

    def save_checkpoint(self, step: int) -> None:
        """The backend's state plus the loop's (step, data cursors, best, costs), written to a temporary
        directory and renamed, so a job killed mid-write leaves the previous checkpoint intact."""
        state = {"step": step, "job_device_seconds": self.job_device_seconds, "job_flops": self.job_flops,
                 "cursors": {name: s.cursor for name, s in self.streams.items()},
                 "members": {role: {"best": asdict(m.best),
                                    "device_seconds": m.device_seconds, "flops": m.flops,
                                    "positive_rates": m.tracked}   # the key checkpoints have always had
                             for role, m in self.members.items()}}
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_interrupted_writes()
        tmp = Path(tempfile.mkdtemp(prefix=f"ckpt-{step}-", suffix=".tmp", dir=self.root))
        self.backend.save(tmp, step)
        (tmp / "driver.json").write_text(json.dumps(state))
        final = self.root / f"ckpt-{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.checkpoints():
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    def remove_interrupted_writes(self) -> None:
        """Delete ``ckpt-*.tmp`` directories a killed job left half-written (tens of GB on verl)."""
        for tmp in self.root.glob("ckpt-*.tmp"):
            log.info("removing the interrupted checkpoint write %s", tmp)
            shutil.rmtree(tmp, ignore_errors=True)

    def load_checkpoint(self) -> None:
        """Continue from the newest checkpoint of this run key, if any."""
        if self.root.is_dir():
            self.remove_interrupted_writes()
        found = self.checkpoints()
        if not found:
            return
        try:
            state = json.loads((found[-1] / "driver.json").read_text())
            self.backend.load(found[-1])
        except Exception as err:  # torch and json raise many kinds for a truncated or foreign file
            raise CheckpointError(
                f"checkpoint {found[-1]} cannot be loaded ({type(err).__name__}: {err}). Delete it to resume "
                "from scratch, or launch again with rerun=true for a fresh run") from err
        for role, saved in state["members"].items():
            member = self.members[role]
            member.best = BestCheckpoint(**saved["best"])
            member.device_seconds = saved["device_seconds"]
            member.flops = saved.get("flops", 0.0)   # checkpoints written before the counted charge: from 0
            member.tracked = list(saved["positive_rates"])
        for name, cursor in state["cursors"].items():
            self.streams[name].cursor = cursor
        self.job_device_seconds, self.job_flops = state["job_device_seconds"], state.get("job_flops", 0.0)
        self.start_step = state["step"] + 1
        log.info("resumed from %s (step %d)", found[-1], state["step"])

    # -------------------------------------------------------------------- the job
    def fit(self, stop_at_step: int | None = None) -> dict[str, dict[str, float]]:
        """Train to the last step (validating, checkpointing), evaluate the best checkpoints, close the runs.

        ``stop_at_step`` leaves the job unfinished right after checkpointing that step, as a preempted job
        would (resumption tests). Returns each model's mean final test scores."""
        if not self.members:
            log.info("every model run of this job is FINISHED already; nothing to train")
            return {}
        self.start()
        if self.train(stop_at_step):
            return {}
        return self.finish()

    def start(self) -> None:
        """Before the first step: the newest checkpoint's state (a resumed job), the config, step 0's validation."""
        if self.job.resumed:
            self.load_checkpoint()
        self.log_config()
        if self.start_step == 1:
            self.validate(0)

    def train(self, stop_at_step: int | None) -> bool:
        """The steps, each logged once, validated every ``eval.val_every`` steps and checkpointed every
        ``train.save_every``, to the last step or the one that spends the budget. True when it stopped at
        ``stop_at_step`` instead."""
        every, save_every = int(self.cfg.eval.val_every), int(self.cfg.train.save_every)
        with progress_bar(bool(self.cfg.backend.progress), self.total_steps, self.start_step - 1,
                          list(self.members)) as bar:
            for step in range(self.start_step, self.total_steps + 1):
                if self.budget_spent():   # resumed from the checkpoint of the step that spent it
                    break
                metrics, job_metrics = self.co_train_step(step)
                self.job.log_metrics(job_metrics, step)
                for role, member in self.members.items():
                    member.log(metrics[role], step)
                # The step that spends the budget ends training as the last step would: validated (a
                # candidate for the best checkpoint) and checkpointed.
                last = step == self.total_steps or self.budget_spent()
                if is_validation_step(step, every, self.total_steps) or last:
                    self.validate(step)
                bar.advance({role: m[schema.TRAIN + "reward_mean"] for role, m in metrics.items()})
                if step % save_every == 0 or last or step == stop_at_step:
                    started = time.perf_counter()
                    self.save_checkpoint(step)   # timed: the warning before a time limit must cover it
                    self.job.log_metrics({schema.CHECKPOINT_SECONDS: time.perf_counter() - started}, step)
                if step == stop_at_step:
                    return True
                if last:
                    self.job.set_tags({schema.LAST_STEP: step})
                    break
        return False

    def finish(self) -> dict[str, dict[str, float]]:
        """After the last step: each model's best checkpoint evaluated, its run closed (``finish_member``), and the
        job's score where every model was evaluated. Returns each model's mean final test scores."""
        results = self.each(self.final_evaluation)
        scores = {role: self.finish_member(m, *results[role]) for role, m in self.members.items()}
        if len(scores) == len(roles(self.cfg.pair)):   # a baseline job may have evaluated only some of its models
            self.job.log_metrics({schema.SCORE: job_score([s[AVG] for s in scores.values()])}, 0)
        return scores

    def final_evaluation(self, role: str) -> tuple[list[dict[str, float]], float]:
        """The best checkpoint's scores, R runs x k samples, and the seconds they took."""
        ev, started = self.cfg.eval, time.perf_counter()
        self.backend.restore_best(role)
        results = final_evaluation(self.backend.generate(role, self.members[role].best.step),
                                   self.backend.benchmarks(), int(ev.runs), int(ev.samples), float(ev.temperature),
                                   float(ev.top_p), derive_seed(self.cfg.seed, "test"))
        return results, time.perf_counter() - started

    def finish_member(self, member: Member, results: list[dict[str, float]], seconds: float) -> dict[str, float]:
        """Record the final evaluation (and its time), the artifacts, FINISHED."""
        for r, scores in enumerate(results):
            member.log({schema.TEST + k: v for k, v in scores.items()}, r)
        member.log({schema.SCORE: checkpoint_score([scores[AVG] for scores in results]),
                    schema.TEST_SECONDS: seconds}, 0)
        if member.run is not None:
            member.run.set_tags({schema.BEST_STEP: member.best.step})
            traj = self.root / "trajectories" / member.role
            staged = self.root / f"artifacts_{member.role}"
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir()
            member.run.log_artifact(write_prompt_success(read_log(traj), staged / "prompt_success.parquet"))
            member.run.log_artifacts(traj, "trajectories")
            if (self.root / "transfers" / member.role).is_dir():
                member.run.log_artifacts(self.root / "transfers" / member.role, "transfers")
            member.run.finish("FINISHED")
        return {k: sum(r[k] for r in results) / len(results) for k in results[0]}

    def budget_spent(self) -> bool:
        """Whether the job's cost in its budget's charge (``cost/gpu_hours`` or ``cost/flops``) reached it."""
        budget = self.job.budget   # equal compute (None: steps alone), as open_job resolved it
        return budget is not None and self.costs()[budget.metric] >= budget.amount

    def log_config(self) -> None:
        path = self.root / "config.yaml"
        self.root.mkdir(parents=True, exist_ok=True)
        path.write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
        self.job.log_artifact(path)


def stored_logs(cfg: DictConfig, client, download_to: Path) -> dict:
    """The trajectory log (``trajectories.read_log``) each role replays: its peer's, from the run
    ``tracking.stored_log_run`` finds (checked before any run was opened); none for a method that replays
    nothing (``tracking.stored_log_peers``)."""
    logs = {}
    for peer_key in tracking.stored_log_peers(cfg):
        run = tracking.stored_log_run(client, cfg, peer_key)
        if run is None:   # deleted since the job's pre-launch check
            tracking.check_stored_logs(cfg, client)
        directory = download_to / peer_key
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        logs[peer_key] = read_log(Path(client.download_artifacts(run.info.run_id, "trajectories", str(directory))))
    return {role: logs[cfg.pair[peer]] for role in roles(cfg.pair) for peer in peers(cfg.pair, role)
            if cfg.pair[peer] in logs}


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


def run_directory(cfg: DictConfig) -> Path:
    """The job's directory: checkpoints, trajectory logs, staged artifacts and the backend's files
    (``<checkpoint_root>/<run_key>``, so a requeued job finds them by its identity)."""
    return Path(cfg.checkpoint_root) / tracking.run_key(cfg)


def fit(cfg: DictConfig, job: tracking.TrackedRun, backend_factory: BackendFactory, *,
        stop_at_step: int | None = None) -> dict[str, dict[str, float]]:
    """Train, evaluate and record one job, and close its MLflow runs: the job run and its model runs
    FINISHED, or FAILED / KILLED on a failure / Ctrl-C. A preemption (SystemExit from submitit's signal
    handler, or its requeue command stopped by the requeue: ``scheduler.requeue_under_way``) leaves the runs
    RUNNING, and the requeued job resumes them; so does
    ``stop_at_step`` (see ``Driver.fit``), and a spool that cannot be written (``tracking.SpoolError``). Records the
    store did not take (its outage outlasted MLflow's retries) are in the job's spool: a finished job waits up to
    ``tracking.outage_wait_s`` to send them, then leaves them for ``python -m graft_exp.tracking send``.
    Returns each model's mean final test scores."""
    driver = None
    try:
        driver = Driver(cfg, job, backend_factory)
        scores = driver.fit(stop_at_step=stop_at_step)
    except (Exception, KeyboardInterrupt) as err:
        if scheduler.requeue_under_way(err):   # preempted after all: leave as submitit does after its requeue
            log.warning("preempted: Slurm requeued the job while submitit's `scontrol requeue` ran (%s); the runs "
                        "stay RUNNING for the requeued job", err)
            raise SystemExit(-1) from err
        if isinstance(err, tracking.SpoolError):   # nothing more can be recorded: the runs stay as a preemption
            raise                                  # leaves them, for the relaunch to resume
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        for member in driver.members.values() if driver is not None else []:
            if member.run is not None and member.run.ended is None:
                member.run.finish(status)
        if status == "FAILED":
            log.exception("job failed: MLflow run %s marked FAILED (a re-launch resumes it)", job.run_id)
        job.finish(status)
        if job.spool is not None:   # a failed job waits for no store: what it kept is sent by its relaunch
            job.spool.settle(0)
        raise
    finally:   # also on a preemption: the next job of this process starts from free devices
        if driver is not None and driver.backend is not None:
            driver.backend.close()
    if stop_at_step is None:
        job.finish("FINISHED")
        job.spool.settle(float(cfg.tracking.outage_wait_s))
    return scores
