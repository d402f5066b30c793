"""``python -m graft_exp.preflight [overrides]``: the job those overrides compose, in miniature, through the
launcher it will run with, and one table of what holds on the machine it ran on (docs/reproduce.md, "Preflight").

The miniature keeps what sizes the job per GPU (models, formats, ``train.max_response_length``, the micro-batch
token budget, vLLM's memory share, the method) and shrinks what sizes it in time: one minibatch of prompts, two
steps (the second samples from weights the first updated and synced), a validation of four problems per benchmark
and one evaluation run, a checkpoint at each step. Its runs go to the experiment ``graft-preflight/<study>``
(``preflight=true``), which no analysis, comparison or run lookup reads; its checkpoints to a folder of their own
under ``checkpoint_root``. The report is attached to its job run (``preflight/report.md``, ``report.json``),
tagged ``graft.preflight`` = pass | fail; the exit status is 1 on any fail.

Each check reads what the job itself recorded (tags, metrics, its trajectory log, its checkpoint folder), so what
passes is what ran: pass, fail (with the line that says what to change), not measurable here (a GPU figure on a
machine without one; never a pass), or info (a measurement with nothing to hold it against).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from packaging.requirements import Requirement

from graft_exp import methods, prompts, resources, schema, tracking
from graft_exp.config import FLASH_ATTN, ConfigError, roles
from graft_exp.launching.jobs import PAPER_STEPS, Projection, estimate_gpu_hours

PASS, FAIL, NOT_HERE, INFO = "pass", "fail", "not measurable here", "info"
#: The largest mean per-token |vLLM - FSDP| log-prob gap of a response on step 2 (nats) that a weight sync passes
#: with: bf16 engines differ by ~1e-2 per token; weights the sync never delivered differ by the update's effect.
SYNC_GAP_BOUND = 0.1
#: Step 1 samples with the weights both sides loaded, so its gap is the engines' own noise; a sync that delivers
#: nothing leaves step 2 one update behind: a gap this many times step 1's (or the floor's, below it) fails. Measured
#: on vLLM's CPU engine over the paper vocabularies: step 1 ~1e-4, step 2 synced the same, one update not delivered
#: 0.0115 (the tiny models' lr), far below SYNC_GAP_BOUND.
SYNC_NOISE_RATIO, SYNC_NOISE_FLOOR = 5.0, 1e-3
#: The smallest share of responses ending on a stop id: below it the model does not stop (its format's end of turn
#: is not among the stop ids, or the response limit is far too short).
MIN_FINISHED_SHARE = 0.05
#: A projected job of more than this many times App. D's GPU-hours fails: the rollout or the update is far slower
#: than the paper's nodes ran it.
MAX_TIME_RATIO = 2.0
#: Libraries whose version the node must have, per backend; those only a GPU node can show are judged there only.
LIBRARIES = {"local": ("torch", "transformers", "mlflow", "math-verify"),
             "verl": ("torch", "transformers", "mlflow", "math-verify", "verl", "ray", "vllm", "flash-attn")}
GPU_ONLY = ("vllm", "flash-attn")
PREFLIGHT_TAG = schema.PREFLIGHT


@dataclass
class Check:
    """One row of the report."""

    check: str
    model: str
    status: str
    measured: str
    expected: str
    fix: str = ""


def miniature(cfg: DictConfig, checkpoint_root: Path) -> list[str]:
    """The overrides that shrink the job ``cfg`` to a preflight: one minibatch of prompts (the method's own, HACPO's
    64), two steps, a small validation and one evaluation run, a checkpoint each step."""
    prompts_per_step = methods.resolve(cfg.method).minibatch_prompts(cfg.train)
    return ["preflight=true", f"train.batch_prompts={prompts_per_step}", "train.max_steps=2", "train.save_every=1",
            "eval.val_every=2", "eval.max_problems=4", "eval.runs=1", "eval.samples=1",
            f"checkpoint_root={checkpoint_root}"]


def requirement(dist: str, backend: str, gpu: bool) -> Requirement | None:
    """The project's requirement on ``dist`` (pyproject.toml): the ``verl`` extra's pin on a GPU node of
    ``backend=verl``, else the base one; flash-attn's from the node check's install line."""
    if dist == "flash-attn":
        return Requirement(FLASH_ATTN)
    base = extra = None
    for req in map(Requirement, metadata.requires("graft_exp") or []):
        if req.name == dist and req.marker is None:
            base = req
        elif req.name == dist and req.marker.evaluate({"extra": "verl"}):
            extra = req
    return extra if backend == "verl" and gpu and extra else base or extra


def check_packages(env: dict[str, str], backend: str) -> list[Check]:
    """Each library the path needs, at the version the project pins, as the job's process recorded it."""
    gpu = schema.ENV_GPU in env
    rows = []
    for dist in LIBRARIES[backend]:
        recorded = env.get(schema.ENV_LIBRARY_TAGS[dist], "none")
        req = requirement(dist, backend, gpu)
        if dist in GPU_ONLY and not gpu:
            rows.append(Check(f"package {dist}", "job", NOT_HERE, recorded, f"{req} on the GPU node"))
        elif req is None or (recorded != "none" and req.specifier.contains(recorded, prereleases=True)):
            rows.append(Check(f"package {dist}", "job", PASS, recorded, str(req or "installed")))
        else:
            rows.append(Check(f"package {dist}", "job", FAIL, recorded, str(req),
                              f"pip install '{req}' in the job's environment"))
    return rows


