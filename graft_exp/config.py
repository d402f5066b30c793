"""Typed schemas of the config root and the method group, and the validation every job runs before it starts.

The root schema (``config_schema``, first in ``conf/config.yaml``'s defaults) types the top-level
keys, so ``seed=abc`` or ``rerun=maybe`` fails at composition, before any run exists. The method
schema is registered as ``method_schema``; every ``conf/method/*.yaml`` extends it (directly or
through ``graft``), so a misspelt key in a method file or on the command line fails at
composition. ``validate`` then checks the values and the combination (pair x method x backend)
and raises ``ConfigError`` naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig
from omegaconf.errors import InterpolationResolutionError

from graft_exp import methods

BACKENDS = ("local", "verl")
LOCAL_SAMPLERS = ("static_cache", "loop")   # graft_exp/backends/local_policy.py
ROLES = ("A", "B")               # the two models of a pair
PEER_OF = {"A": "B", "B": "A"}


class ConfigError(ValueError):
    """A composed configuration that cannot run; the message says what to change."""


@dataclass
class HacpoConfig:
    """HACPO's released configuration (paper App. B; official code recipe/hacpo)."""

    # The same numbers as graft_exp.algorithms.hacpo's HACPO_* defaults (test_config checks it); written
    # out here because the config layer does not import torch.
    self_clip_low: float = 3e-4
    self_clip_high: float = 4e-4
    peer_clip_init: float = 0.8      # L_m = min(1, init + step * m)
    peer_clip_step: float = 0.025
    kl_coef: float = 1e-3
    minibatch_prompts: int = 64


@dataclass
class MethodConfig:
    """One training method: GRPO baselines, GRAFT, its Appendix-G variants, HACPO, SGT, LUFFY.

    Defaults are full GRAFT with the paper's settings; each conf/method file changes only the
    components its variant changes.
    """

    name: str = MISSING               # the conf/method file name, e.g. graft_no_gate
    n: int = 8                        # rollouts per prompt per model
    co_train: bool = True             # two models trained together (False: each alone, GRPO)
    source: str = "online"            # online peer | stored: replay the peer's GRPO n=8 log
    selection: str = "balanced"       # which prompts transfer (eq. 3 + balanced exchange)
    peer_loss: str = "graft"          # how the receiver learns from peer responses
    gate: bool = True                 # compatibility weighting w = 1[s>delta] min(s,1) (eq. 9)
    delta: float = 0.8                # compatibility floor; 0 = no floor
    admission: str = "gate"           # gate | random (count-matched random admission)
    ratio: str = "token"              # token-level ratio (eq. 7) | sequence-level (ablation)
    peer_position: str = "last"       # minibatches containing peer groups: last | first | uniform
    advantages: str = "source"        # source-computed | pooled over receiver + peer group
    peer_responses: str = "all"       # all | success (success-only transfer)
    dynamic_sampling: bool = False    # DAPO: drop zero-variance groups, refill the batch
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float = 3.0         # verl's dual clip for A < 0, the same for every method (GRPO's loss)
    adv_eps: float = 1e-6
    sgt_lambda: float = 0.1           # SGT's NLL coefficient
    luffy_gamma: float = 0.1          # LUFFY's f(x) = x / (x + gamma)
    hacpo: HacpoConfig = field(default_factory=HacpoConfig)


@dataclass
class PairConfig:
    """Two models (roles A and B of conf/catalog/models.yaml), their training data and benchmarks."""

    name: str = MISSING
    A: str = MISSING
    B: str = MISSING
    data: str = MISSING               # math (prepare.py's Parquet) | tiny_arith (generated)
    benchmarks: list[str] = MISSING   # bench keys of val/<bench> and test/<bench>
    gpus: int = MISSING               # GPUs of one job (the paper: one 4-GPU node); 0 on CPU
    train_size: int | None = None  # tiny_arith: generated training prompts


@dataclass
class TrainConfig:
    """Paper Table 3 (conf/config.yaml); every backend reads the same names."""

    batch_prompts: int = MISSING
    minibatch_prompts: int = MISSING
    ppo_epochs: int = MISSING
    total_epochs: int = MISSING
    max_steps: int | None = None   # null: total_epochs over the training split
    optimizer: str = MISSING
    lr: float = MISSING
    lr_warmup_steps: int = MISSING
    betas: list[float] = MISSING
    weight_decay: float = MISSING
    grad_clip: float = MISSING
    max_prompt_length: int = MISSING
    max_response_length: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    kl_coef: float = MISSING
    entropy_coef: float = MISSING
    precision: str = MISSING
    save_every: int = MISSING         # steps between resumable checkpoints (and at the last step)


@dataclass
class EvalConfig:
    """Validation (every val_every steps, best checkpoint by the average) and the final evaluation."""

    val_every: int = MISSING
    val_samples: int = MISSING
    max_problems: int | None = None   # problems per benchmark (null: all)
    runs: int = MISSING
    samples: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING


@dataclass
class LocalBackendConfig:
    """backend=local (graft_exp/backends/local.py)."""

    name: str = "local"
    device: str = "auto"              # auto | cpu | cuda
    progress: bool = True
    threads: int | None = 1        # torch CPU threads (null: torch's default)
    sampler: str = "static_cache"     # static_cache | loop (one model call per token, the old sampler)


@dataclass
class VerlBackendConfig:
    """backend=verl (graft_exp/backends/verl/config.py maps these and train/eval/method to verl's)."""

    name: str = "verl"
    gpus_per_model: int = 2
    rollout_tp: int = 2
    gpu_memory_utilization: float = 0.6
    max_token_len_per_gpu: int = 16384
    gradient_checkpointing: bool = True
    param_offload: bool = False
    optimizer_offload: bool = False
    agent_workers: int = 8
    data_dir: str = MISSING
    model_dir: str = MISSING
    ray_address: str | None = None
    nnodes: int = 1
    verl_overrides: list[str] = field(default_factory=list)
    progress: bool = True


