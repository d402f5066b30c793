"""The MLflow schema (docs/design.md "MLflow schema"): every tag and metric name training writes and
analysis reads, with when it is written. The contract between ``graft_exp`` and ``analysis``; tests
check that both backends write only these names and that ``analysis/`` reads only these names.

``<bench>`` stands for a benchmark key of the pair (``math500``, ``aime2024``, ``aime2025``, ``amc23``,
``minerva``; the tiny pair's ``add``, ``sub``, ``mul``, ``mixed``).
"""

from __future__ import annotations

import re

#: A study's MLflow experiment: ``graft/<study>``. The analysis, the comparisons and every run lookup read these
#: experiments only (``GRAFT_EXPERIMENTS``); ``python -m graft_exp.preflight`` records its jobs under
#: ``graft-preflight/<study>``, which none of them sees.
EXPERIMENT_PREFIX = "graft/"
PREFLIGHT_PREFIX = "graft-preflight/"
GRAFT_EXPERIMENTS = f"name LIKE '{EXPERIMENT_PREFIX}%'"
PREFLIGHT_EXPERIMENTS = f"name LIKE '{PREFLIGHT_PREFIX}%'"   # what python -m graft_exp.plan projects from


def experiment_name(study: str, preflight: bool = False) -> str:
    return f"{PREFLIGHT_PREFIX if preflight else EXPERIMENT_PREFIX}{study}"


#: The job's environment (graft_exp.environment), tags of the job run set at creation and on every
#: resume: library versions ("none" when not installed); GPU, driver and CUDA only where there is a GPU.
ENV_PREFIX = "graft.env."
#: Libraries whose version is recorded: distribution name (as pip knows it) -> tag.
ENV_LIBRARY_TAGS = {dist: ENV_PREFIX + dist.replace("-", "_")
                    for dist in ("torch", "transformers", "verl", "vllm", "math-verify", "mlflow", "ray", "flash-attn")}