def check_gpu(env: dict[str, str], plan: resources.Plan) -> Check:
    if plan.gpus == 0:
        return Check("GPU", "job", INFO, env.get(schema.ENV_GPU, "none"), "no GPU in the plan")
    if schema.ENV_GPU not in env:
        return Check("GPU", "job", NOT_HERE, "no GPU where the job ran", f"{plan.gpus} GPUs per node")
    return Check("GPU", "job", PASS, f"{env[schema.ENV_GPU]}, CUDA {env.get(schema.ENV_CUDA)}", f"{plan.gpus} GPUs")


def check_prompt(model: str, tags: dict[str, str]) -> Check:
    """The rendered prompt holds the paper's message once, and the model has stop ids."""
    rendered, stops = tags.get(schema.RENDERED_PROMPT, ""), tags.get(schema.STOP_IDS, "")
    shown = rendered.replace("\n", "\\n")
    if rendered.count(prompts.SUFFIX) != 1 or not stops:
        return Check("prompt", model, FAIL, shown[-120:], "the paper's suffix once, stop ids recorded",
                     f"check models.{model}.prompt_format (python -m graft_exp.prompts)")
    return Check("prompt", model, PASS, f"{shown[-80:]} | stop ids {stops}", "the paper's suffix once")


def check_stopping(model: str, log, limit: int) -> Check:
    """How the model's responses of both steps ended: the share on a stop id, and their mean length."""
    share, mean = float(log["finished"].mean()), float(log["num_tokens"].mean())
    measured = f"{share:.0%} stopped, {mean:.0f} tokens on average"
    if share < MIN_FINISHED_SHARE:
        return Check("stopping", model, FAIL, measured, f">= {MIN_FINISHED_SHARE:.0%} end on a stop id (limit {limit})",
                     f"responses do not stop: the end of turn of models.{model}.prompt_format must be among "
                     "graft.stop_ids, and train.max_response_length must leave room for an answer")
    return Check("stopping", model, PASS, measured, f">= {MIN_FINISHED_SHARE:.0%} end on a stop id (limit {limit})")


def check_sync(model: str, gaps: dict[int, float]) -> Check:
    """vLLM's log-probs of step 2's responses against the trainer's, after the first update was synced."""
    if 2 not in gaps:
        return Check("weight sync", model, NOT_HERE, "one engine samples and scores (backend=local)",
                     f"gap <= {SYNC_GAP_BOUND} on step 2")
    measured = f"{gaps[2]:.4f} (step 1: {gaps.get(1, float('nan')):.4f})"
    bound = min(SYNC_GAP_BOUND, SYNC_NOISE_RATIO * max(gaps[1], SYNC_NOISE_FLOOR)) if 1 in gaps else SYNC_GAP_BOUND
    expected = f"<= {bound:.4g} nats per token on step 2 ({SYNC_NOISE_RATIO:g} x step 1's, at most {SYNC_GAP_BOUND})"
    if gaps[2] > bound:
        return Check("weight sync", model, FAIL, measured, expected,
                     "vLLM did not sample with the trainer's weights: check the weight sync (docs/verl.md)")
    return Check("weight sync", model, PASS, measured, expected)