@dataclass
class RootConfig:
    """The top-level keys of ``conf/config.yaml``: scalars typed here, groups by their schemas (pair,
    train, eval here; method and backend by ``method_schema`` / ``backend_<name>_schema``)."""

    seed: int = MISSING
    study: str = MISSING
    rerun: bool = MISSING
    checkpoint_root: str = MISSING
    pair: PairConfig = MISSING
    method: Any = MISSING
    backend: Any = MISSING
    cluster: Any = MISSING
    tracking: Any = MISSING
    models: Any = MISSING
    train: TrainConfig = MISSING
    eval: EvalConfig = MISSING


def register_schemas() -> None:
    store = ConfigStore.instance()
    store.store(name="config_schema", node=RootConfig)
    # Outside the groups they type (conf files extend them as `/method_schema`, ...), so that neither
    # --help nor tab completion offers them as a method or a backend.
    store.store(name="method_schema", node=MethodConfig)
    store.store(name="backend_local_schema", node=LocalBackendConfig)
    store.store(name="backend_verl_schema", node=VerlBackendConfig)


def total_steps(cfg: DictConfig, num_problems: int) -> int:
    """Training steps of a job: ``train.max_steps``, or ``total_epochs`` passes over the training split."""
    return int(cfg.train.max_steps or cfg.train.total_epochs * num_problems // int(cfg.train.batch_prompts))


def minibatch_prompts(cfg: DictConfig) -> int:
    """Prompt groups per optimizer minibatch: Table 3's 32 (of 128), HACPO's released 64."""
    return methods.resolve(cfg.method).minibatch_prompts(cfg.train)


def _choice(value: str, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")


def validate(cfg: DictConfig) -> None:
    """Check one composed job config; raise ConfigError with the override that fixes it."""
    try:
        uri = cfg.tracking.uri
    except InterpolationResolutionError as err:
        raise ConfigError(f"tracking={cfg.tracking._name} needs MLFLOW_TRACKING_URI, e.g. "
                          "export MLFLOW_TRACKING_URI=http://host:5000 (or use tracking=sqlite)") from err
    if not uri:
        raise ConfigError("tracking.uri is empty; set MLFLOW_TRACKING_URI or tracking.uri")
    method, pair = cfg.method, cfg.pair
    models = cfg.models
    for role in ("A", "B"):
        key = pair[role]
        if key not in models:
            raise ConfigError(
                f"pair.{role}={key!r} is not a known model; choose one of {', '.join(models)} "
                "(conf/catalog/models.yaml)"
            )
    if pair.A == pair.B:
        raise ConfigError(f"pair {pair.name!r} names {pair.A!r} twice; a pair needs two different models")
    if method.n < 2:
        raise ConfigError(f"method.n={method.n}: GRPO needs at least 2 rollouts per prompt (n >= 2)")
    if not 0.0 <= method.delta <= 1.0:
        raise ConfigError(f"method.delta={method.delta} is outside [0, 1]; the paper uses 0.8")
    if method.clip_low < 0 or method.clip_high < 0 or method.clip_low >= 1:
        raise ConfigError(
            f"clip range (1-{method.clip_low}, 1+{method.clip_high}) is invalid; "
            "need 0 <= method.clip_low < 1 and method.clip_high >= 0"
        )
    if not method.clip_ratio_c > 1:
        raise ConfigError(f"method.clip_ratio_c={method.clip_ratio_c} must be > 1 (verl's dual clip; 3.0)")
    if method.adv_eps <= 0:
        raise ConfigError(f"method.adv_eps={method.adv_eps} must be > 0 (paper: 1e-6)")
    try:
        methods.declaration(method.name)
        spec = methods.resolve(method)
    except methods.UnknownName as err:
        raise ConfigError(str(err)) from err
    _choice(cfg.backend.name, BACKENDS, "backend")
    if cfg.backend.name == "local":
        _choice(cfg.backend.sampler, LOCAL_SAMPLERS, "backend.sampler")
    exchanges = spec.selection.transfers or spec.peer_loss.transfers
    if method.co_train != exchanges:
        raise ConfigError(
            f"method {method.name!r}: co_train={method.co_train} but selection={method.selection!r}, "
            f"peer_loss={method.peer_loss!r}; a single-model method needs selection=none and "
            "peer_loss=none, a two-model method needs both set"
        )
    if method.co_train and method.dynamic_sampling:
        raise ConfigError("method.dynamic_sampling is a single-model GRPO baseline (grpo_ds); "
                          "it cannot be combined with trajectory exchange")
    if spec.replays_stored_log and not spec.selection.one_direction_ok:
        raise ConfigError(
            f"stored-trajectory replay transfers in one direction only, so method.selection={method.selection} "
            "is inactive: set method.selection=complementary (as conf/method/graft_stored.yaml does)"
        )
    if cfg.backend.name == "verl" and pair.gpus < 1:
        raise ConfigError(
            f"backend=verl runs on GPU nodes; pair={pair.name} is the CPU test bed. "
            "Use backend=local, or pair=pair1|pair2|pair3"
        )
    train = cfg.train
    if train.batch_prompts % train.minibatch_prompts:
        raise ConfigError(
            f"train.batch_prompts={train.batch_prompts} is not a multiple of "
            f"train.minibatch_prompts={train.minibatch_prompts}"
        )
    if cfg.eval.runs < 1 or cfg.eval.samples < 1:
        raise ConfigError("eval.runs and eval.samples must be >= 1")
