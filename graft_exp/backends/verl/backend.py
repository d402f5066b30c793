"""The verl backend as the driver's adapter (``graft_exp.contract.Backend``): one ``VerlModel`` per trained
model on its own resource pool, rows in verl's ``DataProto`` layout (``batch.py``), the receiver loss
inside verl's FSDP workers (``loss.py``). The loop, the exchange and the records are the driver's, the
same code the local backend runs every day.

The two models sit on disjoint GPU pools, so the driver runs their generation, scoring and updates at
the same time (``concurrent``): a model's GPUs are busy with its own work, never idle waiting for the
other's update to be charged to it.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from transformers import AutoConfig
from verl import DataProto
from verl.utils import hf_tokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.utils.tokenizer import normalize_token_ids
from verl.utils.tokenizer.chat_template import apply_chat_template

from graft_exp import resources
from graft_exp.algorithms import sequence_log_prob_sums
from graft_exp.backends.verl import batch as vb
from graft_exp.backends.verl.config import verl_config
from graft_exp.backends.verl.runtime import VerlModel, start_models
from graft_exp.backends.verl.seeded_agent import SEED_COLUMN, STOP_COLUMN
from graft_exp.config import total_steps
from graft_exp.contract import Generation, Sampled
from graft_exp.costs import phase
from graft_exp.methods import Method
from graft_exp.methods.objective import COUNT_METRICS, row_column_values
from graft_exp.methods.receiver import ReceiverBatch, Scorer
from graft_exp.prompts import job_prompt_date, pin_template_date, reads_the_clock
from graft_exp.resources import BEST_CONTENTS
from graft_exp.rollouts import Rollouts
from graft_exp.seeds import derive_seed
from graft_exp.step_record import GPU_PEAK, UPDATE_MFU


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


def check_verl_loadable(path: str) -> None:
    """verl 0.9.1 loads a model it can train: it picks the model class by the substring "ForCausalLM" of
    the config's architecture (``utils/model.get_hf_auto_model_class``: anything else, GPT-2's
    ``GPT2LMHeadModel`` included, is loaded as a bare ``AutoModel``, without its LM head) and its FSDP
    patches read ``num_key_value_heads`` (``models/transformers/monkey_patch.apply_monkey_patch``).
    Raises naming the model and what it lacks."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    architecture = (config.architectures or ["<none>"])[0]
    problems = []
    if "ForCausalLM" not in architecture:
        problems.append(f"its architecture {architecture} is not a *ForCausalLM (verl would load it without its "
                        "LM head)")
    if getattr(config.get_text_config(), "num_key_value_heads", None) is None:
        problems.append("its config has no num_key_value_heads (verl's FSDP patches read it)")
    if problems:
        raise ValueError(f"model {path} cannot train on backend=verl: {'; '.join(problems)}. Pick a *ForCausalLM "
                         "model (the paper's SmolLM3, Qwen3 and OctoThinker are), or backend=local")


def gather_groups(parts: list[tuple[DataProto, list[int]]], n: int) -> DataProto:
    """The rows of the chosen prompt groups of several rollout batches (prompt-major, ``n`` per prompt), in
    order: DAPO's refilled batch in verl's layout."""
    return DataProto.concat([out[torch.tensor([q * n + i for q in groups for i in range(n)], dtype=torch.long)]
                             for out, groups in parts if groups])


