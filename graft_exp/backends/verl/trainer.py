"""The verl co-training driver: Alg. 1 step by step over two ``VerlModel`` stacks (runtime.py).

Per step: the same prompt batch to both models; rollouts; rewards (graft_exp.reward on the decoded
strings); old log-probs; GRPO (or HACPO) advantages; the method's selection; peer responses re-tokenized
for each receiver with its own prompt tokens (batch.py) and scored under its old policy; compatibility
weights; receiver rows (plan.py); peer-last minibatches laid out for verl's dispatch; one optimizer step
per minibatch through the ``actor_loss`` set on the workers. Single-model methods use verl's vanilla
GRPO loss and its standard minibatching (DAPO's group filter for ``grpo_ds``). Validation every
``eval.val_every`` steps, best checkpoint, final evaluation ``eval.runs`` x ``eval.samples``.

This orchestration has never run on a GPU (no GPU in this project's CI); its CPU-side pieces are tested.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig
from verl import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

from graft_exp import reward, tracking
from graft_exp.algorithms import (
    compatibility_score,
    dynamic_sampling_batch_full,
    dynamic_sampling_group_mask,
    grpo_advantages,
    hacpo_advantages,
    hacpo_capability,
    hacpo_capability_ratio,
    hacpo_positive_rate,
    sequence_log_prob_sums,
)
from graft_exp.backends.verl import batch as vb
from graft_exp.backends.verl.config import minibatch_prompts, verl_config
from graft_exp.backends.verl.loss import CAPABILITY_RATIO, SOURCE_MEAN_LOG_PROB, LossSpec
from graft_exp.backends.verl.plan import receiver_rows, select_prompts
from graft_exp.backends.verl.runtime import VerlModel, start_models

log = logging.getLogger("graft_exp.verl")
ROLES = ("A", "B")
#: Most prompt batches DAPO dynamic sampling draws for one step before training on what it kept.
MAX_DYNAMIC_BATCHES = 20


def prompt_order(num_prompts: int, seed: int, epoch: int) -> torch.Tensor:
    """The training prompt order of one epoch: a permutation that depends only on (seed, epoch), so
    every model of a job, and a stored run replayed against it, sees the same prompts at each step."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_prompts, generator=generator)


def bench_scores(rewards: np.ndarray, sources: np.ndarray, prompt_ids: np.ndarray) -> dict[str, float]:
    """pass@1 per benchmark: mean over each problem's responses, then over problems (App. B); ``avg`` is
    the unweighted mean of the benchmarks."""
    frame = pd.DataFrame({"bench": sources, "prompt": prompt_ids, "r": rewards})
    per_bench = frame.groupby(["bench", "prompt"]).r.mean().groupby("bench").mean()
    scores = {str(b): float(v) for b, v in per_bench.items()}
    scores["avg"] = float(np.mean(list(scores.values())))
    return scores