def check_host_memory(peak_gb: float | None, plan: resources.Plan) -> Check:
    expected = f"<= {plan.slurm['mem_gb']} GB (the job's Slurm request)"
    if peak_gb is None:
        return Check("host memory", "job", NOT_HERE, "the job ran on another machine (sacct shows MaxRSS)", expected)
    if peak_gb > plan.slurm["mem_gb"]:
        return Check("host memory", "job", FAIL, f"{peak_gb:.1f} GB", expected,
                     "the plan's host term is below what the job used: raise it (graft_exp/resources.py)")
    return Check("host memory", "job", PASS, f"{peak_gb:.1f} GB", expected)


def check_gpu_memory(env: dict[str, str], plan: resources.Plan, peaks: dict[str, float]) -> list[Check]:
    """Each model's trainer peak reserved GPU memory (``train/gpu_peak_reserved_gb``, GiB, by model key) against
    the plan's per-GPU train term."""
    rows = []
    for pool in plan.pools:
        expected = f"<= {pool.gpu_mem_gb.train} GB per GPU in training (the plan's train term)"
        peak = peaks.get(pool.model)
        if schema.ENV_GPU not in env:
            rows.append(Check("GPU memory", pool.model, NOT_HERE, "no GPU where the job ran", expected))
        elif peak is None:
            rows.append(Check("GPU memory", pool.model, NOT_HERE, "not recorded (backend=local)", expected))
        elif peak > pool.gpu_mem_gb.train:   # both GiB (resources.GB)
            rows.append(Check("GPU memory", pool.model, FAIL, f"{peak:.1f} GiB reserved", expected,
                              "the plan's train term is below what the trainer reserved: raise it "
                              "(conf/catalog/sizes.yaml, graft_exp/resources.py)"))
        else:
            rows.append(Check("GPU memory", pool.model, PASS, f"{peak:.1f} GiB reserved", expected))
    return rows


@dataclass(frozen=True)
class StepTime:
    """One full-size step of the job a preflight stands for: step 2 scaled to the job's prompts per step."""

    device_s: float
    wall_s: float

    def projection(self, full: DictConfig) -> Projection:
        steps = int(full.train.max_steps or PAPER_STEPS)
        return Projection(self.device_s * steps / 3600, self.wall_s * steps / 3600, "measured by a preflight")


def step_time(cfg: DictConfig, full: DictConfig, costs: list[tuple[int, float]],
              walls: dict[int, float]) -> StepTime | None:
    """``StepTime`` of the preflight ``cfg`` of ``full`` from its cumulative ``cost/gpu_hours`` and its
    ``time/step_s`` by step; None without a step 2."""
    per_step = dict(costs)
    if 2 not in per_step or 2 not in walls:
        return None
    scale = int(full.train.batch_prompts) / int(cfg.train.batch_prompts)
    return StepTime((per_step[2] - per_step.get(1, 0.0)) * 3600 * scale, walls[2] * scale)


def check_time(full: DictConfig, step: StepTime | None, tokens: int = 0) -> Check:
    """Step 2's device-hours scaled to the full job (its prompts per step, its steps) beside App. D's figure, its
    wall time, and the throughput the defaults gave: ``tokens`` generated at step 2 per device-second."""
    if step is None:
        return Check("time", "job", FAIL, "no step 2 recorded", "two steps", "see the job's log")
    projected = step.projection(full)
    steps = int(full.train.max_steps or PAPER_STEPS)
    measured = (f"{step.device_s:.1f} device-s per step, {tokens / max(step.device_s, 1e-9):.0f} generated tokens per "
                f"device-s; full job ~{projected.gpu_hours:.2f} GPU-h, ~{projected.wall_hours:.2f} h wall ({steps} steps)")
    paper = estimate_gpu_hours(full) if full.backend.name == "verl" else 0.0
    if not paper:   # a CPU pair (pair.gpus 0): App. D has no figure for it
        return Check("time", "job", INFO, measured, "App. D times the paper's GPU nodes")
    expected = f"App. D: {paper:.1f} GPU-h"
    if projected.gpu_hours > MAX_TIME_RATIO * paper:
        return Check("time", "job", FAIL, measured, expected,
                     "far slower than the paper's nodes: compare the rollout layout and vLLM's settings (docs/verl.md)")
    return Check("time", "job", PASS, measured, expected)


