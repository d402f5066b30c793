"""The verl backend through the shared driver (``graft_exp.driver``) on the tiny pair, on CPU: for graft, sgt,
hacpo and grpo_ds a step, a checkpoint, a resume by a new driver of the same MLflow run, a second step,
validation at every step and the final evaluation of the best checkpoint.

Stood in, and only these (verl cannot run them without GPUs and Ray):
- each model's FSDP engine worker group: ``verl_standins.EngineWorkerGroup`` at data-parallel size 2;
- its vLLM replicas: ``ModelServer`` below answers verl's ``LLMServerClient.generate`` (token ids in, sampled
  token ids out) from the worker group's current model, so the checkpoint engine has nothing to sync
  (``NoWeightSync``);
- Ray's actors around verl's agent-loop workers (``InProcessAgentLoop``: verl's ``AgentLoopManager`` with its
  ``AgentLoopWorker`` objects in this process).

verl's own code does the rest: ``RLHFDataset`` over Parquet written by ``graft_exp.prepare``, its agent loop
(chat template, ``single_turn_agent``, padding into ``prompts``/``responses``/``input_ids``/... and the
performance metrics), DataProto/TensorDict assembly, the split at dp = 2, micro-batching,
``Metric.aggregate_dp``, the optimizer, LR scheduler and ``FSDPCheckpointManager``, and our loss registered
with ``set_loss_fn``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import torch
from support.mlflow_records import histories, model_runs
from support.verl_standins import EngineWorkerGroup
from transformers import AutoConfig, AutoTokenizer
from verl.experimental.agent_loop import AgentLoopManager, AgentLoopWorker
from verl.utils import hf_tokenizer
from verl.workers.rollout.replica import TokenOutput

from graft_exp import driver, schema, tracking
from graft_exp.backends.local_policy import top_p_filter
from graft_exp.backends.verl.backend import VerlBackend
from graft_exp.backends.verl.config import data_files, model_path
from graft_exp.backends.verl.loss import IS_PEER, NLL, WEIGHT
from graft_exp.methods import resolve
from graft_exp.prepare import Source, verl_rows, write_parquet
from graft_exp.tiny.models import ASSETS, EVAL_SIZE, RECIPES, model_input
from graft_exp.tiny.task import SKILLS, benchmark, train_split

torch.set_num_threads(1)
DP_SIZE = 2
TRAIN_PROBLEMS, BENCH_PROBLEMS = 64, 2
#: The tiny models are base models conditioned on ``tiny.models.model_input(prompt)``: the prompt, then a
#: newline. As a chat template (which verl's agent loop applies to the dataset's messages):
#: It reads the clock without writing the date (the tiny format has none), so that the date pin of templates that
#: do (``prompts.pin_template_date``, SmolLM3's and Llama 3.x's) runs in every verl tier, verl's agent-loop
#: workers included, without changing a tiny prompt.
CHAT_TEMPLATE = ("{%- set today = strftime_now('%d %B %Y') -%}"
                 "{% for message in messages %}{{ message['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '\\n' }}{% endif %}")
SMALL = ["train.batch_prompts=8", "train.minibatch_prompts=4", "method.hacpo.minibatch_prompts=4",
         "train.max_steps=2", "train.save_every=1", "train.max_prompt_length=128", "train.max_response_length=48",
         "eval.val_every=1", "eval.val_samples=1", "eval.runs=2", "eval.samples=1", "backend.progress=false",
         "backend.gpus_per_model=2", "backend.rollout_tp=1", "backend.agent_workers=1",
         "backend.max_token_len_per_gpu=512", "pair.gpus=4"]
METHODS = ["graft", "sgt", "hacpo", "grpo_ds"]


# ------------------------------------------------------------------------------------ stand-ins
class NoWeightSync:
    """verl's ``CheckpointEngineManager`` for replicas that read the trainer's weights directly: there is
    nothing to sync (the calls are counted)."""

    def __init__(self):
        self.calls = {"update_weights": 0, "wake_up_replicas": 0, "sleep_replicas": 0}

    def update_weights(self, global_steps: int | None = None) -> None:
        self.calls["update_weights"] += 1

    def wake_up_replicas(self) -> None:
        self.calls["wake_up_replicas"] += 1

    def sleep_replicas(self) -> None:
        self.calls["sleep_replicas"] += 1


class ModelServer:
    """The model's vLLM replicas as verl's agent loop calls them (``LLMServerClient.generate``): prompt token
    ids in, sampled response token ids out, ending with a stop token of the model's generation config (kept,
    as vLLM keeps an EOS) or at ``rollout.response_length``; sampled from the worker group's current model at
    the request's temperature and top-p. The agent loop sends one request per sample, concurrently; requests
    that arrive together are sampled as one left-padded, KV-cached batch (as vLLM batches them). Each request
    draws from its own generator, seeded by the request's ``seed`` (vLLM's per-request ``SamplingParams.seed``),
    so the samples do not depend on how requests were batched; a request without one is refused."""

    def __init__(self, wg: EngineWorkerGroup, stop_ids: list[int], response_length: int):
        self.wg, self.stop_ids, self.response_length = wg, stop_ids, response_length
        self.prompts: set[tuple[int, ...]] = set()     # every prompt it was sent (tests read them)
        self.requests: list[dict] = []                 # every request's sampling parameters, in arrival order
        self.pending: list[tuple[list[int], dict, int, asyncio.Future]] = []
        self.flushes: list[asyncio.Task] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, priority: int = 0,
                       **_media) -> TokenOutput:
        future = asyncio.get_running_loop().create_future()
        self.prompts.add(tuple(prompt_ids))
        self.requests.append(dict(sampling_params))
        self.pending.append((list(prompt_ids), dict(sampling_params), int(priority), future))
        if len(self.pending) == 1:
            self.flushes = [t for t in self.flushes if not t.done()] + [asyncio.ensure_future(self._flush())]
        return await future

    async def _flush(self) -> None:
        seen = -1
        while seen != len(self.pending):          # until the event loop brings no further request
            seen = len(self.pending)
            await asyncio.sleep(0.01)
        batch, self.pending = self.pending, []
        try:
            shared = [{k: v for k, v in params.items() if k != "seed"} for _, params, _, _ in batch]
            if any(params != shared[0] for params in shared):
                raise ValueError("one generate_sequences call sends one set of sampling parameters")
            if any("seed" not in params for _, params, _, _ in batch):
                raise ValueError("a request without its sampling seed")
            outputs = self._sample([p for p, _, _, _ in batch], [params["seed"] for _, params, _, _ in batch],
                                   batch[0][1])
        except Exception as err:  # noqa: BLE001 (each waiting request fails with the sampler's error, none hangs)
            for *_, future in batch:
                future.set_exception(err)
            return
        for (*_, future), ids in zip(batch, outputs):
            future.set_result(TokenOutput(token_ids=ids, stop_reason="completed"))

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], seeds: list[int], params: dict) -> list[list[int]]:
        model, pad = self.wg.model, self.wg.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        temperature, top_p = float(params["temperature"]), float(params["top_p"])
        position = (mask.cumsum(dim=1) - 1).clamp(min=0)
        result = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True)
        position = position[:, -1:]
        done = torch.zeros(len(prompts), dtype=torch.bool)
        responses: list[list[int]] = [[] for _ in prompts]
        for _ in range(self.response_length):
            logits = result.logits[:, -1].float()
            if temperature > 0:
                probs = top_p_filter(torch.softmax(logits / temperature, dim=-1), top_p)
                token = torch.cat([torch.multinomial(probs[row], 1, generator=gen) for row, gen in enumerate(generators)])
            else:
                token = logits.argmax(dim=-1)
            for row in torch.nonzero(~done).flatten().tolist():
                responses[row].append(int(token[row]))
            done |= torch.isin(token, torch.tensor(self.stop_ids))
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position = position + 1
            result = model(input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=position,
                           past_key_values=result.past_key_values, use_cache=True)
        return responses


class _LocalActor:
    """A Ray actor handle's ``handle.method.remote(...)`` for an object in this process (an awaitable)."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        method = getattr(self.target, name)
        return type("RemoteMethod", (), {"remote": staticmethod(method)})