class Trainer:
    """Both models of one job, their MLflow model runs, checkpoints and the step loop."""

    def __init__(self, cfg: DictConfig, job: tracking.TrackedRun, checkpoint_dir: Path):
        self.cfg, self.job, self.method = cfg, job, cfg.method
        self.dir = checkpoint_dir
        self.co_train = bool(cfg.method.co_train)
        self.runs: dict[str, tracking.TrackedRun] = {}
        for role in ROLES:
            run = tracking.open_model_run(cfg, job, role)
            if run is not None:
                self.runs[role] = run
        loss = LossSpec.from_method(cfg.method) if self.co_train else None
        self.models = {role: VerlModel(role, verl_config(cfg, role, str(self.dir / role)), loss)
                       for role in self.runs}
        self.generator = torch.Generator().manual_seed(int(cfg.seed))
        self.state = {"step": 0, "best": {}, "gpu_hours": {}, "job_gpu_hours": 0.0, "positive_rates": {}}
        self.pool = ThreadPoolExecutor(max_workers=2)

    # --- setup ------------------------------------------------------------------------------------
    def start(self) -> None:
        with_ref = bool(next(iter(self.models.values())).config.actor_rollout_ref.actor.use_kl_loss)
        start_models(list(self.models.values()), with_ref=with_ref)
        first = next(iter(self.models.values()))
        data = first.config.data
        self.train_set = RLHFDataset(data_files=data.train_files, tokenizer=first.tokenizer, config=data)
        self.val_set = RLHFDataset(data_files=list(data.val_files), tokenizer=first.tokenizer, config=data)
        self._resume()

    def _state_file(self) -> Path:
        return self.dir / "state.json"

    def _resume(self) -> None:
        if not self._state_file().exists():
            return
        self.state = json.loads(self._state_file().read_text())
        for role, model in self.models.items():
            model.load(str(self.dir / role / "latest"))
        log.info("resumed at step %d from %s", self.state["step"], self.dir)

    def _checkpoint(self) -> None:
        for role, model in self.models.items():
            model.save(str(self.dir / role / "latest"), self.state["step"])
        self._state_file().write_text(json.dumps(self.state))

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
    def rollout(self, role: str, prompts: DataProto, step: int, validate: bool = False) -> dict:
        model = self.models[role]
        n = int(model.config.actor_rollout_ref.rollout.val_kwargs.n if validate else self.method.n)
        repeated = prompts.repeat(repeat_times=n, interleave=True)
        out = model.generate(repeated, step, validate)
        # The agent loop returns rows in input order; carry the prompt-level columns over (as verl's union).
        for key in ("graft_prompt_id", "data_source", "reward_model", "extra_info", "uid"):
            if key in repeated.non_tensor_batch:
                out.non_tensor_batch[key] = repeated.non_tensor_batch[key]
        texts, finished = vb.decode_responses(out, model.tokenizer)
        golds = [r["ground_truth"] for r in out.non_tensor_batch["reward_model"]]
        rewards = torch.tensor(reward.rewards(texts, golds)).view(-1, n)
        result = {"out": out, "texts": texts, "finished": finished, "rewards": rewards, "n": n}
        if not validate:
            out.batch["old_log_probs"] = model.log_probs(out)
            result["logp_sum"], result["logp_count"] = sequence_log_prob_sums(out.batch["old_log_probs"],
                                                                              out.batch["response_mask"])
        return result

    def both(self, fn, *args):
        """Run ``fn(role, *args)`` for every trained model at once (their pools are disjoint)."""
        futures = {role: self.pool.submit(fn, role, *args) for role in self.models}
        return {role: f.result() for role, f in futures.items()}

    # --- steps ------------------------------------------------------------------------------------
    def step_single(self, step: int, cursor: int) -> tuple[dict, int]:
        """GRPO (n = method.n) for each model on its own, with verl's vanilla loss; DAPO's filter for grpo_ds."""
        batch_size = int(self.cfg.train.batch_prompts)
        metrics = {}
        results = {}
        for role in self.models:
            kept, used = [], 0
            while True:
                prompts = self.prompt_batch(cursor + used, batch_size)
                used += batch_size
                result = self.rollout(role, prompts, step)
                if not self.method.dynamic_sampling:
                    kept = [result]
                    break
                keep = dynamic_sampling_group_mask(result["rewards"])
                kept.append(_subset_groups(result, keep))
                total = sum(len(k["rewards"]) for k in kept)
                if dynamic_sampling_batch_full(total, batch_size) or used >= MAX_DYNAMIC_BATCHES * batch_size:
                    break
            result = _concat_results(kept, batch_size)
            out, rewards = result["out"], result["rewards"]
            advantages = grpo_advantages(rewards, float(self.method.adv_eps)).flatten()
            out.batch["advantages"] = advantages.unsqueeze(1) * out.batch["response_mask"].float()
            self.models[role].update_grpo(out)
            results[role] = result
            metrics[role] = {"train/reward_mean": float(rewards.mean()),
                             "train/all_fail_frac": float((rewards.sum(1) == 0).float().mean())}
            self._record(role, step, result, advantages.view_as(rewards))
        return metrics, cursor + (used if self.method.dynamic_sampling else batch_size)

    def step_co_train(self, step: int, cursor: int) -> tuple[dict, int, dict]:
        """Alg. 1, one training step of both models (see the module docstring)."""
        prompts = self.prompt_batch(cursor, int(self.cfg.train.batch_prompts))
        res = self.both(self.rollout, prompts, step)
        n = int(self.method.n)
        k = {role: (res[role]["rewards"] > 0).sum(1) for role in ROLES}
        adv = {role: grpo_advantages(res[role]["rewards"], float(self.method.adv_eps)) for role in ROLES}
        sources = {"A": res["B"], "B": res["A"]}
        if self.method.source == "stored":
            # Each receiver replays its peer's GRPO n=8 log of this step (rewards re-verified); one direction
            # per receiver, so no balancing: A->B uses A's log and B's rollouts, and vice versa.
            sources = {receiver: self.stored_source(peer, step, prompts) for receiver, peer in (("A", "B"), ("B", "A"))}
            a_to_b, _ = select_prompts(self.method, (sources["B"]["rewards"] > 0).sum(1), k["B"], n, self.generator)
            b_to_a, _ = select_prompts(self.method, (sources["A"]["rewards"] > 0).sum(1), k["A"], n, self.generator)
        else:
            a_to_b, b_to_a = select_prompts(self.method, k["A"], k["B"], n, self.generator)
        selected = {"B": a_to_b, "A": b_to_a}
        hacpo_which = None
        if self.method.peer_loss == "hacpo" and self.method.selection != "all":
            # hacpo_which: peer rows of every prompt, HACPO advantages kept only on the selected prompts.
            hacpo_which = dict(selected)
            every = torch.ones_like(a_to_b)
            selected = {"A": every, "B": every}
        metrics = {role: {} for role in ROLES}
        for receiver, source in (("A", "B"), ("B", "A")):
            src = sources[receiver]
            own_adv, peer_adv = adv[receiver], src.get("advantages", adv[source])
            if self.method.peer_loss == "hacpo":
                own_adv, peer_adv = self._hacpo_advantages(receiver, source, res)
            batch, stats = self._receiver_batch(receiver, source, res[receiver], src, selected[receiver], own_adv, peer_adv,
                                                None if hacpo_which is None else hacpo_which[receiver])
            metrics[receiver].update(stats)
            metrics[receiver]["batch"] = batch
            self._record(receiver, step, res[receiver], adv[receiver])
        updates = self.both(self._update_receiver, {role: metrics[role].pop("batch") for role in ROLES})
        for role in ROLES:
            metrics[role].update(updates[role])
        return metrics, cursor + int(self.cfg.train.batch_prompts), {
            "exchange/A_to_B": float(a_to_b.sum()), "exchange/B_to_A": float(b_to_a.sum())}

    def _receiver_batch(self, receiver: str, source: str, own: dict, src: dict, selected: torch.Tensor, own_adv,
                        peer_adv, hacpo_selected) -> tuple[DataProto, dict]:
        model, n = self.models[receiver], int(self.method.n)
        res = {receiver: own, source: src}
        chosen = torch.nonzero(selected).flatten().tolist()
        source_rows = [p * n + i for p in chosen for i in range(n)]
        peer = None
        scores = torch.zeros(len(chosen), n)
        if chosen:
            peer = vb.peer_batch(own["out"], {p: p * n for p in chosen}, [p for p in chosen for _ in range(n)],
                                 [src["texts"][r] for r in source_rows], [src["finished"][r] for r in source_rows],
                                 model.tokenizer, source=source)
            peer.batch["old_log_probs"] = model.log_probs(peer)
            recv_sum, recv_count = sequence_log_prob_sums(peer.batch["old_log_probs"], peer.batch["response_mask"])
            rows = torch.tensor(source_rows)
            scores = compatibility_score(recv_sum, recv_count.clamp(min=1), src["logp_sum"][rows],
                                         src["logp_count"][rows].clamp(min=1)).view(len(chosen), n)
        plan = receiver_rows(self.method, own_rewards=own["rewards"], own_advantages=own_adv,
                             peer_rewards=src["rewards"], peer_advantages=peer_adv, selected=selected, scores=scores,
                             generator=self.generator, hacpo_selected=hacpo_selected)
        batch = vb.receiver_batch(own["out"], peer, plan.rows)
        if self.method.peer_loss == "hacpo":
            self._hacpo_columns(batch, receiver, source, res, plan.rows, source_rows)
        return batch, plan.stats

    def stored_source(self, peer: str, step: int, prompts: DataProto) -> dict:
        """The peer's recorded GRPO n=8 rollouts of ``step`` (same seed, same prompt order), as a source:
        strings, finished flags, generation log-prob sums and counts, re-verified rewards and the recorded
        source advantages."""
        if not hasattr(self, "_stored"):
            self._stored = {}
        if peer not in self._stored:
            self._stored[peer] = _download_stored_log(self.job, self.cfg, peer, self.dir / "stored" / peer)
        frame = pd.read_parquet(self._stored[peer] / f"step_{step:05d}.parquet")
        ids = prompts.non_tensor_batch["graft_prompt_id"]
        if not np.array_equal(frame.prompt_id.to_numpy()[:: int(self.method.n)], ids):
            raise RuntimeError(f"stored log of {self.cfg.pair[peer]} step {step} has other prompts than this run: "
                               "replay needs the same seed and data")
        golds = [r["ground_truth"] for r in prompts.non_tensor_batch["reward_model"] for _ in range(int(self.method.n))]
        n = int(self.method.n)
        return {"texts": frame.response.tolist(), "finished": frame.finished.tolist(), "n": n,
                "rewards": torch.tensor(reward.rewards(frame.response.tolist(), golds)).view(-1, n),
                "advantages": torch.tensor(frame.advantage.to_numpy()).float().view(-1, n),
                "logp_sum": torch.tensor(frame.logprob_sum.to_numpy()).float(),
                "logp_count": torch.tensor(frame.num_tokens.to_numpy())}

    def _hacpo_advantages(self, receiver: str, source: str, res: dict):
        rates = self.state["positive_rates"]
        capability = {role: hacpo_capability(rates.get(role, [])) for role in ROLES}
        ratio = hacpo_capability_ratio(capability[source], capability[receiver])
        self._capability_ratio = ratio
        return hacpo_advantages(res[receiver]["rewards"], res[source]["rewards"], ratio, float(self.method.adv_eps))

    def _hacpo_columns(self, batch: DataProto, receiver: str, source: str, res: dict, rows, source_rows) -> None:
        own = res[receiver]
        own_mean = own["logp_sum"] / own["logp_count"].clamp(min=1)
        src_mean = res[source]["logp_sum"] / res[source]["logp_count"].clamp(min=1)
        peer_mean = src_mean[torch.tensor(source_rows, dtype=torch.long)[rows.peer]] if len(rows.peer) else src_mean[:0]
        batch.batch[SOURCE_MEAN_LOG_PROB] = torch.cat([own_mean[rows.own], peer_mean]).float()
        batch.batch[CAPABILITY_RATIO] = torch.full((len(batch),), float(self._capability_ratio))
        if self.cfg.method.hacpo.kl_coef > 0:
            batch.batch["ref_log_prob"] = self.models[receiver].log_probs(batch, reference=True)

    def _update_receiver(self, role: str, batches: dict) -> dict:
        model, batch = self.models[role], batches[role]
        hacpo = self.method.peer_loss == "hacpo"
        minibatches = vb.minibatch_plan(batch, prompts_per_minibatch=minibatch_prompts(self.cfg),
                                        ordering=str(self.method.peer_position), dp_size=model.gpus,
                                        generator=self.generator, peer_groups_separate=hacpo, sequence_mean=hacpo)
        raw = model.update_minibatches(minibatches)
        kind = "seqs" if hacpo else "tokens"
        counts = {key: float(np.sum(raw.get(f"graft/{key}", [0.0])))
                  for key in (f"{kind}_self", f"{kind}_peer", f"clipped_{kind}_self", f"clipped_{kind}_peer")}
        return {"train/clipfrac_self": counts[f"clipped_{kind}_self"] / max(counts[f"{kind}_self"], 1.0),
                "train/clipfrac_peer": counts[f"clipped_{kind}_peer"] / max(counts[f"{kind}_peer"], 1.0),
                "train/grad_norm": float(np.mean(raw.get("grad_norm", [0.0])))}

    # --- records ----------------------------------------------------------------------------------
    def _record(self, role: str, step: int, result: dict, advantages: torch.Tensor) -> None:
        """Append this step's rollouts to the model's stored-trajectory log and prompt-success table."""
        out, n = result["out"], result["n"]
        ids = out.non_tensor_batch["graft_prompt_id"]
        mask = out.batch["response_mask"].bool()
        frame = pd.DataFrame({
            "step": step, "prompt_id": ids, "response_index": np.tile(np.arange(n), len(ids) // n),
            "response": result["texts"], "finished": result["finished"],
            "token_ids": [out.batch["responses"][i][mask[i]].tolist() for i in range(len(out))],
            "logprob_sum": result["logp_sum"].numpy(), "num_tokens": result["logp_count"].numpy(),
            "reward": result["rewards"].flatten().numpy(), "advantage": advantages.flatten().numpy()})
        path = self.dir / role / "trajectories" / f"step_{step:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(path, index=False)
        self.runs[role].log_artifact(path, "trajectories")
        success = frame.groupby("prompt_id", sort=False).reward.sum().rename("k").reset_index()
        success.insert(0, "step", step)
        table = self.dir / role / "prompt_success.parquet"
        if table.exists():
            success = pd.concat([pd.read_parquet(table), success[~success.step.isin(pd.read_parquet(table).step)]])
        success.to_parquet(table, index=False)
        if self.method.peer_loss == "hacpo":
            self.state["positive_rates"].setdefault(role, []).append(float(hacpo_positive_rate(result["rewards"])))

    # --- validation and evaluation ----------------------------------------------------------------
    def evaluate(self, role: str, step: int) -> dict[str, float]:
        prompts = DataProto.from_single_dict(collate_fn([self.val_set[i] for i in range(len(self.val_set))]))
        ids = np.arange(len(prompts))
        prompts.non_tensor_batch["graft_prompt_id"] = ids
        result = self.rollout(role, prompts, step, validate=True)
        rows = result["out"].non_tensor_batch
        return bench_scores(result["rewards"].flatten().numpy(), rows["data_source"], rows["graft_prompt_id"])

    def validate(self, step: int) -> None:
        scores = self.both(self.evaluate, step)
        for role, values in scores.items():
            self.runs[role].log_metrics({f"val/{b}": v for b, v in values.items()}, step)
            best = self.state["best"].get(role)
            if best is None or values["avg"] > best["avg"]:
                self.state["best"][role] = {"avg": values["avg"], "step": step}
                self.models[role].save(str(self.dir / role / "best"), step)

    def final_evaluation(self) -> None:
        for role, model in self.models.items():
            best = self.state["best"].get(role)
            if best is None:
                continue
            model.load(str(self.dir / role / "best"))
            for run_index in range(int(self.cfg.eval.runs)):
                values = self.evaluate(role, best["step"])
                self.runs[role].log_metrics({f"test/{b}": v for b, v in values.items()}, run_index)
            self.runs[role].set_tags({"graft.best_step": str(best["step"])})
            self.runs[role].log_artifact(self.dir / role / "prompt_success.parquet")

    # --- the loop ---------------------------------------------------------------------------------
    def fit(self) -> None:
        total, val_every = self.total_steps(), int(self.cfg.eval.val_every)
        cursor = self.state.get("cursor", 0)
        for step in range(self.state["step"] + 1, total + 1):
            started = time.monotonic()
            if self.co_train:
                metrics, cursor, job_metrics = self.step_co_train(step, cursor)
            else:
                (metrics, cursor), job_metrics = self.step_single(step, cursor), {}
            seconds = time.monotonic() - started
            self.state["job_gpu_hours"] += seconds * sum(m.gpus for m in self.models.values()) / 3600
            self.job.log_metrics({**job_metrics, "cost/gpu_hours": self.state["job_gpu_hours"]}, step)
            for role, values in metrics.items():
                hours = self.state["gpu_hours"].get(role, 0.0) + seconds * self.models[role].gpus / 3600
                self.state["gpu_hours"][role] = hours
                self.runs[role].log_metrics({**values, "cost/gpu_hours": hours}, step)
            self.state["step"], self.state["cursor"] = step, cursor
            if step % val_every == 0 or step == total:
                self.validate(step)
            if step % int(self.cfg.backend.save_every) == 0 or step == total:
                self._checkpoint()
        self.final_evaluation()
        for run in self.runs.values():
            run.finish("FINISHED")


def _download_stored_log(job: tracking.TrackedRun, cfg: DictConfig, peer: str, target: Path) -> Path:
    """The trajectory log of the peer model's finished GRPO n=8 run with this seed (backend verl)."""
    tags = {"graft.model": cfg.pair[peer], "graft.method": "grpo_n8", "graft.seed": str(cfg.seed),
            "graft.backend": "verl"}
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items()) + " and attributes.status = 'FINISHED'"
    experiments = [e.experiment_id for e in job.client.search_experiments(filter_string="name LIKE 'graft/%'")]
    runs = job.client.search_runs(experiments, query, max_results=1, order_by=["attributes.start_time DESC"])
    if not runs:
        raise RuntimeError(f"graft_stored needs the finished grpo_n8 run of {cfg.pair[peer]} with seed {cfg.seed} on "
                           f"backend verl; train it first (method=grpo_n8)")
    target.mkdir(parents=True, exist_ok=True)
    return Path(job.client.download_artifacts(runs[0].info.run_id, "trajectories", str(target)))


def _subset_groups(result: dict, keep: torch.Tensor) -> dict:
    n = result["n"]
    rows = torch.nonzero(keep.repeat_interleave(n)).flatten()
    return {"out": result["out"][rows], "texts": [result["texts"][i] for i in rows.tolist()],
            "finished": [result["finished"][i] for i in rows.tolist()], "rewards": result["rewards"][keep],
            "logp_sum": result["logp_sum"][rows], "logp_count": result["logp_count"][rows], "n": n}


def _concat_results(parts: list[dict], groups: int) -> dict:
    """DAPO: the first ``groups`` kept groups of the accumulated prompt batches."""
    if len(parts) == 1:
        return parts[0]
    n = parts[0]["n"]
    merged = {"out": DataProto.concat([p["out"] for p in parts]), "texts": [t for p in parts for t in p["texts"]],
              "finished": [f for p in parts for f in p["finished"]], "n": n,
              "rewards": torch.cat([p["rewards"] for p in parts]), "logp_sum": torch.cat([p["logp_sum"] for p in parts]),
              "logp_count": torch.cat([p["logp_count"] for p in parts])}
    keep = torch.arange(len(merged["rewards"])) < groups
    return _subset_groups(merged, keep)