def check_timeline(model: str, history: dict[str, float], step_s: float | None) -> Check:
    """Where model ``model``'s step 2 went (its ``time/<phase>_s`` and ``time/wait_s``), as shares of the step."""
    if not step_s or not history:
        return Check("timeline", model, FAIL, "no timeline recorded at step 2", "time/<phase>_s", "see the job's log")
    shares = [(p, history.get(schema.phase_metric(p), 0.0)) for p in schema.PHASES]
    shares.append(("wait", history.get(schema.WAIT_SECONDS, 0.0)))
    shown = ", ".join(f"{p} {v / step_s:.0%}" for p, v in shares)
    return Check("timeline", model, INFO, f"{shown} of a {step_s:.1f} s step", "the wait share: time this pool idles")


def check_mfu(model: str, env: dict[str, str], values: list[float]) -> Check:
    """The update's model FLOPs utilisation at step 2 (``perf/mfu``): only a GPU of known dense peak has one."""
    if schema.ENV_GPU not in env:
        return Check("MFU", model, NOT_HERE, "no GPU where the job ran", "perf/mfu of the update")
    if not values:
        return Check("MFU", model, NOT_HERE, f"no dense bf16 peak known for {env[schema.ENV_GPU]}",
                     "perf/mfu of the update")
    return Check("MFU", model, INFO, f"{values[-1]:.1%} of the dense bf16 peak", "perf/mfu of the update")


def measured_cost(cfg: DictConfig) -> Projection | None:
    """The job ``cfg`` projected from the newest passing preflight of its pair, method and backend in its store
    (``graft.preflight_step_device_s`` / ``graft.preflight_step_s``), or None: no such preflight, no store yet, or
    a store that does not answer (the plan then shows App. D's figures). Creates nothing."""
    from mlflow import MlflowClient

    uri = str(cfg.tracking.uri)
    db = tracking.sqlite_file(uri)
    if db is not None and not db.exists():
        return None
    try:
        client = MlflowClient(uri)
        ids = [e.experiment_id for e in client.search_experiments(
            filter_string=schema.PREFLIGHT_EXPERIMENTS)]
        found = client.search_runs(ids, " and ".join(
            [f"tags.`{PREFLIGHT_TAG}` = '{PASS}'", f"tags.`{schema.PAIR}` = '{cfg.pair.name}'",
             f"tags.`{schema.METHOD}` = '{cfg.method.name}'", f"tags.`{schema.BACKEND}` = '{cfg.backend.name}'"]),
            order_by=["attributes.start_time DESC"], max_results=1) if ids else []
    except Exception:   # noqa: BLE001  the store's own errors: the plan falls back to App. D's figures
        return None
    if not found:
        return None
    tags = found[0].data.tags
    step = StepTime(float(tags[schema.PREFLIGHT_STEP_DEVICE_S]), float(tags[schema.PREFLIGHT_STEP_S]))
    projected = step.projection(cfg)
    return Projection(projected.gpu_hours, projected.wall_hours,
                      f"measured by the preflight of {time.strftime('%Y-%m-%d', time.gmtime(found[0].info.start_time / 1000))} "
                      f"on {tags.get(schema.HOST, '?')}")


def check_checkpoint(folder: Path, plan: resources.Plan) -> Check:
    """What the job's checkpoints (latest and best) hold on disk, beside the plan's peak."""
    files = [f for f in folder.rglob("*") if f.is_file()] if folder.is_dir() else []
    size = sum(f.stat().st_size for f in files) / resources.GB
    expected = f"<= {plan.peak_disk_gb} GB (the plan's peak)" if plan.peak_disk_gb else "written"
    if not files:
        return Check("checkpoint", "job", FAIL, f"nothing under {folder}", expected,
                     "checkpoint_root must be writable from the node (a shared file system under Slurm)")
    if plan.peak_disk_gb and size > plan.peak_disk_gb:
        return Check("checkpoint", "job", FAIL, f"{size:.2f} GB", expected, "raise the plan's checkpoint term")
    return Check("checkpoint", "job", PASS, f"{size:.3f} GB in {len(files)} files", expected)