class InProcessAgentLoop(AgentLoopManager):
    """verl's ``AgentLoopManager`` whose ``AgentLoopWorker``s live in this process instead of Ray actors."""

    async def _init_agent_loop_workers(self):
        self.agent_loop_workers = [_LocalActor(AgentLoopWorker(self.config, self.llm_client))
                                   for _ in range(int(self.rollout_config.agent.num_workers))]


class CountingWorkerGroup(EngineWorkerGroup):
    """The engine stand-in, also counting the rows each ``update_actor`` call trains on (tests read them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained = {"own": 0, "peer": 0, "nll_rows": 0}

    def update_actor(self, data):
        real = data[WEIGHT] > 0
        peer, nll_rows = data[IS_PEER].bool(), data[NLL].bool()
        self.trained["own"] += int((real & ~peer).sum())
        self.trained["peer"] += int((real & peer).sum())
        self.trained["nll_rows"] += int(nll_rows.sum())
        return super().update_actor(data)


backends: list[VerlBackend] = []   # every backend the factory built, in order (tests inspect them)


def standin_backend(cfg, method, roles: list[str], run_dir) -> VerlBackend:
    """``backend.create`` without Ray: verl's datasets and ``VerlModel``s, each attached to the stand-ins."""
    backend = VerlBackend(cfg, method, roles, run_dir)
    train_file, val_files = data_files(cfg)
    backend.build(train_file, val_files, hf_tokenizer(model_path(cfg, roles[0])))
    for model in backend.models.values():
        config = model.config
        if not AutoConfig.from_pretrained(config.actor_rollout_ref.model.path).architectures[0].endswith("ForCausalLM"):
            # verl's checkpoint manager picks the class of its Hugging Face export by the architecture's name
            # (*ForCausalLM, ...); GPT-2's GPT2LMHeadModel predates that convention, so the tiny GPT-2 keeps
            # verl's sharded checkpoint without the export (the paper's models are all *ForCausalLM).
            config.actor_rollout_ref.actor.checkpoint.save_contents = ["model", "optimizer", "extra"]
        wg = CountingWorkerGroup(config.actor_rollout_ref.model.path, config.actor_rollout_ref, DP_SIZE,
                                 with_ref=backend.method.loss.needs_reference_model)
        model.attach(wg, wg.tokenizer, wg.model.generation_config)
        server = ModelServer(wg, model.stop_ids, int(config.actor_rollout_ref.rollout.response_length))
        model.agent_loop = InProcessAgentLoop.create(config=config, llm_client=server)
        model.checkpoints = NoWeightSync()
    backends.append(backend)
    return backend