class VerlBackend:
    """The models of one job on verl (``contract.Backend``)."""

    concurrent = True

    def __init__(self, cfg: DictConfig, method: Method, roles: list[str], run_dir: Path):
        self.cfg, self.method, self.roles = cfg, method, roles
        self.dir = run_dir      # the driver's run directory: each model's verl checkpoints and best weights
        self.n = int(cfg.method.n)
        self.models: dict[str, VerlModel] = {}
        self.scorers: dict[str, vb.PeerScorer] = {}
        self.step = 0
        self.ray_temp_dir: str | None = None   # the private Ray's folder, removed by close (create sets it)
        for role in roles:   # an earlier process's staged best: a resume takes the checkpoint's (load)
            shutil.rmtree(self.staged_best(role), ignore_errors=True)

    def build(self, train_files: str, val_files: list[str], tokenizer) -> None:
        """Datasets (``prepare.py``'s Parquet, read by verl's ``RLHFDataset`` with the model's chat template)
        and one ``VerlModel`` per role, not yet started."""
        probe = verl_config(self.cfg, self.roles[0], str(self.dir / self.roles[0]))
        self.train_set = RLHFDataset(data_files=train_files, tokenizer=tokenizer, config=probe.data)
        self.val_set = RLHFDataset(data_files=val_files, tokenizer=tokenizer, config=probe.data)
        self._problems = [p for _, p in dataset_problems(self.train_set)]
        self._benchmarks: dict[str, list[Problem]] = {}
        limit = self.cfg.eval.get("max_problems")
        for source, problem in dataset_problems(self.val_set):
            problems = self._benchmarks.setdefault(source, [])
            if limit is None or len(problems) < int(limit):   # eval.max_problems: each benchmark's first ones
                problems.append(problem)
        self.val_row = {p.prompt: p.row for problems in self._benchmarks.values() for p in problems}
        steps = total_steps(self.cfg, len(self._problems))
        self.models = {role: VerlModel(role, verl_config(self.cfg, role, str(self.dir / role), training_steps=steps),
                                       self.method.loss) for role in self.roles}
        prompt_date = job_prompt_date(self.dir)
        for model in self.models.values():
            path = model.config.actor_rollout_ref.model.path
            rendering = hf_tokenizer(path)
            template = model.config.actor_rollout_ref.model.get("custom_chat_template") or rendering.chat_template
            if reads_the_clock(template):   # verl's agent-loop workers render the job's date, not their day's
                model.config.actor_rollout_ref.model.custom_chat_template = pin_template_date(template, prompt_date)
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

    def peak_flops(self, role: str) -> None:
        return None   # verl's update reports its own (UPDATE_MFU), from verl's flops counter

    def model_config(self, role: str):
        return AutoConfig.from_pretrained(self.models[role].config.actor_rollout_ref.model.path)

    def prompting(self, role: str) -> dict[str, str]:
        model = self.models[role]
        messages = list(self.train_set.dataframe[self.train_set.prompt_key][0])
        rendered = model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False,
            chat_template=model.config.actor_rollout_ref.model.get("custom_chat_template"),
            **(model.config.data.get("apply_chat_template_kwargs") or {}))
        return {"stop_ids": ",".join(str(i) for i in model.stop_ids), "rendered_prompt": rendered}

    # ------------------------------------------------------------------ rollouts and scoring
    def prompt_batch(self, dataset: RLHFDataset, rows: list[int]) -> DataProto:
        return DataProto.from_single_dict(collate_fn([dataset[i] for i in rows]))

    def _generate(self, role: str, prompts: DataProto, n: int, seed: int,
                  validate: bool) -> tuple[DataProto, list, list]:
        """n samples of each prompt; sample i is drawn with vLLM seed ``derive_seed(seed, i)``, or from the
        engine's own stream (``backend.seeded_requests=false``)."""
        model = self.models[role]
        repeated = prompts.repeat(repeat_times=n, interleave=True)
        seeded = bool(self.cfg.backend.seeded_requests)
        repeated.non_tensor_batch[SEED_COLUMN] = np.array(
            [derive_seed(seed, i) if seeded else None for i in range(len(repeated))], dtype=object)
        stops = np.empty(len(repeated), dtype=object)   # one list per row (np.array would make a 2-D array)
        for row in range(len(repeated)):
            stops[row] = list(model.stop_ids)
        repeated.non_tensor_batch[STOP_COLUMN] = stops
        out = model.generate(repeated, self.step, validate)
        return out, *vb.decode_responses(out, model.tokenizer, model.stop_ids)

    def sample(self, role: str, problems: list[Problem], n: int, seed: int, step: int) -> Generation:
        """n rollouts per prompt (each with its own vLLM seed from ``seed``, which the driver derives from the
        run seed and the step) and their old log-probs from the FSDP workers."""
        self.step = step
        out, texts, finished = self._generate(role, self.prompt_batch(self.train_set, [p.row for p in problems]),
                                              n, seed, validate=False)
        with phase("logprob"):
            out.batch["old_log_probs"] = self.models[role].log_probs(out)
        logp_sum, num_tokens = sequence_log_prob_sums(out.batch["old_log_probs"], out.batch["response_mask"])
        return Generation(responses=[texts[q * n:(q + 1) * n] for q in range(len(problems))],
                          logp_sum=logp_sum.double().view(-1, n), num_tokens=num_tokens.view(-1, n),
                          finished=torch.tensor(finished).view(-1, n), token_ids=vb.response_token_ids(out, n),
                          data=out, prompt_tokens=vb.prompt_token_counts(out, n), logprob_gap=vb.logprob_gap(out))

    def gather(self, role: str, parts: list[tuple[DataProto, list[int]]]) -> DataProto:
        return gather_groups(parts, self.n)

    def scorer(self, role: str, own: Sampled) -> Scorer:
        model = self.models[role]
        self.scorers[role] = vb.PeerScorer(own.data, self.n, model.tokenizer, model.log_probs, model.stop_ids[0])
        return self.scorers[role]

    def copy_lengths(self, role: str, source: Rollouts, copies: list[tuple[int, int]]) -> list[int]:
        model = self.models[role]
        return [len(vb.copy_ids(source.responses[q][i], model.tokenizer, finished=bool(source.finished[q, i]),
                                stop_id=model.stop_ids[0])) for q, i in copies]

    # ------------------------------------------------------------------ update
    def update(self, role: str, batch: ReceiverBatch, minibatches: list[list[int]], own: Sampled,
               source: Rollouts | None, capability_ratio: float) -> dict[str, float]:
        """The receiver batch as verl rows, cut into the driver's minibatches, one ``update_actor`` each."""
        model, scorer, spec = self.models[role], self.scorers[role], self.method.loss
        with phase("score"):   # SGT scores its NLL rows only, here
            peer_rows = scorer.score(batch.nll, source) if batch.nll else scorer.scored
        rows = vb.receiver_batch(own.data, self.n, peer_rows, batch,
                                 lambda part: row_column_values(spec, part, own.rollouts, source, capability_ratio))
        if spec.needs_reference_model:
            with phase("logprob"):
                rows.batch["ref_log_prob"] = model.log_probs(rows, reference=True)
        raw = model.update_minibatches(vb.minibatch_layout(rows, minibatches, dp_size=model.dp_size,
                                                           sequence_mean=spec.sequence_level))
        losses = raw.get("actor/pg_loss", [])
        # what the preflight holds against the plan's train term (0 on CPU: no CUDA allocator)
        peak = float(max(raw.get("perf/max_memory_reserved_gb", [0.0])))
        # verl's own MFU of the update (its flops counter, the GPU's dense peak); on a CPU it divides by a nominal
        # CPU figure, which is no utilisation of anything: logged on a GPU only
        utilisation = {UPDATE_MFU: float(np.mean(raw["mfu"]))} if peak > 0 and raw.get("mfu") else {}
        return {"loss": float(np.mean(losses)) if len(losses) else float("nan"),
                **{key: float(np.sum(raw.get(f"graft/{key}", [0.0]))) for key in COUNT_METRICS},
                GPU_PEAK: peak, **utilisation}

    # ------------------------------------------------------------------ evaluation and state
    def generate(self, role: str, step: int):
        """``graft_exp.evaluation``'s generate: validation prompts by text, sampled by verl's agent loop at the
        config's ``val_kwargs`` (= ``eval.temperature`` / ``eval.top_p``), seeded by ``seed``."""
        val_kwargs = self.models[role].config.actor_rollout_ref.rollout.val_kwargs

        def generate(prompts: list[str], k: int, temperature: float, top_p: float, seed: int) -> list[list[str]]:
            if (temperature, top_p) != (float(val_kwargs.temperature), float(val_kwargs.top_p)):
                raise ValueError(f"verl samples evaluations at val_kwargs temperature {val_kwargs.temperature}, top-p "
                                 f"{val_kwargs.top_p}; {temperature} / {top_p} were asked for")
            self.step = step
            batch = self.prompt_batch(self.val_set, [self.val_row[p] for p in prompts])
            _, texts, _ = self._generate(role, batch, k, seed, validate=True)
            return [texts[i * k:(i + 1) * k] for i in range(len(prompts))]
        return generate

    def staged_best(self, role: str) -> Path:
        """Where ``keep_best`` saves ``role``'s best weights until the next checkpoint takes them."""
        return self.dir / role / "best"

    def keep_best(self, role: str, step: int) -> None:
        """Save the weights under ``staged_best``; only ``save`` makes them part of a checkpoint, next to the
        driver's record of the best step, so a job killed in between resumes with the older pair."""
        shutil.rmtree(self.staged_best(role), ignore_errors=True)   # unlinks; a checkpoint's links stay intact
        self.models[role].save(str(self.staged_best(role)), step, BEST_CONTENTS)

    def restore_best(self, role: str) -> None:
        if self.staged_best(role).is_dir():   # no trained checkpoint was validated: the final weights stand
            self.models[role].load(str(self.staged_best(role)), BEST_CONTENTS)

    def close(self) -> None:
        """Stop every model's vLLM replicas and workers and leave Ray, so that the next job of this process (a
        multirun on cluster=local) starts a Ray of its own instead of inheriting this one's placement groups."""
        from graft_exp.backends.verl.ray_slurm import stop_local_ray

        for model in self.models.values():
            model.stop()
        stop_local_ray(self.ray_temp_dir)

    def save(self, directory: Path, step: int) -> None:
        """Each model's state under ``directory/<role>`` and its staged best (hard links) under
        ``directory/<role>/best``, the models' at the same time (each pool writes its own shards): the driver
        writes its record into the same directory and renames it."""
        def save(role: str) -> None:
            self.models[role].save(str(directory / role), step)
            if self.staged_best(role).is_dir():
                link_tree(self.staged_best(role), directory / role / "best")
        with ThreadPoolExecutor(len(self.models)) as pool:
            list(pool.map(save, self.models))   # re-raises a model's failure

    def load(self, directory: Path) -> None:
        """The models' state and, as the staged best, the best weights of the same checkpoint."""
        for role, model in self.models.items():
            self.step = model.load(str(directory / role))
            shutil.rmtree(self.staged_best(role), ignore_errors=True)
            if (directory / role / "best").is_dir():
                link_tree(directory / role / "best", self.staged_best(role))