def check_checkpoint_time(seconds: list[float], lead: str | None) -> Check:
    """The longest checkpoint write of the job (its models at full size: the miniature changes no shape) against the
    launcher's warning before the time limit, in which a job stopped by the limit writes its last checkpoint."""
    measured = f"{max(seconds):.1f} s" if seconds else "none recorded"
    if not seconds:
        return Check("checkpoint time", "job", FAIL, measured, "each checkpoint timed", "see the job's log")
    if lead is None:
        return Check("checkpoint time", "job", INFO, measured, "no time limit warns this launcher's jobs")
    expected = f"< {lead} s (hydra.launcher.signal_delay_s: the warning before the time limit)"
    if max(seconds) >= float(lead):
        return Check("checkpoint time", "job", FAIL, measured, expected,
                     f"a job stopped at its time limit would lose its last steps: raise hydra.launcher.signal_delay_s "
                     f"above {2 * max(seconds):.0f}, or checkpoint more often (train.save_every)")
    return Check("checkpoint time", "job", PASS, measured, expected)


def check_job(run, rc: int) -> list[Check]:
    """The job ran to its end and its run reached the store from where it ran."""
    if run is None:
        return [Check("job", "job", FAIL, f"exit status {rc}, no run recorded", "a FINISHED run",
                      "the job's output above says why; the tracking store must be reachable from the node")]
    status = run.info.status
    host = run.data.tags.get(schema.HOST, "?")
    rows = [Check("tracking", "job", PASS, f"run {run.info.run_id[:8]} recorded from {host}", "reached from the node")]
    rows.append(Check("job", "job", PASS if status == "FINISHED" else FAIL, f"{status}, exit status {rc}",
                      "FINISHED", "" if status == "FINISHED" else f"its log: {run.data.tags.get(schema.LOG, 'above')}"))
    return rows


def job_runs(client, cfg: DictConfig, since_ms: int):
    """The preflight's job run (newest with the job's key since ``since_ms``) and its model runs by role."""
    experiment = client.get_experiment_by_name(tracking.experiment_name(cfg))
    if experiment is None:
        return None, {}
    found = client.search_runs([experiment.experiment_id],
                               f"tags.`{schema.RUN_KEY}` = '{tracking.run_key(cfg)}' and attributes.start_time >= {since_ms}",
                               order_by=["attributes.start_time DESC"])
    job = next((r for r in found if "mlflow.parentRunId" not in r.data.tags), None)
    if job is None:
        return None, {}
    children = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{job.info.run_id}'")
    return job, {r.data.tags[schema.ROLE]: r for r in children}