ENV_GPU, ENV_DRIVER, ENV_CUDA = ENV_PREFIX + "gpu", ENV_PREFIX + "driver", ENV_PREFIX + "cuda"
ENV_TAGS = {
    **{tag: f"{dist} version" for dist, tag in ENV_LIBRARY_TAGS.items()},
    ENV_GPU: "GPU model (nvidia-smi)", ENV_DRIVER: "NVIDIA driver version",
    ENV_CUDA: "CUDA version torch was built with",
}
#: Tags of a job run (one per Hydra job) -> when they are set.
JOB_TAGS = {
    "graft.run_key": "at creation: hash of the resolved config without launcher/tracking/paths (identity)",
    "graft.study": "at creation", "graft.method": "at creation", "graft.pair": "at creation",
    "graft.seed": "at creation", "graft.backend": "at creation", "graft.git_sha": "at creation",
    "graft.slurm_job_id": "at creation and on every resume, under Slurm",
    "graft.host": "at creation and on every resume", "graft.pid": "at creation and on every resume",
    "graft.log": "at creation and on every resume, when the launcher names a log file",
    "graft.budget_gpu_hours": "at creation, with an equal-compute budget (train.max_gpu_hours or gpu_hours_of)",
    "graft.budget_flops": "at creation, with a counted budget (train.max_flops or flops_of)",
    "graft.last_step": "when training ends: the last trained step (below train.max_steps when the budget ran out)",
    "graft.run_key_before": "by python -m graft_exp.rekey, when it changed graft.run_key: the key it replaced",
    "graft.prompt_date": "at creation: the date chat templates that read the clock render (kept on resume)",
    "graft.preflight": "on a preflight's job run (experiment graft-preflight/<study>), after its checks: pass | fail",
    "graft.preflight_step_device_s": "on a preflight's job run, after its checks: device-seconds of one full-size step "
                                     "of the job it stands for (step 2 scaled to its prompts; what the plan projects from)",
    "graft.preflight_step_s": "on a preflight's job run, after its checks: wall seconds of one full-size step",
    "graft.tracking_gap": "after a tracking outage, when the store answers again: '<since> to <back>: N records "
                          "kept in the job's spool, being sent', then '..., sent in order at <time>'; outages joined "
                          "by '; '",
    "graft.signal_lead_s": "at the job's start, under a launcher that warns before the time limit: the seconds between "
                           "the warning (USR2) and the limit (hydra.launcher.signal_delay_s)",
    **ENV_TAGS,
}
#: Tags of a model run (child of the job run, one per trained model).
MODEL_TAGS = {
    "graft.run_key": "at creation (per model: shared GRPO baselines are found by it)",
    "graft.model": "at creation", "graft.peer": "at creation (the peer's model key; a group's other members' keys joined by ','; or none)",
    "graft.role": "at creation (A/B; C.. in a group)",
    "graft.study": "at creation", "graft.method": "at creation", "graft.pair": "at creation",
    "graft.seed": "at creation", "graft.backend": "at creation", "graft.n": "at creation",
    "graft.slurm_job_id": "as the job run's", "graft.host": "as the job run's", "graft.pid": "as the job run's",
    "graft.log": "as the job run's",
    "graft.best_step": "when training ends: the selected (trained) checkpoint's step",
    "graft.data_order": "at creation: hash of what fixes each step's prompts (a graft_stored replay must match)",
    "graft.run_key_before": "as the job run's",
    "graft.stop_ids": "at the job's start: the token ids the model's rollouts stop on, in order (end of turn first)",
    "graft.rendered_prompt": "at the job's start: the first training problem as the model receives it (5000 chars at most)",
    "graft.prompt_format": "at creation, for a model with a catalog prompt format: <name>@<16 hex of its template's "
                           "SHA-256> (the digest its run key holds)",
    "graft.tracking_gap": "as the job run's",
    "graft.revision": "at creation, for a hub model whose catalog pins a snapshot revision: that revision",
}
#: Metrics of a job run, step = training step.
JOB_METRICS = {
    "cost/gpu_hours": "every step: cumulative joint cost, GPUs x training-step wall seconds / 3600",
    "cost/flops": "every step: cumulative counted FLOPs of the training steps, the sum of its models'",
    "score": "at the end (step 0), when every model of the job was evaluated: the job's score (graft_exp.scores)",
    "time/checkpoint_s": "at each checkpoint: the seconds writing it took (every model's state, the loop's, the rename)",
    "time/step_s": "every step: the training step's wall time (sampling to the record written; the GPU-hours' wall "
                   "is this up to the trajectory log, before the transfer log)",
    "time/record_s": "every step: writing the step's record (metrics, trajectory and transfer logs, the probe)",
    "exchange/A_to_B": "every step of an online co-trained method: prompts selected A -> B",
    "exchange/B_to_A": "every step of an online co-trained method: prompts selected B -> A",
    "exchange/<S>_to_<R>": "every step of an online co-trained group: prompts receiver R took from S, each ordered pair",
}
#: The phases of a step's timeline: each model's busy time in a step cut into what it was doing
#: (``costs.Timeline``), the same on both backends. verl's trainer times its own stages the same way
#: (``marked_timer`` -> ``timing_s/*``); these are the project's names.
PHASES = {
    "generate": "its rollouts in the engine",
    "reward": "verifying its rollouts' answers, and a replayed log's",
    "logprob": "its old log-probs where a pass of their own computes them (verl), and any reference-model pass",
    "score": "scoring the peers' responses under its old policy, with the exchange's bookkeeping shared out",
    "update": "its optimizer steps on the method's loss",
    "sync": "its trainer's weights sent to its rollout engine (verl)",
}
#: Metrics of a model run: step = training step, except test/* (step = evaluation run 0..R-1).
MODEL_METRICS = {
    "train/reward_mean": "every step", "train/all_fail_frac": "every step",
    "train/informative_frac": "every step: prompts with 0 < k < n",
    "train/response_tokens_mean": "every step",
    "train/loss": "every step: mean minibatch loss",
    "train/clipfrac_self": "every step (HACPO: sequences)",
    "train/clipfrac_peer": "steps with peer tokens (HACPO: sequences)",
    "train/peer_solved_frac": "steps where this model failed some prompt and a peer sampled the same prompts",
    "train/peer_solved_frac/<S>": "as train/peer_solved_frac, in a group of K > 2: the share member S solved",
    "train/peer_groups": "every step of a co-trained method", "train/peer_admitted": "every step of a co-trained method",
    "train/compat_mean": "steps where peer groups were scored",
    "train/rollout_logprob_gap": "every step on backend=verl: the largest mean per-token |vLLM - FSDP| log-prob gap "
                                 "of a response this model sampled (a weight sync that delivers nothing shows here)",
    "train/gpu_peak_reserved_gb": "every step on backend=verl: the trainer's peak reserved GPU memory so far (GiB, "
                                  "verl's perf/max_memory_reserved_gb of the update; 0 without a GPU)",
    "train/peer_copies_cut": "every step with peer rows: peer responses longer than this model's response limit in "
                             "its tokens (method.cut_copies: dropped, or trained as cut)",
    "cost/gpu_hours": "every step: cumulative, this model's cost (its share of a joint run)",
    **{f"time/{phase}_s": f"every step: this model's busy seconds in the step's {phase} phase ({meaning}; "
                          "docs/design.md \"The step's timeline\")" for phase, meaning in PHASES.items()},
    "time/wait_s": "every step: the step's wall time before its record that this model's pool was not busy (waiting "
                   "for the other models' phases)",
    "time/validate_s": "validation steps: the seconds this model's validation took",
    "time/test_s": "at the end (step 0): the seconds this model's final evaluation took",
    "perf/mfu": "every step on a device with a known dense bf16 peak: model FLOPs utilisation of the update (verl: "
                "verl's own, from its flops counter; local: counted FLOPs / (update device-seconds x the peak))",
    "cost/flops": "every step: cumulative counted FLOPs of this model's sampling, scoring and updates (costs.ModelFlops)",
    "transfers/admitted": "every step of a method that transfers: peer responses admitted into this model's update",
    "transfers/absorbed": "with train.probe_transfers: of its candidates (prompts it failed, the source solved) "
                          "it received a group on, the share it solves after the update (k > 0)",
    "transfers/control_absorbed": "with train.probe_transfers: the same share on its controls (candidates it did "
                                  "not receive)",
    "val/<bench>": "validation steps (0, every eval.val_every, last)", "val/avg": "validation steps",
    "test/<bench>": "final evaluation of the best checkpoint, one per run", "test/avg": "final evaluation",
    "score": "at the end (step 0): the model's final score, the mean of its runs' test/avg (graft_exp.scores); "
             "the one value the MLflow UI's runs table shows for it",
}
# Names the writers use (driver.py, tracking/); each is a key of the tables above.
GPU_HOURS, FLOPS, SCORE = "cost/gpu_hours", "cost/flops", "score"
#: The charges a budget is spent in: unit (``train.max_<unit>``, ``train.<unit>_of``, a sweep's ``compute_unit``)
#: -> the cost metric it is compared with; the job run's budget tag is ``graft.budget_<unit>``.
CHARGES = {"gpu_hours": GPU_HOURS, "flops": FLOPS}
TRAIN, VAL, TEST = "train/", "val/", "test/"      # prefixes of MODEL_METRICS' train/*, val/<bench>, test/<bench>
BEST_STEP = "graft.best_step"
RUN_KEY, MODEL, PEER, ROLE = "graft.run_key", "graft.model", "graft.peer", "graft.role"
#: ``graft.peer`` of a model trained alone (a GRPO baseline): it has no peer.
NO_PEER = "none"
RUN_KEY_BEFORE, PROMPT_DATE = "graft.run_key_before", "graft.prompt_date"
STOP_IDS, RENDERED_PROMPT = "graft.stop_ids", "graft.rendered_prompt"
PROMPT_FORMAT, REVISION, PREFLIGHT = "graft.prompt_format", "graft.revision", "graft.preflight"
PREFLIGHT_STEP_DEVICE_S, PREFLIGHT_STEP_S = "graft.preflight_step_device_s", "graft.preflight_step_s"
SIGNAL_LEAD, CHECKPOINT_SECONDS = "graft.signal_lead_s", "time/checkpoint_s"
TRACKING_GAP = "graft.tracking_gap"
STEP_SECONDS, RECORD_SECONDS, WAIT_SECONDS = "time/step_s", "time/record_s", "time/wait_s"
VALIDATE_SECONDS, TEST_SECONDS, MFU = "time/validate_s", "time/test_s", "perf/mfu"


