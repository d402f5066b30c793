"""The verl backend as the driver's adapter (``graft_exp.driver.Backend``): one ``VerlModel`` per trained
model on its own resource pool, rows in verl's ``DataProto`` layout (``batch.py``), the receiver loss
inside verl's FSDP workers (``loss.py``). The loop, the exchange and the records are the driver's, the
same code the local backend runs every day.

The two models sit on disjoint GPU pools, so the driver runs their generation, scoring and updates at
the same time (``concurrent``): a model's GPUs are busy with its own work, never idle waiting for the
other's update to be charged to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from verl import DataProto
from verl.utils import hf_tokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.utils.tokenizer import normalize_token_ids
from verl.utils.tokenizer.chat_template import apply_chat_template

from graft_exp import tracking
from graft_exp.algorithms import sequence_log_prob_sums
from graft_exp.backends.verl import batch as vb
from graft_exp.backends.verl.config import verl_config
from graft_exp.backends.verl.runtime import VerlModel, start_models
from graft_exp.driver import Generation, Sampled, total_steps
from graft_exp.exchange import ReceiverBatch, Scorer
from graft_exp.objective import COUNT_METRICS, LossSpec
from graft_exp.rollouts import Rollouts


@dataclass(frozen=True)
class Problem:
    """One training or benchmark problem: its row in verl's dataset, its user message, its gold answer."""

    uid: str
    prompt: str
    answer: str
    row: int


def dataset_problems(dataset: RLHFDataset) -> list[tuple[str, Problem]]:
    """(data source, problem) of every row of a ``prepare.py`` Parquet dataset: the problem's text is its
    user message (with the paper's suffix), the gold answer ``reward_model.ground_truth``."""
    frame = dataset.dataframe
    return [(str(source), Problem(str(row), messages[-1]["content"], gold["ground_truth"], row))
            for row, (messages, gold, source) in enumerate(zip(frame[dataset.prompt_key], frame["reward_model"],
                                                               frame["data_source"]))]


def check_prompt_lengths(dataset: RLHFDataset, tokenizer, max_length: int, model: str,
                         chat_template_kwargs: dict | None = None) -> None:
    """Every prompt of ``dataset`` fits ``max_length`` tokens once rendered as verl's agent loop renders it
    for ``model`` (its chat template with the generation prompt). verl 0.9.1's agent loop left-truncates a
    longer prompt with only a warning (the dataset's ``truncation: error`` is no longer applied): the model
    would be sampled, rewarded and trained on a problem cut from the front. Raises naming the first."""
    for row, messages in enumerate(dataset.dataframe[dataset.prompt_key]):
        length = len(normalize_token_ids(apply_chat_template(tokenizer, list(messages), tokenize=True,
                                                             add_generation_prompt=True,
                                                             **(chat_template_kwargs or {}))))
        if length > max_length:
            raise ValueError(f"row {row} of {dataset.data_files} is {length} tokens for {model} with its chat template, "
                             f"more than train.max_prompt_length={max_length}; verl's agent loop would cut it from "
                             "the front. Raise train.max_prompt_length")


def gather_groups(parts: list[tuple[DataProto, list[int]]], n: int) -> DataProto:
    """The rows of the chosen prompt groups of several rollout batches (prompt-major, ``n`` per prompt), in
    order: DAPO's refilled batch in verl's layout."""
    return DataProto.concat([out[torch.tensor([q * n + i for q in groups for i in range(n)], dtype=torch.long)]
                             for out, groups in parts if groups])