def report(cfg: DictConfig, full: DictConfig, rc: int, peak_gb: float | None, since_ms: int) -> list[Check]:
    """Every check of the preflight job ``cfg`` (the miniature of ``full``), from what it recorded."""
    from mlflow import MlflowClient

    from graft_exp.driver import run_directory
    from graft_exp.step_record import GPU_PEAK
    from graft_exp.trajectories import read_log

    client = MlflowClient(str(cfg.tracking.uri))
    job, models = job_runs(client, cfg, since_ms)
    rows = check_job(job, rc)
    if job is None:
        return rows
    env, plan = job.data.tags, resources.job_plan(full)
    rows += check_packages(env, str(cfg.backend.name)) + [check_gpu(env, plan)]
    tokens, peaks = 0, {}
    with tempfile.TemporaryDirectory() as scratch:
        for role in roles(cfg.pair):
            run = models.get(role)
            model = str(cfg.pair[role])
            if run is None:
                rows.append(Check("model run", model, FAIL, "none", "one per model", "see the job's log"))
                continue
            rows.append(check_prompt(model, run.data.tags))
            log = read_log(Path(client.download_artifacts(run.info.run_id, "trajectories", f"{scratch}/{role}")))
            rows.append(check_stopping(model, log, int(cfg.train.max_response_length)))
            tokens += int(log.loc[log["step"] == 2, "num_tokens"].sum())
            gaps = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/rollout_logprob_gap")}
            rows.append(check_sync(model, gaps))
            reserved = client.get_metric_history(run.info.run_id, schema.TRAIN + GPU_PEAK)
            if reserved:
                peaks[model] = max(m.value for m in reserved)
    rows += [check_host_memory(peak_gb, plan), *check_gpu_memory(env, plan, peaks)]
    costs = [(m.step, m.value) for m in client.get_metric_history(job.info.run_id, schema.GPU_HOURS)]
    walls = {m.step: m.value for m in client.get_metric_history(job.info.run_id, schema.STEP_SECONDS)}
    for role, run in models.items():
        history = {key: next((m.value for m in client.get_metric_history(run.info.run_id, key) if m.step == 2), 0.0)
                   for key in [*map(schema.phase_metric, schema.PHASES), schema.WAIT_SECONDS]}
        rows.append(check_timeline(str(cfg.pair[role]), history, walls.get(2)))
        rows.append(check_mfu(str(cfg.pair[role]), env,
                              [m.value for m in client.get_metric_history(run.info.run_id, schema.MFU)]))
    step = step_time(cfg, full, costs, walls)
    rows.append(check_time(full, step, tokens))
    rows.append(check_checkpoint(run_directory(cfg), plan))
    written = [m.value for m in client.get_metric_history(job.info.run_id, schema.CHECKPOINT_SECONDS)]
    rows.append(check_checkpoint_time(written, job.data.tags.get(schema.SIGNAL_LEAD)))
    verdict = FAIL if any(r.status == FAIL for r in rows) else PASS
    client.set_tag(job.info.run_id, PREFLIGHT_TAG, verdict)
    if step is not None:   # what python -m graft_exp.plan projects this job from, once the preflight passed
        client.set_tag(job.info.run_id, schema.PREFLIGHT_STEP_DEVICE_S, f"{step.device_s:.6g}")
        client.set_tag(job.info.run_id, schema.PREFLIGHT_STEP_S, f"{step.wall_s:.6g}")
    client.log_text(job.info.run_id, json.dumps([asdict(r) for r in rows], indent=1), "preflight/report.json")
    client.log_text(job.info.run_id, markdown(rows), "preflight/report.md")
    return rows


def markdown(rows: list[Check]) -> str:
    lines = ["| check | model | status | measured | expected | fix |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.check} | {r.model} | {r.status} | {r.measured.replace('|', '/')} | {r.expected} | {r.fix} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def show(rows: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    colour = {PASS: "green", FAIL: "bold red", NOT_HERE: "yellow", INFO: "cyan"}
    table = Table(title="preflight")
    for column in ("check", "model", "status", "measured", "expected"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(r.check, r.model, f"[{colour[r.status]}]{r.status}[/]", r.measured, r.expected)
    console = Console(width=max(Console().width, 160))
    console.print(table)
    for r in rows:
        if r.status == FAIL:
            console.print(f"[bold red]fail[/] {r.check} ({r.model}): {r.fix}", markup=True, highlight=False)


def compose(overrides: list[str]) -> DictConfig:
    from graft_exp.launching.jobs import Composer

    return Composer().compose(overrides)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m graft_exp.preflight", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the job, as for python -m graft_exp")
    overrides = parser.parse_args(list(sys.argv[1:] if argv is None else argv)).overrides
    try:
        full = compose(overrides)
        root = Path(str(full.checkpoint_root)).resolve() / "preflight" / time.strftime("%Y%m%d-%H%M%S")
        shape = miniature(full, root)
        cfg = compose(overrides + shape)
        resources.check_job(cfg)
        tracking.check_store(str(cfg.tracking.uri))
    except (ConfigError, tracking.TrackingError) as err:
        print(f"preflight: {err}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as err:   # a typo in an override: Hydra's message, one line
        print(f"preflight: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "graft_exp", *(["-m"] if cfg.cluster.name != "local" else []), *overrides, *shape]
    print("preflight:", " ".join(command[1:]), flush=True)
    since_ms = int(time.time() * 1000) - 1000
    rc = subprocess.run(command, check=False).returncode
    # The job's process ran here (cluster=local): its peak resident memory is the host figure.
    peak_gb = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / resources.GB
               if cfg.cluster.name == "local" else None)
    rows = report(cfg, full, rc, peak_gb, since_ms)
    show(rows)
    return 1 if any(r.status == FAIL for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