# ------------------------------------------------------------------------------------ data, models
@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """What ``python -m graft_exp.prepare`` leaves for the verl backend, for the tiny pair: the tiny task as
    verl Parquet (training split as ``math``, one benchmark per skill) and the model snapshots, whose
    tokenizers carry the chat template of the tiny prompt format."""
    root = tmp_path_factory.mktemp("verl_prepared")
    fields = {"question": "question", "answer": "answer"}
    train = Source("math", "tiny", "train", rows=TRAIN_PROBLEMS, output="train", **fields)
    write_parquet(verl_rows([vars(p) for p in train_split(SKILLS, EVAL_SIZE, TRAIN_PROBLEMS)], train), train,
                  root / "data")
    for skill in SKILLS:
        source = Source(skill, "tiny", "test", rows=BENCH_PROBLEMS, **fields)
        write_parquet(verl_rows([vars(p) for p in benchmark(skill, EVAL_SIZE)[:BENCH_PROBLEMS]], source), source,
                      root / "data")
    for key in RECIPES:
        target = root / "models" / key
        shutil.copytree(ASSETS / key, target)
        tokenizer = AutoTokenizer.from_pretrained(target)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(target)
    return root


def test_chat_template_renders_the_tiny_prompt_format(prepared):
    for key in RECIPES:
        tokenizer = AutoTokenizer.from_pretrained(prepared / "models" / key)
        prompt = "Compute 2+3."
        assert tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False) == model_input(prompt)


