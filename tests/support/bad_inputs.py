"""Bad inputs a new user can give, and what each must get: one clear message, a non-zero exit, no
traceback, and nothing created (no run, no experiment, no checkpoint directory).

``CASES`` is the table ``tests/test_bad_inputs.py`` runs; ``python tests/support/bad_inputs.py docs/bad-inputs.md``
runs every case once and writes the table with the message each got, its exit code and its time to fail.

Every case runs in a fresh directory holding a seeded SQLite store (experiment ``graft/default`` with the
GRPO n=8 logs a ``graft_stored`` job would replay, written in another data order) and a checkpoint root
with an unfinished run's corrupt checkpoint; the store's content is compared before and after.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))   # as a script: this checkout's graft_exp, whatever is installed


SWEEP_TEXT = "study: default\nruns:\n  - {method: [grpo_n8, graft], seed: 0}\n"


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]             # after `python -m graft_exp` (or graft_exp.sweep with sweep=True)
    expect: str                       # a piece of the message the user must see
    hide: tuple[str, ...] = ()        # packages the process must not find (a meta-path blocker)
    env: dict = field(default_factory=dict)
    sweep: bool = False               # with module graft_exp.sweep: a valid sweep.yaml, then ARGS
    corrupt_checkpoint: bool = False  # leave a corrupt checkpoint for the run key of ``args``
    module: str = "graft_exp"         # the entry point: graft_exp, graft_exp.sweep, analysis, ...
    files: dict = field(default_factory=dict)   # name -> text written into the case's directory first
    without_gpu: bool = False         # a case about a GPU this machine lacks: skipped where one exists

    @property
    def program(self) -> str:
        return f"python -m {self.module}" + (" sweep.yaml" if self.sweep else "")


CASES = [
    Case("GPU pair on the local backend", ("pair=pair1",), "pair=pair1 needs GPUs: use backend=verl"),
    Case("verl backend without verl installed", ("backend=verl", "pair=pair1"), "pip install -e '.[verl]'",
         hide=("verl",)),
    Case("verl backend on the CPU pair", ("backend=verl",), "Use backend=local, or pair=pair1|pair2|pair3"),
    Case("negative step count", ("train.max_steps=-1",), "train.max_steps=-1 must be an integer >= 1"),
    Case("negative evaluation temperature", ("eval.temperature=-1",), "eval.temperature=-1.0 must be > 0"),
    Case("empty batch", ("train.batch_prompts=0",), "train.batch_prompts=0 must be an integer >= 1"),
    Case("batch not a multiple of the minibatch", ("train.minibatch_prompts=5",),
         "train.batch_prompts=16 is not a multiple of train.minibatch_prompts=5"),
    Case("no PPO epoch", ("train.ppo_epochs=0",), "train.ppo_epochs=0 must be an integer >= 1"),
    Case("negative warm-up", ("train.lr_warmup_steps=-5",), "train.lr_warmup_steps=-5 must be an integer >= 0"),
    Case("bf16 on the local backend", ("train.precision=bf16",),
         "train.precision=bf16 is not supported by backend=local"),
    Case("KL term on the local backend", ("train.kl_coef=0.01",),
         "train.kl_coef=0.01 is not supported by backend=local (no kl term in its loss)"),
    Case("unknown optimizer", ("train.optimizer=sgd",), "train.optimizer='sgd' is not one of adamw"),
    Case("top-p above 1", ("train.top_p=1.5",), "train.top_p=1.5 must be in (0, 1]"),
    Case("gate floor outside [0, 1]", ("method.delta=1.5",), "method.delta=1.5 is outside [0, 1]"),
    Case("one rollout per prompt", ("method.n=1",), "method.n=1: GRPO needs at least 2 rollouts"),
    Case("HACPO on a group of three", ("group=tiny3", "method=hacpo"), "method=hacpo trains exactly two models"),
    Case("unknown source rule", ("group=tiny3", "method.source_rule=best"),
         "method.source_rule='best' is not one of most_successes, compatibility, random"),
    Case("the same model twice", ("pair.B=tiny-char-llama",), "names 'tiny-char-llama' twice"),
    Case("a gap in a group's members", ("pair.D=tiny-unigram-neox",), "members are consecutive letters from A"),
    Case("unknown group", ("group=tiny4",), "Could not find 'group/tiny4'"),
    Case("wrong type: root", ("seed=abc",), "Value 'abc' of type 'str' could not be converted to Integer"),
    Case("wrong type: train", ("train.batch_prompts=abc",), "full_key: train.batch_prompts"),
    Case("wrong type: pair", ("pair.gpus=many",), "full_key: pair.gpus"),
    Case("wrong type: method", ("method.gate=maybe",), "full_key: method.gate"),
    Case("wrong type: backend", ("backend.threads=two",), "full_key: backend.threads"),
    Case("misspelt key", ("train.learning_rate=1e-5",), "Key 'learning_rate' not in 'TrainConfig'"),
    Case("unknown group option", ("method=grpo_n7",), "Could not find 'method/grpo_n7'"),
    Case("tracking=server without its URI", ("tracking=server",), "needs MLFLOW_TRACKING_URI"),
    Case("unreachable tracking server", ("tracking.uri=http://127.0.0.1:9",),
         "the MLflow tracking server http://127.0.0.1:9 does not answer"),
    Case("unwritable store", ("tracking.uri=sqlite:////proc/graft/mlflow.db",),
         "cannot write the MLflow store sqlite:////proc/graft/mlflow.db"),
    Case("unwritable checkpoint root", ("checkpoint_root=/proc/graft",), "checkpoint_root=/proc/graft: cannot write"),
    Case("checkpoint root under a file", ("checkpoint_root=store.db/ckpt",), "is a file, not a directory"),
    Case("corrupt checkpoint", ("train.max_steps=4",), "cannot be loaded (JSONDecodeError", corrupt_checkpoint=True),
    Case("replayed log of another data order", ("method=graft_stored",), "was written in another data order"),
    Case("multirun with one bad job", ("-m", "train.max_steps=2,0"),
         "train.max_steps=0): train.max_steps=0 must be an integer >= 1"),
    Case("sweep with a bad job", ("train.top_p=0",), "train.top_p=0.0 must be in (0, 1]", sweep=True,
         module="graft_exp.sweep"),
    Case("cores per job not a number", (), "GRAFT_JOB_CORES='two' is not a number of cores",
         env={"GRAFT_JOB_CORES": "two"}),
    # Values a range check would accept but a run cannot honour.
    Case("not a number where a range check passes", ("method.adv_eps=nan",),
         "method.adv_eps=nan must be a finite number"),
    Case("an infinite gradient clip", ("train.grad_clip=inf",), "train.grad_clip=inf must be a finite number"),
    Case("prompt + response beyond the model's positions", ("train.max_response_length=100",),
         "= 228 tokens, but tiny-char-llama holds 192 positions"),
    Case("a CUDA device this machine lacks", ("backend.device=cuda",),
         "backend.device=cuda but this machine has no CUDA GPU", without_gpu=True),
    # Files handed to an entry point.
    Case("sweep file that is not YAML", ("broken.yaml",), "broken.yaml is not valid YAML (",
         module="graft_exp.sweep", files={"broken.yaml": "study: x\nruns: [\n"}),
    Case("YAML file that is not a sweep", ("grid.yaml",), "grid.yaml: runs is 3, not a non-empty list",
         module="graft_exp.sweep", files={"grid.yaml": "study: x\nruns: 3\n"}),
    Case("sweep path that is a folder", ("sweeps",), "cannot read the sweep file sweeps (Is a directory)",
         module="graft_exp.sweep", files={"sweeps/main.yaml": SWEEP_TEXT}),
    Case("a postgresql:// store that does not answer", ("tracking.uri=postgresql://graft@127.0.0.1:9/mlflow",),
         "the tracking database postgresql://graft@127.0.0.1:9/mlflow does not answer"),
    Case("a store file that is not an MLflow store", ("tracking.uri=sqlite:///notes.db",),
         "notes.db is not an MLflow store", files={"notes.db": "my notes, not a database"}),
    Case("analysis of a file that is not an MLflow store",
         ("tables", "--tracking-uri", "sqlite:///notes.db", "--out", "reports"), "notes.db is not an MLflow store",
         module="analysis", files={"notes.db": "my notes, not a database"}),
    Case("analysis output into a file", ("tables", "--tracking-uri", "sqlite:///store.db", "--out", "store.db"),
         "--out store.db is a file; give a folder", module="analysis"),
    Case("prepare into a file", ("--data-dir", "store.db", "--no-models"),
         "--data-dir store.db: ", module="graft_exp.prepare"),
    Case("server folder that is a file", ("start", "--dir", "store.db", "--host", "127.0.0.1"),
         "--dir store.db: ", module="graft_exp.server"),
    Case("sweep output into a file", ("sweep.yaml", "--out", "store.db"), "--out store.db: ",
         module="graft_exp.sweep", files={"sweep.yaml": SWEEP_TEXT}),
    Case("tiny models built into a file", ("build", "--out", "store.db"), "--out store.db: ", module="graft_exp.tiny"),
    Case("re-key of a store that is not there", ("--tracking-uri", "sqlite:///old.db"),
         "sqlite:///old.db does not exist; give the store to re-key", module="graft_exp.rekey"),
    Case("re-key of a server that does not answer", ("--tracking-uri", "http://127.0.0.1:9"),
         "the MLflow tracking server http://127.0.0.1:9 does not answer", module="graft_exp.rekey"),
    Case("a comparison reference that is not a method", ("-m", "method=graft,sgt", "compare_to=graf"),
         "compare_to=graf is not a method; choose one of"),
    Case("chat-template models on the local backend", ("pair=tiny_paper_vocab",),
         "tiny-qwen3-vocab is prompted through a chat template, which verl renders: use backend=verl"),
    Case("a comparison of jobs without test scores",
         ("methods", "--tracking-uri", "sqlite:///store.db", "--out", "reports"),
         "none of the 3 finished jobs selected has a final test score of each model", module="analysis"),
    Case("a rule parameter out of its range", ("method=graft_top_half", "method.params.top_fraction=1.5"),
         "method.params.top_fraction=1.5: method.selection=top_fraction needs a number in [0, 1]"),
    Case("a rule parameter that is not a number", ("method=graft_top_half", "method.params.top_fraction=abc"),
         "method.params.top_fraction=abc: method.selection=top_fraction needs a number in [0, 1]"),
    Case("a rule parameter set to null", ("method=graft_top_half", "method.params.top_fraction=null"),
         "method.params.top_fraction=null: method.selection=top_fraction needs a number in [0, 1]"),
    Case("both budgets at once", ("train.max_gpu_hours=1", "train.max_flops=1e12"),
         "train.max_gpu_hours=1.0 and train.max_flops=1000000000000.0 all set the budget; keep one of them"),
    Case("a budget in a unit no job records", ("tokens.yaml",), "compute_unit='tokens': no job records cost/tokens",
         module="graft_exp.sweep", files={"tokens.yaml": "study: x\nruns:\n  - {method: graft, compute_of: "
                                                          "{method: grpo_n8}, compute_unit: tokens}\n"}),
    Case("a counted budget whose reference recorded GPU-hours only", ("train.flops_of=old-job",),
         "train.flops_of=old-job: that job recorded no cost/flops (it ran before that charge existed; it records "
         "cost/gpu_hours): budget with train.gpu_hours_of instead"),
    Case("one chat template for every model of a pair",
         ("backend=verl", "pair=pair1", "backend.verl_overrides=['actor_rollout_ref.model.custom_chat_template=x']"),
         "backend.verl_overrides sets actor_rollout_ref.model.custom_chat_template for every model of the job; it is "
         "each model's own: use models.<key>.prompt_format=<name>"),
    Case("a verl override that does not parse (Jinja on the command line)",
         ("backend=verl", "pair=pair1", "backend.verl_overrides=['actor_rollout_ref.rollout.x={%- if x %}']"),
         "does not parse as dotted key=value settings"),
    Case("a prompt format that does not exist", ("backend=verl", "pair=pair1",
                                                   "models.smollm3-3b-base.prompt_format=chatlm"),
         "models.smollm3-3b-base.prompt_format='chatlm' is not a prompt format; choose one of chatml, qwen3, llama3"),
]


class Hide:
    """A meta-path finder for which the packages ``hidden`` are not installed."""

    def __init__(self, hidden: set[str]):
        self.hidden = hidden

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def run_entry_point(hide: tuple[str, ...], module: str, args: list[str]) -> None:
    """``python -m MODULE ARGS`` as a user's shell runs it, in this process, with the packages ``hide`` not
    installed (also where this process imported them already)."""
    hidden = set(hide)
    for name in [m for m in sys.modules if m.split(".")[0] in hidden]:
        del sys.modules[name]
    sys.meta_path.insert(0, Hide(hidden))
    # An entry module imported before (ForkedCases' preload) would not run as __main__.
    sys.modules.pop(module, None)
    sys.modules.pop(f"{module}.__main__", None)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def seed_store(where: Path) -> None:
    """The store every case starts from: graft/default with FINISHED GRPO n=8 model runs of both tiny
    models (seed 0) tagged with a data order no current job has, and a FINISHED job that recorded GPU-hours only."""
    from mlflow.tracking import MlflowClient

    from graft_exp.tracking import EXPERIMENT_TAGS

    client = MlflowClient(f"sqlite:///{where / 'store.db'}")
    experiment = client.create_experiment("graft/default", tags=EXPERIMENT_TAGS)
    for model in ("tiny-char-llama", "tiny-bpe-gpt2"):
        run = client.create_run(experiment, tags={
            "graft.run_key": f"old-{model}", "graft.method": "grpo_n8", "graft.model": model, "graft.seed": "0",
            "graft.data_order": "an-older-order"})
        client.set_terminated(run.info.run_id, "FINISHED")
    # A finished job from before the counted charge: it recorded cost/gpu_hours only.
    job = client.create_run(experiment, tags={"graft.run_key": "old-job", "graft.method": "grpo_n8"})
    client.log_metric(job.info.run_id, "cost/gpu_hours", 0.05, step=20)
    client.set_terminated(job.info.run_id, "FINISHED")


def store_content(db: Path) -> list:
    """Everything a run or experiment would change, in a comparable form."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    experiments = client.search_experiments(view_type=3)
    runs = client.search_runs([e.experiment_id for e in experiments], run_view_type=3) if experiments else []
    return ([(e.experiment_id, e.name, e.lifecycle_stage, sorted(e.tags.items())) for e in experiments] +
            [(r.info.run_id, r.info.status, r.info.end_time, sorted(r.data.tags.items()),
              sorted(r.data.params.items()), sorted(r.data.metrics.items())) for r in runs])