class VerlBackend:
    """The models of one job on verl (``driver.Backend``)."""

    concurrent = True

    def __init__(self, cfg: DictConfig, roles: list[str]):
        self.cfg, self.roles = cfg, roles
        self.dir = Path(cfg.checkpoint_root) / tracking.run_key(cfg)
        self.spec = LossSpec.from_method(cfg.method)
        self.n = int(cfg.method.n)
        self.models: dict[str, VerlModel] = {}
        self.scorers: dict[str, vb.PeerScorer] = {}
        self.step = 0

    def build(self, train_files: str, val_files: list[str], tokenizer) -> None:
        """Datasets (``prepare.py``'s Parquet, read by verl's ``RLHFDataset`` with the model's chat template)
        and one ``VerlModel`` per role, not yet started."""
        probe = verl_config(self.cfg, self.roles[0], str(self.dir / self.roles[0]))
        self.train_set = RLHFDataset(data_files=train_files, tokenizer=tokenizer, config=probe.data)
        self.val_set = RLHFDataset(data_files=val_files, tokenizer=tokenizer, config=probe.data)
        self._problems = [p for _, p in dataset_problems(self.train_set)]
        self._benchmarks: dict[str, list[Problem]] = {}
        for source, problem in dataset_problems(self.val_set):
            self._benchmarks.setdefault(source, []).append(problem)
        self.val_row = {p.prompt: p.row for problems in self._benchmarks.values() for p in problems}
        steps = total_steps(self.cfg, len(self._problems))
        self.models = {role: VerlModel(role, verl_config(self.cfg, role, str(self.dir / role), training_steps=steps),
                                       self.spec) for role in self.roles}
        for model in self.models.values():
            path = model.config.actor_rollout_ref.model.path
            rendering = hf_tokenizer(path)
            if model.config.actor_rollout_ref.model.get("custom_chat_template"):   # as verl's agent loop applies it
                rendering.chat_template = model.config.actor_rollout_ref.model.custom_chat_template
            for dataset in (self.train_set, self.val_set):
                check_prompt_lengths(dataset, rendering, int(model.config.actor_rollout_ref.rollout.prompt_length),
                                     path, model.config.data.get("apply_chat_template_kwargs"))

    def problems(self) -> list[Problem]:
        return self._problems

    def benchmarks(self) -> dict[str, list[Problem]]:
        return self._benchmarks

    def devices(self, role: str) -> int:
        return self.models[role].gpus

    # ------------------------------------------------------------------ rollouts and scoring
    def prompt_batch(self, dataset: RLHFDataset, rows: list[int]) -> DataProto:
        return DataProto.from_single_dict(collate_fn([dataset[i] for i in rows]))

    def _generate(self, role: str, prompts: DataProto, n: int, validate: bool) -> tuple[DataProto, list, list]:
        model = self.models[role]
        out = model.generate(prompts.repeat(repeat_times=n, interleave=True), self.step, validate)
        return out, *vb.decode_responses(out, model.tokenizer, model.stop_ids)

    def sample(self, role: str, problems: list[Problem], n: int, seed: int, step: int) -> Generation:
        """n rollouts per prompt (vLLM takes no per-call seed) and their old log-probs from the FSDP workers."""
        self.step = step
        out, texts, finished = self._generate(role, self.prompt_batch(self.train_set, [p.row for p in problems]),
                                              n, validate=False)
        out.batch["old_log_probs"] = self.models[role].log_probs(out)
        logp_sum, num_tokens = sequence_log_prob_sums(out.batch["old_log_probs"], out.batch["response_mask"])
        return Generation(responses=[texts[q * n:(q + 1) * n] for q in range(len(problems))],
                          logp_sum=logp_sum.double().view(-1, n), num_tokens=num_tokens.view(-1, n),
                          finished=torch.tensor(finished).view(-1, n), token_ids=vb.response_token_ids(out, n),
                          data=out)

    def gather(self, role: str, parts: list[tuple[DataProto, list[int]]]) -> DataProto:
        return gather_groups(parts, self.n)

    def scorer(self, role: str, own: Sampled) -> Scorer:
        model = self.models[role]
        self.scorers[role] = vb.PeerScorer(own.data, self.n, model.tokenizer, model.log_probs, model.stop_ids[0])
        return self.scorers[role]

    # ------------------------------------------------------------------ update
    def update(self, role: str, spec: LossSpec, batch: ReceiverBatch, minibatches: list[list[int]], own: Sampled,
               peer: Rollouts | None, capability_ratio: float) -> dict[str, float]:
        """The receiver batch as verl rows, cut into the driver's minibatches, one ``update_actor`` each."""
        model, scorer = self.models[role], self.scorers[role]
        peer_rows = scorer.score(batch.nll, peer) if batch.nll else scorer.scored   # SGT scores its NLL rows only
        rows = vb.receiver_batch(own.data, self.n, peer_rows, batch)
        if spec.kind == "hacpo":
            vb.hacpo_columns(rows, own.rollouts, peer, capability_ratio)
            if spec.hacpo_kl_coef > 0:
                rows.batch["ref_log_prob"] = model.log_probs(rows, reference=True)
        raw = model.update_minibatches(vb.minibatch_layout(rows, minibatches, dp_size=model.dp_size,
                                                           sequence_mean=spec.sequence_level))
        losses = raw.get("actor/pg_loss", [])
        return {"loss": float(np.mean(losses)) if len(losses) else float("nan"),
                **{key: float(np.sum(raw.get(f"graft/{key}", [0.0]))) for key in COUNT_METRICS}}

    # ------------------------------------------------------------------ evaluation and state
    def generate(self, role: str, step: int):
        """``graft_exp.evaluation``'s generate: validation prompts by text, sampled by verl's agent loop at the
        config's ``val_kwargs`` (= ``eval.temperature`` / ``eval.top_p``); repeated runs differ by vLLM's noise."""
        val_kwargs = self.models[role].config.actor_rollout_ref.rollout.val_kwargs

        def generate(prompts: list[str], k: int, temperature: float, top_p: float, seed: int) -> list[list[str]]:
            if (temperature, top_p) != (float(val_kwargs.temperature), float(val_kwargs.top_p)):
                raise ValueError(f"verl samples evaluations at val_kwargs temperature {val_kwargs.temperature}, top-p "
                                 f"{val_kwargs.top_p}; {temperature} / {top_p} were asked for")
            self.step = step
            batch = self.prompt_batch(self.val_set, [self.val_row[p] for p in prompts])
            _, texts, _ = self._generate(role, batch, k, validate=True)
            return [texts[i * k:(i + 1) * k] for i in range(len(prompts))]
        return generate

    def keep_best(self, role: str, step: int) -> None:
        self.models[role].save(str(self.dir / role / "best"), step)

    def restore_best(self, role: str) -> None:
        if (self.dir / role / "best").is_dir():   # no trained checkpoint was validated: the final weights stand
            self.models[role].load(str(self.dir / role / "best"))

    def save(self, directory: Path, step: int) -> None:
        for role, model in self.models.items():
            model.save(str(directory / role), step)

    def load(self, directory: Path) -> None:
        for role, model in self.models.items():
            self.step = model.load(str(directory / role))


def create(cfg: DictConfig, roles: list[str]) -> VerlBackend:
    """The backend of one GPU job: Ray (a private one on this node, or the allocation's), the datasets and
    every model's worker group, vLLM replicas and checkpoint engine on split resource pools."""
    from verl.utils import hf_tokenizer

    from graft_exp.backends.verl.config import data_files, model_path, ray_init_kwargs
    from graft_exp.backends.verl.ray_slurm import start_local_ray

    backend = VerlBackend(cfg, roles)
    train_file, val_files = data_files(cfg)
    backend.build(train_file, val_files, hf_tokenizer(model_path(cfg, roles[0])))
    start_local_ray(num_gpus=int(cfg.pair.gpus), job_dir=backend.dir, address=cfg.backend.ray_address,
                    init_kwargs=ray_init_kwargs(backend.models[roles[0]].config))
    with_ref = spec_needs_reference(backend.spec)
    start_models(list(backend.models.values()), with_ref=with_ref)
    return backend


def spec_needs_reference(spec: LossSpec) -> bool:
    """HACPO's KL term needs the frozen initial policy (verl's ref worker)."""
    return spec.kind == "hacpo" and spec.hacpo_kl_coef > 0