def link_tree(source: Path, target: Path) -> None:
    """``source``'s files under ``target`` as hard links (a checkpoint's files are never rewritten in
    place, so both trees stay valid when either is deleted); copies where the filesystem cannot link."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    shutil.copytree(source, target, copy_function=link)


def create(cfg: DictConfig, method: Method, roles: list[str], run_dir: Path) -> VerlBackend:
    """The backend of one GPU job: Ray (a private one on this node, or the allocation's), the datasets and
    every model's worker group, vLLM replicas and checkpoint engine on split resource pools."""
    from verl.utils import hf_tokenizer

    from graft_exp.backends.verl.config import data_files, model_path, ray_init_kwargs
    from graft_exp.backends.verl.ray_slurm import check_shared_paths, start_local_ray

    for role in roles:
        check_verl_loadable(model_path(cfg, role))
    resources.check_on_node(cfg, roles, resources.device_memory_gb())   # the GPUs this node really has
    backend = VerlBackend(cfg, method, roles, run_dir)
    train_file, val_files = data_files(cfg)
    backend.build(train_file, val_files, hf_tokenizer(model_path(cfg, roles[0])))
    # The GPUs of the pools this job starts: a single-model job whose other member's shared baseline already
    # finished was allocated (resources.job_plan) and runs one pool only.
    ray_kwargs = ray_init_kwargs(backend.models[roles[0]].config, logprob_path=cfg.backend.logprob_path)
    backend.ray_temp_dir = start_local_ray(
        num_gpus=len(roles) * int(cfg.backend.gpus_per_model), job_dir=backend.dir, address=cfg.backend.ray_address,
        init_kwargs=ray_kwargs, num_cpus=len(os.sched_getaffinity(0)))
    if int(cfg.backend.nnodes) > 1:
        local_models = {f"model of {role}": model_path(cfg, role) for role in roles
                        if os.path.isdir(model_path(cfg, role))}   # a hub id is fetched by each node itself
        check_shared_paths({"checkpoint_root": str(run_dir)}, local_models)
    start_models(list(backend.models.values()), with_ref=method.loss.needs_reference_model)
    return backend