# ------------------------------------------------------------------------------------ the contract
def verl_cfg(compose_cfg, prepared: Path, tmp_path: Path, *overrides: str):
    """The tiny pair on backend=verl (not ``config.validate``d: it refuses verl for the CPU test-bed pair),
    reading the prepared data and models, tracking and checkpoints under ``tmp_path``."""
    return compose_cfg("backend=verl", "pair=tiny", "pair.data=math", f"backend.data_dir={prepared / 'data'}",
                       f"backend.model_dir={prepared / 'models'}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                       f"checkpoint_root={tmp_path}/ckpt", *SMALL, *overrides)


def test_an_overlong_prompt_stops_the_job_before_training(compose_cfg, prepared, tmp_path):
    """verl's agent loop would cut a prompt longer than train.max_prompt_length from the front, silently;
    the backend refuses at build time, naming the row, its length under the model's chat template, the limit."""
    cfg = verl_cfg(compose_cfg, prepared, tmp_path, "method=graft", "train.max_prompt_length=64")
    train_file, val_files = data_files(cfg)
    with pytest.raises(ValueError, match=r"row 0 of .* is \d+ tokens for .*tiny-char-llama.*max_prompt_length=64"):
        VerlBackend(cfg, resolve(cfg.method), ["A", "B"], tmp_path / "run").build(train_file, val_files, hf_tokenizer(model_path(cfg, "A")))


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_verl_adapter_through_the_driver(compose_cfg, prepared, store_template, tmp_path, method):
    """Step 1, checkpoint, stop (a preempted job); a new driver resumes the same MLflow run from the
    checkpoint, trains step 2, validates, evaluates the best checkpoint and closes the runs."""
    shutil.copy(store_template, tmp_path / "mlflow.db")
    # The exchange methods need both directions' complementary prompts in a batch: 8 prompts (at seed 0
    # every step of each exchanges). DAPO needs no peer; 4 prompts keep its refills short.
    batch = ["train.batch_prompts=4", "train.minibatch_prompts=2"] if method == "grpo_ds" else []

    def make_job():
        cfg = verl_cfg(compose_cfg, prepared, tmp_path, f"method={method}", *batch)
        return cfg, tracking.open_job(cfg)

    backends.clear()
    cfg, job = make_job()
    assert driver.fit(cfg, job, standin_backend, stop_at_step=1) == {}
    job.finish("KILLED")
    run_dir = driver.run_directory(cfg)
    assert sorted(p.name for p in run_dir.glob("ckpt-*")) == ["ckpt-1"]
    for role in ("A", "B"):
        latest = run_dir / "ckpt-1" / role
        assert (latest / "latest_checkpointed_iteration.txt").read_text() == "1"
        assert (latest / "global_step_1" / "model_world_size_1_rank_0.pt").is_file()
        assert not list((latest / "global_step_1" / "huggingface").glob("*.safetensors"))   # no hf_model export
    assert json.loads((run_dir / "ckpt-1" / "driver.json").read_text())["step"] == 1

    cfg, resumed = make_job()
    assert resumed.resumed and resumed.run_id == job.run_id
    scores = driver.fit(cfg, resumed, standin_backend)
    assert resumed.status == "FINISHED"     # the driver closes the job run
    assert set(scores) == {"A", "B"}

    first, second = backends
    for backend in (first, second):
        for model in backend.models.values():
            assert model.wg.calls["update_actor"] >= 1          # each driver trained its step
            calls = model.checkpoints.calls
            assert calls["update_weights"] + calls["wake_up_replicas"] == calls["sleep_replicas"]
            # every wake without a weight transfer first hands the trainer's cached GPU blocks back
            assert model.wg.calls["release_cached_memory"] == calls["wake_up_replicas"]
            # weights are sent once per change (an update, a load): the benchmarks of one validation reuse them
            assert calls["wake_up_replicas"] >= 1 and calls["update_weights"] <= model.wg.calls["update_actor"] + 3
    for model in second.models.values():
        assert model.wg.calls["load_checkpoint"] >= 1           # the resume read verl's checkpoint
    # The template reads the clock: both processes' workers render the job's date, the one its first start kept.
    date = (run_dir / "prompt_date").read_text()
    assert resumed.client.get_run(job.run_id).data.tags["graft.prompt_date"] == date
    for backend in backends:
        for model in backend.models.values():
            pinned = model.config.actor_rollout_ref.model.custom_chat_template
            assert pinned.startswith("{%- macro strftime_now(format)") and pinned.endswith(CHAT_TEMPLATE)
            assert datetime.date.fromisoformat(date).strftime("%d %B %Y") in pinned
    if method == "hacpo":                                       # its KL term's reference pass
        assert all(m.wg.calls.get("compute_ref_log_prob", 0) >= 1 for b in backends for m in b.models.values())
    # Both charges every step, the counted one from the verl batches' prompt lengths and the models' configs;
    # each receiver of an exchange method has its transfer log, one file per step, as an artifact.
    flops = [m.value for m in resumed.client.get_metric_history(job.run_id, "cost/flops")]
    assert len(flops) == 2 and 0 < flops[0] < flops[1]
    for child in model_runs(resumed.client, job.run_id).values():
        artifacts = {a.path for a in resumed.client.list_artifacts(child.info.run_id, "transfers")}
        assert artifacts == ({"transfers/step_000001.parquet", "transfers/step_000002.parquet"}
                             if method != "grpo_ds" else set())
    # verl's agent loop rendered each dataset prompt with the model's chat template: the tiny prompt format
    texts = {model_input(p.prompt) for p in train_split(SKILLS, EVAL_SIZE, TRAIN_PROBLEMS)}
    texts |= {model_input(p.prompt) for skill in SKILLS for p in benchmark(skill, EVAL_SIZE)[:BENCH_PROBLEMS]}
    for backend in backends:
        for model in backend.models.values():
            sent = {model.tokenizer.decode(list(ids)) for ids in model.agent_loop.llm_client.prompts}
            assert sent and sent <= texts, sorted(sent - texts)[:3]
    trained = {role: {k: first.models[role].wg.trained[k] + second.models[role].wg.trained[k]
                      for k in ("own", "peer", "nll_rows")} for role in ("A", "B")}

    client = resumed.client
    job_metrics = histories(client, job.run_id)
    assert all(schema.known_metric(k, "job") for k in job_metrics), sorted(job_metrics)
    assert [s for s, _ in job_metrics["cost/gpu_hours"]] == [1, 2]
    runs = model_runs(client, job.run_id)
    assert set(runs) == {"A", "B"}
    for role, run in runs.items():
        tags = run.data.tags
        assert run.info.status == "FINISHED"
        assert all(schema.known_tag(k) for k in tags if k.startswith("graft.")), sorted(tags)
        assert tags["graft.backend"] == "verl" and tags["graft.method"] == method
        assert int(tags["graft.best_step"]) in (1, 2)                # a trained step, never step 0
        model = second.models[role]   # how the model was prompted and stopped, as recorded at the start
        assert tags["graft.stop_ids"] == ",".join(str(i) for i in model.stop_ids)
        assert tags["graft.rendered_prompt"] in texts                # the tiny prompt format, date pinned
        metrics = histories(client, run.info.run_id)
        assert all(schema.known_metric(k, "model") for k in metrics), sorted(metrics)
        for key in ("train/reward_mean", "train/loss", "train/clipfrac_self", "cost/gpu_hours"):
            assert [s for s, _ in metrics[key]] == [1, 2], (key, metrics[key])   # each step logged once
        assert [s for s, _ in metrics["val/avg"]] == [0, 1, 2]
        assert [s for s, _ in metrics["test/avg"]] == [0, 1]
        assert {f"test/{b}" for b in SKILLS} <= set(metrics)
        assert all(np.isfinite(v) for _, v in metrics["train/loss"])
        for phase in ("generate", "logprob", "update"):   # the FSDP workers' passes, timed as the step's phases
            assert all(v > 0 for _, v in metrics[schema.phase_metric(phase)]), phase
        # verl's LR scheduler steps once per update_actor call: the checkpoint carried it through the resume;
        # the best checkpoint holds the model only, so restoring it for the final evaluation leaves it as trained
        updates = first.models[role].wg.calls["update_actor"] + second.models[role].wg.calls["update_actor"]
        assert second.models[role].wg.lr_scheduler.last_epoch == updates
        if method == "grpo_ds":
            assert trained[role]["peer"] == trained[role]["nll_rows"] == 0
            assert "train/peer_groups" not in metrics
        else:
            assert [s for s, _ in metrics["train/peer_groups"]] == [1, 2]
    if method != "grpo_ds":
        # peer rows reached verl's update (SGT: its NLL rows), in at least one direction
        key = "nll_rows" if method == "sgt" else "peer"
        assert trained["A"][key] + trained["B"][key] > 0, trained
        if method != "sgt":   # the workers' peer token (HACPO: sequence) counts came back through aggregate_dp
            assert all(trained[role]["peer"] == 0 or "train/clipfrac_peer" in histories(client, r.info.run_id)
                       for role, r in runs.items())
        peer_groups = {role: sum(v for _, v in histories(client, r.info.run_id)["train/peer_groups"])
                       for role, r in runs.items()}
        assert sum(peer_groups.values()) > 0, peer_groups