def phase_metric(phase: str) -> str:
    """A model's metric of its busy seconds in timeline phase ``phase`` (``costs.PHASES``)."""
    return f"time/{phase}_s"


#: Metrics measured on the clock, not computed: the same job run twice records other values (every other metric of
#: a seeded job on the local backend repeats bit for bit).
WALL_CLOCK = (GPU_HOURS, CHECKPOINT_SECONDS, STEP_SECONDS, RECORD_SECONDS, WAIT_SECONDS, VALIDATE_SECONDS,
              TEST_SECONDS, MFU, *map(phase_metric, PHASES))
STUDY, METHOD, PAIR, SEED, BACKEND = "graft.study", "graft.method", "graft.pair", "graft.seed", "graft.backend"
GIT_SHA, N, DATA_ORDER = "graft.git_sha", "graft.n", "graft.data_order"
BUDGET, BUDGET_FLOPS, LAST_STEP = "graft.budget_gpu_hours", "graft.budget_flops", "graft.last_step"
SLURM_JOB_ID, HOST, PID, LOG = "graft.slurm_job_id", "graft.host", "graft.pid", "graft.log"   # where a job runs


def budget_tag(unit: str) -> str:
    """The job-run tag recording a budget in ``unit`` (a key of ``CHARGES``)."""
    return f"graft.budget_{unit}"