def run_key_of(overrides: tuple[str, ...], where: Path) -> str:
    from hydra import compose, initialize_config_dir

    from graft_exp import tracking
    from graft_exp.config import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"checkpoint_root={where / 'ckpt'}"])
    return tracking.run_key(cfg)


def prepare(case: Case, where: Path, template: Path | None = None) -> None:
    """A fresh directory with the seeded store (copied from ``template`` when given) and, for a corrupt
    checkpoint case, that run key's checkpoint with a truncated loop state."""
    where.mkdir(parents=True, exist_ok=True)
    if template is not None:
        shutil.copy(template, where / "store.db")
    else:
        seed_store(where)
    for name, text in case.files.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(text)
    if case.corrupt_checkpoint:
        ckpt = where / "ckpt" / run_key_of(case.args, where) / "ckpt-2"
        ckpt.mkdir(parents=True)
        (ckpt / "driver.json").write_text('{"step": 2, "cursors": {"shar')


def arguments(case: Case, where: Path) -> list[str]:
    """The command line after ``python -m MODULE`` (the store and checkpoint root of ``where``)."""
    if case.module not in ("graft_exp", "graft_exp.sweep"):   # no Hydra overrides: the arguments as given
        return list(case.args)
    defaults = [f"checkpoint_root={where / 'ckpt'}"]
    if not any(a.startswith("tracking") for a in case.args):   # a case about tracking names its own store
        defaults.insert(0, f"tracking.uri=sqlite:///{where / 'store.db'}")
    flags = [a for a in case.args if a.startswith("-") or "=" not in a]   # options and the sweep file
    # After the defaults: the case's own value of a default wins (Hydra takes the last of two overrides).
    args = [*flags, *defaults, *(a for a in case.args if a not in flags)]
    if case.sweep:
        (where / "sweep.yaml").write_text(SWEEP_TEXT)
        args = ["sweep.yaml", *args]
    return args


def case_env(case: Case) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_", "GRAFT_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **case.env)
    env.pop("HYDRA_FULL_ERROR", None)   # Hydra's own one-message form, as a user sees it
    return env


@dataclass
class Outcome:
    returncode: int
    output: str       # stdout and stderr, interleaved as a terminal shows them
    seconds: float


def run_case(case: Case, where: Path) -> Outcome:
    """The case in a fresh Python process, from interpreter start to exit (docs/bad-inputs.md's times)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--run", ",".join(case.hide), case.module,
                           *arguments(case, where)], cwd=where, env=case_env(case), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
    return Outcome(done.returncode, done.stdout, time.perf_counter() - start)


#: What the entry points import before they read their arguments: mlflow, torch and Hydra are most of a fresh
#: process's time to fail (~2 s of ~2.1 s on two cores).
PRELOAD = ["graft_exp.__main__", "graft_exp.sweep.__main__", "analysis.__main__", "graft_exp.prepare",
           "graft_exp.server", "graft_exp.tiny.__main__"]


def _forked_case(where: str, env: dict, output: str, hide: tuple, module: str, args: list) -> None:
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(where)
    os.environ.clear()
    os.environ.update(env)
    run_entry_point(hide, module, args)


class ForkedCases:
    """Runs each case in a process of its own (its exit code, output and state) forked from one that imported
    ``PRELOAD`` once (multiprocessing's forkserver), without paying those imports per case."""

    def __init__(self):
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)

    def __call__(self, case: Case, where: Path) -> Outcome:
        output = where.parent / f"{where.name}.out"
        start = time.perf_counter()
        process = self.context.Process(target=_forked_case, args=(
            str(where), case_env(case), str(output), case.hide, case.module, arguments(case, where)))
        process.start()
        process.join(timeout=300)
        if process.exitcode is None:
            process.kill()
            process.join()
        return Outcome(process.exitcode, output.read_text(), time.perf_counter() - start)