def budget_unit(tags: dict[str, str]) -> str | None:
    """The unit of the budget a job run's ``tags`` record (a key of ``CHARGES``), or None without one."""
    return next((unit for unit in CHARGES if budget_tag(unit) in tags), None)


def exchange_metric(source: str, receiver: str) -> str:
    """The job metric counting the prompts selected from role ``source`` to role ``receiver``."""
    return f"exchange/{source}_to_{receiver}"


def peer_solved_metric(peer: str) -> str:
    """A group member's model metric: of its all-fail prompts, the share the member in role ``peer`` solved."""
    return f"{TRAIN}peer_solved_frac/{peer}"


#: Tags of runs that are not training runs (the analysis skips them as such): the analysis run that holds
#: regenerated tables and figures, and a seeds-until-decided sweep's own run (its rounds and decisions).
ANALYSIS_TAGS = {
    "graft.analysis": "on the analysis run `python -m analysis ... --log-to-mlflow` creates; "
                      "'until-decided' on the run of `python -m graft_exp.sweep SWEEP --until-decided`",
    "graft.sweep": "on an until-decided run, at creation: the sweep file",
    "graft.decision.<method>_vs_<reference>": "on an until-decided run, after every round: the comparison's state",
}
ANALYSIS, SWEEP, DECISION_PREFIX = "graft.analysis", "graft.sweep", "graft.decision."

_BENCH = re.compile(r"^(val|test)/[a-z0-9_]+$")


def known_metric(key: str, run: str) -> bool:
    """Whether ``key`` is a schema metric of a ``run`` ("job" or "model") run."""
    names = JOB_METRICS if run == "job" else MODEL_METRICS
    return key in names or (run == "model" and bool(_BENCH.match(key)))


def known_tag(key: str) -> bool:
    """Whether ``key`` is a ``graft.*`` tag of the schema (MLflow's own ``mlflow.*`` tags are not ours)."""
    return (key in JOB_TAGS or key in MODEL_TAGS or key in ANALYSIS_TAGS
            or (key.startswith(DECISION_PREFIX) and "_vs_" in key[len(DECISION_PREFIX):]))