def message(done: Outcome, case: Case) -> str:
    """The line of the output that carries the expected message (the first error line otherwise)."""
    lines = [line.strip() for line in done.output.splitlines() if line.strip()]
    for line in lines:
        if case.expect in line:
            return line.split("] - ", 1)[-1]
    return next((line for line in lines if "rror" in line), lines[0] if lines else "")


def write_table(path: Path) -> None:
    import tempfile

    rows = ["| # | bad input | command | exit | time to fail (s) | message |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(CASES, 1):
            where = Path(tmp) / f"case{i}"
            prepare(case, where)
            done = run_case(case, where)
            shown = message(done, case).replace("|", "\\|")
            rows.append(f"| {i} | {case.name} | `{case.program} {' '.join(case.args)}` | {done.returncode} | "
                        f"{done.seconds:.1f} | {shown} |")
            print(rows[-1], flush=True)
    path.write_text(
        "# Bad inputs and what they get\n\n"
        "Generated by `python tests/support/bad_inputs.py docs/bad-inputs.md` (the cases of\n"
        "`tests/support/bad_inputs.py`, which `tests/test_bad_inputs.py` runs and checks: non-zero exit, no\n"
        "traceback, this message, the store and the checkpoint root unchanged). Every `graft_exp` and `graft_exp.sweep` command also gets\n"
        "`tracking.uri=sqlite:///<dir>/store.db checkpoint_root=<dir>/ckpt` (a case about the store names its own);\n"
        "the other entry points get their arguments as shown, in a directory holding `store.db` and `ckpt/`.\n"
        "The time is the wall time of the whole process, Python start included.\n\n"
        + "\n".join(rows) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "--run":   # one case's process (run_case): --run HIDDEN,PACKAGES MODULE ARGS...
        run_entry_point(tuple(sys.argv[2].split(",")) if sys.argv[2] else (), sys.argv[3], sys.argv[4:])
    else:
        write_table(Path(sys.argv[1]))
